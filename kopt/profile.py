"""Profiler attribution: which FX node of an optimized graph spent the time.

:func:`profile_graph` runs a graph module under ``torch.profiler`` with every node's execution
wrapped in a ``record_function`` range named after the node; each aten/kopt op event (CPU) and
each device kernel (CUDA: the kernels the profiler links to their launching CPU event) is then
attributed to the innermost node range around it. Whatever ran outside any node (the graph's
own Python, a hoisted region's cache check) is reported as unattributed, never dropped.

Each node also gets its FLOPs (``torch.utils.flop_counter``, per op) and the bytes it reads and
writes (its tensors' sizes), so a report can say how close a node came to the device's peak
rate or bandwidth.

The time per call is split into categories by the node's op (:func:`kopt.graph.op_category`): GEMMs,
attention, quantization, the rest element-wise (norms, pointwise chains, copies, fused row-wise
kernels), and launch gaps = wall time - busy time (the device idle between kernels on CUDA; the
graph's Python and dispatch between ops on the CPU). With a device model (``kopt.cost``) each
category's time is also set against its roofline at the device's measured ceilings.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import difflib
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import fx
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from kopt.bench import STEADY_S
from kopt.cudagraphs import CudaGraphRunner
from kopt.graph import CATEGORIES, op_category, qualified_name

PREFIX = "kopt::node::"
ITERATION = "kopt::call::"
# op events the attribution counts: what the graph's nodes dispatch to (aten and kopt's ops)
_OP_PREFIXES = ("aten::", "kopt::", "prims::")

GAPS = "launch gaps"


class Ceilings(Protocol):
    """What the device can do (``kopt.cost.DeviceModel``): the time a node would take at the
    roofline of the device's peak rate for ``dtype`` and its bandwidth."""

    def roofline_ms(self, flops: float, nbytes: float, dtype: str) -> float: ...


@dataclass
class NodeCost:
    name: str
    op: str
    ms: float = 0.0  # per call: device kernel time on CUDA, op self time on the CPU
    calls: int = 0  # op events (CPU) or kernels (CUDA) per call
    flops: int = 0
    bytes: int = 0
    category: str = "elementwise"  # see op_category; a hoisted region's events go by their op
    dtype: str = ""  # of the first floating-point input (what a GEMM runs in)
    host_ms: float = 0.0  # per call: CPU self time of the node's op events (= ms on the CPU)
    min_ms: float = 0.0  # the least of the profiled calls' ms: the least disturbed sample

    def rates(self) -> tuple[float, float]:
        """(TFLOP/s, GB/s) achieved, 0 where no time was measured."""
        if self.ms <= 0:
            return 0.0, 0.0
        return self.flops / self.ms / 1e9, self.bytes / self.ms / 1e6


@dataclass(frozen=True)
class CategoryTime:
    """Time per call in one category, with the work done in it (FLOPs, bytes) and, given
    ceilings, the time the same work takes at the roofline."""

    name: str
    ms: float
    nodes: int = 0
    flops: int = 0
    bytes: int = 0
    roofline_ms: float | None = None

    def rates(self) -> tuple[float, float]:
        """(TFLOP/s, GB/s) achieved, 0 where no time was measured."""
        if self.ms <= 0:
            return 0.0, 0.0
        return self.flops / self.ms / 1e9, self.bytes / self.ms / 1e6

    @property
    def of_roofline(self) -> float | None:
        """Roofline time / measured time: 1.0 = at the device's ceiling."""
        if self.roofline_ms is None or self.ms <= 0:
            return None
        return self.roofline_ms / self.ms


@dataclass
class Attribution:
    device: str
    iters: int
    nodes: dict[str, NodeCost] = field(default_factory=dict)
    unattributed: dict[str, float] = field(default_factory=dict)  # event name -> ms per call
    total_ms: float = 0.0  # wall time per call
    category_ms: dict[str, float] = field(default_factory=dict)  # busy time per category

    @property
    def attributed_ms(self) -> float:
        return sum(n.ms for n in self.nodes.values())

    @property
    def busy_ms(self) -> float:
        """Time in ops (CPU) or kernels (CUDA), attributed or not."""
        return self.attributed_ms + sum(self.unattributed.values())

    def categories(self, ceilings: Ceilings | None = None) -> list[CategoryTime]:
        """The call's time split into :data:`CATEGORIES` and launch gaps (wall - busy); the
        parts add up to the wall time. FLOPs and bytes are those of the nodes of each category
        (a hoisted region's work counts where its events went, its FLOPs nowhere)."""
        out = []
        for cat in CATEGORIES:
            members = [c for c in self.nodes.values() if c.category == cat]
            roof = None
            if ceilings is not None:
                roof = sum(ceilings.roofline_ms(c.flops, c.bytes, c.dtype) for c in members
                           if c.ms > 0)
            out.append(CategoryTime(cat, self.category_ms.get(cat, 0.0),
                                    sum(1 for c in members if c.ms > 0),
                                    sum(c.flops for c in members), sum(c.bytes for c in members),
                                    roof))
        out.append(CategoryTime(GAPS, max(self.total_ms - self.busy_ms, 0.0)))
        return out

    def top(self, n: int = 20) -> list[NodeCost]:
        return sorted(self.nodes.values(), key=lambda c: -c.ms)[:n]

    def format(self, n: int = 20, ceilings: Ceilings | None = None) -> str:
        busy = self.busy_ms
        lines = [f"profile ({self.device}, {self.iters} calls): {self.total_ms:.3f} ms per call, "
                 f"{busy:.3f} ms in ops/kernels ({self.attributed_ms:.3f} attributed to "
                 f"{sum(1 for c in self.nodes.values() if c.ms > 0)} nodes)",
                 f"  {'category':16s} {'ms':>9s} {'share':>6s} {'nodes':>6s} {'TFLOP/s':>8s} "
                 f"{'GB/s':>8s} {'of roofline':>11s}"]
        for cat in self.categories(ceilings):
            tf, gbs = cat.rates()
            roof = cat.of_roofline
            lines.append(f"  {cat.name:16s} {cat.ms:9.4f} "
                         f"{cat.ms / self.total_ms if self.total_ms else 0:6.1%} {cat.nodes:6d} "
                         f"{tf:8.3g} {gbs:8.1f} {'' if roof is None else f'{roof:.1%}':>11s}")
        lines.append(f"  {'node':40s} {'op':28s} {'ms':>9s} {'share':>6s} {'TFLOP/s':>8s} "
                     f"{'GB/s':>8s}")
        for c in self.top(n):
            tf, gbs = c.rates()
            lines.append(f"  {c.name[:40]:40s} {c.op[:28]:28s} {c.ms:9.4f} "
                         f"{c.ms / busy if busy else 0:6.1%} {tf:8.3g} {gbs:8.1f}")
        if self.unattributed:
            worst = sorted(self.unattributed.items(), key=lambda kv: -kv[1])[:5]
            lines.append("  unattributed: " + ", ".join(f"{k} {v:.4f} ms" for k, v in worst))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "iters": self.iters, "total_ms": self.total_ms,
                           "categories": {c.name: c.ms for c in self.categories()},
                           "nodes": {k: vars(v) for k, v in self.nodes.items()},
                           "unattributed": self.unattributed,
                           "category_ms": self.category_ms}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Attribution:
        """The attribution :meth:`to_json` wrote (its per-category times are derived)."""
        d = json.loads(text)
        return cls(d["device"], d["iters"],
                   {k: NodeCost(**v) for k, v in d["nodes"].items()},
                   dict(d["unattributed"]), d["total_ms"], dict(d.get("category_ms", {})))


class _Annotated(fx.Interpreter):
    """Runs the graph with a profiler range around every node that computes something."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module"):
            with record_function(PREFIX + n.name):
                return super().run_node(n)
        return super().run_node(n)


def _op_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module:{n.target}"
    return getattr(n.target, "__name__", str(n.target))


def _compute_dtype(n: fx.Node) -> str:
    for a in n.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return str(v.dtype).removeprefix("torch.")
    return ""


def _static_costs(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[str, NodeCost]:
    """FLOPs and bytes of every computing node, from one run with a FLOP counter per node."""
    costs: dict[str, NodeCost] = {}

    class Count(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(n)
            with FlopCounterMode(display=False) as fc:
                out = super().run_node(n)
            args = [a for a in tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)]
            moved = sum(_nbytes(self.env[a]) for a in args if a in self.env) + _nbytes(out)
            category = op_category(qualified_name(n.target)) if n.op == "call_function" \
                else "elementwise"
            costs[n.name] = NodeCost(n.name, _op_name(n), flops=fc.get_total_flops(),
                                     bytes=moved, category=category, dtype=_compute_dtype(n))
            return out

    with torch.no_grad():
        Count(gm).run(*inputs)
    return costs


def _nbytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(v) if isinstance(t, torch.Tensor))


def _enclosing(e: Any, prefix: str) -> str | None:
    p = e
    while p is not None:
        if p.name.startswith(prefix):
            return p.name[len(prefix):]
        p = p.cpu_parent
    return None


def _enclosing_node(e: Any) -> str | None:
    return _enclosing(e, PREFIX)


def host_times(gm: fx.GraphModule, inputs: Sequence[Any], iters: int = 5, *,
               drain: bool = False) -> dict[str, float]:
    """Host time (ms) of each computing node's call, without the profiler: the least over
    ``iters`` calls (after one warm-up) of the wall time around it, less the per-node cost of
    timing it (measured on the graph's placeholders, which do nothing). On CUDA, where
    launches return at once, this is what the node costs the host -- as long as the device
    keeps up (a full launch queue makes a launch wait: a device-bound graph's host times are
    upper bounds; ``drain`` waits for the device, outside the timed span, before each node).
    The profiler's own op times inflate the host's by its recording, more for an op that
    calls many others (kopt's custom ops)."""
    clock = time.perf_counter_ns
    best: dict[str, int] = {}
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs)
    sync = torch.cuda.synchronize if cuda and drain else None

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if sync is not None:
                sync()
            t0 = clock()
            out = super().run_node(n)
            t = clock() - t0
            if t < best.get(n.name, t + 1):
                best[n.name] = t
            return out

    runner = Timed(gm)
    with torch.no_grad():
        for _ in range(iters + 1):
            runner.run(*inputs)
    if cuda:
        torch.cuda.synchronize()
    empty = [best[n.name] for n in gm.graph.nodes if n.op == "placeholder" and n.name in best]
    floor = min(empty) if empty else 0
    return {n.name: max(best[n.name] - floor, 0) / 1e6 for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module") and n.name in best}


def profile_graph(gm: fx.GraphModule, inputs: Sequence[Any], iters: int = 3,
                  trace: str | Path | None = None) -> Attribution:
    """Attribute the time of ``iters`` calls of ``gm(*inputs)`` to its nodes (after one warm-up
    call). ``trace``: also write the profiler's Chrome/Perfetto trace there."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs)
    runner = _Annotated(gm)
    with torch.no_grad():
        runner.run(*inputs)  # warm-up: autotuning, allocator, caches
    # counted after the warm-up, like the profiled calls: a hoisted region that hits its cache
    # does no work in either
    costs = _static_costs(gm, inputs)
    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            t0 = time.perf_counter()
            if start is not None:
                start.record()
            for i in range(iters):
                with record_function(f"{ITERATION}{i}"):
                    runner.run(*inputs)
            if end is not None:
                end.record()
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        total = start.elapsed_time(end) if start is not None else wall
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    result = Attribution("cuda" if cuda else "cpu", iters, costs, {}, total / iters)
    regions = {n.name for n in gm.graph.nodes if n.op == "call_module"}
    unattributed: dict[str, float] = defaultdict(float)
    category_ms: dict[str, float] = defaultdict(float)
    per_call: dict[tuple[str, str | None], float] = defaultdict(float)  # (node, call) -> ms
    for e in prof.events():
        if e.name.startswith((PREFIX, ITERATION)):
            continue
        node = _enclosing_node(e)
        if e.name.startswith(_OP_PREFIXES) and node in result.nodes:
            result.nodes[node].host_ms += e.self_cpu_time_total / 1e3 / iters
        if cuda:
            ms = sum(k.duration for k in e.kernels) / 1e3 / iters
            if not e.kernels:
                continue
        else:
            if not e.name.startswith(_OP_PREFIXES):
                continue
            ms = e.self_cpu_time_total / 1e3 / iters
        # a node's events count in its category; a hoisted region's (and unattributed) events
        # by their own op
        by_node = node in result.nodes and node not in regions
        category_ms[result.nodes[node].category if by_node else op_category(e.name)] += ms
        if node is None or node not in result.nodes:
            unattributed[e.name] += ms
            continue
        cost = result.nodes[node]
        cost.ms += ms
        cost.calls += len(e.kernels) if cuda else 1
        per_call[node, _enclosing(e, ITERATION)] += ms * iters
    for c in result.nodes.values():
        c.calls = round(c.calls / iters)
        calls = [per_call.get((c.name, str(i)), 0.0) for i in range(iters)]
        c.min_ms = min(calls) if c.ms > 0 else 0.0
    result.unattributed = dict(unattributed)
    result.category_ms = {cat: category_ms.get(cat, 0.0) for cat in CATEGORIES}
    return result


REPLAY = "kopt::replay::"
ORDER = "kopt::order"
# Below this share of the eager kernel time matched to replayed kernels, a replay profile is
# not used (the two calls launched different kernels: another library choice under capture).
MIN_REPLAY_COVERAGE = 0.9

Launch = tuple[str | None, str, float]  # (node, kernel name, ms) in launch order


def align_replay(order: Sequence[Launch], replays: Sequence[Sequence[tuple[str, float]]]
                 ) -> tuple[list[dict[str, float]], float]:
    """Per replayed call, each node's kernel ms, by matching the replay's kernels (name, ms) in
    execution order to an eager call's (node, name, ms) in launch order; and the least share
    of the eager kernel time that found its kernel in a replay (1.0: every kernel matched).

    A CUDA graph replay names no node: its kernels are the eager call's, in the same order (one
    stream), less what ran outside the graph (input copies, a hoisted region's misses). The
    sequences are matched by kernel name (longest common blocks); an eager kernel without a
    match keeps its eager time, so a node's time is never dropped."""
    names = [name for _, name, _ in order]
    total = sum(ms for _, _, ms in order) or 1.0
    per_call, coverage = [], 1.0
    for replay in replays:
        matcher = difflib.SequenceMatcher(None, names, [n for n, _ in replay], autojunk=False)
        times = [ms for *_, ms in order]
        matched = 0.0
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                j = block.a + k
                matched += order[j][2]
                times[j] = replay[block.b + k][1]
        nodes: dict[str, float] = defaultdict(float)
        for (node, _, _), ms in zip(order, times, strict=True):
            if node is not None:
                nodes[node] += ms
        per_call.append(dict(nodes))
        coverage = min(coverage, matched / total)
    return per_call, coverage


class RawEvent(NamedTuple):
    """One event of the profiler's raw trace: a CPU range (an op, a runtime call, a
    ``record_function`` range) or a device kernel, with the correlation id that ties a kernel
    to the runtime call that launched it (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch)."""

    name: str
    gpu: bool
    start_ns: int
    duration_ns: int
    correlation: int


def replay_launches(events: Sequence[RawEvent], iters: int
                    ) -> tuple[list[Launch], list[list[tuple[str, float]]]]:
    """From a trace of one annotated eager call (range :data:`ORDER`, a node range per node)
    and ``iters`` replays (ranges :data:`REPLAY` + i): the eager call's kernels (node, name,
    ms) and each replay's (name, ms), each in the order they ran. A kernel belongs to the
    range in which the host call that launched it started (the kernel itself runs later)."""
    cpu = [e for e in events if not e.gpu]
    # runtime/driver calls only: ops' own correlation ids are another counter
    launched_at = {e.correlation: e.start_ns for e in cpu if e.name.startswith("cu")}
    windows = {e.name: (e.start_ns, e.start_ns + e.duration_ns) for e in cpu
               if e.name == ORDER or e.name.startswith(REPLAY)}
    nodes = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name[len(PREFIX):])
                   for e in cpu if e.name.startswith(PREFIX))
    starts = [n[0] for n in nodes]

    def node_at(t: int) -> str | None:
        i = bisect.bisect_right(starts, t) - 1
        return nodes[i][2] if i >= 0 and t <= nodes[i][1] else None

    def kernels(window: str) -> list[tuple[int, RawEvent]]:
        lo, hi = windows.get(window, (0, -1))
        return sorted(((launched_at[e.correlation], e) for e in events
                       if e.gpu and not e.name.startswith("kopt::")
                       and lo <= launched_at.get(e.correlation, -1) <= hi),
                      key=lambda te: te[1].start_ns)

    order = [(node_at(t), e.name, e.duration_ns / 1e6) for t, e in kernels(ORDER)]
    replays = [[(e.name, e.duration_ns / 1e6) for _, e in kernels(f"{REPLAY}{i}")]
               for i in range(iters)]
    return order, replays


# profile_replay replays for STEADY_S before it profiles: a few replays of a short graph
# can end before a GPU at its power cap has lowered its clock to what longer timed calls run
# at (H200: W1's calibration replays sampled 1980 MHz while its ablation rows, timed longer,
# ran at 1590-1980). With it, and the clock sampled during the replays only, W1's two
# calibration graphs read 1755 and 1605 MHz against 1725 and 1620 for the same graphs'
# ablation rows (RESULTS.md, 2026-12-02). One second was not enough: W1's calibration replays
# then drew 576-582 W where the same graphs drew 689-693 W after 2 s of their steps
# (RESULTS.md, 2026-12-03).
# The ablation's rows run as long (3 s) before they are timed.


def profile_replay(gm: fx.GraphModule, inputs: Sequence[Any], eager: Attribution,
                   iters: int = 3, steady_s: float = STEADY_S,
                   during: contextlib.AbstractContextManager | None = None,
                   ) -> tuple[Attribution | None, str]:
    """``eager`` (:func:`profile_graph` of the same call) with each node's kernel time as
    measured in CUDA graph replays of the graph (:class:`kopt.cudagraphs.CudaGraphRunner`, the
    hoisted regions outside it), and a line saying what was matched. What a replay predicts
    is the replayed kernels' time, which an eager profile can miss: on the H200, W2 FLUX.2's
    unfused QK-norm + RoPE graph held 420.5 ms of profiled kernels per call against 380.4 ms
    for its timed replay (RESULTS.md, 2026-11-30). ``(None, why)`` where the profiler saw no
    replayed kernels or too few of them matched.

    ``during`` (a :class:`kopt.power.ClockSampler`) is entered around the steady and the
    profiled replays only: the GPU idles at its highest clock while the profiler starts and
    while its trace is read, and a sampler around the whole call recorded that clock (1980 MHz
    for W1's calibration graph, whose ablation row ran at 1830 MHz; RESULTS.md, 2026-12-02)."""
    order_run = _Annotated(gm)
    # as the timed calls run it (kopt.ablate): two eager calls, then the capture
    runner = CudaGraphRunner(gm, warmup=2, clone_outputs=False)
    with torch.no_grad():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(ORDER):
                order_run.run(*inputs)
                torch.cuda.synchronize()
            for _ in range(runner.warmup + 1):  # captured with the profiler on, so that its
                runner(*inputs)  # replays are traced
            torch.cuda.synchronize()
            with during if during is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while time.perf_counter() - start < steady_s:  # to the clocks of sustained load
                    runner(*inputs)
                    torch.cuda.synchronize()
                for i in range(iters):
                    with record_function(f"{REPLAY}{i}"):
                        runner(*inputs)
                        torch.cuda.synchronize()
    order, replays = replay_launches(
        [RawEvent(e.name(), e.device_type() == torch.autograd.DeviceType.CUDA, e.start_ns(),
                  e.duration_ns(), e.correlation_id()) for e in
         prof.profiler.kineto_results.events()], iters)
    order = [(node if node in eager.nodes else None, name, ms) for node, name, ms in order]
    if not order or not all(replays):
        return None, "no replayed kernels in the profile"
    per_call, coverage = align_replay(order, replays)
    if coverage < MIN_REPLAY_COVERAGE:
        return None, (f"{coverage:.0%} of the eager kernel time matched replayed kernels "
                      f"(under {MIN_REPLAY_COVERAGE:.0%})")
    nodes = {}
    for name, c in eager.nodes.items():
        calls = [p.get(name, 0.0) for p in per_call]
        # the mean of equal floats can round an ulp below them (3 x 2.7e-5 / 3): kept >= min
        ms = max(sum(calls) / len(calls), min(calls)) if c.ms > 0 else 0.0
        nodes[name] = dataclasses.replace(c, ms=ms, min_ms=min(calls) if c.ms > 0 else 0.0)
    replayed = Attribution(eager.device, iters, nodes, dict(eager.unattributed),
                           eager.total_ms, dict(eager.category_ms))
    return replayed, (f"replayed kernels {replayed.attributed_ms:.4g} ms per call against "
                      f"{eager.attributed_ms:.4g} eager, {coverage:.1%} of the eager kernel "
                      f"time matched")


def try_profile_replay(gm: fx.GraphModule, inputs: Sequence[Any], eager: Attribution,
                       iters: int = 3, during: contextlib.AbstractContextManager | None = None,
                       ) -> tuple[Attribution | None, str]:
    """:func:`profile_replay`, or None and why where it fails (a graph that cannot be
    captured, a profiler that does not trace graph replays): a replay profile only refines
    what the eager one already measures."""
    try:
        return profile_replay(gm, inputs, eager, iters, during=during)
    except Exception as e:  # noqa: BLE001 -- the caller keeps the eager profile, and says why
        return None, f"not replayed: {type(e).__name__}: {str(e)[:200]}"
    finally:
        torch.cuda.empty_cache()
