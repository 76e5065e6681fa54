"""Warm start (``kopt.warm``): a second optimization of the same model restores the graph the
first one recorded in the knowledge base, node for node and bitwise; anything that makes it
another optimization is a miss; a broken or tampered entry is dropped and the model optimized
cold; the stored form never runs code or holds a weight."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import kopt
import kopt.warm as warm
from kopt.capture import capture_module
from kopt.graph import attr, is_view
from kopt.graph.serialize import NotSerializable, Target, fingerprint
from kopt.kb import KnowledgeBase, using, workload_key
from kopt.models import build
from kopt.models.zoo import ZOO
from kopt.models.zoo import build as build_zoo
from kopt.passes import FP8Config, PassConfig, PassManager
from kopt.passes.fold import LoadProgram
from kopt.verify import VerifyOptions

ROOT = Path(__file__).resolve().parents[2]
ONE_SEED = VerifyOptions(seeds=(0,))
FP8 = PassConfig(fp8=FP8Config(min_features=16))


@pytest.fixture
def kb(tmp_path: Path):  # noqa: ANN201
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as k:
        yield k


def _optimize(kb: KnowledgeBase, config: PassConfig = PassConfig(), *, seed: int = 0,
              dtype: torch.dtype = torch.bfloat16, verify: VerifyOptions = ONE_SEED):  # noqa: ANN202
    """A fresh model (as a new process would build it), optimized in ``kb``'s scope."""
    w = build("qwen-image-tiny", dtype=dtype, seed=seed)
    with using(kb) as session:
        opt = kopt.optimize(w.model, w.args, w.kwargs, config, verify=verify)
    out = pytree.tree_leaves(opt(*w.args, **w.kwargs))
    return opt, session, out, w


def _packed_in_place(opt: kopt.OptimizedModule, read: bool = False) -> int:
    """The model's parameters that view one of the graph's packed buffers (``read``: one the
    graph reads)."""
    packed = {b.untyped_storage().data_ptr() for n, b in opt.graph_module.named_buffers()
              if n.startswith("_kopt") and (not read or n in _reads(opt))}
    return sum(p.untyped_storage().data_ptr() in packed for p in opt.original.parameters())


def _reads(opt: kopt.OptimizedModule) -> set[str]:
    gm = opt.graph_module
    graphs = [gm, *(m.region for m in gm.modules() if hasattr(m, "region"))]
    return {n.target for g in graphs for n in g.graph.nodes if n.op == "get_attr"}


def _output(program: LoadProgram) -> list:
    return next(n for n in program.graph_module.graph.nodes if n.op == "output").args[0]


def _bitwise(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("config", [PassConfig(), FP8], ids=["bf16", "fp8"])
def test_second_optimization_restores_the_recorded_graph(kb: KnowledgeBase,
                                                         config: PassConfig) -> None:
    cold, s1, out1, _ = _optimize(kb, config)
    assert not cold.report.warm and any(r.startswith("G1:") for r in s1.recorded)
    warm_opt, s2, out2, w2 = _optimize(kb, config)
    report = warm_opt.report
    assert report.warm.startswith("warm start: optimized graph G1 restored")
    assert "end-to-end check on seed 0 passed" in report.warm
    assert [r.from_kb for r in report.passes] == ["G1"] * len(cold.report.passes)
    assert [(r.name, r.matched, r.sites) for r in report.passes] == \
        [(r.name, r.matched, r.sites) for r in cold.report.passes]
    assert "[from KB G1]" in report.format() and report.warm in report.format()
    assert report.pipeline_uuid == cold.report.pipeline_uuid
    assert any("restored from the knowledge base" in u for u in s2.used)
    assert not s2.recorded  # nothing re-run, so no verdict filed again
    # node for node, bitwise
    assert warm_opt.graph_module.code == cold.graph_module.code
    assert [is_view(n) for n in warm_opt.graph_module.graph.nodes] == \
        [is_view(n) for n in cold.graph_module.graph.nodes]
    assert _bitwise(out1, out2)
    # the load programs re-ran on this model: the merged weights the graph reads packed in
    # place as a cold run does
    assert 0 < _packed_in_place(warm_opt, read=True) == _packed_in_place(cold, read=True)
    assert kb.graphs()[0].hits == 1


@pytest.mark.parametrize(("name", "config"), [
    *[(name, PassConfig()) for name in sorted(ZOO)],
    ("flux2-tiny", PassConfig()), ("flux2-tiny", FP8), ("llm-tiny", FP8),
], ids=[*sorted(ZOO), "flux2-tiny", "flux2-tiny-fp8", "llm-tiny-fp8"])
def test_every_model_round_trips(kb: KnowledgeBase, name: str, config: PassConfig) -> None:
    """The stored form takes every graph kopt makes of the zoo and the reference models."""
    def once() -> tuple[kopt.OptimizedModule, list]:
        w = build_zoo(name) if name in ZOO else build(name, dtype=torch.bfloat16)
        with using(kb):
            opt = kopt.optimize(w.model, w.args, w.kwargs, config, verify=ONE_SEED)
        return opt, pytree.tree_leaves(opt(*w.args, **w.kwargs))

    (cold, want), (hit, got) = once(), once()
    assert not cold.report.warm and hit.report.warm, kb.graphs()
    assert hit.graph_module.code == cold.graph_module.code
    assert _bitwise(got, want)


def test_merged_weights_only_quantized_are_never_concatenated_on_a_warm_start(
        kb: KnowledgeBase) -> None:
    """A cold run concatenates the merged weights to check the merge, then quantizes the
    concatenation; the warm start quantizes each weight into its rows of the FP8 buffer (the
    same bits) and never makes the BF16 concatenation, which the optimized graph does not read.
    The programs it runs instead re-pack the FP8 buffers when a weight changes in place."""
    cold, _, want, w1 = _optimize(kb, FP8)
    warm_opt, _, got, w2 = _optimize(kb, FP8)
    assert warm_opt.report.warm and _bitwise(got, want)
    cold_buffers = dict(cold.graph_module.named_buffers())
    warm_buffers = dict(warm_opt.graph_module.named_buffers())
    programs = cold.graph_module.meta["kopt_load_programs"]
    cats = {t: (p, n) for p in programs for t, n in zip(p.targets, _output(p), strict=True)
            if n.target is torch.ops.aten.cat.default}
    concatenated = {t for t in cats if t not in _reads(cold)}
    assert concatenated, "the cold run made no concatenation the graph does not read"
    assert not concatenated & set(warm_buffers)
    for name, b in warm_buffers.items():
        assert torch.equal(b, cold_buffers[name]), name
    # a weight of a merged concatenation changed in place: both re-pack the same FP8 rows
    merged = {id(attr(p.graph_module, a.target)) for p, n in map(cats.get, concatenated)
              for a in n.args[0]}
    name = next(n for n, t in w1.model.named_parameters() if id(t) in merged)
    for w in (w1, w2):
        with torch.no_grad():
            w.model.get_parameter(name).mul_(1.5)
    assert _bitwise(pytree.tree_leaves(warm_opt(*w2.args, **w2.kwargs)),
                    pytree.tree_leaves(cold(*w1.args, **w1.kwargs)))


def test_another_checkpoint_is_a_hit_packed_from_its_own_weights(kb: KnowledgeBase) -> None:
    _optimize(kb, FP8)
    hit, _, out, _ = _optimize(kb, FP8, seed=1)
    assert hit.report.warm
    with KnowledgeBase.open(kb.path.with_name("other.sqlite")) as fresh:
        cold, _, want, _ = _optimize(fresh, FP8, seed=1)
    assert not cold.report.warm
    assert _bitwise(out, want)  # FP8 weights and scales of seed 1's weights, not seed 0's


def test_what_makes_another_optimization_is_a_miss(kb: KnowledgeBase,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _optimize(kb)
    assert not _optimize(kb, dtype=torch.float32)[0].report.warm  # weights' dtype
    assert not _optimize(kb, FP8)[0].report.warm  # the pipeline's configuration
    assert not _optimize(kb, verify=VerifyOptions(seeds=(0, 1)))[0].report.warm
    kb.record_verdict("hoist", "dead_end", workload="*", device="*", cause="measured slower",
                      origin="human")
    skipped, _, _, _ = _optimize(kb)  # a dead end now in force: the stored graph has it
    assert not skipped.report.warm and skipped.report.result("hoist").matched == 0
    monkeypatch.setattr(warm, "kopt_build", lambda: "src-another")
    assert not _optimize(kb)[0].report.warm  # another kopt
    assert len(kb.graphs()) == 6


def test_unrestorable_entry_is_dropped_and_the_model_optimized_cold(
        kb: KnowledgeBase, caplog: pytest.LogCaptureFixture) -> None:
    _, _, want, _ = _optimize(kb)
    key = _key_of(kb)
    bad = kb.record_graph(key, "w", "cpu", warm.kopt_build(), 1, 4,
                          zlib.compress(b"not a pickle"))
    with caplog.at_level(logging.WARNING, logger="kopt"):
        opt, session, out, _ = _optimize(kb)
    assert not opt.report.warm and _bitwise(out, want)
    assert "dropped: it could not be restored" in caplog.text
    assert any("dropped" in u for u in session.used)
    (again,) = kb.graphs()  # recorded anew by the cold run, under a new id
    assert again.key == key and again.id > bad and warm.unpack(kb.graph(key)[1]).passes


@pytest.mark.parametrize(("op", "wrong", "why"), [
    ("aten.mul.Tensor", "aten.add.Tensor", "its end-to-end check failed: relative error"),
    ("aten.gelu.default", "aten.relu.default", "its end-to-end check raised"),
], ids=["wrong-values", "does-not-run"])
def test_failed_end_to_end_check_drops_the_entry(kb: KnowledgeBase,
                                                 caplog: pytest.LogCaptureFixture, op: str,
                                                 wrong: str, why: str) -> None:
    _, _, want, _ = _optimize(kb)
    record, payload = kb.graph(_key_of(kb))
    stored = warm.unpack(payload)
    # a wrong graph under the right key: its first ``op`` becomes ``wrong``
    i = next(i for i, node in enumerate(stored.graph) if node[2] == Target("op", op))
    stored.graph[i] = (*stored.graph[i][:2], Target("op", wrong), *stored.graph[i][3:])
    kb.record_graph(record.key, record.workload, record.device, record.kopt_build,
                    record.nodes, 0, zlib.compress(pickle.dumps(stored)))
    with caplog.at_level(logging.WARNING, logger="kopt"):
        opt, _, out, _ = _optimize(kb)
    assert why in caplog.text
    assert not opt.report.warm and _bitwise(out, want)


def test_stored_form_runs_no_code_and_holds_no_weight(kb: KnowledgeBase) -> None:
    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("pwned",))

    with pytest.raises(pickle.UnpicklingError, match="never names builtins.print"):
        warm.unpack(zlib.compress(pickle.dumps(Evil())))
    _, _, _, w = _optimize(kb, FP8)
    stored = warm.unpack(kb.graph(_key_of(kb))[1])
    names = {n for n, _ in (*w.model.named_parameters(), *w.model.named_buffers())}
    assert stored.weights and set(stored.weights) <= names  # weights by name only
    # a tensor pickled as itself (a weight written into the payload) is refused on reading
    raw = dataclasses.replace(stored, inline={"w": torch.ones(2)})
    with pytest.raises(pickle.UnpicklingError, match="never names torch"):
        warm.unpack(zlib.compress(pickle.dumps(raw)))


def test_a_graph_the_encoding_cannot_name_gets_no_warm_start(kb: KnowledgeBase) -> None:
    """A closure as a target: no fingerprint (never one two graphs could share), no warm
    start, and the knowledge base's workload key still made (from the graph's code)."""
    w = build("qwen-image-tiny", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    node = next(n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    node.target = lambda *a, **k: torch.ops.aten.linear.default(*a, **k)
    with pytest.raises(NotSerializable, match="no importable name"):
        fingerprint(cap.gm)
    assert workload_key(cap.gm, cap.example_inputs).startswith("graph-")
    with using(kb):
        assert warm.WarmStart.lookup(cap, PassManager(), ONE_SEED, False) is None


def test_meta_device_warm_start_without_check(kb: KnowledgeBase) -> None:
    def meta_run() -> kopt.api.Report:
        w = build("qwen-image-tiny", device="meta", dtype=torch.bfloat16)
        cap = capture_module(w.model, w.args, w.kwargs)
        with using(kb):
            return kopt.api.optimize_captured(cap, FP8, VerifyOptions(enabled=False), None,
                                              w.name, 0.0).report

    cold, hit = meta_run(), meta_run()
    assert not cold.warm and "end-to-end check not run (verification off)" in hit.warm
    assert hit.applied == cold.applied


def test_key_is_the_same_in_another_process(kb: KnowledgeBase) -> None:
    """Nothing process-dependent (an address in a repr, an id in a name) enters the key."""
    script = textwrap.dedent("""
        import torch
        from kopt.capture import capture_module
        from kopt.graph.serialize import fingerprint
        from kopt.models import build
        from kopt.passes import FP8Config, PassConfig, PassManager
        from kopt.verify import VerifyOptions
        import kopt.warm as warm
        w = build("qwen-image-tiny", dtype=torch.bfloat16)
        cap = capture_module(w.model, w.args, w.kwargs)
        m = PassManager(PassConfig(fp8=FP8Config(min_features=16)), VerifyOptions(seeds=(0,)))
        print(warm.key(cap, fingerprint(cap.gm), m, VerifyOptions(seeds=(0,)), "cpu", [],
                       False))
    """)
    theirs = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()[-1]
    w = build("qwen-image-tiny", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    m = PassManager(FP8, ONE_SEED)
    assert warm.key(cap, fingerprint(cap.gm), m, ONE_SEED, "cpu", [], False) == theirs


def test_fingerprint_sees_weights_dtype_and_shape() -> None:
    def fp(**kw: object) -> str:
        w = build("qwen-image-tiny", **kw)
        return fingerprint(capture_module(w.model, w.args, w.kwargs).gm)

    same = fp(dtype=torch.bfloat16)
    assert same == fp(dtype=torch.bfloat16, seed=3)  # weights' values are not the graph
    assert same != fp(dtype=torch.float32)
    assert same != fp(dtype=torch.bfloat16, text_tokens=12)


def test_kb_lists_prunes_and_never_merges_graphs(kb: KnowledgeBase, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gid = kb.record_graph("k" * 64, "graph-x", "cpu-x86_64", "0.0.1+old", 10, 3, b"abc")
    rec = kb.get(f"G{gid}")
    assert rec.entry_id == "G1" and rec.nodes == 10
    assert "optimized graph of graph-x" in kb.show("G1")
    assert "Optimized graphs (warm start) (1)" in kb.export("md")
    assert '"graphs"' in kb.export("json")
    with KnowledgeBase.open(tmp_path / "other.sqlite") as other:
        result = other.merge(kb)
        assert not other.graphs()
        assert result.skipped == {"optimized graphs (each machine records its own)": 1}
    kb.record_graph("n" * 64, "graph-x", "cpu-x86_64", warm.kopt_build(), 10, 3, b"abc")
    dry = kb.prune(dry_run=True)
    assert dry.graphs_other_builds == 1 and len(kb.graphs()) == 2
    kb.prune()
    assert [g.kopt_build for g in kb.graphs()] == [warm.kopt_build()]
    (kept,) = kb.graphs()
    kb.graph_used(kept.id)  # used now: an old entry, but not unused for a day
    assert kb.prune(older_than_days=1).older["optimized graphs"] == 0
    assert kb.prune(older_than_days=-1, dry_run=True).older["optimized graphs"] == 1


def _key_of(kb: KnowledgeBase) -> str:
    (only,) = kb.graphs()
    return only.key


def test_restore_is_exercised_on_real_kb_file_reopened(tmp_path: Path) -> None:
    """Two opens of one file, as two processes: the second finds what the first recorded."""
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as first:
        _optimize(first)
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as second:
        assert _optimize(second)[0].report.warm


def test_backend_path_warm_starts(kb: KnowledgeBase) -> None:
    """``torch.compile(backend="kopt")`` in a knowledge base's scope: the second compile of
    the same model restores its graph, and computes what the first one did."""
    def compile_once() -> tuple[list, list]:
        torch._dynamo.reset()
        w = build("qwen-image-tiny", dtype=torch.bfloat16)
        reports: list = []
        compiled = torch.compile(w.model, backend="kopt",
                                 options={"inner": "eager", "reports": reports})
        with using(kb):
            out = pytree.tree_leaves(compiled(*w.args, **w.kwargs))
        return reports, out

    cold, want = compile_once()
    hit, got = compile_once()
    assert len(cold) == len(hit) == 1 and not cold[0].warm
    assert hit[0].warm.startswith("warm start: optimized graph G1")
    assert _bitwise(got, want)


def test_kopt_optimize_warm_starts_by_default(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    """The command line's knowledge base is on unless ``--no-kb``: its second run of a model
    restores the graph (and says so), ``--no-kb`` and ``--retry`` run the passes."""
    from kopt.cli import main

    path = str(tmp_path / "kb.sqlite")
    args = ["optimize", "--model", "llm-tiny", "--kb", path]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warm start:" not in out and "recorded: G1: the optimized graph" in out
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warm start: optimized graph G1 restored" in out and "[from KB G1]" in out
    for flag in ("--no-kb", "--retry"):
        assert main([*args, flag]) == 0
        assert "warm start:" not in capsys.readouterr().out
    assert main(["kb", "list", "--kind", "graphs", "--kb", path]) == 0
    assert "G1     optimized graph of graph-" in capsys.readouterr().out
