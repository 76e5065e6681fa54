"""The knowledge base: schema and migrations, two processes writing at once, unusable files left
untouched, tampered configs refused (nothing executed), autotuning that starts from the stored
winner, dead ends skipped (and retried), verdicts recorded, export and the ``kopt kb`` CLI."""

from __future__ import annotations

import argparse
import ast
import json
import os
import pickle
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import triton

import kopt
from kopt.codegen import gemm as G
from kopt.kb import (
    InvalidRecord,
    KnowledgeBase,
    KnowledgeBaseError,
    KnowledgeBaseWarning,
    Versions,
    record_pass_results,
    safe_open,
    schema,
    skip_reason,
    tuning,
    using,
)
from kopt.kb import cli as kb_cli
from kopt.passes.base import PassResult, Verdict
from tests.fixtures import QKV

ROOT = Path(__file__).resolve().parents[2]
GEMM_CFG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
            "PERSISTENT": 0, "SPLIT_K": 1, "num_stages": 3}
BUCKET = "m=4096 n=3072 k=3072 tma=1 precise=0 bias=none act=none gate=1 res=1"
H200 = "NVIDIA H200"


@pytest.fixture
def kb(tmp_path: Path):  # noqa: ANN201
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as k:
        yield k


def _config(**changes: int) -> dict[str, int]:
    return {**GEMM_CFG, **changes}


def _record(kb: KnowledgeBase, ms: float | None = None, **changes: int) -> int:
    kid = kb.record_kernel_config("gemm_fp8", "srchash", _config(**changes), BUCKET,
                                  "float8_e4m3fn/bfloat16", H200)
    if ms is not None:
        kb.record_measurement("micro", BUCKET, H200, 1.0, ms, kernel_id=kid)
    return kid


# -- store ------------------------------------------------------------------------------------

def test_best_config_is_the_fastest_for_exactly_this_key(kb: KnowledgeBase) -> None:
    _record(kb, 0.50)
    fast = _record(kb, 0.40, num_stages=4)
    _record(kb, None, GROUP_M=4)  # never measured: ranks after the measured ones
    best = kb.best_config("gemm_fp8", BUCKET, H200)
    assert best is not None and best.id == fast and best.config == _config(num_stages=4)
    assert best.best_ms == pytest.approx(0.40)
    # the same config for the same key is one row, not two
    assert _record(kb, None, num_stages=4) == fast
    # any other part of the key: no hit
    assert kb.best_config("gemm_fp8", BUCKET, "NVIDIA H100") is None
    assert kb.best_config("gemm_bf16", BUCKET, H200) is None
    assert kb.best_config("gemm_fp8", BUCKET.replace("m=4096", "m=4352"), H200) is None
    assert kb.best_config("gemm_fp8", BUCKET, H200, source_hash="other") is None
    now = Versions.current()
    assert kb.best_config("gemm_fp8", BUCKET, H200, Versions(now.torch, "0.0")) is None
    assert kb.best_config("gemm_fp8", BUCKET, H200, Versions("2.0", now.triton)) is None


def test_invalid_records_are_refused_on_write(kb: KnowledgeBase) -> None:
    with pytest.raises(KnowledgeBaseError, match="BLOCK_M = 96"):
        _record(kb, BLOCK_M=96)
    with pytest.raises(KnowledgeBaseError, match="unknown tags"):
        kb.record_verdict("fp8", "rejected", workload="w", device="d", tags=["faster?"])
    with pytest.raises(KnowledgeBaseError, match="human or the ablation"):
        kb.record_verdict("fp8", "dead_end", workload="w", device="d")
    with pytest.raises(KnowledgeBaseError, match="finite"):
        kb.record_measurement("e2e", "w", "d", 1.0, float("nan"))
    assert kb.entries() == []


@pytest.mark.parametrize("start", [1, 2])
def test_migrations_to_current_keep_every_row(tmp_path: Path, start: int) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, time.time(), upto=start) == list(range(1, start + 1))
    now = Versions.current()
    db.execute("INSERT INTO kernels (template, source_hash, config, bucket, dtype, device, "
               "torch_version, triton_version, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
               ("gemm_fp8", "srchash", json.dumps(GEMM_CFG), BUCKET, "float8_e4m3fn/bfloat16",
                H200, now.torch, now.triton, time.time()))
    db.execute("INSERT INTO verdicts (rewrite, workload, device, verdict, cause, created_at) "
               "VALUES ('fp8', 'W1', ?, 'dead_end', 'slower under CUDA graphs: 2.1 ms more', ?)",
               (H200, time.time()))
    db.execute("INSERT INTO verdicts (rewrite, workload, device, verdict, cause, created_at) "
               "VALUES ('cse', 'W1', ?, 'rejected', 'failed verification: 3e-2', ?)",
               (H200, time.time()))
    db.close()
    with KnowledgeBase.open(path) as kb:
        assert kb.schema_version() == schema.CURRENT
        best = kb.best_config("gemm_fp8", BUCKET, H200)
        assert best is not None and best.config == GEMM_CFG
        verdicts = {v.rewrite: v for v in kb.verdicts()}
        assert set(verdicts) == {"fp8", "cse"}
        if start == 1:  # v2 derived tags from v1's causes
            assert verdicts["fp8"].tags == ("slower-under-cuda-graphs",)
            assert verdicts["cse"].tags == ("numerics",)
        assert kb.dead_end("fp8", H200, "W1", cuda_graphs=True) is not None
        lid = kb.add_lesson("v3 lessons work on a migrated file", ["shape-regime"])
        assert [x.id for x in kb.lessons()] == [lid]
    raw = sqlite3.connect(path)
    versions = [r[0] for r in raw.execute("SELECT version FROM kopt_schema ORDER BY version")]
    raw.close()
    assert versions == [m.version for m in schema.MIGRATIONS]


# -- files kopt must not use, and must not touch ---------------------------------------------

def _unusable_files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.sqlite"
    with KnowledgeBase.open(good) as kb:
        for i in range(40):  # a few pages of rows
            kb.record_verdict(f"pass{i}", "accepted", workload="w" * 200, device="d")
    data = good.read_bytes()
    files = {
        "garbage": os.urandom(3000),
        "damaged pages": data[:4096] + bytes((7 * i + 3) % 256 for i in range(len(data) - 4096)),
        "truncated": data[: len(data) // 2 + 100],
    }
    out = {}
    for name, blob in files.items():
        p = tmp_path / f"{name.replace(' ', '_')}.sqlite"
        p.write_bytes(blob)
        out[name] = p
    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (x TEXT)")
    db.commit()
    db.close()
    out["another app's database"] = other
    return out


def test_corrupt_or_foreign_file_clear_error_and_bytes_unchanged(tmp_path: Path) -> None:
    for name, path in _unusable_files(tmp_path).items():
        before = path.read_bytes()
        with pytest.raises(KnowledgeBaseError) as err:
            KnowledgeBase.open(path)
        msg = str(err.value)
        assert str(path) in msg and "leaves the file as it is" in msg, name
        assert ("corrupt" in msg) if name != "another app's database" else \
            ("not a kopt knowledge base" in msg)
        with pytest.warns(KnowledgeBaseWarning, match="runs without its knowledge base"):
            assert safe_open(path) is None
        assert path.read_bytes() == before, f"{name}: the file was modified"


def test_newer_schema_clear_error_file_unchanged_and_optimize_runs_on(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite"
    with KnowledgeBase.open(path) as kb:
        _record(kb, 0.5)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO kopt_schema VALUES (?, 'from the future', 0)", (schema.CURRENT + 4,))
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(KnowledgeBaseError, match=f"schema version {schema.CURRENT + 4}, newer"):
        KnowledgeBase.open(path)
    parser = argparse.ArgumentParser()
    kb_cli.add_optimize_arguments(parser)
    args = parser.parse_args(["--kb", str(path)])
    with kb_cli.optimize_session(args) as session:
        assert session is None  # kopt runs on without it ...
        opt = kopt.optimize(QKV().eval(), (torch.randn(2, 37),))
    assert opt.report.verified
    assert path.read_bytes() == before  # ... losing nothing already stored


# -- two processes ----------------------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kopt.kb import KnowledgeBase
    path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    folder = Path(path).parent
    (folder / f"ready-{tag}").touch()
    while len(list(folder.glob("ready-*"))) < 2:  # start together: both create the file
        time.sleep(0.001)
    kb = KnowledgeBase.open(path)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
           "PERSISTENT": 0, "num_stages": 3}
    for i in range(n):
        kid = kb.record_kernel_config("gemm_bf16", "h", cfg, f"{tag}-{i}", "bf16", "dev")
        shared = kb.record_kernel_config("gemm_bf16", "h", cfg, "shared", "bf16", "dev")
        kb.record_measurement("micro", f"{tag}-{i}", "dev", 2.0, 1.0, kernel_id=kid)
        kb.record_verdict(f"{tag}-{i}", "accepted", workload="w", device="dev")
        time.sleep(0.002)  # stay in the race: the other process writes in between
    kb.close()
""")


def test_two_processes_tuning_at_once_lose_nothing(tmp_path: Path) -> None:
    path, n = tmp_path / "kb.sqlite", 150
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), tag, str(n)], env=env,
                              cwd=ROOT, stderr=subprocess.PIPE, text=True) for tag in "ab"]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with KnowledgeBase.open(path) as kb:
        buckets = sorted(k.bucket for k in kb.kernels())
        assert buckets == sorted([f"{t}-{i}" for t in "ab" for i in range(n)] + ["shared"])
        assert sorted(m.workload for m in kb.measurements()) == \
            sorted(f"{t}-{i}" for t in "ab" for i in range(n))
        assert len({v.rewrite for v in kb.verdicts()}) == len(kb.verdicts()) == 2 * n
        order = [v.rewrite[0] for v in kb.verdicts()]  # by id: the order the writes committed
        switches = sum(x != y for x, y in zip(order, order[1:], strict=False))
        assert switches >= 20, f"the writers barely overlapped ({switches} switches)"
        assert kb.schema_version() == schema.CURRENT
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    # both raced to migrate the new file; each migration ran once
    assert db.execute("SELECT count(*) FROM kopt_schema").fetchone()[0] == schema.CURRENT
    db.close()


# -- tampered configs -------------------------------------------------------------------------

class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def _tampered(marker: Path) -> dict[str, object]:
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return {
        "source string": json.dumps(code),
        "pickle": pickle.dumps(_Evil(marker)),
        "source as a value": json.dumps(_config(BLOCK_M=0) | {"BLOCK_M": code}),
        "extra key with source": json.dumps(_config() | {"source": f"def f():\n    {code}"}),
        "not a power of two": json.dumps(_config(BLOCK_M=96)),
        "out of range": json.dumps(_config(BLOCK_N=4096)),
        "negative stages": json.dumps(_config(num_stages=-1)),
        "bool": json.dumps(_config() | {"GROUP_M": True}),
        "float": json.dumps(_config() | {"num_warps": 8.0}),
        "nested object": json.dumps(_config() | {"BLOCK_K": {"__class__": "os.system"}}),
        "NaN": json.dumps(_config()).replace("3}", "NaN}"),
        "duplicate key": json.dumps(_config())[:-1] + ', "BLOCK_M": 64}',
        "missing key": json.dumps({k: v for k, v in GEMM_CFG.items() if k != "GROUP_M"}),
        "persistent is 0 or 1": json.dumps(_config(PERSISTENT=2)),
        "split-K of a persistent launch": json.dumps(_config(PERSISTENT=1, SPLIT_K=2)),
        "split-K of 17": json.dumps(_config(SPLIT_K=17)),
        "too much shared memory": json.dumps(_config(BLOCK_M=256, BLOCK_N=256, BLOCK_K=256,
                                                     num_stages=8)),
    }


def test_a_gemm_config_stored_before_the_persistent_flag_reads_as_one_tile_per_program(
        kb: KnowledgeBase) -> None:
    kid = _record(kb, 0.3)
    old = {k: v for k, v in GEMM_CFG.items() if k not in ("PERSISTENT", "SPLIT_K")}
    db = sqlite3.connect(kb.path)  # the row as an earlier kopt wrote it
    db.execute("UPDATE kernels SET config = ? WHERE id = ?", (json.dumps(old), kid))
    db.commit()
    db.close()
    best = kb.best_config("gemm_fp8", BUCKET, H200)
    assert best is not None and best.config["PERSISTENT"] == 0 and best.config["SPLIT_K"] == 1
    assert G._config_from_params(best.config).kwargs["PERSISTENT"] == 0
    assert G._config_from_params(best.config).kwargs["SPLIT_K"] == 1


def test_tampered_config_rows_are_refused_and_nothing_runs(kb: KnowledgeBase,
                                                           tmp_path: Path) -> None:
    kid = _record(kb, 0.4)
    marker = tmp_path / "PWNED"
    key = tuning.TuningKey("gemm_fp8", "srchash", BUCKET, "float8_e4m3fn/bfloat16", H200)
    sweep = ["sweep-a", "sweep-b"]
    for name, raw in _tampered(marker).items():
        db = sqlite3.connect(kb.path)
        db.execute("UPDATE kernels SET config = ? WHERE id = ?", (raw, kid))
        db.commit()
        db.close()
        assert kb.best_config("gemm_fp8", BUCKET, H200) is None, name
        (row,) = kb.kernels()
        assert row.config is None and row.invalid, name
        assert "INVALID" in kb.export("md") and "PWNED" not in kb.export("md"), name
        with using(kb) as session:  # the autotune hook falls back to its own sweep
            assert tuning.configs_for(key, sweep, lambda c: pytest.fail("used")) == sweep
            assert session.used == []
        assert not marker.exists(), f"{name}: stored text was executed"
    # prune removes what cannot be used
    result = kb.prune()
    assert result.kernels_invalid == 1 and kb.kernels() == []


def test_kb_package_cannot_execute_what_it_reads() -> None:
    """No eval/exec/compile/pickle/marshal/import machinery anywhere in kopt/kb: the only way
    from a row to a kernel is integers into kopt's own template."""
    banned_calls = {"eval", "exec", "compile", "__import__", "load_generated_module"}
    banned_modules = {"pickle", "marshal", "importlib", "shelve", "dill", "runpy"}
    for path in (ROOT / "kopt" / "kb").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                assert name not in banned_calls, f"{path.name}:{node.lineno} calls {name}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = {a.name.split(".")[0] for a in node.names} | {
                    (getattr(node, "module", None) or "").split(".")[0]}
                assert not mods & banned_modules, f"{path.name}:{node.lineno} imports {mods}"


# -- autotuning from the knowledge base (Triton interpreter, a fake timer for the sweep) -----

SWEEP = [G.gemm_config(16, 32, 32, 2, 1, 4), G.gemm_config(32, 32, 32, 2, 1, 4)]


@pytest.fixture
def sweeping(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two interpreter-sized configs to sweep; the timer runs each config and says the later
    one is faster. Returns the log of benchmarked configs."""
    benched: list[str] = []
    monkeypatch.setattr(G, "gemm_configs", lambda *a, **k: list(SWEEP))
    monkeypatch.setattr(G, "_TUNERS", {})
    monkeypatch.setattr(tuning, "_REUSED", {})
    real = triton.autotune

    def fake_bench(kernel_call, quantiles):  # noqa: ANN001, ANN202
        kernel_call()
        benched.append("x")
        t = 2.0 if len(benched) % 2 else 1.0  # the second config of each sweep is faster
        return [t, t, t]

    monkeypatch.setattr(triton, "autotune", lambda **kw: real(**kw, do_bench=fake_bench))
    return benched


def _gemm_once() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(96, 64, generator=g).bfloat16().t()
    return G.gemm(a, b), G.gemm_reference(a, b, None, None, None, None, None)


def test_sweep_winner_recorded_then_reused_without_sweeping(kb: KnowledgeBase,
                                                            sweeping: list[str],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    with using(kb) as first:
        out, ref = _gemm_once()
    torch.testing.assert_close(out, ref, atol=0.0, rtol=0.0)  # bf16 in, fp32 exact sums
    assert len(sweeping) == len(SWEEP)  # a real sweep ran
    (row,) = kb.kernels()
    assert row.template == "gemm_bf16" and row.device == kopt.kb.device_name("cpu")
    assert row.config == tuning.config_params("gemm_bf16", SWEEP[1])  # the faster one
    (m,) = kb.measurements()
    assert (m.kernel_id, m.baseline_ms, m.candidate_ms) == (row.id, 2.0, 1.0)
    assert any(f"K{row.id}" in r for r in first.recorded) and first.used == []
    # a "second run": a fresh process has no autotuners and nothing reused yet
    monkeypatch.setattr(G, "_TUNERS", {})
    monkeypatch.setattr(tuning, "_REUSED", {})
    with using(kb) as second:
        out2, _ = _gemm_once()
        out3, _ = _gemm_once()
    assert len(sweeping) == len(SWEEP)  # no new benchmark: the sweep was skipped
    assert torch.equal(out2, out) and torch.equal(out3, out)
    (tuner,) = G._TUNERS.values()
    assert [str(c) for c in tuner.configs] == [str(SWEEP[1])]
    assert len(second.used) == 1 and f"K{row.id}" in second.used[0]
    assert "sweep of 2 configs skipped" in second.used[0]
    assert second.recorded == [] and len(kb.kernels()) == 1
    # without a knowledge base the launcher sweeps as before
    monkeypatch.setattr(G, "_TUNERS", {})
    monkeypatch.setattr(tuning, "_REUSED", {})
    _gemm_once()
    assert len(sweeping) == 2 * len(SWEEP)


def test_tampered_winner_falls_back_to_the_sweep(kb: KnowledgeBase, sweeping: list[str],
                                                 tmp_path: Path) -> None:
    with using(kb):
        _gemm_once()
    (row,) = kb.kernels()
    marker = tmp_path / "PWNED"
    db = sqlite3.connect(kb.path)
    db.execute("UPDATE kernels SET config = ? WHERE id = ?",
               (pickle.dumps(_Evil(marker)), row.id))
    db.commit()
    db.close()
    G._TUNERS.clear()
    tuning._REUSED.clear()
    with using(kb) as session:
        out, ref = _gemm_once()
    torch.testing.assert_close(out, ref, atol=0.0, rtol=0.0)
    assert len(sweeping) == 2 * len(SWEEP) and session.used == [] and not marker.exists()


class _FakeTuner:
    """What record_winner reads of a triton Autotuner after a sweep."""

    def __init__(self) -> None:
        self.configs = list(SWEEP)
        self.best_config = SWEEP[0]
        self.configs_timings = {SWEEP[0]: [0.5, 0.4, 0.6], SWEEP[1]: [0.7, 0.6, 0.8]}


@pytest.mark.parametrize("verified", [True, False])
def test_configs_tuned_in_a_pipeline_run_are_kept_only_if_it_verifies(kb: KnowledgeBase,
                                                                      verified: bool) -> None:
    from kopt.kb.verdicts import pipeline_run

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    key = tuning.TuningKey("gemm_bf16", "h", "m=16 n=4 k=4", "bfloat16/bfloat16", "dev")
    with using(kb) as session:
        run = pipeline_run(gm, [torch.randn(2, 4)])
        tuning.record_winner(key, _FakeTuner())
        tuning.record_winner(key, _FakeTuner())  # filed once per key and scope
        assert kb.kernels() == []  # waits for the run's verification
        run.record([_result("gemm_epilogue", verified)], [])
    kernels = kb.kernels()
    if verified:
        assert [k.config for k in kernels] == [tuning.config_params("gemm_bf16", SWEEP[0])]
        (m,) = kb.measurements()
        assert (m.baseline_ms, m.candidate_ms, m.kernel_id) == (0.5, 0.5, kernels[0].id)
    else:
        assert kernels == [] and kb.measurements() == []
        assert any("not kept" in r for r in session.recorded)


# -- pass verdicts ----------------------------------------------------------------------------

def _result(name: str, passed: bool | None, reverted: tuple[str, ...] = ()) -> PassResult:
    verdict = None if passed is None else Verdict(passed, "tolerance", "rel. error 3e-2")
    return PassResult(name, matched=2, rejected={}, nodes_before=10, nodes_after=8, seconds=0.1,
                      verdict=verdict, reverted=reverted)


def test_failed_verification_is_a_rejection_tagged_numerics(kb: KnowledgeBase) -> None:
    results = [_result("cse", True), _result("fp8", False), _result("hoist", None),
               _result("rowwise_fusion", True, reverted=("add_3",))]
    ids = record_pass_results(kb, results, "W1", H200, uuids={"fp8": "u1"})
    assert len(ids) == 3  # hoist was not verified: no verdict
    v = {x.rewrite: x for x in kb.verdicts()}
    assert (v["fp8"].verdict, v["fp8"].tags, v["fp8"].rewrite_uuid) == ("rejected",
                                                                        ("numerics",), "u1")
    assert "rel. error 3e-2" in v["fp8"].cause
    assert (v["cse"].verdict, v["cse"].tags) == ("accepted", ())
    assert (v["rowwise_fusion"].verdict, v["rowwise_fusion"].tags) == ("accepted",
                                                                        ("numerics",))
    # the same results again: nothing new
    assert record_pass_results(kb, results, "W1", H200, uuids={"fp8": "u1"}) == ids
    assert skip_reason(kb, "fp8", "W1", H200) is None  # rejected is not a dead end


def test_dead_end_scope_and_who_lifts_it(kb: KnowledgeBase) -> None:
    kb.record_verdict("fp8", "dead_end", workload="W1", device=H200, origin="ablation",
                      cause="slower under CUDA graphs", tags=["slower-under-cuda-graphs"],
                      rewrite_uuid="u1")
    why = skip_reason(kb, "fp8", "W1", H200, uuid="u1", cuda_graphs=True)
    assert why is not None and "slower under CUDA graphs" in why and "ablation" in why
    assert skip_reason(kb, "fp8", "W1", H200, uuid="u1") is None  # eager: it does not lose
    graphs = {"cuda_graphs": True}
    assert skip_reason(kb, "fp8", "W2", H200, **graphs) is None  # another workload
    assert skip_reason(kb, "fp8", "W1", "NVIDIA H100", **graphs) is None  # another device
    assert skip_reason(kb, "fp8", "W1", H200, uuid="u2", **graphs) is None  # pass changed
    kb.record_verdict("fp8", "accepted", workload="W1", device=H200, origin="pipeline")
    assert skip_reason(kb, "fp8", "W1", H200, **graphs) is not None  # numerics lift nothing
    kb.record_verdict("fp8", "accepted", workload="W1", device=H200, origin="human",
                      cause="fixed by the epilogue change")
    assert skip_reason(kb, "fp8", "W1", H200, **graphs) is None
    kb.record_verdict("hoist", "dead_end", workload="*", device=H200, origin="human",
                      cause="regime: tokens >= 8192", tags=["shape-regime"])
    assert skip_reason(kb, "hoist", "anything", H200) is not None
    kb.record_verdict("cse", "dead_end", workload="W9", regime="long-context", device="*",
                      origin="human", cause="no gain", tags=["no-gain"])
    assert skip_reason(kb, "cse", "W3", "cpu", regime="long-context") is not None
    assert skip_reason(kb, "cse", "W3", "cpu") is None


class _ScaledQKV(QKV):
    """QKV and a parameter-only op besides the merge's (a pass other than the merge accepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(37))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.exp()


def test_pipeline_skips_a_dead_end_and_retry_runs_it(kb: KnowledgeBase) -> None:
    model, args = _ScaledQKV().eval(), (torch.randn(2, 37),)
    with using(kb) as s1:
        first = kopt.optimize(model, args).report.result("merge_projections")
    assert first.matched > 0 and first.verdict.passed
    recorded = {v.rewrite: v for v in kb.verdicts()}
    assert recorded["merge_projections"].verdict == "accepted"
    assert recorded["merge_projections"].workload == s1.last_workload
    kb.record_verdict("merge_projections", "dead_end", workload=s1.last_workload,
                      device=s1.last_device, origin="human", tags=["slower"],
                      cause="one wide GEMM lost to three narrow ones here")
    with using(kb) as s2:
        opt = kopt.optimize(model, args)
    skipped = opt.report.result("merge_projections")
    assert skipped.matched == 0 and skipped.verdict is None
    assert any("one wide GEMM lost" in n and "--retry" in n for n in skipped.notes)
    assert "one wide GEMM lost" in opt.report.format()
    assert any("merge_projections skipped" in u for u in s2.used)
    assert any("accepted before" in u for u in s2.used)  # the other passes
    assert opt.report.verified
    torch.testing.assert_close(opt(*args), model(*args))
    with using(kb, retry=True) as s3:
        again = kopt.optimize(model, args).report.result("merge_projections")
    assert again.matched == first.matched and again.verdict.passed
    assert any("retried (--retry)" in u for u in s3.used)
    with using(kb, device="another-device"):  # the dead end was recorded for this device only
        assert kopt.optimize(model, args).report.result("merge_projections").matched > 0


def test_a_pass_slower_only_under_cuda_graphs_is_skipped_only_there(kb: KnowledgeBase) -> None:
    """An ablation found hoist 2.7 ms slower per call replayed from a CUDA graph but 106 ms
    faster eager on W1: its dead end must not cost the eager runs their gain."""
    model, args = QKV().eval(), (torch.randn(2, 37),)
    with using(kb) as s:
        assert kopt.optimize(model, args).report.result("merge_projections").matched > 0
    kb.record_verdict("merge_projections", "dead_end", workload=s.last_workload,
                      device=s.last_device, origin="ablation", tags=["slower-under-cuda-graphs"],
                      cause="measured by ablation: 2.7 ms per call slower CUDA graph")
    assert kb.dead_end("merge_projections", s.last_device, s.last_workload) is None
    assert kb.dead_end("merge_projections", s.last_device, s.last_workload,
                       cuda_graphs=True) is not None
    with using(kb):
        eager = kopt.optimize(model, args).report.result("merge_projections")
        graphed = kopt.optimize(model, args, cuda_graphs=True).report.result("merge_projections")
    assert eager.matched > 0
    assert graphed.matched == 0 and any("slower CUDA graph" in n for n in graphed.notes)


# -- export and CLI ---------------------------------------------------------------------------

def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kopt")
    kb_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["kb", *argv])


def _populate(kb: KnowledgeBase) -> None:
    _record(kb, 0.42)
    kb.record_verdict("fp8", "dead_end", workload="W1", device=H200, origin="human",
                      cause="slower | under CUDA graphs", tags=["slower-under-cuda-graphs"])
    kb.record_verdict("cse", "rejected", workload="W1", device=H200,
                      cause="failed verification", tags=["numerics"])
    kb.record_measurement("e2e", "W1", H200, 183.4, 179.7, cuda_graphs=True)
    kb.add_lesson("FP8 modulation GEMVs lose under CUDA graphs", ["slower-under-cuda-graphs"],
                  rewrite="fp8")


def test_export_md_and_json(kb: KnowledgeBase) -> None:
    _populate(kb)
    doc = json.loads(kb.export("json"))
    assert doc["schema_version"] == schema.CURRENT
    (dead,) = [v for v in doc["verdicts"] if v["verdict"] == "dead_end"]
    assert dead["rewrite"] == "fp8" and dead["cause"] == "slower | under CUDA graphs"
    assert dead["tags"] == ["slower-under-cuda-graphs"] and dead["device"] == H200
    assert doc["kernels"][0]["config"] == GEMM_CFG
    assert doc["kernels"][0]["best_ms"] == pytest.approx(0.42)
    (e2e,) = [m for m in doc["measurements"] if m["kind"] == "e2e"]
    assert e2e["cuda_graphs"] is True and e2e["baseline_ms"] == 183.4
    assert doc["lessons"][0]["tags"] == ["slower-under-cuda-graphs"]
    md = kb.export("md")
    dead_row = next(line for line in md.splitlines() if line.startswith("| V1 |"))
    assert "dead end" in dead_row and "slower \\| under CUDA graphs" in dead_row
    assert dead_row.count(" | ") == 9  # the | in the cause did not add a column
    assert "| M2 | e2e | W1 |" in md and "1.021x" in md and "| on |" in md
    assert "BLOCK_M=128 BLOCK_N=256" in md and "FP8 modulation GEMVs" in md


def test_cli_list_show_export_prune_mark(kb: KnowledgeBase, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    _populate(kb)
    path = str(kb.path)
    assert kb_cli.run(_cli("list", "--kb", path)) == 0
    out = capsys.readouterr().out
    assert "V1" in out and "dead end" in out and "K1" in out and "6 entries" in out
    assert kb_cli.run(_cli("list", "--kb", path, "--kind", "verdicts")) == 0
    assert "2 entries" in capsys.readouterr().out
    assert kb_cli.run(_cli("show", "V1", "--kb", path)) == 0
    assert "cause: slower | under CUDA graphs" in capsys.readouterr().out
    assert kb_cli.run(_cli("show", "V99", "--kb", path)) == 2
    assert "no entry V99" in capsys.readouterr().err
    out_file = tmp_path / "kb.json"
    assert kb_cli.run(_cli("export", "--format", "json", "--out", str(out_file),
                           "--kb", path)) == 0
    assert json.loads(out_file.read_text())["verdicts"][0]["verdict"] == "dead_end"
    assert kb_cli.run(_cli("mark", "hoist", "dead_end", "--cause", "no gain at 512 tokens",
                           "--tag", "shape-regime", "--device", H200, "--kb", path)) == 0
    assert "V3" in capsys.readouterr().out
    assert skip_reason(kb, "hoist", "any workload", H200) is not None
    # prune: a config of another triton version and everything older than 30 days
    other = kb.record_kernel_config("gemm_fp8", "srchash", GEMM_CFG, BUCKET, "x", H200,
                                    Versions("2.11.0", "3.6.0"))
    kb.record_measurement("micro", BUCKET, H200, 1.0, 0.9, kernel_id=other)
    db = sqlite3.connect(kb.path)
    db.execute("UPDATE verdicts SET created_at = ? WHERE id = 2", (time.time() - 40 * 86400,))
    db.commit()
    db.close()
    assert kb_cli.run(_cli("prune", "--older-than", "30", "--dry-run", "--kb", path)) == 0
    assert "would remove 3 rows" in capsys.readouterr().out
    assert len(kb.kernels()) == 2 and len(kb.verdicts()) == 3
    assert kb_cli.run(_cli("prune", "--older-than", "30", "--kb", path)) == 0
    assert "removed 3 rows" in capsys.readouterr().out
    assert [k.versions for k in kb.kernels()] == [Versions.current()]
    assert [v.id for v in kb.verdicts()] == [1, 3] and len(kb.lessons()) == 1
    # an unusable file: exit 1 and a clear message, file untouched
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database at all" * 100)
    assert kb_cli.run(_cli("list", "--kb", str(bad))) == 1
    assert "is corrupt" in capsys.readouterr().err


def test_default_path_follows_the_cache_dir(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KOPT_CACHE_DIR", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kb = safe_open()
    assert kb is not None and kb.path == tmp_path / "cache" / "kb.sqlite"
    kb.close()
    assert (tmp_path / "cache" / "kb.sqlite").exists()


# -- ablation -> dead ends --------------------------------------------------------------------

def _ablation(rows: dict[str, tuple[float, float]]):  # noqa: ANN202
    """An Ablation of three passes with leave-one-out rows: variant -> (eager, graph) ms."""
    from kopt.ablate import Ablation, Row

    passes = ("cse", "hoist", "fp8")
    out = Ablation("W1", "cuda", "bf16", 2, 5, order=passes)
    for variant, (ms, graph_ms) in rows.items():
        kind, left = ("baseline", None) if variant == "baseline" else (
            ("cumulative", None) if variant == "all" else ("leave-one-out", variant[6:]))
        on = () if kind == "baseline" else tuple(p for p in passes if p != left)
        out.rows.append(Row(variant, kind, left or (passes[-1] if kind == "cumulative" else None),
                            on, ms, graph_ms, None, None, 10 * len(on), None, "not verified",
                            None))
    return out


def test_an_ablation_files_savings_and_the_passes_that_lose_as_dead_ends(
        kb: KnowledgeBase) -> None:
    from kopt.kb.verdicts import record_ablation

    ablation = _ablation({"baseline": (130.0, 120.0), "all": (100.0, 90.0),
                          "all - cse": (100.1, 90.1),   # +0.1 ms: noise, kept
                          "all - hoist": (104.0, 94.0),  # hoist saves 4 ms: kept
                          "all - fp8": (99.0, 88.0)})   # fp8 costs 1 ms eager, 2 ms graphed
    lines = record_ablation(kb, ablation, "W1", H200)
    dead = {v.rewrite: v for v in kb.verdicts() if v.verdict == "dead_end"}
    assert set(dead) == {"fp8"} and dead["fp8"].origin == "ablation"
    assert dead["fp8"].tags == ("slower",) and "2.000 ms per call slower CUDA graph" in \
        dead["fp8"].cause and "1.000 ms per call slower eager" in dead["fp8"].cause
    assert kb.dead_end("fp8", H200, "W1") is not None and kb.dead_end("hoist", H200, "W1") is None
    saved = {(m.rewrite, m.cuda_graphs): (m.baseline_ms, m.candidate_ms)
             for m in kb.measurements()}
    assert saved[("hoist", True)] == pytest.approx((94.0, 90.0))
    assert saved[("fp8", False)] == pytest.approx((99.0, 100.0))
    assert len(saved) == 6 and any("fp8 is a dead end" in line for line in lines)
    # losing only when replayed from a CUDA graph is tagged so
    graphed = _ablation({"baseline": (130.0, 120.0), "all": (100.0, 90.0),
                         "all - cse": (101.0, 89.0)})
    record_ablation(kb, graphed, "W2", H200)
    assert kb.dead_end("cse", H200, "W2") is None  # eager runs keep it
    assert kb.dead_end("cse", H200, "W2", cuda_graphs=True).tags == (
        "slower-under-cuda-graphs",)


def test_a_loss_within_the_paired_spread_is_noise_and_a_later_saving_lifts_a_dead_end(
        kb: KnowledgeBase) -> None:
    """In a paired ablation a loss smaller than the all-passes row's spread over the run is
    not a dead end; a loss beyond it is. A later ablation that measures the pass saving more
    than its noise in every mode lifts the dead end (an accepted verdict of the ablation);
    one within the noise leaves it in force."""
    import dataclasses

    from kopt.kb.verdicts import record_ablation

    def paired(rows: dict[str, tuple[float, float]], ref: tuple[float, float]):  # noqa: ANN202
        out = _ablation(rows)  # every leave-one-out row re-timed the all-passes row at ``ref``
        out.rows = [dataclasses.replace(r, ref_ms=ref[0], ref_graph_ms=ref[1])
                    if r.kind == "leave-one-out" else r for r in out.rows]
        return out

    # the all-passes row measured 100 then 102 (graph: 90 then 92): 2 ms of drift
    drifted = paired({"baseline": (130.0, 120.0), "all": (100.0, 90.0),
                      "all - cse": (100.6, 90.6),  # -1.4 ms against its paired 102 / 92
                      "all - fp8": (98.0, 88.0)}, ref=(102.0, 92.0))  # -4 ms: beyond 2 ms
    assert drifted.savings("leave-one-out")["cse"][1] == pytest.approx(-1.4)
    record_ablation(kb, drifted, "W1", H200)
    assert kb.dead_end("cse", H200, "W1") is None  # a loss over 0.5%, but within the drift
    assert kb.dead_end("fp8", H200, "W1") is not None

    within = paired({"baseline": (130.0, 120.0), "all": (100.0, 90.0),
                     "all - fp8": (101.0, 91.0)}, ref=(100.0, 90.0))  # +1 ms, noise 0.5
    unsure = paired({"baseline": (130.0, 120.0), "all": (100.0, 90.0),
                     "all - fp8": (100.3, 90.3)}, ref=(100.0, 90.0))  # +0.3 ms: noise
    record_ablation(kb, unsure, "W1", H200)
    assert kb.dead_end("fp8", H200, "W1") is not None
    lines = record_ablation(kb, within, "W1", H200)
    assert kb.dead_end("fp8", H200, "W1") is None
    lifted = [v for v in kb.verdicts() if v.rewrite == "fp8" and v.verdict == "accepted"]
    assert len(lifted) == 1 and lifted[0].origin == "ablation"
    assert "saves 1.000 ms per call CUDA graph" in lifted[0].cause
    assert any("fp8 is no longer a dead end" in line for line in lines)


def test_cli_ablate_files_dead_ends_that_optimize_then_skips(tmp_path: Path, capsys,  # noqa: ANN001
                                                              monkeypatch) -> None:  # noqa: ANN001
    """`kopt ablate` files its measurements; a pass it measured as slower is skipped by the
    next `kopt optimize` of the same workload, with the measured cause in the report."""
    import kopt.kb.verdicts as verdicts
    from kopt.cli import main

    real = verdicts.record_ablation

    def cse_loses(kb, ablation, workload, device, **kw):  # noqa: ANN001, ANN003, ANN202
        every = ablation.every_pass  # make "all - cse" faster than all: cse measured as a loss
        ablation.rows = [r if r.variant != "all - cse" else
                         type(r)(**{**r.__dict__, "ms": every.ms * 0.9}) for r in ablation.rows]
        return real(kb, ablation, workload, device, **kw)

    monkeypatch.setattr(verdicts, "record_ablation", cse_loses)
    path = str(tmp_path / "kb.sqlite")
    assert main(["ablate", "-q", "--model", "llm-tiny", "--pass", "cse", "--pass",
                 "merge_projections", "--kind", "leave-one-out", "--iters", "1", "--warmup",
                 "1", "--seeds", "0", "--no-verify", "--device-model", "h200",
                 "--kb", path]) == 0
    err = capsys.readouterr().err
    assert "cse is a dead end here" in err
    assert main(["optimize", "-q", "--model", "llm-tiny", "--kb", path]) == 0
    out = capsys.readouterr().out
    assert "cse skipped: a dead end" in out and "measured by ablation (leave-one-out)" in out


# -- merging another file ---------------------------------------------------------------------

def test_merge_copies_what_is_missing_once_and_refuses_tampered_rows(
        kb: KnowledgeBase, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _record(kb, 0.50)  # the same config both files have: kept once
    with KnowledgeBase.open(tmp_path / "other.sqlite") as other:
        _populate(other)  # kernel + micro measurement, dead end, rejection, e2e, lesson
        _record(other, 0.47, BLOCK_N=128)
        other_path = other.path
    db = sqlite3.connect(other_path)  # a tampered row: copied never, counted
    db.execute("INSERT INTO kernels (template, source_hash, config, bucket, dtype, device, "
               "torch_version, triton_version, created_at) VALUES ('gemm_fp8', 'h', "
               "'{\"BLOCK_M\": \"__import__(1)\"}', 'b', 'd', 'dev', 't', 't', 0)")
    db.commit()
    db.close()
    with KnowledgeBase.open(other_path) as other:
        result = kb.merge(other)
        assert result.added == {"kernels": 1, "measurements": 3, "verdicts": 2, "lessons": 1}
        assert result.skipped == {"kernel configs that fail validation": 1}
        assert kb.merge(other).added == dict.fromkeys(result.added, 0)  # idempotent
        with pytest.raises(InvalidRecord, match="into itself"):
            kb.merge(kb)
    assert len(kb.kernels()) == 2 and all(k.config is not None for k in kb.kernels())
    # the measurements point at this file's kernel ids; the best of the shared config is the
    # faster of the two files' timings
    best = kb.best_config("gemm_fp8", BUCKET, H200, dtype="float8_e4m3fn/bfloat16")
    assert best is not None and best.best_ms == pytest.approx(0.42)
    dead = kb.dead_end("fp8", H200, "W1", cuda_graphs=True)
    assert dead is not None and dead.tags == ("slower-under-cuda-graphs",)
    assert kb.lessons()[0].tags == ("slower-under-cuda-graphs",)
    # the CLI, on a third file
    third = tmp_path / "third.sqlite"
    KnowledgeBase.open(third).close()
    assert kb_cli.run(_cli("merge", str(other_path), "--kb", str(third))) == 0
    out = capsys.readouterr().out
    assert "added 2 kernels, 3 measurements, 2 verdicts, 1 lessons" in out
    assert "left out 1 kernel configs that fail validation" in out
    assert kb_cli.run(_cli("merge", str(tmp_path / "missing.sqlite"), "--kb", str(third))) == 2
    assert "no knowledge base at" in capsys.readouterr().err
