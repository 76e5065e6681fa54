"""Fitting a device model to a profiler trace.

Input: graphs and their :class:`kopt.profile.Attribution` (measured time per node). Each node
with measured time is one equation; the model's time is linear in its unknown parameters once
the roofline time of each node is known::

    measured_i ~ launches_i x kernel_us + roofline_i x (1 / efficiency[kind_i])   (device time)
    host_i     ~ launches_i x launch_us + views_i x view_us                       (host time)

On a CPU the two are one (the op's self time), so one system gives launch_us (per op),
view_us and the efficiencies. On CUDA the kernel durations give kernel_us and the efficiencies,
the ops' CPU times give launch_us and view_us, and the kernels each op launched give
``kernels_per_op``.

The device times are solved by non-negative least squares on relative errors (each equation
divided by its measured value), so a 5 us element-wise op weighs as much as a 5 ms GEMM and the
fixed costs are set by the many small ops; then an op with ``min_nodes`` large kernels (roofline
time well above the fixed cost) gets the efficiency its large kernels' total time says, since a
rewrite's saving is a sum dominated by them. On CUDA the host costs are medians (per launch,
per view, per op where it differs). The ops' own times miss what the host spends between them
(the graph's Python): given each graph's measured wall time per call (:func:`calibrate`
measures it), that is fitted as ``node_us``, a host cost per node; on CUDA, with two host-bound
graphs, together with a scale on the ops' host times (the profiler's own time per recorded op
inflates them).
An op whose host cost per launch differs from the pooled one (kopt's custom ops: Python and a
Triton launcher) gets its own (``host_us``). Each node's time is the least over the profiled
calls (``NodeCost.min_ms``) and each wall time the least of the timed calls: on a shared
machine the least disturbed sample is the one that measures the device.

Peaks and bandwidth come from ``base`` (a datasheet model); without one (a CPU) they are the
device's measured ceilings: the best rate any node of the trace reached.
An op gets its own fixed cost and efficiency when the trace has ``min_nodes`` of it at sizes
that tell the two apart, else its category's, else those shared by every other kernel
(``kernel_us`` and ``efficiency["*"]``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from kopt.bench import median_ms
from kopt.cost.counts import OpCount, count_graph
from kopt.cost.device import (
    EPILOGUE_SLOWDOWN,
    FAST_ACCUM_SPEEDUP,
    DeviceModel,
    Prediction,
    layout_factor,
)
from kopt.graph.regions import cached_regions
from kopt.power import ClockSampler, read_power_limit
from kopt.profile import Attribution, NodeCost, host_times, profile_graph, try_profile_replay

# The time a profiler gives an op below this is mostly its own overhead: not a rate sample.
MIN_RATE_SAMPLE_MS = 1e-3


@dataclass(frozen=True)
class _Sample:
    count: OpCount
    cost: NodeCost

    @property
    def ms(self) -> float:
        return self.cost.min_ms or self.cost.ms


Counted = tuple[Sequence[OpCount], Attribution]  # a graph's counts and its measured times


def _counted(pairs: Sequence[tuple[fx.GraphModule, Attribution]]) -> list[Counted]:
    return [(count_graph(gm), attribution) for gm, attribution in pairs]


def _samples(pairs: Sequence[Counted]) -> list[_Sample]:
    """Nodes with measured time, top-level only (a hoisted region's time is its cache check
    on the profiled repeat calls, not its nodes')."""
    out = []
    for counts, attribution in pairs:
        for c in counts:
            cost = attribution.nodes.get(c.node)
            if "/" not in c.node and cost is not None and (cost.ms > 0 or cost.host_ms > 0):
                out.append(_Sample(c, cost))
    return out


def measured_ceilings(samples: Sequence[_Sample]) -> tuple[dict[str, float], float]:
    """(peak TFLOP/s by dtype, GB/s): the best any node reached."""
    peaks: dict[str, float] = {}
    bandwidth = 0.0
    for s in samples:
        if not s.count.kernel or s.ms < MIN_RATE_SAMPLE_MS:
            continue
        if s.count.flops:
            rate = s.count.flops / s.ms / 1e9
            peaks[s.count.dtype] = max(peaks.get(s.count.dtype, 0.0), rate)
        bandwidth = max(bandwidth, s.count.bytes / s.ms / 1e6)
    return peaks or {"float32": 1.0}, bandwidth or 1.0


def nnls(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method), fp64."""
    a, b = a.double(), b.double()
    scale = a.norm(dim=0).clamp_min(1e-300)  # columns of very different magnitudes
    a = a / scale
    n = a.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)

    def solve(mask: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(n, dtype=torch.float64)
        z[mask] = torch.linalg.lstsq(a[:, mask], b.unsqueeze(1), driver="gelsd").solution[:, 0]
        return z

    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        free = ~passive
        if not free.any() or w[free].max() <= tol:
            break
        j = int(torch.where(free, w, torch.tensor(-torch.inf, dtype=torch.float64)).argmax())
        passive[j] = True
        z = solve(passive)
        while (z[passive] <= tol).any():
            neg = passive & (z <= tol)
            alpha = (x[neg] / (x[neg] - z[neg])).min()
            x = x + alpha * (z - x)
            passive &= x > tol
            z = solve(passive)
        x = z
    return x / scale


# The group of the kernels whose op and category have too little variety of their own.
ANY_KERNEL = "*"
# Sizes must span this factor (in roofline time) to tell a fixed cost from a rate.
SPREAD = 4.0


def _groups(samples: Sequence[_Sample], roof: Sequence[float], min_nodes: int) -> dict[str, str]:
    """op -> the key of its (fixed cost, efficiency) pair: the op itself where the trace has
    ``min_nodes`` kernels of it whose sizes span :data:`SPREAD`, else its category where the
    rest of the category's kernels do, else :data:`ANY_KERNEL`. A rate measured at one size
    alone cannot be told from a fixed cost."""
    by_op: dict[str, list[float]] = defaultdict(list)
    category: dict[str, str] = {}
    for s, r in zip(samples, roof, strict=True):
        if s.count.kernel and s.ms > 0:
            by_op[s.count.op].append(r)
            category[s.count.op] = s.count.category

    own = {op for op, v in by_op.items() if _varied(v, min_nodes)}
    by_category: dict[str, list[float]] = defaultdict(list)
    for op, v in by_op.items():
        if op not in own:
            by_category[category[op]].extend(v)
    pooled = {c for c, v in by_category.items() if _varied(v, min_nodes)}
    return {op: op if op in own else category[op] if category[op] in pooled else ANY_KERNEL
            for op in by_op}


def _varied(roof: Sequence[float], min_nodes: int = 1) -> bool:
    return len(roof) >= min_nodes and min(roof) > 0 and max(roof) >= SPREAD * min(roof)


def fit(pairs: Sequence[tuple[fx.GraphModule, Attribution]], base: DeviceModel | None = None,
        *, wall_ms: Sequence[float] | None = None, min_nodes: int = 3,
        name: str | None = None) -> DeviceModel:
    """A device model fitted to the measured times of ``pairs`` (graph, its attribution).

    ``base``: the datasheet model of the device (peaks, bandwidth, the CUDA-graph launch cost
    a profile of eager calls cannot see); without one the ceilings are the measured ones and
    the device is taken to be synchronous (a CPU). ``wall_ms``: each graph's measured time per
    call outside the profiler, for the host overhead between ops.
    """
    return fit_counted(_counted(pairs), base, wall_ms=wall_ms, min_nodes=min_nodes, name=name)


def fit_counted(pairs: Sequence[Counted], base: DeviceModel | None = None, *,
                wall_ms: Sequence[float] | None = None, min_nodes: int = 3,
                name: str | None = None, power: PowerLimit | None = None,
                miss_ms: Sequence[float | None] | None = None) -> DeviceModel:
    """:func:`fit` on graphs already counted (``(counts, attribution)``): what a
    :class:`Calibration` saved on one machine holds, fitted again on another. ``power``: the
    device was measured at its power cap; the compute-bound kernels' rates are then fitted
    at the reference clock (:mod:`kopt.cost.device`'s power model) and the model keeps it.
    ``miss_ms``: per graph, its wall time per call with its hoisted regions run
    (:func:`miss_ms`), or None; a host-time equation more for the wall fit."""
    samples = _samples(pairs)
    if not samples:
        raise ValueError("no node of the trace has measured time")
    cuda = any(a.device == "cuda" for _, a in pairs)
    if base is not None:
        peaks, bandwidth = dict(base.peak_tflops), base.bandwidth_gbs
    else:
        peaks, bandwidth = measured_ceilings(samples)
    ceiling = DeviceModel(name or (base.name if base else "cpu"), peaks, bandwidth)
    factors = [1.0] * len(pairs)
    if power is not None and cuda:
        ceiling = ceiling.with_(**power.fields())
        pairs, factors = _at_reference_clock(ceiling, pairs)
        samples = _samples(pairs)
    kernels_per_op = _kernels_per_op(samples) if cuda else dict(base.kernels_per_op if base
                                                                else {})
    counted = ceiling.with_(kernels_per_op=kernels_per_op)

    launches = [counted.launches(s.count) for s in samples]
    roof = [ceiling.roofline_ms(s.count.flops, s.count.bytes, s.count.dtype) for s in samples]
    group = _groups(samples, roof, min_nodes)

    # device time per kernel: fixed cost + roofline / efficiency, one pair per group; on a CPU
    # also the views' time. On a CPU the op's fixed cost holds its dispatch, which cannot be
    # told apart from it (launch_us = 0 there).
    dev = [i for i, s in enumerate(samples) if s.count.kernel and s.ms > 0]
    views = [] if cuda else [i for i, s in enumerate(samples) if not s.count.kernel and s.ms > 0]
    keys = sorted(set(group.values()))
    # the shared group, if it saw one size only: its fixed cost is the other groups' (or the
    # base's), its efficiency is fitted
    shared_roof = [roof[i] for i in dev if group[samples[i].count.op] == ANY_KERNEL]
    pinned = bool(shared_roof) and not _varied(shared_roof)
    cols = ([("fixed", k) for k in keys if not (pinned and k == ANY_KERNEL)]
            + [("eff", k) for k in keys] + ([("view", "")] if views else []))
    index = {c: j for j, c in enumerate(cols)}

    def solve(shared_fixed_us: float) -> list[float]:
        rows = dev + views
        a = torch.zeros(len(rows), len(cols), dtype=torch.float64)
        y = torch.tensor([samples[i].ms for i in rows], dtype=torch.float64)
        weight = 1 / y.clone()  # relative errors
        for r, i in enumerate(rows):
            if not samples[i].count.kernel:
                a[r, index["view", ""]] = 1 / 1e3
                continue
            k = group[samples[i].count.op]
            # the group's rate, at which a GEMM of a slower or faster layout runs its factor
            # apart (as DeviceModel.efficiency_of costs it)
            a[r, index["eff", k]] = roof[i] * layout_factor(samples[i].count)
            if ("fixed", k) in index:
                a[r, index["fixed", k]] = launches[i] / 1e3
            else:
                y[r] -= launches[i] * shared_fixed_us / 1e3
        return nnls(a * weight.unsqueeze(1), y * weight).tolist()

    x = solve(0.0)
    fixed_us = {k: x[j] for (kind, k), j in index.items() if kind == "fixed"}
    if pinned:
        others = list(fixed_us.values())
        fixed_us[ANY_KERNEL] = statistics.median(others) if others else (
            base.kernel_us if base else 0.0)
        x = solve(fixed_us[ANY_KERNEL])
        fixed_us = {k: x[j] for (kind, k), j in index.items() if kind == "fixed"} | {
            ANY_KERNEL: fixed_us[ANY_KERNEL]}
    efficiency = {k: (1.0 / x[j] if x[j] > 0 else 1.0) for (kind, k), j in index.items()
                  if kind == "eff"}
    kernel_us = fixed_us.pop(ANY_KERNEL, base.kernel_us if base else (
        statistics.median(fixed_us.values()) if fixed_us else 0.0))
    if base is not None:  # a group of small kernels only measured no rate: the base's
        efficiency |= _unmeasured_rates(base, samples, roof, dev, group,
                                        {k: fixed_us.get(k, kernel_us) for k in keys})

    host_us: dict[str, float] = {}
    if cuda:  # host time per launch and per view, from the ops' CPU times
        launch_us, view_us, host_us = _fit_host(samples, launches, min_nodes)
    else:
        launch_us, view_us = 0.0, (x[index["view", ""]] if views else 0.0)

    model = counted.with_(
        launch_us=launch_us, view_us=view_us, host_us=host_us, kernel_us=kernel_us,
        fixed_us=fixed_us, efficiency=efficiency,
        graph_launch_us=(base.graph_launch_us if base else None), asynchronous=cuda)
    rates = {**model.efficiency, **_op_efficiencies(model, samples, roof, min_nodes)}
    rates |= _epilogue_rates(rates)
    model = model.with_(efficiency={**_layout_priors(base, rates), **rates})
    note = ""
    if wall_ms is not None:
        model, note = _fit_walls(model, [counts for counts, _ in pairs], wall_ms, miss_ms)
        note += _slow_profiles(pairs, wall_ms)
    error = fit_error(model, pairs)
    where = ", ".join(sorted({a.device for _, a in pairs}))
    if model.power_limited:
        note += ("; compute-bound kernels at the power cap's clock x "
                 + "/".join(f"{f:.3f}" for f in factors) + " in the traces")
    return model.with_(source=f"fitted to {len(samples)} nodes of {len(pairs)} {where} "
                              f"trace(s); median relative error per node {error:.0%}{note}")


@dataclass(frozen=True)
class PowerLimit:
    """What :func:`measure` read of a GPU's power (NVML, :mod:`kopt.power`): its enforced
    cap, the power a copy draws (memory-bound kernels), its highest SM clock, and the lowest
    median SM clock of the calibration graphs' replays."""

    cap_w: float
    memory_w: float
    max_mhz: float
    min_mhz: float

    @property
    def throttled(self) -> bool:
        """The calibration ran below the highest clock: the cap was reached."""
        return self.min_mhz < THROTTLED * self.max_mhz

    def fields(self) -> dict[str, float]:
        return {"power_cap_w": self.cap_w, "memory_power_w": self.memory_w,
                "max_boost": self.max_mhz / self.min_mhz}


# A median SM clock under this fraction of the highest one: the GPU was held at its power cap.
THROTTLED = 0.97


def _at_reference_clock(model: DeviceModel, pairs: Sequence[Counted]
                        ) -> tuple[list[Counted], list[float]]:
    """``pairs`` with each compute-bound kernel's measured time divided by its graph's clock
    factor (the graph's memory-bound share as measured): the rates they fit are the
    reference clock's, which :meth:`DeviceModel.kernel_times` scales to any other graph."""
    out, factors = [], []
    for counts, attribution in pairs:
        bound = {c.node: model.compute_bound(c) for c in counts if "/" not in c.node}
        timed = {k: v for k, v in attribution.nodes.items() if k in bound and v.ms > 0}
        memory = sum(v.ms for k, v in timed.items() if not bound[k])
        total = sum(v.ms for v in timed.values())
        f = model.clock_factor(memory / total if total > 0 else 0.0)
        nodes = {k: (dataclasses.replace(v, ms=v.ms / f, min_ms=v.min_ms / f)
                     if bound.get(k) else v) for k, v in attribution.nodes.items()}
        out.append((counts, dataclasses.replace(attribution, nodes=nodes)))
        factors.append(f)
    return out, factors


# A CUDA profile whose kernels add up to more than this multiple of the graph's timed call ran
# slower than the timed calls.
SLOW_PROFILE = 1.05


def _slow_profiles(pairs: Sequence[Counted], wall_ms: Sequence[float]) -> str:
    """A note for the fit's source naming each CUDA graph whose profiled kernel time per call
    exceeds its timed wall time: one stream cannot, so the profiled calls ran slower than the
    timed ones and the rates fitted from them are slow by up to that factor (on the H200, W2's
    captured graph: 662 ms of kernels against 543 ms timed in one run, 567 against 534 in
    another, with GEMMs and attention x1.2 and most element-wise ops x1.0-1.1 between them).
    Not corrected: the excess is not spread evenly over the ops."""
    slow = [f"graph {i + 1} {a.attributed_ms / wall:.2f}x"
            for i, ((_, a), wall) in enumerate(zip(pairs, wall_ms, strict=True))
            if a.device == "cuda" and wall > 0 and a.attributed_ms > SLOW_PROFILE * wall]
    if not slow:
        return ""
    return ("; profiled kernel time above the timed call (" + ", ".join(slow)
            + "): the profile ran slower, its rates are pessimistic")


def _rate_dominates(roof_ms: float, fixed_us: float) -> bool:
    """A kernel measures a rate only where its roofline time is well above its fixed cost
    (a small kernel's time is its fixed cost)."""
    return roof_ms * 1e3 >= SPREAD * fixed_us


def _unmeasured_rates(base: DeviceModel, samples: Sequence[_Sample], roof: Sequence[float],
                      dev: Sequence[int], group: dict[str, str],
                      fixed_us: dict[str, float]) -> dict[str, float]:
    """The base model's efficiency for each group whose kernels are all small: their time is
    their fixed cost, so the fitted rate is whatever the solver left (0.09 of the bandwidth
    for a decode step's quantizers, all on 64-row inputs), and a large kernel of the group
    elsewhere (the same quantizer on a weight) would be costed at it."""
    largest: dict[str, float] = defaultdict(float)
    category: dict[str, str] = {}
    for i in dev:
        key = group[samples[i].count.op]
        largest[key] = max(largest[key], roof[i])
        category.setdefault(key, samples[i].count.category)
    out = {}
    for key, roof_ms in largest.items():
        if key == ANY_KERNEL or _rate_dominates(roof_ms, fixed_us.get(key, 0.0)):
            continue
        prior = base.efficiency.get(key, base.efficiency.get(category[key]))
        if prior is not None:
            out[key] = prior
    return out


def _epilogue_rates(fitted: Mapping[str, float]) -> dict[str, float]:
    """The rate of a plain GEMM (no bias epilogue, exact accumulation) from its kernels' of
    another layout where the trace had only those (W1: every linear has a bias; by default
    every FP8 GEMM accumulates fast); the other way round :meth:`DeviceModel.efficiency_of`
    applies :data:`EPILOGUE_SLOWDOWN` and :data:`FAST_ACCUM_SPEEDUP` itself."""
    out: dict[str, float] = {}
    for op in sorted(set(EPILOGUE_SLOWDOWN) | set(FAST_ACCUM_SPEEDUP)):
        if op in fitted:
            continue
        for layout in ("bias", "fast", "bias,fast"):
            if f"{op}[{layout}]" in fitted:
                rate = fitted[f"{op}[{layout}]"]
                if "bias" in layout:
                    rate *= EPILOGUE_SLOWDOWN.get(op, 1.0)
                if "fast" in layout:
                    rate /= FAST_ACCUM_SPEEDUP.get(op, 1.0)
                out[op] = rate
                break
    return out


def _layout_priors(base: DeviceModel | None, fitted: Mapping[str, float]) -> dict[str, float]:
    """The base model's rates for an op with a given operand layout (``aten::cat[strided]``)
    where the fit has none: such a key gets a rate of its own only from large kernels in the
    trace, and without one the op would be costed at its contiguous kernels' rate (a strided
    cat at a plain cat's 0.89 of the bandwidth instead of 0.15)."""
    if base is None:
        return {}
    return {k: v for k, v in base.efficiency.items() if k.endswith("]") and k not in fitted}


def _op_efficiencies(model: DeviceModel, samples: Sequence[_Sample], roof: Sequence[float],
                     min_nodes: int) -> dict[str, float]:
    """Each op's own efficiency where the trace has ``min_nodes`` large kernels of it: the one
    that makes those kernels' modelled time add up to their measured time, the fixed cost
    kept.

    The group fit weighs every node alike (relative errors), so the many small kernels of a
    group set its rate; an op whose few large kernels run slower (a copy out of a broadcast
    or a strided view, a bias add over a whole activation) would be costed at the small ones'
    rate. What a rewrite saves is a sum of kernel times, dominated by the large ones: the op's
    totals decide its rate, one per operand layout (:func:`kopt.cost.counts.layout`: a
    broadcast or strided operand takes ATen's unvectorized kernel)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    dtypes: dict[str, set[str]] = defaultdict(set)
    for s, r in zip(samples, roof, strict=True):
        if s.count.kernel and s.ms > 0 and _rate_dominates(r, model.fixed_of(s.count)):
            keys = [s.count.rate_key]
            if s.count.op.startswith("aten::") and s.count.category == "elementwise" \
                    and s.count.dtype:
                keys.append(s.count.dtype_key)
                dtypes[s.count.rate_key].add(s.count.dtype)
            for key in keys:
                t = totals[key]
                t[0] += 1
                t[1] += s.ms
                t[2] += model.launches(s.count) * model.fixed_of(s.count) / 1e3
                t[3] += r
    # a rate per element type only where the op ran in several (ATen's unvectorized
    # kernels are bound by elements per second: W2's bf16 broadcast multiplies move 1.4 TB/s,
    # its fp32 ones 2.2)
    keep = {k for k in totals if "@" not in k or len(dtypes[k.split("@")[0]]) > 1}
    return {op: r / (m - f) for op, (n, m, f, r) in totals.items()
            if op in keep and n >= min_nodes and r > 0 and m > f}


# An op gets its own host cost per launch when its median differs from the pooled one by more
# than this fraction (kopt's custom ops: a Python implementation and a Triton launcher).
OWN_HOST = 0.25


def _fit_host(samples: Sequence[_Sample], launches: Sequence[float],
              min_nodes: int) -> tuple[float, float, dict[str, float]]:
    """(launch_us, view_us, host_us by op) from the ops' CPU times: the median cost per launch
    and per view, and an op's own median cost per launch where the trace has ``min_nodes`` of
    it and that median is not the pooled one. Medians, not a least-squares fit on relative
    errors: timed without the profiler (:func:`kopt.profile.host_times`), a view's cost less
    the timer's own comes out near zero for some nodes, and a relative error would let those
    decide the fit."""
    per_op: dict[str, list[float]] = defaultdict(list)
    views: list[float] = []
    for s, n in zip(samples, launches, strict=True):
        if s.cost.host_ms <= 0:
            continue
        if s.count.kernel and n > 0:
            per_op[s.count.op].append(s.cost.host_ms * 1e3 / n)
        elif not s.count.kernel and s.count.dispatched:
            views.append(s.cost.host_ms * 1e3)

    def median(v: Sequence[float]) -> float:
        return statistics.median(v) if v else 0.0

    launch_us = median([x for v in per_op.values() for x in v])
    host_us = {op: median(v) for op, v in per_op.items()
               if len(v) >= min_nodes and abs(median(v) - launch_us) > OWN_HOST * launch_us}
    if host_us:
        rest = [x for op, v in per_op.items() if op not in host_us for x in v]
        launch_us = median(rest) if rest else launch_us
    return launch_us, median(views), host_us


def _fit_walls(model: DeviceModel, graphs: Sequence[Sequence[OpCount]],
               wall_ms: Sequence[float], miss_ms: Sequence[float | None] | None = None,
               ) -> tuple[DeviceModel, str]:
    """Fit the host time the ops' own times do not show to the measured wall times per call.

    On a CPU (synchronous) every graph's wall time is its op times plus the graph's Python
    between them: ``node_us``, a host cost per node (the median over the graphs). On CUDA only
    the graphs whose ops take longer on the host than on the device (both as measured, through
    the model) are host-bound and say anything about the host -- a device-bound graph's wall
    time above its modelled device time is the device model's error, not host time. The
    profiler also adds its own time to every op it records, so with two such graphs both a
    scale on the ops' host costs and ``node_us`` are fitted (non-negative least squares on
    relative errors), with one only ``node_us``. Hoisted
    regions hit their caches in repeated calls with the same inputs: their nodes count as not
    run in ``wall_ms``, and as run in ``miss_ms`` (a graph's wall time with every region
    missing, where measured): one more equation where fewer than two graphs are host-bound;
    where two are, it fits the regions' own cost per node instead (:func:`_fit_region_nodes`)."""
    hits = [([c for c in graph if c.cached is None], wall)
            for graph, wall in zip(graphs, wall_ms, strict=True)]
    misses = [(list(graph), miss) for graph, miss in
              zip(graphs, miss_ms or [None] * len(graphs), strict=True) if miss is not None]

    def equations(timed: list[tuple[list[OpCount], float]]) -> list[tuple[float, int, float]]:
        eqs = []  # (ops' host ms, nodes, wall ms)
        for counts, wall in timed:
            p = model.predict(counts)
            if not _host_bound(model, p):
                continue  # device-bound: the wall time is the device's
            ops = p.host_ms if model.asynchronous else p.total_ms
            eqs.append((ops, sum(c.dispatched for c in counts), wall))  # node_us's nodes
        return eqs

    eqs = equations(hits)
    if len(eqs) < 2:  # a miss is one more equation; else it fits the regions' own node cost
        eqs += equations(misses)
    if not eqs:
        return model, ""
    if not model.asynchronous or len(eqs) < 2:
        per_node = [(wall - ops) / n * 1e3 for ops, n, wall in eqs]
        return model.with_(node_us=max(statistics.median(per_node), 0.0)), ""
    a = torch.tensor([[ops, n / 1e3] for ops, n, _ in eqs], dtype=torch.float64)
    y = torch.tensor([wall for *_, wall in eqs], dtype=torch.float64)
    scale, node_us = nnls(a / y.unsqueeze(1), torch.ones_like(y)).tolist()
    if scale <= 0:
        return model, ""
    model = model.with_(launch_us=model.launch_us * scale, view_us=model.view_us * scale,
                        host_us={k: v * scale for k, v in model.host_us.items()},
                        node_us=node_us)
    model, region = _fit_region_nodes(model, graphs, wall_ms, miss_ms)
    return model, f"; ops' host times x {scale:.2f} to {len(eqs)} measured wall times{region}"


def _fit_region_nodes(model: DeviceModel, graphs: Sequence[Sequence[OpCount]],
                      wall_ms: Sequence[float], miss_ms: Sequence[float | None] | None,
                      ) -> tuple[DeviceModel, str]:
    """``region_node_us`` from the graphs timed both with their hoisted regions hit and
    missing: where the call is host-bound both ways, the difference of the two wall times is
    the regions' host time, so less their ops' own host times, over their dispatched nodes.
    The regions are mostly views of one merged GEMM's output (W1: 718 unsqueeze, 360 split
    of 2182 nodes), whose generated code runs far faster than the graph's average node: at the
    average (``node_us``, 31 us) hoist's leave-one-out on W1 was predicted to lose 15.9 ms a
    call against 2.1 measured (RESULTS.md, 2026-12-02, H200)."""
    per_node = []
    for graph, wall, miss in zip(graphs, wall_ms, miss_ms or [None] * len(graphs),
                                 strict=True):
        region = [c for c in graph if c.cached is not None]
        n = sum(c.dispatched for c in region)
        if miss is None or not n:
            continue
        hit = model.predict([c for c in graph if c.cached is None])
        if not (_host_bound(model, hit) and _host_bound(model, model.predict(graph))):
            continue  # device-bound: the difference is not the host's
        ops = sum(model.op_host_ms(c) for c in region)
        per_node.append(max((miss - wall - ops) / n * 1e3, 0.0))
    if not per_node:
        return model, ""
    us = statistics.median(per_node)
    return model.with_(region_node_us=us), f", hoisted regions' nodes {us:.2f} us (their miss)"


def _host_bound(model: DeviceModel, p: Prediction) -> bool:
    """Whether a call so predicted takes its host's time (always on a synchronous device)."""
    return not model.asynchronous or p.host_ms > p.device_ms


@dataclass(frozen=True)
class Calibration:
    """What a fit is made of, per graph: its counts, its profiled times, its wall time per
    call; on CUDA also its kernels' times as replayed from a CUDA graph (``replay``, one per
    graph, None where it could not be matched). Saved (:meth:`to_json`) beside a
    measurement, it lets the device model be fitted again later, on any machine, without the
    graphs or the device."""

    graphs: tuple[tuple[tuple[OpCount, ...], Attribution, float], ...]
    replay: tuple[Attribution | None, ...] = ()
    notes: tuple[str, ...] = ()  # per graph: what the replay profile matched, or why not
    # per graph: (median SM MHz, mean W) during its replay profile (kopt.power), or None
    clocks: tuple[tuple[float, float] | None, ...] = ()
    # the GPU's power cap, a copy's power and its highest clock (None: not read)
    power: tuple[float, float, float] | None = None
    # per graph: its wall time per call with every hoisted region missing (None: no regions)
    miss_ms: tuple[float | None, ...] = ()

    @property
    def power_limit(self) -> PowerLimit | None:
        """The power model's parameters where the calibration ran at the power cap."""
        clocks = [c[0] for c in self.clocks if c is not None]
        if self.power is None or not clocks:
            return None
        limit = PowerLimit(*self.power, min(clocks))
        return limit if limit.throttled else None

    @property
    def replayed(self) -> bool:
        """Every graph has its replayed kernel times."""
        return bool(self.replay) and all(a is not None for a in self.replay)

    def fit(self, base: DeviceModel | None = None, *, min_nodes: int = 3,
            name: str | None = None, source: str = "replay", power: bool = True
            ) -> DeviceModel:
        """``source``: ``replay`` fits the kernels' rates to their times in CUDA graph
        replays where every graph has them (what a replayed call costs, the mode a serving
        engine runs), else to the eager profile; ``eager``: always the eager profile.
        ``power``: with replays measured at the GPU's power cap (:attr:`power_limit`), the
        model's clock factor is fitted too (:mod:`kopt.cost.device`)."""
        if source not in ("replay", "eager"):
            raise ValueError(f"source must be 'replay' or 'eager', not {source!r}")
        use_replay = source == "replay" and self.replayed
        pairs = [(c, r if use_replay else a) for (c, a, _), r in
                 zip(self.graphs, self.replay or [None] * len(self.graphs), strict=True)]
        model = fit_counted(pairs, base, wall_ms=[w for *_, w in self.graphs],
                            miss_ms=self.miss_ms or None, min_nodes=min_nodes, name=name,
                            power=self.power_limit if use_replay and power else None)
        if use_replay:
            model = model.with_(source=model.source + "; kernel times from CUDA graph replays")
        return model

    def to_json(self) -> str:
        replay = self.replay or (None,) * len(self.graphs)
        notes = self.notes or ("",) * len(self.graphs)
        clocks = self.clocks or (None,) * len(self.graphs)
        misses = self.miss_ms or (None,) * len(self.graphs)
        return json.dumps([{"counts": [dataclasses.asdict(c) for c in counts],
                            "attribution": json.loads(a.to_json()), "wall_ms": wall,
                            "replay": None if r is None else json.loads(r.to_json()),
                            "replay_note": note, "clocks": clock, "power": self.power,
                            "miss_ms": miss}
                           for (counts, a, wall), r, note, clock, miss in
                           zip(self.graphs, replay, notes, clocks, misses, strict=True)])

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        return cls(tuple((tuple(OpCount(**c) for c in g["counts"]),
                          Attribution.from_json(json.dumps(g["attribution"])), g["wall_ms"])
                         for g in data),
                   tuple(None if g.get("replay") is None else
                         Attribution.from_json(json.dumps(g["replay"])) for g in data),
                   tuple(g.get("replay_note", "") for g in data),
                   tuple(None if g.get("clocks") is None else tuple(g["clocks"]) for g in data),
                   next((tuple(g["power"]) for g in data if g.get("power")), None),
                   tuple(g.get("miss_ms") for g in data))


def measure(graphs: Sequence[tuple[fx.GraphModule, Sequence[Any]]], *,
            iters: int = 5, replay: bool = True) -> Calibration:
    """Profile each (graph, inputs) and time it end to end (outside the profiler). On CUDA the
    nodes' host times come from a run without the profiler (:func:`kopt.profile.host_times`),
    whose recording inflates them unevenly; and with ``replay`` the kernels are profiled again
    as replayed from a CUDA graph (:func:`kopt.profile.profile_replay`)."""
    out, replays, notes, clocks, misses = [], [], [], [], []
    for gm, inputs in graphs:
        attribution = profile_graph(gm, inputs, iters=iters)
        replayed, note, clock = None, "", None
        if attribution.device == "cuda":
            host = host_times(gm, inputs, iters)
            attribution.nodes = {k: dataclasses.replace(v, host_ms=host.get(k, v.host_ms))
                                 for k, v in attribution.nodes.items()}
            if replay:
                sampler = ClockSampler(attribution.device)  # while the replays run only
                replayed, note = try_profile_replay(gm, inputs, attribution, iters,
                                                    during=sampler)
                if sampler.result is not None:
                    clock = (sampler.result.sm_mhz, sampler.result.power_w)
                    note = f"{note}; {sampler.result.format()}"
        out.append((tuple(count_graph(gm)), attribution, best_ms(gm, inputs, iters)))
        misses.append(miss_ms(gm, inputs, iters))
        replays.append(replayed)
        notes.append(note)
        clocks.append(clock)
    power = None
    if replay and any(c is not None for c in clocks):
        device = next(t.device for _, inputs in graphs for t in inputs
                      if isinstance(t, torch.Tensor))
        try:
            power = read_power_limit(device)
        except RuntimeError as e:  # out of memory, a failed capture: no power model, no stop
            notes[-1] = f"{notes[-1]}; power limit not read: {str(e)[:200]}"
        finally:
            torch.cuda.empty_cache()
    return Calibration(tuple(out), tuple(replays), tuple(notes), tuple(clocks), power,
                       tuple(misses))


def calibrate(graphs: Sequence[tuple[fx.GraphModule, Sequence[Any]]],
              base: DeviceModel | None = None, *, iters: int = 5,
              name: str | None = None) -> DeviceModel:
    """Profile each (graph, inputs), time it end to end, and fit a device model to both."""
    return measure(graphs, iters=iters).fit(base, name=name)


def best_ms(gm: fx.GraphModule, inputs: Sequence[Any], iters: int = 5) -> float:
    """The least time per call of ``gm(*inputs)`` over ``iters`` calls (after a warm-up)."""
    return _least_ms(lambda: gm(*inputs), inputs, iters)


def miss_ms(gm: fx.GraphModule, inputs: Sequence[Any], iters: int = 5) -> float | None:
    """:func:`best_ms` with every hoisted region's cache emptied before each call, so that
    each call runs the regions as the first call of a CFG pair does; None without regions.
    Repeated calls with the same inputs hit the caches, so :func:`best_ms` times the body
    alone: this is the only measurement of the regions' own host time (W1: 2182 nodes, 1078
    of them views, run eagerly before the CUDA graph's replay)."""
    regions = cached_regions(gm)
    if not regions:
        return None

    def call() -> None:
        for r in regions:
            r.clear()
        gm(*inputs)

    return _least_ms(call, inputs, iters)


def _least_ms(call: Any, inputs: Sequence[Any], iters: int) -> float:
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    with torch.no_grad():
        return min(median_ms(call, 1, warmup=1 if i == 0 else 0, device=device)
                   for i in range(iters))


def _kernels_per_op(samples: Sequence[_Sample]) -> dict[str, float]:
    """Kernels each op launched per call, on average over its nodes, where that is not 1.

    The mean, not the median: W1's ``_scaled_mm`` nodes launch one kernel (358 nodes) or two
    (360), whose median, 2, counted 2218 launches per call of the unmerged graph against the
    1860 its replays ran, and 480 fewer for merge_projections against the 360 measured
    (RESULTS.md, 2026-12-03, H200). The mean (1.5) counts both exactly."""
    per_op: dict[str, list[int]] = defaultdict(list)
    for s in samples:
        if s.count.kernel:
            per_op[s.count.op].append(s.cost.calls)
    means = {op: round(statistics.fmean(v), 3) for op, v in per_op.items()}
    return {op: m for op, m in means.items() if m != 1.0}


def fit_error(model: DeviceModel, pairs: Sequence[Counted]) -> float:
    """Median |predicted - measured| / measured over the nodes with measured time (kernel
    time on CUDA, op time on a CPU)."""
    errors = []
    for s in _samples(pairs):
        measured = s.ms
        if measured <= 0:
            continue
        # an op's own time: its kernel, and on a CPU its dispatch (the graph's Python is
        # between the ops, not in them)
        predicted = model.kernel_ms(s.count) + (0.0 if model.asynchronous else
                                                 model.op_host_ms(s.count))
        errors.append(abs(predicted - measured) / measured)
    return statistics.median(errors) if errors else float("nan")
