"""Pass-by-pass ablation: what each pass is worth end to end, measured and predicted.

From one capture, every variant is optimized anew (ablation is flipping ``PassConfig``
fields) and timed per call:

* ``baseline``: no pass (the captured graph as it is), or only the passes not ablated (the
  context, e.g. ``fp8`` when ablating the GEMM epilogue that needs it);
* ``alone``: each pass by itself on the baseline;
* ``cumulative``: the passes added one by one in the cost model's rank order (the last row is
  every pass);
* ``leave-one-out``: every pass but one.

Each row has the median time per call in eager mode and, on CUDA, replayed from a CUDA graph;
the cost model's prediction for the same graph; the rewrites applied; and the numerics verdict
(every pass of the variant verified at its tier, as ``kopt optimize`` does) with the output's
relative error against the baseline. The calls are made as the workload's caller makes them:
floating-point step inputs (the timestep) take a new value every ``calls_per_step`` calls, so a
hoisted region misses once per step, as in a denoising loop, instead of hitting forever.

Writers: a Markdown table (with predicted vs measured saving per pass and their Spearman rank
correlation), JSON, and a waterfall chart (PNG, matplotlib) of the cumulative rows.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kopt.api import optimize_captured
from kopt.bench import STEADY_S, median_ms, sustain
from kopt.capture import Captured, capture_module, flatten_inputs
from kopt.cost import CostModel, OpCount, Ranking, count_graph
from kopt.cudagraphs import CudaGraphRunner
from kopt.models import Workload
from kopt.passes import PassConfig
from kopt.power import ClockSampler
from kopt.profile import profile_graph, try_profile_replay
from kopt.verify import VerifyOptions, relative_error

log = logging.getLogger("kopt")

KINDS = ("alone", "cumulative", "leave-one-out")
# distinct step inputs cycled through: more than a hoisted region keeps entries for
STEPS = 4


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # baseline, alone, cumulative, leave-one-out
    passes: tuple[str, ...]  # the passes it enables, pipeline order
    config: PassConfig
    subject: str | None = None  # the pass run alone, added, or left out


@dataclass(frozen=True)
class Row:
    variant: str
    kind: str
    subject: str | None  # the pass run alone, added, or left out
    passes: tuple[str, ...]
    ms: float  # median per call, eager
    graph_ms: float | None  # median per call replayed from a CUDA graph (CUDA only)
    predicted_ms: float | None
    predicted_graph_ms: float | None
    sites: int  # rewrites applied
    verified: bool | None  # None: not verified
    verdict: str
    error: float | None  # relative error of the main output against the baseline's
    # the optimized graph's counts (what the predictions are made from; not in to_json)
    counts: tuple[OpCount, ...] | None = field(default=None, compare=False, repr=False)
    # measured kernel time (CUDA; op time on a CPU) per call by op, from a profile of the
    # variant's call with the hoisted regions hit (``ablate(profile_rows=N)``): on CUDA its
    # CUDA graph replays where they could be matched, else its eager call
    op_ms: dict[str, float] | None = field(default=None, compare=False, repr=False)
    # the all-passes row timed again right after this row (``ablate(paired=True)``): eager,
    # CUDA graph; a leave-one-out saving is then this row less its own re-timing
    ref_ms: float | None = None
    ref_graph_ms: float | None = None
    # the GPU's median SM clock and mean power while the CUDA graph was timed (NVML; None
    # without): a GPU at its power cap clocks a denser graph lower (kopt.power)
    sm_mhz: float | None = None
    power_w: float | None = None

    def same_graph(self, other: Row) -> bool:
        """Whether the two rows ran the same graph: the same ops with the same work, by their
        counts where both rows have them, else by the number of rewrites applied. Two passes
        can apply as many rewrites to different effect (FLUX.2 without the act + quant fusion:
        ``fuse_act`` takes its 1646 sites' count, not its kernels)."""
        if self.counts is None or other.counts is None:
            return self.sites == other.sites

        def work(r: Row) -> list[tuple[str, float, float, bool]]:
            return sorted((c.rate_key, c.flops, c.bytes, c.cached is None) for c in r.counts)

        return self.sites == other.sites and work(self) == work(other)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "counts"}
        d["passes"] = list(self.passes)
        return d


@dataclass
class Ablation:
    model: str
    device: str
    dtype: str
    calls_per_step: int
    iters: int
    order: tuple[str, ...]  # rank order (predicted saving), the cumulative rows' order
    rows: list[Row] = field(default_factory=list)
    ranking: Ranking | None = None
    device_model: str = ""
    context: tuple[str, ...] = ()  # passes on in every row, the baseline included
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M"))
    torch_version: str = torch.__version__

    @property
    def baseline(self) -> Row:
        return self.row("baseline")

    def row(self, variant: str) -> Row:
        for r in self.rows:
            if r.variant == variant:
                return r
        raise KeyError(f"no ablation row {variant!r}")

    def savings(self, kind: str, graphs: bool = False) -> dict[str, tuple[float | None, float]]:
        """Per pass that rewrote something there: (predicted, measured) ms per call saved.
        ``alone``: baseline minus the pass alone; ``leave-one-out``: all but the pass minus all;
        ``cumulative``: the step the pass adds in rank order. ``graphs``: CUDA-graph times."""
        def ms(r: Row) -> float | None:
            return r.graph_ms if graphs else r.ms

        def pred(r: Row) -> float | None:
            return r.predicted_graph_ms if graphs else r.predicted_ms

        out: dict[str, tuple[float | None, float]] = {}
        every = self.every_pass
        prev = self.baseline
        for r in (r for r in self.rows if r.kind == kind):
            if kind == "alone":
                a, b = self.baseline, r
            elif kind == "leave-one-out":
                a, b = r, every
            else:
                a, b, prev = prev, r, r
            # a pass that rewrote nothing here leaves the same graph: its difference is noise
            if ms(a) is None or ms(b) is None or a.same_graph(b):
                continue
            p = None if pred(a) is None or pred(b) is None else pred(a) - pred(b)
            paired = r.ref_graph_ms if graphs else r.ref_ms
            measured_b = paired if kind == "leave-one-out" and paired is not None else ms(b)
            out[r.subject] = (p, ms(a) - measured_b)
        return out

    def reference_spread(self, graphs: bool = False) -> tuple[float, float] | None:
        """(least, most) ms per call the all-passes row measured over its paired re-timings
        (``ablate(paired=True)``), its own first timing included: the drift of the run."""
        every = self.every_pass
        times = [r.ref_graph_ms if graphs else r.ref_ms for r in self.rows]
        times = [t for t in times if t is not None]
        first = every.graph_ms if graphs else every.ms
        if not times or first is None:
            return None
        return min(times + [first]), max(times + [first])

    @property
    def every_pass(self) -> Row:
        """The row with every ablated pass on (the last cumulative row, or ``all``)."""
        every = [r for r in self.rows if r.kind in ("cumulative", "all")]
        if every:
            return every[-1]
        return max(self.rows, key=lambda r: len(r.passes))

    def markdown(self) -> str:
        base = self.baseline
        graphs = any(r.graph_ms is not None for r in self.rows)
        head = (f"### Ablation: {self.model}, {self.dtype} on {self.device} "
                f"({self.date}, torch {self.torch_version})\n\n"
                f"Median of {self.iters} timed steps of {self.calls_per_step} call(s), per call. "
                f"Predicted: {self.device_model or 'no cost model'}.\n\n"
                + (f"On in every row, the baseline included (not ablated): "
                   f"{', '.join(self.context)}.\n\n" if self.context else ""))
        spreads = [(m, self.reference_spread(g)) for m, g in (("eager", False),
                                                             ("CUDA graph", True))]
        spreads = [(m, sp) for m, sp in spreads if sp is not None]
        if spreads:
            head += ("Paired: the all-passes row was timed again right after each later row; a "
                     "leave-one-out saving is that row less its paired re-timing. The "
                     "all-passes row measured " + ", ".join(
                         f"{lo:.4g}-{hi:.4g} ms ({m})" for m, (lo, hi) in spreads)
                     + " over the run.\n\n")
        cols = ["variant", "sites", "ms/call", "saved"]
        if graphs:
            cols += ["ms/call (CUDA graph)", "saved (graph)"]
        cols += ["predicted ms", "predicted saved"] + (["predicted ms (graph)"] if graphs else [])
        cols += ["numerics", "rel. error vs baseline"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            cells = [r.variant, str(r.sites), f"{r.ms:.4g}", _pct(base.ms - r.ms, base.ms)]
            if graphs:
                cells += ["-" if r.graph_ms is None else f"{r.graph_ms:.4g}",
                          "-" if r.graph_ms is None or base.graph_ms is None
                          else _pct(base.graph_ms - r.graph_ms, base.graph_ms)]
            cells += ["-" if r.predicted_ms is None else f"{r.predicted_ms:.4g}",
                      "-" if r.predicted_ms is None or base.predicted_ms is None
                      else _pct(base.predicted_ms - r.predicted_ms, base.predicted_ms)]
            if graphs:
                cells.append("-" if r.predicted_graph_ms is None else f"{r.predicted_graph_ms:.4g}")
            cells += [r.verdict.replace("|", "/"),
                      "-" if r.error is None else f"{r.error:.2e}"]
            lines.append("| " + " | ".join(cells) + " |")
        out = head + "\n".join(lines)
        for kind, g in itertools.product(("alone", "leave-one-out"),
                                         (False, True) if graphs else (False,)):
            s = self.savings(kind, graphs=g)
            if not s:
                continue
            mode = ", replayed from a CUDA graph" if g else ""
            out += (f"\n\nPredicted vs measured ms saved per call ({kind}{mode}):\n\n"
                    "| pass | predicted | measured | predicted / measured |\n|---|---|---|---|\n")
            for name, (p, m) in s.items():
                ratio = "-" if p is None or m == 0 else f"{p / m:.2f}"
                out += f"| {name} | {'-' if p is None else f'{p:.4g}'} | {m:.4g} | {ratio} |\n"
            pairs = [(p, m) for p, m in s.values() if p is not None]
            if len(pairs) >= 2:
                rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
                out += f"\nSpearman rank correlation: {rho:.2f} over {len(pairs)} passes\n"
        return out

    def meta(self) -> dict[str, Any]:
        """The run's settings (everything but the rows and the ranking)."""
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "calls_per_step": self.calls_per_step, "iters": self.iters, "date": self.date,
                "torch": self.torch_version, "device_model": self.device_model,
                "order": list(self.order), "context": list(self.context)}

    def to_json(self) -> str:
        return json.dumps({
            **self.meta(),
            "rows": [r.to_dict() for r in self.rows],
            "savings": {k: self.savings(k) for k in KINDS},
            "ranking": None if self.ranking is None else [
                {"pass": p.name, "sites": p.sites, "predicted_saved_ms": p.saved_ms,
                 "applied": p.applied, "reason": p.reason} for p in self.ranking.ranked()],
        }, indent=1)

    def waterfall(self, path: str | Path) -> None:
        """The cumulative rows as a waterfall: each pass's bar spans the time per call before
        and after it (green: faster, red: slower), predicted times as markers; one panel per
        execution mode measured."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [self.baseline] + [r for r in self.rows if r.kind == "cumulative"]
        modes = [("eager", "ms", "predicted_ms")]
        if all(r.graph_ms is not None for r in steps):
            modes.append(("CUDA graph", "graph_ms", "predicted_graph_ms"))
        fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.0, 1.1 * len(steps) + 2), 4.2 *
                                                          len(modes)), squeeze=False)
        labels = ["baseline"] + [f"+ {r.subject}" for r in steps[1:]] + ["kopt"]
        for ax, (mode, key, pkey) in zip(axes[:, 0], modes, strict=True):
            values = [getattr(r, key) for r in steps]
            ax.bar(0, values[0], color="#7f7f7f")
            for i in range(1, len(values)):
                lo, hi = sorted((values[i - 1], values[i]))
                ax.bar(i, hi - lo, bottom=lo,
                       color="#2ca02c" if values[i] <= values[i - 1] else "#d62728")
            ax.bar(len(values), values[-1], color="#1f77b4")
            predicted = [getattr(r, pkey) for r in steps]
            if all(p is not None for p in predicted):
                ax.plot(range(len(predicted)), predicted, "k_", markersize=18,
                        label="predicted (cost model)")
                ax.legend(loc="upper right", fontsize=8)
            ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel("ms per call")
            ax.set_title(f"{self.model} on {self.device}, {mode}: {values[0]:.3g} -> "
                         f"{values[-1]:.3g} ms per call", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _pct(saved: float, base: float) -> str:
    return f"{saved:+.4g} ({saved / base:+.1%})" if base else f"{saved:+.4g}"


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their average rank); nan when either side is
    constant."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else float("nan")


def _off(name: str) -> Any:
    """The value of PassConfig field ``name`` that turns its pass off."""
    return False if isinstance(getattr(PassConfig(), name), bool) else None


def variants(config: PassConfig, order: Sequence[str], kinds: Sequence[str] = KINDS,
             context: Sequence[str] = ()) -> list[Variant]:
    """Baseline, then the rows of ``kinds`` over the passes ``config`` enables; ``order`` is
    the cumulative rows' order (passes of ``config`` not in it are appended). ``context``:
    passes of ``config`` that stay on in every row, the baseline included (not ablated: e.g.
    ``fp8``, which the GEMM epilogue needs)."""
    on = tuple(p for p in config.enabled() if p not in context)
    none = PassConfig(**{p: getattr(config, p) if p in context else _off(p)
                         for p in PassConfig.pass_names()})
    out = [Variant("baseline", "baseline", (), none)]
    if "alone" in kinds:
        out += [Variant(f"{p} alone", "alone", (p,), none.replace(**{p: getattr(config, p)}), p)
                for p in on]
    if "cumulative" in kinds:
        ranked = [p for p in order if p in on] + [p for p in on if p not in order]
        for k in range(1, len(ranked) + 1):
            chosen = set(ranked[:k])
            cfg = none.replace(**{p: getattr(config, p) for p in chosen})
            out.append(Variant(f"+ {ranked[k - 1]}", "cumulative",
                               tuple(p for p in on if p in chosen), cfg, ranked[k - 1]))
    if "leave-one-out" in kinds:
        if "cumulative" not in kinds:  # what each pass is left out of
            out.append(Variant("all", "all", on, config))
        out += [Variant(f"all - {p}", "leave-one-out", tuple(q for q in on if q != p),
                        config.replace(**{p: _off(p)}), p) for p in on]
        if "fp8" in on:  # its levers are ablated with it
            out += [Variant(f"all - {name}", "leave-one-out", on, other, name)
                    for name, other in levers(config)]
    return out


def levers(config: PassConfig) -> list[tuple[str, PassConfig]]:
    """The configuration choices of ``config`` ablated as rows of their own, each ``(name,
    config with it at its other setting)``: FP8 GEMMs accumulating fast (``accumulate=fast``,
    left out: exact), named as :meth:`kopt.cost.CostModel.levers` prices them."""
    fp8 = config.fp8
    if fp8 is not None and fp8.layout == "rowwise" and fp8.accumulate == "fast":
        return [("accumulate=fast",
                 config.replace(fp8=dataclasses.replace(fp8, accumulate="exact")))]
    return []


def baseline_config(config: PassConfig, passes: Sequence[str] | None = None) -> PassConfig:
    """The baseline row's config when only ``passes`` of ``config`` are ablated: the others
    stay on (:func:`variants`' ``context``); every pass off when ``passes`` is None."""
    context = () if passes is None else tuple(p for p in config.enabled() if p not in passes)
    return variants(config, (), (), context)[0].config


def step_kwargs(w: Workload, steps: int = STEPS, kwargs: dict | None = None) -> list[dict]:
    """``kwargs`` (the workload's by default) at ``steps`` consecutive steps: the
    floating-point step inputs (timestep, guidance) scaled per step into new tensors, the rest
    as they are."""
    out = []
    for s in range(steps):
        kw = dict(w.kwargs if kwargs is None else kwargs)
        for k in w.step_invariant:
            v = kw.get(k)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                kw[k] = v * (1.0 - 0.1 * s)
        out.append(kw)
    return out


def step_inputs(w: Workload, steps: int = STEPS) -> list[list[Any]]:
    """Flat inputs of :func:`step_kwargs`' steps."""
    return [flatten_inputs(w.args, kw)[0] for kw in step_kwargs(w, steps)]


def stepper(inputs: Iterator[list[Any]], calls: int) -> Callable[[Callable[..., Any]], None]:
    """One step: ``calls`` calls of a runner on the next step's inputs."""
    def step(fn: Callable[..., Any]) -> None:
        flat = next(inputs)
        for _ in range(calls):
            fn(*flat)
    return step


def _main(out: Any) -> torch.Tensor:
    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def ablate(w: Workload, config: PassConfig = PassConfig(), *, passes: Sequence[str] | None = None,
           kinds: Sequence[str] = KINDS, cost: CostModel | None = None, iters: int = 10,
           warmup: int = 3, verify: VerifyOptions = VerifyOptions(),
           captured: Captured | None = None,
           progress: Callable[[str], None] = log.info,
           on_row: Callable[[Ablation, Row], None] | None = None,
           profile_rows: int = 0, paired: bool = False,
           steady_s: float = STEADY_S) -> Ablation:
    """Ablate the passes ``config`` enables (or only ``passes`` of them) on workload ``w``.

    ``cost``: ranks the passes (the cumulative order) and predicts each row; without it the
    order is the pipeline's. ``captured``: reuse a capture of ``w``. ``on_row``: called with
    each row as it is measured (to save rows of a run that may not finish). ``profile_rows``:
    also profile each variant over that many calls, for its kernel time by op (``Row.op_ms``:
    where a prediction and a measurement part, :func:`op_deltas` says which ops).
    ``paired``: keep the all-passes variant and time it again right after every later row
    (``Row.ref_ms``, ``Row.ref_graph_ms``), so each leave-one-out saving is a difference of two
    timings taken back to back, and the GPU's drift between rows stays out of it (on the H200
    the same W1 row measured +-2 ms apart across runs of a 103 ms call; within one run it is
    what this measures). Holds a second variant's memory. ``steady_s``: seconds each CUDA
    graph runs its steps before it is timed, so that every row is timed at the GPU's sustained
    clock (:data:`kopt.bench.STEADY_S`).
    """
    if steady_s < 0:
        raise ValueError(f"steady_s must be >= 0, not {steady_s}")
    context: tuple[str, ...] = ()
    if passes is not None:
        unknown = set(passes) - set(config.enabled())
        if unknown:
            raise ValueError(f"passes {sorted(unknown)} are not enabled in the config")
        context = tuple(p for p in config.enabled() if p not in passes)
    cap = captured or capture_module(w.model, w.args, w.kwargs)
    inputs = step_inputs(w)
    device = next((t.device for t in cap.example_inputs if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    cuda = device.type == "cuda"
    ranking = None
    order = tuple(p for p in config.enabled() if p not in context)
    if cost is not None:
        everything = dataclasses.replace(cost, min_saving_ms=-math.inf)  # rank, skip nothing
        spec = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0,
                                 cost=everything)
        ranking = spec.report.ranking
        order = tuple(p.name for p in ranking.ranked()
                      if p.name in config.enabled() and p.name not in context)
        del spec
    result = Ablation(w.name, str(device), str(next(
        (t.dtype for t in cap.example_inputs if isinstance(t, torch.Tensor)
         and t.is_floating_point()), torch.float32)).removeprefix("torch."), w.calls_per_step,
        iters,
        order, ranking=ranking, device_model=cost.device.describe() if cost else "",
        context=context)
    with torch.no_grad():
        expected = _main(cap.gm(*cap.example_inputs)).detach().clone()
    measured: dict[PassConfig, Row] = {}
    rows = variants(config, order, kinds, context)
    every = [v for v in rows if v.kind in ("all", "cumulative")]
    keep = every[-1].name if paired and every else None
    reference: _Reference | None = None
    for v in rows:
        known = measured.get(v.config)
        if known is not None:  # the same passes under another name: measured once
            result.rows.append(dataclasses.replace(known, variant=v.name, kind=v.kind,
                                                   subject=v.subject))
            if on_row is not None:
                on_row(result, result.rows[-1])
            continue
        row, kept = _measure(v, w, cap, verify, cost, expected, inputs, iters, warmup,
                             profile_rows, reference, keep=v.name == keep, steady_s=steady_s)
        reference = kept or reference
        measured[v.config] = row
        result.rows.append(row)
        if on_row is not None:
            on_row(result, row)
        progress(f"ablate {v.name}: {row.ms:.4g} ms per call"
                 + (f", {row.graph_ms:.4g} ms in a CUDA graph" if row.graph_ms is not None
                    else "")
                 + (f", predicted {row.predicted_ms:.4g}" if row.predicted_ms is not None
                    else "")
                 + (f" ({row.predicted_graph_ms:.4g} in a graph)"
                    if row.predicted_graph_ms is not None else "")
                 + (f"; SM {row.sm_mhz:.0f} MHz, {row.power_w:.0f} W in the graph"
                    if row.sm_mhz is not None else "")
                 + f"; {row.verdict}")
        gc.collect()  # the variant's packed weights and caches
        if cuda:
            torch.cuda.empty_cache()
    del reference
    return result


@dataclass
class _Reference:
    """The all-passes variant kept for paired timings: its module and CUDA-graph runner."""

    gm: Any
    runner: Any
    step: Callable[[Callable[..., Any]], None]
    calls: int
    iters: int
    warmup: int
    device: torch.device
    steady_s: float = 0.0

    def time(self) -> tuple[float, float | None]:
        """(eager, CUDA graph) ms per call now."""
        with torch.no_grad():
            ms = median_ms(lambda: self.step(self.gm), self.iters, self.warmup,
                           self.device) / self.calls
            graph = None
            if self.runner is not None:
                sustain(lambda: self.step(self.runner), self.steady_s, self.device)
                graph = median_ms(lambda: self.step(self.runner), self.iters, self.warmup,
                                  self.device) / self.calls
        return ms, graph


def _measure(v: Variant, w: Workload, cap: Captured, verify: VerifyOptions,
             cost: CostModel | None, expected: torch.Tensor, inputs: list[list[Any]],
             iters: int, warmup: int, profile_rows: int = 0, paired: _Reference | None = None,
             *, keep: bool = False, steady_s: float = 0.0,
             ) -> tuple[Row, _Reference | None]:
    """Optimize the capture with the variant's config (verified), time it, predict it (and
    with ``profile_rows``, profile it: its kernel time by op). ``paired``: time that kept
    variant again right after this one; ``keep``: return this variant for paired timings."""
    spec = optimize_captured(cap, v.config, verify, None, f"{w.name} [{v.name}]", 0.0)
    gm, calls = spec.gm, w.calls_per_step
    device = expected.device
    step = stepper(itertools.cycle(inputs), calls)
    with torch.no_grad():
        error = relative_error(_main(gm(*cap.example_inputs)), expected)
        ms = median_ms(lambda: step(gm), iters, warmup, device) / calls
        graph_ms, graph_error, runner, clocks = None, None, None, None
        if device.type == "cuda":
            try:
                runner = CudaGraphRunner(gm)
                # to the sustained clock: the eager timing above left the GPU below its cap
                sustain(lambda: step(runner), steady_s, device)
                with ClockSampler(device) as sampler:
                    graph_ms = median_ms(lambda: step(runner), iters, warmup, device) / calls
                clocks = sampler.result
            except Exception as exc:  # noqa: BLE001 -- the row says why it has no graph time
                first = (str(exc).strip().splitlines() or [""])[0]
                graph_error = f"no CUDA graph: {type(exc).__name__}: {first[:200]}"
                log.warning("ablate %s: %s", v.name, graph_error)
                runner = None
                torch.cuda.synchronize()
    ref_ms, ref_graph_ms = paired.time() if paired is not None else (None, None)
    counts = tuple(count_graph(gm))
    predicted, predicted_graph = _predict(cost, counts, device.type == "cuda")
    verified, verdict = _verdict(spec.report, verify)
    if graph_error:
        verdict = f"{verdict}; {graph_error}"
    op_ms = None
    if profile_rows > 0:
        op_ms = {}
        # the counts' rate keys (aten::mul[broadcast]): the ops as the device model prices them
        op_of = {c.node: c.rate_key for c in counts}
        profiled = profile_graph(gm, cap.example_inputs, iters=profile_rows)
        if device.type == "cuda":  # the kernels as a replayed call runs them, where it can
            replayed, note = try_profile_replay(gm, cap.example_inputs, profiled,
                                                profile_rows)
            log.info("ablate %s: %s", v.name, note)
            profiled = replayed or profiled
        for n in profiled.nodes.values():
            if "/" not in n.name and n.ms > 0:  # top level: a hit region runs nothing
                op = op_of.get(n.name, n.op)
                op_ms[op] = op_ms.get(op, 0.0) + n.ms
    row = Row(v.name, v.kind, v.subject, v.passes, ms, graph_ms, predicted, predicted_graph,
              spec.report.applied, verified, verdict, error, counts, op_ms, ref_ms, ref_graph_ms,
              clocks.sm_mhz if clocks else None, clocks.power_w if clocks else None)
    kept = _Reference(gm, runner if device.type == "cuda" else None, step, calls, iters, warmup,
                      device, steady_s) if keep else None
    return row, kept


def _predict(cost: CostModel | None, counts: Sequence[OpCount],
             cuda: bool) -> tuple[float | None, float | None]:
    """(eager, CUDA graph) ms per call ``cost`` predicts for a graph of ``counts``."""
    if cost is None:
        return None, None
    eager = dataclasses.replace(cost, cuda_graphs=False).predict(counts).total_ms
    graph = dataclasses.replace(cost, cuda_graphs=True).predict(counts).total_ms if cuda else None
    return eager, graph


def op_deltas(result: Ablation, cost: CostModel, subject: str,
              kind: str = "leave-one-out") -> list[tuple[str, float, float]]:
    """Where a pass's saving comes from, by op: (op, predicted, measured) kernel ms per call
    that the row without the pass (``leave-one-out``; the pass alone: ``alone``) spends on
    top of the row with it, largest measured first. The measured side is the rows' profiles
    (``Row.op_ms``), the predicted side the device model's kernel times of their counts (the
    hoisted regions left out, as they hit in the profiled calls)."""
    if kind == "leave-one-out":
        without, with_ = result.row(f"all - {subject}"), result.every_pass
    else:
        without, with_ = result.baseline, result.row(f"{subject} alone")
    if without.op_ms is None or with_.op_ms is None:
        raise ValueError(f"the rows of {subject!r} were not profiled (profile_rows)")
    if without.counts is None or with_.counts is None:
        raise ValueError(f"the rows of {subject!r} have no counts to predict from")

    def predicted(r: Row) -> dict[str, float]:
        out: dict[str, float] = {}
        counts = list(r.counts or ())
        times = cost.device.kernel_times(counts, [cost.run_fraction(c) for c in counts])
        for c, t in zip(counts, times, strict=True):
            if c.kernel and c.cached is None and "/" not in c.node:
                out[c.rate_key] = out.get(c.rate_key, 0.0) + t
        return out

    pa, pb = predicted(without), predicted(with_)
    ops = set(pa) | set(pb) | set(without.op_ms) | set(with_.op_ms)
    rows = [(op, pa.get(op, 0.0) - pb.get(op, 0.0),
             without.op_ms.get(op, 0.0) - with_.op_ms.get(op, 0.0)) for op in ops]
    return sorted(rows, key=lambda x: -abs(x[2]))


def repredict(result: Ablation, cost: CostModel) -> Ablation:
    """``result`` with every row's prediction made again by ``cost`` from the row's counts (a
    device model fitted again, or another one), the measurements as they were. The ranking's
    in-pipeline predictions need the graphs: they are dropped."""
    cuda = result.device.startswith("cuda") or any(r.graph_ms is not None for r in result.rows)
    rows = []
    for r in result.rows:
        if r.counts is None:
            raise ValueError(f"ablation row {r.variant!r} has no counts to predict from")
        p, g = _predict(cost, r.counts, cuda)
        rows.append(dataclasses.replace(r, predicted_ms=p, predicted_graph_ms=g))
    return dataclasses.replace(result, rows=rows, ranking=None,
                               device_model=cost.device.describe())


class RowLog:
    """An ``on_row`` for :func:`ablate`: each row, with its counts, appended to a gzipped
    JSON-lines file as soon as it is measured (the first line: the run's settings), so a run
    cut short still leaves what it measured. :func:`load_rows` reads it back."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.unlink(missing_ok=True)

    def __call__(self, result: Ablation, row: Row) -> None:
        lines = [] if self.path.exists() else [{"meta": result.meta()}]
        lines.append({**row.to_dict(), "counts": None if row.counts is None else
                      [dataclasses.asdict(c) for c in row.counts]})
        with gzip.open(self.path, "at") as f:  # one gzip member per row: still one stream
            f.writelines(json.dumps(x) + "\n" for x in lines)


def load_rows(path: str | Path) -> Ablation:
    """The ablation a :class:`RowLog` wrote (every row it holds, finished run or not)."""
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "meta" not in lines[0]:
        raise ValueError(f"{path}: not an ablation row log (no settings line)")
    meta = lines[0]["meta"]
    result = Ablation(meta["model"], meta["device"], meta["dtype"], meta["calls_per_step"],
                      meta["iters"], tuple(meta["order"]), device_model=meta["device_model"],
                      context=tuple(meta["context"]), date=meta["date"],
                      torch_version=meta["torch"])
    for d in lines[1:]:
        counts = d.pop("counts")
        result.rows.append(Row(**{**d, "passes": tuple(d["passes"])}, counts=None if counts is
                               None else tuple(OpCount(**c) for c in counts)))
    return result


def _verdict(report: Any, verify: VerifyOptions) -> tuple[bool | None, str]:
    """(verified, verdict text) of one variant's report."""
    if not verify.enabled:
        return None, "not verified"
    judged = [r for r in report.passes if r.verdict is not None]
    if not judged:
        return None, "nothing to verify"
    failed = [r for r in judged if not r.verdict.passed]
    if failed:
        return False, "FAILED: " + "; ".join(f"{r.name}: {r.verdict.detail}" for r in failed)
    reverted = sum(len(r.reverted) for r in judged)
    return True, (f"passed ({len(judged)} pass{'es' if len(judged) > 1 else ''} verified"
                  + (f", {reverted} sites reverted)" if reverted else ")"))
