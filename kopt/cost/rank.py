"""Ranking rewrites by predicted time saved, and the gate that skips predicted losers.

A candidate rewrite is a pass run on a copy of the graph (what the pass manager does anyway).
Its predicted saving is the modelled time of the graph before it minus that of the graph after
it: no per-pass code, so a new pass is ranked the day it is written. The nodes it removed and
the fused kernels it inserted are whatever differs between the two graphs.

Constant work is costed as it will run: when ``fold_constants`` comes later in the pipeline, a
parameter-only subgraph (the concatenated weights of a merged projection) is load-time work and
costs nothing per call; the fold pass itself is judged with those subgraphs still per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import fx

from kopt.cost.counts import OpCount, count_graph
from kopt.cost.device import DeviceModel, Prediction
from kopt.passes.base import PassResult


@dataclass(frozen=True)
class PassPrediction:
    """One pass at one workload: modelled time per call before and after it, and the verdict."""

    name: str
    sites: int
    before: Prediction
    after: Prediction
    applied: bool
    reason: str

    @property
    def saved_ms(self) -> float:
        return self.before.total_ms - self.after.total_ms


@dataclass(frozen=True)
class CostModel:
    """The device model plus how the graph is run: eager or from a CUDA graph, and how many
    calls a denoising step makes (a hoisted region keyed on the timestep runs once per step;
    one keyed on positions, once per generation: ~never per call).

    ``min_saving_ms``: a pass is applied only if it is predicted to save more than this (ms per
    call); 0 skips exactly the passes predicted to lose.
    """

    device: DeviceModel
    cuda_graphs: bool = False
    calls_per_step: int = 1
    min_saving_ms: float = 0.0

    @property
    def mode(self) -> str:
        graphs = self.cuda_graphs and self.device.graph_launch_us is not None
        return "CUDA graph" if graphs else "eager"

    def run_fraction(self, c: OpCount) -> float:
        if c.cached is None:
            return 1.0
        return 0.0 if c.cached == "static" else 1.0 / self.calls_per_step

    def predict(self, counts: Sequence[OpCount]) -> Prediction:
        return self.device.predict(counts, cuda_graphs=self.cuda_graphs,
                                   weights=[self.run_fraction(c) for c in counts])

    def graph(self, gm: fx.GraphModule, *, folded: bool = False) -> Prediction:
        return self.predict(count_graph(gm, folded=folded))

    def judge(self, name: str, before: Prediction, after: Prediction,
              sites: int) -> PassPrediction:
        """Applied unless predicted to save no more than ``min_saving_ms`` (ms per call)."""
        saved = before.total_ms - after.total_ms
        if sites == 0:
            return PassPrediction(name, 0, before, after, True, "nothing to rewrite")
        # a saving within rounding of zero is no loss
        applied = saved > self.min_saving_ms - 1e-9 * max(before.total_ms, 1e-12)
        what = (f"{after.kernels - before.kernels:+.0f} launches, "
                f"{(after.bytes - before.bytes) / 1e6:+.3g} MB moved per call, "
                f"{self.device.name}, {self.mode}")
        if applied:
            reason = f"predicted to save {saved:.4g} ms per call ({what})"
        elif saved < 0:
            reason = f"predicted to lose {-saved:.4g} ms per call ({what})"
        else:
            reason = (f"predicted to save {saved:.4g} ms per call, not more than "
                      f"{self.min_saving_ms:g} ({what})")
        return PassPrediction(name, sites, before, after, applied, reason)

    def judge_pass(self, name: str, before: fx.GraphModule, after: fx.GraphModule,
                   result: PassResult, *, folded: bool) -> PassPrediction:
        """The pass manager's gate: ``after`` is ``before`` with the pass applied."""
        return self.judge(name, self.graph(before, folded=folded),
                          self.graph(after, folded=folded), result.matched)

    def ranking(self, captured: fx.GraphModule, final: fx.GraphModule,
                passes: Sequence[PassPrediction]) -> Ranking:
        return Ranking(self.device.name, self.mode, self.graph(captured).total_ms,
                       self.graph(final).total_ms, tuple(passes), self.levers(final))

    def levers(self, final: fx.GraphModule) -> tuple[PassPrediction, ...]:
        """What the configuration levers the optimized graph uses are predicted to save: each
        a :class:`PassPrediction` of the graph with the lever at its other setting (before)
        and as it is (after). FP8 GEMMs accumulating fast (``FP8Config(accumulate="fast")``)
        against the same GEMMs accumulating exactly."""
        counts = count_graph(final)
        fast = [i for i, c in enumerate(counts) if "fast" in c.layout.split(",")]
        if not fast:
            return ()
        exact = list(counts)
        for i in fast:
            layout = ",".join(p for p in counts[i].layout.split(",") if p != "fast")
            exact[i] = replace(counts[i], layout=layout)
        before, after = self.predict(exact), self.predict(counts)
        saved = before.total_ms - after.total_ms
        return (PassPrediction("accumulate=fast", len(fast), before, after, True,
                               f"predicted to save {saved:.4g} ms per call against "
                               f"accumulate='exact' ({len(fast)} FP8 GEMMs, {self.device.name}, "
                               f"{self.mode})"),)


@dataclass(frozen=True)
class Ranking:
    """Predicted saving of every pass of one optimize run, in pipeline order."""

    device: str
    mode: str
    baseline_ms: float  # the captured graph, everything per call
    final_ms: float  # the optimized graph
    passes: tuple[PassPrediction, ...]
    levers: tuple[PassPrediction, ...] = ()  # configuration levers (CostModel.levers)

    def ranked(self) -> list[PassPrediction]:
        """Most predicted time saved first; passes with nothing to rewrite last."""
        return sorted(self.passes, key=lambda p: (p.sites == 0, -p.saved_ms))

    def get(self, name: str) -> PassPrediction:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no prediction for pass {name!r}")

    def format(self, others: Mapping[str, Sequence[PassPrediction]] | None = None) -> str:
        """The ranking table; ``others``: predictions of the same passes at other workloads
        (a column of predicted ms saved each, ``-`` marking a predicted loss)."""
        others = others or {}
        head = (f"ranking ({self.device}, {self.mode}): predicted {self.baseline_ms:.4g} ms per "
                f"call as captured, {self.final_ms:.4g} ms optimized")
        cols = "".join(f" {k[:14]:>14s}" for k in others)
        lines = [head, f"  {'#':>2s} {'pass':20s} {'sites':>5s} {'saved ms':>10s} {'share':>6s}"
                       f"{cols}  decision"]
        at = {k: {p.name: p for p in v} for k, v in others.items()}
        for i, p in enumerate(self.ranked(), start=1):
            share = p.saved_ms / self.baseline_ms if self.baseline_ms else 0.0
            extra = ""
            for k in others:
                q = at[k].get(p.name)
                extra += f" {'' if q is None else f'{q.saved_ms:.4g}':>14s}"
            decision = ("applied" if p.applied else "skipped") if p.sites else "-"
            lines.append(f"  {i:2d} {p.name:20s} {p.sites:5d} {p.saved_ms:10.4g} {share:6.1%}"
                         f"{extra}  {decision}: {p.reason}")
        for p in self.levers:
            share = p.saved_ms / self.baseline_ms if self.baseline_ms else 0.0
            lines.append(f"  {'-':>2s} {p.name:20s} {p.sites:5d} {p.saved_ms:10.4g} {share:6.1%}"
                         f"{' ' * 15 * len(others)}  lever: {p.reason}")
        return "\n".join(lines)
