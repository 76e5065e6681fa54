"""The pipeline: every pass and its order, in one screen.

Each pass runs on a copy of the graph; the copy is kept only if it passes verification at the
pass's declared tier. A pass that fails is retried site by site (bisecting), keeping the sites
that verify and reporting the ones reverted. A model of repeated blocks is verified on its
shallow copy (:meth:`PassManager.run`): the passes are checked on a model cut to its first
blocks, then applied to the whole model unchecked, which one end-to-end run confirms. With a
cost model (``kopt.cost.CostModel``), each pass's predicted saving is recorded (the ranking)
and a pass predicted to lose on this workload is not applied, with the prediction as the
reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx

from kopt import offload
from kopt.collect import collector_skips_what_lives_already
from kopt.graph import copy_graph_module
from kopt.graph.regions import cached_regions
from kopt.kb.verdicts import pipeline_run
from kopt.passes.base import Pass, PassResult, RewritePass, Verdict, count_nodes
from kopt.passes.cat import CatRows
from kopt.passes.config import PassConfig
from kopt.passes.cse import EliminateCommonSubexpressions
from kopt.passes.fold import FoldConstants, PackedAfter, copies_only
from kopt.passes.gqa import FoldGroupedQueryHeads
from kopt.passes.hoist import HoistInvariants
from kopt.passes.noop import ReinplaceCacheUpdates, RemoveNoOps
from kopt.patterns.act_quant import ACT, act_quant_rewrite
from kopt.patterns.bias import ABSORB_BIAS, SPLIT_BIAS_ADD
from kopt.patterns.collectives import ALLREDUCE_NORM_FUSIONS
from kopt.patterns.fp8 import fp8_linear
from kopt.patterns.gemm_epilogue import (
    GEMM_ACT_QUANT,
    GEMM_EPILOGUE,
    TRITON_BLOCKWISE_GEMM,
    TRITON_GEMM,
)
from kopt.patterns.projections import MERGE_PROJECTIONS
from kopt.patterns.qk_norm_rope import QK_NORM_ROPE
from kopt.patterns.rowwise_fusion import rowwise_fusions
from kopt.verify import (
    Baseline,
    VerifyOptions,
    agree_across_ranks,
    compare,
    end_to_end_problem,
    forget_sites,
    output_errors,
    random_inputs,
    run_flat,
    state_kept,
)

if TYPE_CHECKING:
    from kopt.capture import Shallow
    from kopt.cost import CostModel, PassPrediction, Ranking
    from kopt.kb.verdicts import PipelineRun

log = logging.getLogger("kopt")

# set to 1, a pass that raises stops the optimization (the tests set it); otherwise the pass is
# left out and the report says why
STRICT = "KOPT_STRICT"

# (PassConfig field, factory of the pass from the config) in pipeline order.
PIPELINE: tuple[tuple[str, Callable[[PassConfig], Pass]], ...] = (
    ("remove_noops", lambda c: RemoveNoOps()),
    ("reinplace", lambda c: ReinplaceCacheUpdates()),
    ("cse", lambda c: EliminateCommonSubexpressions()),  # exposes shared inputs to the merge
    ("merge_projections",
     lambda c: PackedAfter(RewritePass("merge_projections", [MERGE_PROJECTIONS]))),
    # after merge: one quant/QKV; the linears with weights over 1 GiB in a second round
    ("fp8", lambda c: RewritePass("fp8", [fp8_linear(c.fp8, large=False)])),
    # the FP8 weights packed before the passes below check anything (memory, not speed)
    ("fold_weights", lambda c: FoldConstants("fold_weights") if c.fp8 is not None else None),
    # its check quantizes those weights per call once the BF16 weights packed above have left
    # (fold_constants packs them)
    ("fp8_large", lambda c: _split_from(
        RewritePass("fp8_large", [fp8_linear(c.fp8, large=True)]), "fp8") if c.fp8 else None),
    ("absorb_bias", lambda c: RewritePass("absorb_bias", [ABSORB_BIAS, SPLIT_BIAS_ADD])),
    ("gemm_epilogue", lambda c: RewritePass("gemm_epilogue", [GEMM_EPILOGUE])),
    # q/k are views of the merged QKV output here; the quantizers are the fp8 pass's
    ("fuse_qk_norm_rope", lambda c: RewritePass("fuse_qk_norm_rope", [QK_NORM_ROPE])),
    ("fold_gqa", lambda c: FoldGroupedQueryHeads()),  # after the QK fusion found its SDPA
    ("fuse_act_quant", lambda c: RewritePass("fuse_act_quant", [act_quant_rewrite(
        getattr(c.fp8, "activation_math", "exact"))])),
    ("fuse_act", lambda c: RewritePass("fuse_act", [ACT])),  # what fuse_act_quant left
    # before rowwise_fusion: it would take the same norms without the all-reduce
    ("fuse_allreduce_norm",
     lambda c: RewritePass("fuse_allreduce_norm", list(ALLREDUCE_NORM_FUSIONS))),
    # (ablations flip fp8 to False: no FP8, every step rounded as the model's ops do)
    ("rowwise_fusion", lambda c: RewritePass("rowwise_fusion", list(rowwise_fusions(
        getattr(c.fp8, "intermediates", "eager"))))),
    ("fold_constants", lambda c: FoldConstants()),  # packs what the passes above left on weights
    ("cat_rows", lambda c: CatRows()),  # the cats no fusion took, weights' folded already
    # the blockwise act + quant fuse_act_quant made, into the GEMM before it
    ("gemm_act_quant", lambda c: RewritePass("gemm_act_quant", [GEMM_ACT_QUANT])),
    # the FP8 GEMMs every pass above left to cuBLAS (before hoist: the hoisted ones too)
    ("triton_gemm", lambda c: RewritePass("triton_gemm", [TRITON_GEMM,
                                                          TRITON_BLOCKWISE_GEMM])),
    ("hoist", lambda c: HoistInvariants(c.hoist if isinstance(c.hoist, tuple) else ())),
)


def _split_from(p: Pass, other: str) -> Pass:
    p.split_from = other
    return p


def build_passes(config: PassConfig) -> list[Pass]:
    """The passes ``config`` turns on, in pipeline order (a factory gives None for a pass
    that does nothing under the rest of the config)."""
    passes = [factory(config) for name, factory in PIPELINE if getattr(config, name)]
    return [p for p in passes if p is not None]


class PassManager:
    """Runs the configured passes with verification; one line per pass goes to the log."""

    def __init__(
        self,
        config: PassConfig = PassConfig(),
        verify: VerifyOptions = VerifyOptions(),
        dump_dir: Path | None = None,
        cost: CostModel | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.config = config
        self.cuda_graphs = cuda_graphs  # the result replays from CUDA graphs (the KB's dead ends)
        self.verify = verify
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.passes = build_passes(config)
        self.cost = cost
        self.predictions: list[PassPrediction] = []
        self.ranking: Ranking | None = None  # after run, with a cost model
        # after run, where verification kept them: (the result's outputs, the captured
        # graph's) on seed 0's inputs
        self.end_to_end: tuple[list[Any], list[Any]] | None = None
        self.verified_on = ""  # after run: where the passes were checked, if not on the graph

    def uuid(self) -> str:
        h = hashlib.sha256(repr(self.config).encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.hexdigest()[:16]

    def run(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], workload: str | None = None,
        shallow: Shallow | None = None,
    ) -> tuple[fx.GraphModule, list[PassResult]]:
        """``workload``: the knowledge base's key of ``gm`` where the caller has it.
        ``shallow``: ``gm``'s model cut to its first blocks per repeated list
        (:meth:`kopt.capture.Captured.shallow`), on which verification checks the passes in
        place of ``gm`` (:meth:`_run_shallow`)."""
        with collector_skips_what_lives_already():
            if shallow is not None and self.verify.enabled and self.cost is None:
                return self._run_shallow(gm, example_inputs, shallow, workload)
            return self._run(gm, example_inputs, workload=workload)

    def _run_shallow(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], shallow: Shallow,
        workload: str | None,
    ) -> tuple[fx.GraphModule, list[PassResult]]:
        """The passes checked on ``shallow``, the model cut to its first blocks, then applied
        to ``gm`` without checks.

        Every block past the cut is an instance of a kept block's trace (the same graph with its
        own weights), and the passes match by structure alone: each rewrite they make there is
        one they made, and verification checked, in a kept block or between two kept blocks.
        What the kept blocks' weights cannot stand for -- another block's weights, and the
        whole depth of the model -- one run of the whole optimized model checks against the
        captured graph on seed 0 (:func:`kopt.verify.end_to_end_problem`): outputs of the same
        shapes and dtypes, finite where the captured graph's are, within a multiple of the
        shallow model's own change (a broken rewrite, not a subtle one; the sites' bounds are
        the shallow checks').

        The whole model is verified pass by pass as without ``shallow`` where that cannot
        stand: a pass that fails or reverts a site on the shallow model, a pass that rewrites
        the whole model but not the shallow one or the other way round, or an end-to-end run
        that fails."""
        kb = pipeline_run(gm, example_inputs, cuda_graphs=self.cuda_graphs, workload=workload)
        start = time.perf_counter()
        checker = PassManager(self.config, self.verify, cuda_graphs=self.cuda_graphs)
        inputs = random_inputs(example_inputs, 0)
        # the whole model's passes read every weight after it, and pack them in place
        with offload.releasing(None), copies_only():
            checked_gm, checked = checker._run(shallow.gm, example_inputs, kb=kb, record=False)
            why = _unclean(checked)
            if why is None:
                pair = checker.end_to_end
                if pair is None:  # seed 0 not among the seeds, or its outputs not kept
                    with state_kept(shallow.gm, checked_gm):
                        pair = run_flat(checked_gm, inputs), run_flat(shallow.gm, inputs)
                moved = output_errors(*pair)
                del pair
            del checked_gm  # its packed weights, while the whole model's are made
        where = f"the model cut to {shallow.cut.describe()}"
        if why is not None:
            log.warning("kopt: on %s, %s: verifying the whole model pass by pass", where, why)
            return self._run(gm, example_inputs, workload=workload, kb=kb)
        checked_s = time.perf_counter() - start
        with state_kept(gm):  # before the passes below move the model's weights off the GPU
            first = run_flat(gm, inputs)
        released = offload.released()
        applier = PassManager(self.config, VerifyOptions(enabled=False), self.dump_dir,
                              cuda_graphs=self.cuda_graphs)
        out, results = applier._run(gm, example_inputs, kb=kb, record=False)
        why = _disagree(applier.passes, results, checked)
        got = None
        if why is None:
            start = time.perf_counter()
            try:
                with state_kept(out):
                    got = run_flat(out, inputs)
            except Exception as exc:  # noqa: BLE001 -- a rewrite that crashes has failed
                why = f"the optimized model raised {type(exc).__name__}: {exc}"
            for region in cached_regions(out):
                region.clear()  # what the random inputs left in the caches
            if got is not None:
                why = end_to_end_problem(got, first, moved)
        if why is not None:
            log.warning("kopt: the passes verified on %s, but %s: verifying the whole model "
                        "pass by pass", where, why)
            del out, got, first  # the unchecked graph's packed weights: W1's 19 GiB
            offload.give_back(offload.released() - released)
            return self._run(gm, example_inputs, workload=workload, kb=kb)
        error = max(output_errors(got, first), default=0.0)
        self.verified_on = (f"verified on {where} ({len(self.verify.seeds)} seeds, "
                            f"{checked_s:.2f} s); the whole model checked end to end on seed 0 "
                            f"in {time.perf_counter() - start:.2f} s: output {error:.2g} from "
                            f"the captured graph's, {max(moved, default=0.0):.2g} in the "
                            "shallow model")
        log.info("kopt: %s", self.verified_on)
        results = [replace(r, verdict=Verdict(c.verdict.passed, c.verdict.tier,
                                              f"{c.verdict.detail}; on {where}"),
                           check_seconds=c.check_seconds)
                   if r.matched and c.verdict is not None else r
                   for r, c in zip(results, checked, strict=True)]
        self.end_to_end = (got, first)
        kb.record(results, self.passes)
        return out, results

    def _run(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], snapshots: bool | None = None,
        workload: str | None = None, kb: PipelineRun | None = None, record: bool = True,
    ) -> tuple[fx.GraphModule, list[PassResult]]:
        """``snapshots``: run each pass on a copy of the graph before it (what verification
        and the cost model's gate compare against, and what a pass that raises leaves). Without
        either, the passes share one copy of the captured graph (a copy of W1's 11650 nodes
        costs 0.2 s on the CPU); a pass that raises there runs the pipeline again with
        snapshots, so that it is left out as it would have been. ``kb``: the knowledge base's
        part, where a run over another graph shares it; ``record``: file the results there."""
        if snapshots is None:
            snapshots = self.verify.enabled or self.cost is not None
        results: list[PassResult] = []
        captured = gm
        self._dump(gm, "00_captured")
        self._dump_patterns()
        # knowledge base: dead ends to skip, verdicts
        if kb is None:
            kb = pipeline_run(gm, example_inputs, cuda_graphs=self.cuda_graphs,
                              workload=workload)
        if not snapshots:
            gm = copy_graph_module(gm)  # the captured graph stays as captured
        # each check's reference: the outputs of the graph the passes accepted so far
        baseline = Baseline(gm, example_inputs) if self.verify.enabled else None
        released = offload.released()  # weights fold_constants moved before this run
        for i, p in enumerate(self.passes, start=1):
            if (skipped := kb.skip(p, gm)) is not None:
                results.append(skipped)
                continue
            candidate = copy_graph_module(gm) if snapshots else gm
            start = time.perf_counter()
            before = offload.released()
            try:
                with self._may_release(baseline):
                    result = p.run(candidate)
                candidate.graph.lint()  # every node's inputs in the graph, in order
            except Exception as exc:
                offload.give_back(offload.released() - before)  # the graph before reads them
                if os.environ.get(STRICT) == "1":
                    raise
                if not snapshots:
                    log.info("kopt: %s raised on the graph the passes share; running them "
                             "again, each on a copy", p.name)
                    offload.give_back(offload.released() - released)
                    return self._run(captured, example_inputs, snapshots=True,
                                     workload=workload, kb=kb, record=record)
                results.append(self._raised(p, gm, exc, time.perf_counter() - start))
                continue
            if self.cost is not None:
                candidate, result = self._gate(p, i, gm, candidate, result)
                if candidate is gm:
                    offload.give_back(offload.released() - before)
            verdict = None
            log.info("kopt: [%d/%d] %s: %d rewrites in %.2f s%s", i, len(self.passes), p.name,
                     result.matched, result.seconds,
                     f"; verifying on {len(self.verify.seeds)} seeds"
                     if result.matched and self.verify.enabled else "")
            checked = time.perf_counter()
            if result.matched and self.verify.enabled:
                verdict = compare(gm, candidate, example_inputs, p.numerics, self.verify,
                                  baseline)
                verdict = agree_across_ranks(gm, verdict)  # tensor-parallel graphs
                if not verdict.passed:
                    # bisecting runs the pass again on the graph before it, which reads them
                    offload.give_back(offload.released() - before)
                    with offload.releasing(None):
                        candidate, result, verdict = self._salvage(p, gm, example_inputs,
                                                                   result, verdict, baseline)
            forget_sites(candidate)
            if baseline is not None:
                baseline.accept(candidate, p.numerics)
            result = replace(result, verdict=verdict, check_seconds=time.perf_counter() - checked
                             if verdict is not None else 0.0)
            log.debug("%s", format_pass_line(result))
            results.append(result)
            gm = candidate
            self._dump(gm, f"{i:02d}_{p.name}")
        if not snapshots:  # as a copy made after the last pass: the attributes it reads only
            gm = copy_graph_module(gm)  # (the weights a merge or FP8 replaced are dropped)
        for region in cached_regions(gm):
            region.clear()  # drop what verification's random inputs left in the caches
        if baseline is not None:
            self.end_to_end = baseline.end_to_end(0)  # the warm start's check: seed 0
        if record:
            kb.record(results, self.passes)
        if self.cost is not None:
            self.ranking = self.cost.ranking(captured, gm, self.predictions)
        return gm, results

    def _may_release(self, baseline: Baseline | None) -> contextlib.AbstractContextManager:
        """Where a pass may hand weights to :func:`kopt.offload.release`: unless the check after
        it would run the graph before it again (its outputs not kept, or too large to keep)."""
        if baseline is None or (baseline.keep
                                and all(s in baseline.want for s in self.verify.seeds)):
            return contextlib.nullcontext()
        return offload.releasing(None)

    @staticmethod
    def _raised(p: Pass, gm: fx.GraphModule, exc: Exception, seconds: float) -> PassResult:
        """The result of a pass that raised (a bug in it, or a graph it does not handle): the
        graph before it is kept, and the report and the knowledge base say why."""
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        log.warning("kopt: %s raised %s; it is not applied (the graph before it is kept)",
                    p.name, what, exc_info=True)
        n = count_nodes(gm)
        return PassResult(p.name, 0, {}, n, n, seconds,
                          notes=(f"not applied: the pass raised {what} (a kopt bug: please "
                                 f"report it; {STRICT}=1 raises it)",),
                          verdict=Verdict(False, p.numerics.tier, f"the pass raised {what}",
                                          unverifiable=True))

    def _gate(
        self, p: Pass, i: int, gm: fx.GraphModule, candidate: fx.GraphModule,
        result: PassResult,
    ) -> tuple[fx.GraphModule, PassResult]:
        """Record the pass's predicted saving; undo it where it is predicted to lose. Work on
        parameters alone counts as load-time work while ``fold_constants`` is still to run."""
        folded = any(isinstance(q, FoldConstants) for q in self.passes[i:])
        prediction = self.cost.judge_pass(p.name, gm, candidate, result, folded=folded)
        self.predictions.append(prediction)
        if prediction.applied:
            return candidate, result
        log.info("kopt: %s %s", p.name, prediction.reason)
        return gm, replace(result, matched=0, sites=(), details=(), site_nodes=(),
                           nodes_after=result.nodes_before,
                           notes=(*result.notes, f"skipped: {prediction.reason}"))

    def _salvage(
        self, p: Pass, gm: fx.GraphModule, example: Sequence[Any], first: PassResult,
        failed: Verdict, baseline: Baseline | None = None,
    ) -> tuple[fx.GraphModule, PassResult, Verdict]:
        """Keep the sites of a failed pass that verify on their own (bisection). A verdict that
        could not be reached at all reverts every site at once: each bisection step would
        fail the same way."""
        if failed.unverifiable:
            log.warning("%s could not be verified (%s); reverting its %d sites", p.name,
                        failed.detail, len(first.sites))
            result = replace(first, matched=0, sites=(), nodes_after=first.nodes_before,
                             reverted=tuple(first.sites))
            return copy_graph_module(gm), result, Verdict(
                False, failed.tier, f"{failed.detail}; all {len(first.sites)} sites reverted "
                "(unverified; --no-verify keeps them unchecked)", unverifiable=True)
        log.warning("%s failed verification (%s); bisecting its %d sites", p.name,
                    failed.detail, len(first.sites))

        def verifies(sites: list[str]) -> bool:
            cand = copy_graph_module(gm)
            p.run(cand, set(sites))
            return compare(gm, cand, example, p.numerics, self.verify, baseline).passed

        def good(sites: list[str]) -> list[str]:
            if not sites or verifies(sites):
                return sites
            if len(sites) == 1:
                return []
            mid = len(sites) // 2
            return good(sites[:mid]) + good(sites[mid:])

        keep = good(list(first.sites)) if len(first.sites) > 1 else []
        if keep:
            cand = copy_graph_module(gm)
            result = p.run(cand, set(keep))
            verdict = compare(gm, cand, example, p.numerics, self.verify, baseline)
            if not verdict.passed:  # sites that verify alone fail together: undo them all
                keep = []
        reverted = tuple(s for s in first.sites if s not in keep)
        if not keep:
            cand = copy_graph_module(gm)
            result = replace(first, matched=0, sites=(), nodes_after=first.nodes_before)
            verdict = Verdict(False, failed.tier,
                              f"{failed.detail}; all {len(reverted)} sites reverted")
        else:
            verdict = Verdict(True, verdict.tier, f"{verdict.detail}; {len(reverted)} failing "
                                                  f"sites reverted ({failed.detail})")
        result = replace(result, reverted=reverted, rejections=first.rejections,
                         rejected=first.rejected)
        return cand, result, verdict

    def _dump_patterns(self) -> None:
        """One file per rewrite: its rule, tier, benefit and (for pattern rewrites) the traced
        pattern graph that the matcher walks."""
        if self.dump_dir is None:
            return
        folder = self.dump_dir / "patterns"
        folder.mkdir(parents=True, exist_ok=True)
        for p in self.passes:
            for rw in getattr(p, "rewrites", ()):
                lines = [f"# {rw.name} (pass {p.name}): {rw.description}",
                         f"# numerics: {rw.numerics} -- {rw.numerics.why}",
                         f"# benefit: {rw.benefit}"]
                graph = getattr(rw, "graph", None)
                lines.append(str(graph) if graph is not None else
                             "# structural rewrite: matched by a function, no pattern graph")
                (folder / f"{rw.name}.txt").write_text("\n".join(lines) + "\n")

    def _dump(self, gm: fx.GraphModule, stem: str) -> None:
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        text = gm.print_readable(print_output=False, include_stride=False, include_device=True)
        (self.dump_dir / f"{stem}.py").write_text(text)


def _unclean(checked: Sequence[PassResult]) -> str | None:
    """Why a shallow model's results cannot stand for the whole model's, or None."""
    for r in checked:
        if r.verdict is not None and not r.verdict.passed:
            return f"{r.name} failed verification ({r.verdict.detail})"
        if r.reverted:
            return f"{r.name} reverted {len(r.reverted)} sites"
        if any(n.startswith("not applied") for n in r.notes):
            return f"{r.name} was not applied"
    return None


def _disagree(passes: Sequence[Pass], results: Sequence[PassResult],
              checked: Sequence[PassResult]) -> str | None:
    """Why the whole model's unchecked results are not the shallow model's checked ones: a
    pass that rewrote one and not the other (the whole model's sites are the shallow model's
    only where each pass rewrote both; a pass split from another by the sites' size alone
    counts as that one where the shallow model had none so large), or one that raised on the
    whole model."""
    matched = {c.name: c.matched for c in checked}
    for p, r, c in zip(passes, results, checked, strict=True):
        if any(n.startswith("not applied") for n in r.notes):
            return f"{r.name} was not applied to the whole model"
        if r.matched and not c.matched and matched.get(p.split_from or "", 0):
            continue
        if (r.matched > 0) != (c.matched > 0):
            return (f"{r.name} rewrote {r.matched} sites in the whole model and {c.matched} in "
                    "the shallow one")
    return None


def format_pass_line(r: PassResult) -> str:
    verdict = str(r.verdict) if r.verdict else ("not verified" if r.matched else "-")
    check = f" + check {r.check_seconds:.2f} s" if r.check_seconds else ""
    return (f"{r.name:<20} matched {r.matched:>4}  rejected {sum(r.rejected.values()):>4}  "
            f"nodes {r.nodes_before:>5} -> {r.nodes_after:<5} {r.seconds:7.2f} s{check}  "
            f"{verdict}"
            + (f"  [from KB {r.from_kb}]" if r.from_kb else ""))
