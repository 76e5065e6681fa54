"""Pass verdicts: what the pipeline files after a run, and the dead ends it skips.

The pipeline files, per pass that rewrote something and was verified, ``accepted`` (sites it
reverted tag it ``numerics``) or ``rejected`` with tag ``numerics`` when verification undid it
all. A ``dead_end`` is a judgement on measurements (slower under CUDA graphs, no gain in a shape
regime): a human (``kopt kb mark``) or the ablation records it, and the next run on that device
and workload (or regime) skips the pass with the recorded cause unless asked to retry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kopt.kb.session import Session, active, device_name
from kopt.kb.store import KnowledgeBase, VerdictRecord, format_time


def workload_key(gm: Any, example_inputs: Sequence[Any], graph_fingerprint: str = "") -> str:
    """``graph-<hash>`` of the captured graph (:func:`kopt.graph.serialize.fingerprint`, or
    ``graph_fingerprint`` when the caller has it) and its inputs' shapes and dtypes: the same
    model at the same shapes gets the same key in every run."""
    if not graph_fingerprint:
        from kopt.graph.serialize import NotSerializable, fingerprint  # torch: with a graph

        try:
            graph_fingerprint = fingerprint(gm)
        except NotSerializable:  # a graph it cannot name exactly: its code names it
            graph_fingerprint = gm.code
    h = hashlib.sha256(graph_fingerprint.encode())
    for x in example_inputs:
        h.update(repr((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else
                      type(x).__name__).encode())
    return f"graph-{h.hexdigest()[:12]}"


def inputs_device(example_inputs: Sequence[Any]) -> str:
    for x in example_inputs:
        if hasattr(x, "device") and hasattr(x, "shape"):
            return device_name(x.device)
    return device_name("cpu")


def _reason(v: VerdictRecord) -> str:
    tags = f" [{', '.join(v.tags)}]" if v.tags else ""
    return (f"a dead end on {v.workload if v.workload != '*' else 'every workload'} @ "
            f"{v.device if v.device != '*' else 'every device'} ({v.entry_id}, {v.origin}, "
            f"{format_time(v.created_at)}): {v.cause or 'no cause given'}{tags}")


def skip_reason(kb: KnowledgeBase, pass_name: str, workload_key: str, device: str, *,
                regime: str | None = None, uuid: str | None = None,
                cuda_graphs: bool = False) -> str | None:
    """Why ``pass_name`` should not run on this workload and device (a recorded dead end that
    still applies, see :meth:`KnowledgeBase.dead_end`), or None."""
    v = kb.dead_end(pass_name, device, workload_key, regime, uuid, cuda_graphs=cuda_graphs)
    return None if v is None else _reason(v)


def _verdict_of(r: Any) -> tuple[str, str, tuple[str, ...]] | None:
    """(verdict, cause, tags) for one PassResult, or None when there is nothing to judge
    (nothing rewritten, or not verified)."""
    if r.verdict is None:
        return None
    if not r.verdict.passed:
        return "rejected", f"failed verification: {r.verdict.detail}", ("numerics",)
    if r.reverted:
        return ("accepted", f"{len(r.reverted)} sites reverted after failing verification; "
                            f"{r.verdict.detail}", ("numerics",))
    return "accepted", str(r.verdict), ()


def record_pass_results(kb: KnowledgeBase, report: Any, workload_key: str, device: str, *,
                        uuids: Mapping[str, str] | None = None,
                        regime: str | None = None) -> list[int]:
    """File a verdict per verified pass of ``report`` (a :class:`kopt.Report` or a list of
    :class:`kopt.PassResult`); ``uuids``: pass name -> ``Pass.uuid()``. Returns verdict ids."""
    results: Iterable[Any] = getattr(report, "passes", report)
    ids = []
    for r in results:
        judged = _verdict_of(r)
        if judged is None:
            continue
        verdict, cause, tags = judged
        ids.append(kb.record_verdict(r.name, verdict, workload=workload_key, device=device,
                                     cause=cause, tags=tags, regime=regime, origin="pipeline",
                                     rewrite_uuid=(uuids or {}).get(r.name)))
    return ids


@dataclass
class PipelineRun:
    """What :class:`kopt.passes.PassManager` asks during one run: which passes to skip, and
    where to file the results. Does nothing outside a :func:`kopt.kb.using` scope."""

    session: Session | None
    workload: str = ""
    device: str = ""
    retried: list[str] = field(default_factory=list)
    cuda_graphs: bool = False  # the optimized module replays from CUDA graphs
    # per pass uuid, why it is skipped (None: run it): asked again by a second run over the
    # same workload (a shallow copy's, then the whole model's), answered alike
    decided: dict[str, str | None] = field(default_factory=dict)

    def skip(self, p: Any, gm: Any) -> Any:
        """A PassResult saying why ``p`` is skipped (a dead end), or None to run it."""
        s = self.session
        if s is None:
            return None
        uuid = p.uuid()
        if uuid in self.decided:
            return self._skipped(p, gm, self.decided[uuid])
        self.decided[uuid] = why = self._decide(s, p, uuid)
        return self._skipped(p, gm, why)

    def _decide(self, s: Session, p: Any, uuid: str) -> str | None:
        why = s.guard("reading verdicts", lambda: skip_reason(
            s.kb, p.name, self.workload, self.device, regime=s.regime, uuid=uuid,
            cuda_graphs=self.cuda_graphs), None)
        if why is None:
            before = s.guard("reading verdicts", lambda: s.kb.verdicts_for(
                p.name, self.device, self.workload, s.regime), [])
            same = [v for v in before if v.origin == "pipeline" and v.rewrite_uuid == uuid]
            if same and same[0].verdict == "accepted":
                s.used.append(f"{p.name}: accepted before on this workload and device "
                              f"({same[0].entry_id}); verified again")
            return None
        if s.retry:
            s.used.append(f"{p.name}: {why}; retried (--retry)")
            return None
        s.used.append(f"{p.name} skipped: {why}")
        return why

    @staticmethod
    def _skipped(p: Any, gm: Any, why: str | None) -> Any:
        if why is None:
            return None
        from kopt.passes.base import PassResult, count_nodes

        n = count_nodes(gm)
        return PassResult(p.name, matched=0, rejected={}, nodes_before=n, nodes_after=n,
                          seconds=0.0, notes=(f"skipped: {why} (--retry runs it)",))

    def record(self, results: Sequence[Any], passes: Sequence[Any]) -> None:
        """File the pass verdicts, and the configs tuned during the run if every verified
        pass kept all its sites (a kernel is kept only once it passed verification)."""
        s = self.session
        if s is None:
            return
        s.in_pipeline = False
        pending, s.pending = s.pending, []
        if all(r.verdict is None or (r.verdict.passed and not r.reverted) for r in results):
            for write in pending:
                line = s.guard("recording a tuned config", write, None)
                if line is not None:
                    s.recorded.append(line)
        elif pending:
            s.recorded.append(f"{len(pending)} tuned configs not kept: verification failed in "
                              "this run")
        uuids = {p.name: p.uuid() for p in passes}
        ids = s.guard("recording verdicts", lambda: record_pass_results(
            s.kb, results, self.workload, self.device, uuids=uuids, regime=s.regime), [])
        if ids:
            s.recorded.append(f"{len(ids)} pass verdicts ({', '.join(f'V{i}' for i in ids)})")


def pipeline_run(gm: Any, example_inputs: Sequence[Any], *, cuda_graphs: bool = False,
                 workload: str | None = None) -> PipelineRun:
    """The knowledge base's part in one pass-manager run over the captured ``gm``
    (``cuda_graphs``: the result will replay from CUDA graphs; ``workload``: its key, where
    the caller has it)."""
    s = active()
    if s is None:
        return PipelineRun(None)
    run = PipelineRun(s, s.workload or workload or workload_key(gm, example_inputs),
                      s.device or inputs_device(example_inputs), cuda_graphs=cuda_graphs)
    s.last_workload, s.last_device = run.workload, run.device
    s.in_pipeline, s.pending = True, []
    return run


# An ablation difference smaller than this share of the full pipeline's time is noise.
NOISE = 0.005


def record_ablation(kb: KnowledgeBase, ablation: Any, workload: str, device: str, *,
                    regime: str | None = None) -> list[str]:
    """File what an ablation (:class:`kopt.ablate.Ablation`) measured: per pass, its saving in
    the full pipeline (leave-one-out rows, else alone) as an end-to-end measurement, and a
    ``dead_end`` for a pass that made the model slower by more than the noise (tagged
    ``slower-under-cuda-graphs`` when it only loses replayed from a CUDA graph). The next run
    on this workload and device skips a dead end with that cause.

    The noise is :data:`NOISE` of the full pipeline's time, or, in a paired ablation
    (``ablate(paired=True)``), the spread of the all-passes row's timings over the run where
    that is wider: on the H200 the same leave-one-out row measured +-2 ms apart across runs
    of a 103 ms call, so a single unpaired run can file a dead end from drift. A pass measured
    saving more than the noise in every mode lifts a dead end in force for it (an
    ``accepted`` verdict of the ablation, with the saving as its cause). Returns the report
    lines."""
    kind = "leave-one-out" if any(r.kind == "leave-one-out" for r in ablation.rows) else "alone"
    eager = ablation.savings(kind)
    graphs = ablation.savings(kind, graphs=True) if any(
        r.graph_ms is not None for r in ablation.rows) else {}
    full, base = ablation.every_pass, ablation.baseline
    lines = []
    for name, (_, saved) in eager.items():
        saved_graph = graphs.get(name, (None, None))[1]
        where = [("eager", saved, full.ms, base.ms, _noise(ablation, full.ms, False))]
        if saved_graph is not None:
            where.append(("CUDA graph", saved_graph, full.graph_ms, base.graph_ms,
                          _noise(ablation, full.graph_ms, True)))
        for mode, ms, total, baseline, _ in where:
            # time per call without the pass: all passes but it, or none at all
            without = total + ms if kind == "leave-one-out" else baseline
            mid = kb.record_measurement(
                "e2e", workload, device, without, without - ms, cuda_graphs=mode != "eager",
                rewrite=name, note=f"ablation ({kind}): ms per call without / with {name}")
            lines.append(f"M{mid}: {name} saves {ms:+.3f} ms per call ({mode}, {kind})")
        losses = {mode: ms for mode, ms, _, _, noise in where if ms < -noise}
        if losses:
            said = "; ".join(f"{-ms:.3f} ms per call slower {mode}" for mode, ms in losses.items())
            tags = ("slower-under-cuda-graphs",) if set(losses) == {"CUDA graph"} else ("slower",)
            vid = kb.record_verdict(name, "dead_end", workload=workload, device=device,
                                    cause=f"measured by ablation ({kind}): {said}", tags=tags,
                                    regime=regime, origin="ablation")
            lines.append(f"V{vid}: {name} is a dead end here: {said}")
        elif all(ms > noise for _, ms, _, _, noise in where) and kb.dead_end(
                name, device, workload, regime, cuda_graphs=True) is not None:
            said = "; ".join(f"saves {ms:.3f} ms per call {mode} (noise {noise:.3f})"
                             for mode, ms, _, _, noise in where)
            vid = kb.record_verdict(name, "accepted", workload=workload, device=device,
                                    cause=f"measured by ablation ({kind}): {said}",
                                    regime=regime, origin="ablation")
            lines.append(f"V{vid}: {name} is no longer a dead end here: {said}")
    return lines


def _noise(ablation: Any, total: float, graphs: bool) -> float:
    """The least difference an ablation row tells from noise, ms per call (see
    :func:`record_ablation`)."""
    spread = ablation.reference_spread(graphs)
    return max(NOISE * total, 0.0 if spread is None else spread[1] - spread[0])
