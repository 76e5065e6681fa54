"""Ablation (kopt/ablate.py, `kopt ablate`): the variants are the right flips of PassConfig,
every row is measured, predicted and verified, and the writers produce what they say."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kopt.ablate import (
    KINDS,
    RowLog,
    ablate,
    baseline_config,
    load_rows,
    repredict,
    spearman,
    step_inputs,
    variants,
)
from kopt.api import optimize_captured
from kopt.capture import capture_module, flatten_inputs
from kopt.cli import main
from kopt.cost import H200, CostModel
from kopt.kb import KnowledgeBase
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def test_variants_flip_one_field_at_a_time() -> None:
    config = PassConfig(fp8=FP8Config(), hoist=False)
    on = config.enabled()
    order = ("rowwise_fusion", "fp8", "cse")  # the rest follow in pipeline order
    rows = variants(config, order)
    kinds = [v.kind for v in rows]
    # every pass left out once, and the fast FP8 accumulation (a lever, not a pass)
    assert kinds == ["baseline"] + ["alone"] * len(on) + ["cumulative"] * len(on) + [
        "leave-one-out"] * (len(on) + 1)
    lever = rows[-1]
    assert lever.name == "all - accumulate=fast" and lever.subject == "accumulate=fast"
    assert lever.passes == on and lever.config.fp8.accumulate == "exact"
    assert lever.config.replace(fp8=config.fp8) == config
    base = rows[0].config
    assert base.enabled() == () and base.fp8 is None and base.hoist is False
    alone = [v for v in rows if v.kind == "alone"]
    assert [v.config.enabled() for v in alone] == [(p,) for p in on]
    assert next(v for v in alone if v.passes == ("fp8",)).config.fp8 == FP8Config()
    cumulative = [v for v in rows if v.kind == "cumulative"]
    added = [v.name.removeprefix("+ ") for v in cumulative]
    assert added[:3] == list(order) and sorted(added) == sorted(on)
    assert cumulative[-1].config == config
    for a, b in zip(cumulative, cumulative[1:], strict=False):
        assert set(b.config.enabled()) - set(a.config.enabled()) == {b.name[2:]}
    for v in (v for v in rows if v.kind == "leave-one-out" and v is not lever):
        missing = set(on) - set(v.config.enabled())
        assert missing == {v.name.removeprefix("all - ")}
    assert [v.kind for v in variants(config, order, kinds=("alone",))] == [
        "baseline"] + ["alone"] * len(on)
    # leave-one-out alone still measures the row every pass is left out of
    loo = variants(config, order, kinds=("leave-one-out",))
    assert [v.kind for v in loo] == ["baseline", "all"] + ["leave-one-out"] * (len(on) + 1)
    exact = config.replace(fp8=FP8Config(accumulate="exact"))  # no lever left to ablate
    assert len(variants(exact, order, kinds=("leave-one-out",))) == 2 + len(on)
    assert loo[1].config == config


def test_context_passes_stay_on_in_every_row() -> None:
    """Ablating some passes keeps the others on everywhere, the baseline included: the GEMM
    epilogue is ablated on top of fp8, which it needs."""
    config = PassConfig(fp8=FP8Config(), gemm_epilogue=True)
    context = tuple(p for p in config.enabled() if p != "gemm_epilogue")
    rows = variants(config, ("gemm_epilogue",), ("alone", "leave-one-out"), context)
    assert [v.name for v in rows] == ["baseline", "gemm_epilogue alone", "all",
                                      "all - gemm_epilogue"]
    for v in rows:
        assert set(context) <= set(v.config.enabled()) and v.config.fp8 == FP8Config()
    assert rows[0].config.gemm_epilogue is False and rows[1].config == config


def test_the_baseline_config_keeps_exactly_the_passes_not_ablated() -> None:
    """What the calibration profiles as the ablation's baseline: with fold_constants not
    ablated it stays on (Qwen-Image's host-to-device copies folded, so the graph can be
    captured); with every pass ablated nothing is on."""
    config = PassConfig(fp8=FP8Config())
    base = baseline_config(config, ["cse", "fp8"])
    assert base.cse is False and base.fp8 is None
    assert set(base.enabled()) == set(config.enabled()) - {"cse", "fp8"}
    assert "fold_constants" in base.enabled()
    assert not baseline_config(config).enabled()
    assert baseline_config(config, ["cse"]) == variants(
        config, (), ("leave-one-out",), tuple(p for p in config.enabled() if p != "cse"))[0].config


def test_ablating_some_passes_measures_them_on_top_of_the_rest() -> None:
    w = build("llm-tiny")
    result = ablate(w, PassConfig(), passes=("merge_projections",), kinds=("leave-one-out",),
                    iters=1, warmup=1, verify=VerifyOptions(enabled=False))
    assert "cse" in result.context and "merge_projections" not in result.context
    assert result.baseline.sites > 0  # the context's rewrites
    assert result.row("all").sites > result.row("all - merge_projections").sites
    assert "not ablated" in result.markdown()


def test_paired_rows_time_the_all_passes_row_again_and_savings_use_that_timing() -> None:
    """With ``paired``, every row after ``all`` carries a re-timing of ``all`` taken right
    after it, and a leave-one-out saving is the row less its own re-timing: a drift between
    the first timing of ``all`` and a later row does not go into the saving."""
    w = build("llm-tiny")
    result = ablate(w, PassConfig(), passes=("merge_projections", "cse"),
                    kinds=("leave-one-out",), iters=1, warmup=1,
                    verify=VerifyOptions(enabled=False), paired=True)
    assert result.baseline.ref_ms is None and result.row("all").ref_ms is None
    loo = [r for r in result.rows if r.kind == "leave-one-out"]
    assert loo and all(r.ref_ms is not None and r.ref_ms > 0 for r in loo)
    savings = result.savings("leave-one-out")
    for r in loo:
        assert savings[r.subject][1] == pytest.approx(r.ms - r.ref_ms)
    timings = [result.row("all").ms] + [r.ref_ms for r in loo]
    assert result.reference_spread() == (min(timings), max(timings))
    assert result.reference_spread(graphs=True) is None  # a CPU run has no graph timings
    assert "Paired: the all-passes row was timed again" in result.markdown()

    # a drift of +10 ms after the first timing of ``all``: unpaired, every saving grows by it
    drifted = dataclasses.replace(result, rows=[
        dataclasses.replace(r, ms=r.ms + 10.0, ref_ms=r.ref_ms + 10.0) if r.ref_ms is not None
        else r for r in result.rows])
    for name, (_, saved) in drifted.savings("leave-one-out").items():
        assert saved == pytest.approx(savings[name][1])
    unpaired = dataclasses.replace(drifted, rows=[dataclasses.replace(r, ref_ms=None)
                                                  for r in drifted.rows])
    for name, (_, saved) in unpaired.savings("leave-one-out").items():
        assert saved == pytest.approx(savings[name][1] + 10.0 + (
            result.row(f"all - {name}").ref_ms - result.row("all").ms))


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # nan: constant


def test_step_inputs_give_each_step_a_new_timestep() -> None:
    w = build("qwen-image-tiny")
    steps = step_inputs(w)
    base = flatten_inputs(w.args, w.kwargs)[0]
    t = [i for i, x in enumerate(base) if x is w.kwargs["timestep"]][0]
    latents = [i for i, x in enumerate(base) if x is w.kwargs["hidden_states"]][0]
    values = [float(s[t][0]) for s in steps]
    assert len(set(values)) == len(steps) > 2  # more than a hoisted region keeps
    assert all(s[latents] is w.kwargs["hidden_states"] for s in steps)


@pytest.fixture(scope="module")
def result():  # noqa: ANN201
    w = build("llm-tiny")
    cost = CostModel(H200, calls_per_step=w.calls_per_step)
    passes = ("cse", "merge_projections", "rowwise_fusion")
    only = PassConfig().replace(**{p: False for p in PassConfig().enabled() if p not in passes})
    return ablate(w, only, cost=cost, iters=2, warmup=1, verify=VerifyOptions(seeds=(0,)))


def test_ablation_rows_are_measured_predicted_and_verified(result) -> None:  # noqa: ANN001
    names = [r.variant for r in result.rows]
    passes = ("cse", "merge_projections", "rowwise_fusion")
    assert names[0] == "baseline" and len(names) == 1 + 3 * len(passes)
    assert [r.kind for r in result.rows].count("cumulative") == len(passes)
    # cumulative rows follow the cost model's ranking
    ranked = [p.name for p in result.ranking.ranked() if p.name in passes]
    assert list(result.order) == ranked
    assert [r.subject for r in result.rows if r.kind == "cumulative"] == ranked
    for r in result.rows:
        assert r.ms > 0 and r.graph_ms is None  # no CUDA graphs on the CPU
        assert r.predicted_ms is not None and r.predicted_ms > 0
        assert r.verdict.startswith("passed") == bool(r.sites) and r.verified in (True, None)
        assert r.error is not None and r.error < 1e-5
    assert result.baseline.sites == 0 and result.baseline.error == 0
    alone = {r.passes[0]: r for r in result.rows if r.kind == "alone"}
    assert alone["merge_projections"].sites > 0 and alone["rowwise_fusion"].sites > 0
    # predicted = the cost model on the variant's graph: fewer launches, less predicted time
    every = result.row(f"+ {ranked[-1]}")
    assert every.predicted_ms < result.baseline.predicted_ms
    assert result.row(f"all - {ranked[0]}").predicted_ms > every.predicted_ms
    s = result.savings("alone")
    assert set(s) == {p for p in passes if alone[p].sites}
    for name, (predicted, measured) in s.items():
        assert predicted == pytest.approx(result.baseline.predicted_ms - alone[name].predicted_ms)
        assert measured == pytest.approx(result.baseline.ms - alone[name].ms)
    loo = result.savings("leave-one-out")
    assert loo["cse"][1] == pytest.approx(result.row("all - cse").ms - every.ms)


def test_ablation_writers(result, tmp_path) -> None:  # noqa: ANN001
    text = result.markdown()
    assert text.count("\n| ") >= len(result.rows) + 2
    for r in result.rows:
        assert f"| {r.variant} |" in text
    assert "Predicted vs measured ms saved per call (alone)" in text and "Spearman" in text
    data = json.loads(result.to_json())
    assert [r["variant"] for r in data["rows"]] == [r.variant for r in result.rows]
    assert set(data["savings"]) == set(KINDS) and data["order"] == list(result.order)
    png = tmp_path / "waterfall.png"
    result.waterfall(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_ablate_writes_table_json_and_chart(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    import kopt.ablate

    steady = []
    real = kopt.ablate.ablate
    monkeypatch.setattr(kopt.ablate, "ablate",
                        lambda *a, **k: steady.append(k["steady_s"]) or real(*a, **k))
    md, js, png = tmp_path / "a.md", tmp_path / "a.json", tmp_path / "a.png"
    rc = main(["ablate", "-q", "--model", "llm-tiny", "--pass", "merge_projections",
               "--pass", "cse", "--kind", "alone", "--kind", "cumulative", "--iters", "1",
               "--warmup", "1", "--seeds", "1", "--device-model", "h200", "--md", str(md),
               "--json", str(js), "--png", str(png), "--steady", "0.25"])
    assert rc == 0
    assert steady == [0.25]  # the flag reaches the ablation (its graph rows' steady period)
    out = capsys.readouterr().out
    assert "### Ablation: llm-tiny, float32 on cpu" in out and out.strip() == md.read_text().strip()
    rows = json.loads(js.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["baseline", "alone", "alone", "cumulative",
                                         "cumulative"]
    assert png.stat().st_size > 0
    assert main(["ablate", "-q", "--model", "llm-tiny", "--pass", "fp8"]) == 2  # not enabled


@pytest.fixture(autouse=True)
def _one_thread():  # noqa: ANN202
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_row_log_keeps_rows_and_counts_and_predictions_can_be_made_again(
        result, tmp_path) -> None:  # noqa: ANN001
    log = RowLog(tmp_path / "rows.jsonl.gz")
    for row in result.rows[:3]:  # a run cut short: the rows it finished
        log(result, row)
    back = load_rows(log.path)
    assert back.rows == result.rows[:3] and back.order == result.order
    assert all(a.counts == b.counts and a.counts
               for a, b in zip(back.rows, result.rows[:3], strict=True))
    # the same device model predicts the same from the saved counts; another one otherwise
    cost = CostModel(H200, calls_per_step=result.calls_per_step)
    again = repredict(back, cost)
    assert [r.predicted_ms for r in again.rows] == [r.predicted_ms for r in result.rows[:3]]
    slow_host = repredict(back, CostModel(H200.with_(launch_us=100 * H200.launch_us),
                                          calls_per_step=result.calls_per_step))
    assert all(s.predicted_ms > r.predicted_ms
               for s, r in zip(slow_host.rows, again.rows, strict=True))
    assert [r.ms for r in slow_host.rows] == [r.ms for r in result.rows[:3]]


def test_benchmark_replays_a_cpu_run_from_its_saved_rows_and_calibration(tmp_path) -> None:  # noqa: ANN001
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, str(root / "benchmarks" / "ablate.py"), "--model", "llm-tiny",
           "--device", "cpu", "--dtype", "fp32", "--kind", "leave-one-out", "--pass", "cse",
           "--pass", "rowwise_fusion", "--iters", "2", "--warmup", "1", "--seeds", "0",
           "--profile-iters", "2", "--profile-rows", "1", "--out-dir", str(tmp_path / "run")]
    done = subprocess.run(run, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # every row profiled: its time by op; the row-wise fusion's op only where the pass ran
    rows = {r["variant"]: r for r in
            json.loads((tmp_path / "run" / "ablation.json").read_text())["rows"]}
    assert all(r["op_ms"] for r in rows.values())
    assert "kopt::rowwise" in rows["all"]["op_ms"]
    assert "kopt::rowwise" not in rows["all - rowwise_fusion"]["op_ms"]
    table = (tmp_path / "run" / "ablation.md").read_text()
    section = table[table.index("### Kernel time by op"):]
    assert "all - rowwise_fusion vs all" in section and "| kopt::rowwise |" in section
    saved = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"rows.jsonl.gz", "calibration.json.gz", "device_model.json", "ablation.md",
            "run.json"} <= saved
    replay = [sys.executable, str(root / "benchmarks" / "ablate.py"), "--replay",
              str(tmp_path / "run"), "--out-dir", str(tmp_path / "again"),
              "--kb", str(tmp_path / "kb.sqlite")]
    done = subprocess.run(replay, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads((tmp_path / "run" / "ablation.json").read_text())["rows"]
    again = json.loads((tmp_path / "again" / "ablation.json").read_text())["rows"]
    # the measurements as they were; the fit made again from the same calibration predicts
    # what the run predicted
    assert [r["ms"] for r in again] == [r["ms"] for r in measured]
    assert [r["predicted_ms"] for r in again] == pytest.approx(
        [r["predicted_ms"] for r in measured], rel=1e-9)
    # a new calibration alone, then the old rows predicted with it
    calibrate = [*run[:-1], str(tmp_path / "cal"), "--calibrate-only"]
    done = subprocess.run(calibrate, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "cal" / "rows.jsonl.gz").exists()
    held_out = [*replay[:5], str(tmp_path / "held-out"), "--device-model",
                str(tmp_path / "cal" / "device_model.json")]
    done = subprocess.run(held_out, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "held-out" / "ablation.json").read_text())["rows"]
    assert [r["ms"] for r in rows] == [r["ms"] for r in measured]
    assert all(r["predicted_ms"] > 0 for r in rows)
    # filed under the run's workload: one end-to-end measurement per pass that rewrote
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as kb:
        filed = {m.rewrite for m in kb.measurements() if m.kind == "e2e"}
    workload = json.loads((tmp_path / "run" / "run.json").read_text())["workload"]
    assert filed == {"cse", "rowwise_fusion"} and workload.startswith("graph-")


def test_rank_shapes_predicts_on_the_meta_device_and_the_ranking_moves_with_the_shape() -> None:
    from benchmarks.rank_shapes import predicted_loo

    config = PassConfig().replace(fuse_allreduce_norm=False,
                                  fp8=FP8Config(layout="rowwise", min_features=16))
    got = {mode: predicted_loo("llm-tiny", torch.bfloat16, {"mode": mode}, config, H200)
           for mode in ("prefill", "decode")}
    for r in got.values():
        assert r["all_ms"]["graph"] > 0 and r["all_ms"]["eager"] >= r["all_ms"]["graph"]
        assert {"fp8", "merge_projections", "rowwise_fusion"} <= set(r["saved"])
    # shapes only: the meta device's graph costs what the same model's graph on the CPU does
    w = build("llm-tiny", dtype=torch.bfloat16, mode="decode")
    cap = capture_module(w.model, w.args, w.kwargs)
    spec = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0)
    on_cpu = CostModel(H200, cuda_graphs=True, calls_per_step=w.calls_per_step).graph(spec.gm)
    assert got["decode"]["all_ms"]["graph"] == pytest.approx(on_cpu.total_ms, rel=1e-9)


def test_a_pass_with_as_many_rewrites_but_another_graph_keeps_its_saving() -> None:
    """Without FLUX.2's act + quant fusion, ``fuse_act`` rewrites the same number of sites
    (1646 either way; RESULTS.md, 2026-12-01, H200) into other kernels: the row differs from
    ``all`` and its saving is listed; a row whose counts equal ``all``'s is not."""
    from kopt.ablate import Ablation, Row
    from kopt.cost import OpCount

    def row(variant: str, subject: str | None, ms: float, ops: tuple[str, ...]) -> Row:
        counts = tuple(OpCount(f"n{i}", op, "elementwise", "bfloat16", 0, 1e6, True, None)
                       for i, op in enumerate(ops))
        kind = "leave-one-out" if subject else "all"
        return Row(variant, kind, subject, (), ms, None, None, None, 10, None, "", None, counts)

    fused = ("kopt::act_quant_fp8_rowwise",)
    result = Ablation("m", "cpu", "bfloat16", 1, 1, (), rows=[
        row("baseline", None, 9.0, ("aten::silu", "aten::mul", "kopt::quant_fp8_rowwise")),
        row("all", None, 5.0, fused),
        row("all - fuse_act_quant", "fuse_act_quant", 6.0,
            ("kopt::fused_act", "kopt::quant_fp8_rowwise")),
        row("all - hoist", "hoist", 5.2, fused)])
    result.rows[0] = dataclasses.replace(result.rows[0], kind="baseline", sites=0)
    assert result.savings("leave-one-out") == {"fuse_act_quant": (None, pytest.approx(1.0))}


def test_sustain_runs_the_call_until_the_time_has_passed() -> None:
    """The ablation's rows and the calibration's replays run for ``STEADY_S`` before they are
    timed (the GPU's sustained clock); ``sustain`` calls at least once, for at least that
    long, and refuses a negative time."""
    import time

    from kopt.bench import STEADY_S, sustain

    assert STEADY_S > 0
    calls = []
    start = time.perf_counter()
    n = sustain(lambda: calls.append(time.perf_counter()), 0.05)
    assert 0.05 <= time.perf_counter() - start < 1.0 and n == len(calls) > 1
    assert sustain(lambda: time.sleep(0.02), 0.0) == 1  # once even with no time to run
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        sustain(lambda: None, -1.0)
    with pytest.raises(ValueError, match="steady_s must be >= 0"):
        ablate(build("llm-tiny"), PassConfig(), steady_s=-0.5)
