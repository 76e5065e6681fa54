"""The end-to-end harness's baseline is what it claims: ARCHITECTURE.md's naive FP8 (rowwise FP8
linears from 1024 features), applied and undone without touching the model; its table holds
each variant at its best against the baseline at its best."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.e2e import NaiveFP8Linear, naive_fp8, repeated_blocks, swapped, write_outputs
from kopt.codegen.kernels.quant_fp8 import quant_fp8_rowwise_reference
from kopt.models import build


def test_naive_fp8_linear_is_rowwise_fp8_of_the_linear() -> None:
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    got = NaiveFP8Linear(lin)(x)
    qx, sx = quant_fp8_rowwise_reference(x.reshape(-1, 64))
    qw, sw = quant_fp8_rowwise_reference(lin.weight)
    want = (qx.double() * sx.double()) @ (qw.double() * sw.double()).t() + lin.bias.double()
    assert got.shape == (3, 5, 48)
    # one bf16 rounding of an fp32-accumulated product of the same fp8 values
    torch.testing.assert_close(got.double(), want.reshape(3, 5, 48), rtol=2 ** -7, atol=1e-3)
    full = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert (got.double() - full).abs().max() > 0  # it really quantized


def test_swapped_replaces_only_large_linears_and_restores() -> None:
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 512),
                          nn.ModuleList([nn.Linear(1024, 1024), nn.Linear(1024, 1024)]))
    before = list(model.modules())
    with swapped(model, naive_fp8) as n:
        assert n == 3
        assert isinstance(model[0], NaiveFP8Linear) and isinstance(model[2], nn.Linear)
        assert all(isinstance(m, NaiveFP8Linear) for m in model[3])
    assert list(model.modules()) == before


def test_repeated_blocks_are_uniform_module_lists() -> None:
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])
    model = nn.ModuleDict({"blocks": blocks, "mixed": mixed})
    assert repeated_blocks(model) == set(blocks)


def test_a_step_is_a_cfg_pair_on_a_new_timestep_and_steps_run_back_to_back(monkeypatch) -> None:  # noqa: ANN001, E501
    """``forward_ms`` times one call on the workload's inputs; ``step_ms`` the workload's calls
    per step (the CFG pair: cond, then uncond) on each step's own timestep, which the pair
    shares as one tensor, ``STEPS`` steps back to back: counted, not inferred from timings."""
    import types

    import benchmarks.e2e as e2e

    seen: list[tuple[str, torch.Tensor]] = []

    def fn(*args: object, **kwargs: torch.Tensor) -> torch.Tensor:
        seen.append((kwargs["which"], kwargs["t"]))
        return torch.ones(2)

    per_timing: list[tuple[int, list]] = []

    def once(f, iters, warmup=0, device="cpu", repeat=1):  # noqa: ANN001, ANN202
        seen.clear()
        for _ in range(repeat):
            f()
        per_timing.append((repeat, list(seen)))
        return 1.0

    monkeypatch.setattr(e2e, "median_ms", once)
    t = torch.tensor([1000.0])
    w = types.SimpleNamespace(args=(), kwargs={"which": "cond", "t": t}, calls_per_step=2,
                              step_invariant=("t",))
    row = e2e.measure("x", fn, w, {"which": "uncond", "t": t},
                      [({"which": "cond", "t": t}, torch.ones(2))],
                      iters=1, graphs=False, device="cpu")
    (one, forward), (repeat, steps) = per_timing
    assert one == 1 and forward == [("cond", t)]
    assert repeat == e2e.STEPS and [x for x, _ in steps] == ["cond", "uncond"] * e2e.STEPS
    stamps = [x for _, x in steps]
    assert all(stamps[2 * i] is stamps[2 * i + 1] for i in range(e2e.STEPS))
    assert len({float(x) for x in stamps}) == e2e.STEPS  # a new timestep each step
    assert row["forward_ms"] == row["step_ms"] == 1.0 and row["calls_per_step"] == 2
    assert e2e.best_forward_ms(row) == 0.5  # the loop's ms per forward: a step over 2 calls


def test_harness_runs_end_to_end_on_a_tiny_model_on_the_cpu(tmp_path) -> None:  # noqa: ANN001
    """A smoke run of benchmarks/e2e.py (the device run is the real one): every variant asked
    for is timed, checked against eager, broken down by category, and written out."""
    import json

    from benchmarks.e2e import main

    main(["--model", "qwen-image-tiny", "--device", "cpu", "--iters", "2",
          "--variants", "eager-bf16,kopt-bf16", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = data["variants"]
    kopt_rows = ("kopt-bf16, cuda_graphs=False", "kopt-bf16, default arguments")
    assert set(rows) == {"eager-bf16", *kopt_rows}  # one optimization, two ways to run it
    assert rows[kopt_rows[1]]["runtime"][0].startswith("execution plan:")
    assert rows[kopt_rows[0]]["rel_err_inputs"] == rows[kopt_rows[1]]["rel_err_inputs"]
    rows["kopt-bf16"] = rows.pop(kopt_rows[1])
    del rows[kopt_rows[0]]
    assert rows["eager-bf16"]["rel_err_vs_eager"] == 0.0
    assert rows["kopt-bf16"]["rel_err_vs_eager"] < 0.05 and rows["kopt-bf16"]["verified"]
    # the error on the workload's input and on two more drawn like it, each against eager's
    # output for that input (a pairing mix-up would give eager itself an error)
    assert data["meta"]["error_inputs"] == 3
    assert rows["eager-bf16"]["rel_err_inputs"] == [0.0, 0.0, 0.0]
    errors = rows["kopt-bf16"]["rel_err_inputs"]
    assert len(errors) == 3 and errors[0] == rows["kopt-bf16"]["rel_err_vs_eager"]
    assert all(e < 0.05 for e in errors)
    assert rows["kopt-bf16"]["passes"]["hoist"] == 1
    work = data["meta"]["work"]  # the forward's work; its floor is measured on CUDA only
    assert work["gemm_tflop"] > 0 and work["attention_tflop"] > 0 and work["attention_calls"]
    assert "floor" not in data["meta"]
    for r in rows.values():  # two timings of 2 noisy CPU calls: order not asserted (below)
        assert r["forward_ms"] > 0 and r["step_ms"] > 0
        top = r["breakdown"].pop("top")
        assert sum(r["breakdown"].values()) > 0
        # the longest kernels, longest first, each named with its category
        assert top and all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))
        assert all(name.split(": ")[0] in r["breakdown"] for name, _, _ in top)
    table = (tmp_path / "e2e.md").read_text()
    assert "| kopt-bf16, default arguments |" in table
    assert "| kopt-bf16, cuda_graphs=False |" in table
    assert "Kernel time per forward by category" in table
    assert "Longest kernels of kopt-bf16, default arguments" in table


def test_redrawn_inputs_keep_shapes_scale_and_the_timestep() -> None:
    from benchmarks.e2e import redrawn_inputs

    w = build("qwen-image-tiny", dtype=torch.bfloat16)
    kw = redrawn_inputs(w, seed=1)
    assert kw.keys() == w.kwargs.keys()
    for k, v in w.kwargs.items():
        if not isinstance(v, torch.Tensor):
            assert kw[k] == v
        elif v.is_floating_point() and v.dim() >= 2:  # latents, text: new values, same scale
            assert kw[k].shape == v.shape and kw[k].dtype == v.dtype and not torch.equal(kw[k], v)
            assert abs(kw[k].float().std() / v.float().std() - 1) < 0.2
        else:  # the timestep, ids, masks: as they were
            assert torch.equal(kw[k], v)
    assert torch.equal(redrawn_inputs(w, seed=1)["hidden_states"], kw["hidden_states"])


def test_error_cell_gives_the_mean_and_range_over_inputs() -> None:
    from benchmarks.e2e import error_cell

    assert error_cell({"rel_err_vs_eager": 0.0953}) == "9.53e-02"
    cell = error_cell({"rel_err_vs_eager": 0.0953, "rel_err_inputs": [0.0953, 0.0941, 0.0962]})
    assert cell == "9.53e-02; mean 9.520e-02 over 3 inputs (9.410e-02-9.620e-02)"


def test_table_ratio_is_best_against_the_baselines_best(tmp_path) -> None:  # noqa: ANN001
    """W1 on the H200 (RESULTS.md, 2026-11-30): naive 110.12 ms eager, 106.52 with a CUDA
    graph; kopt 98.85 with a graph. The ratio is graph against graph (0.928x), not against the
    baseline's eager time."""
    def row(eager: float, graph: float) -> dict:
        return {"forward_ms": eager, "step_ms": 2 * eager, "graph_forward_ms": graph,
                "graph_step_ms": 2 * graph, "rel_err_vs_eager": 0.1, "breakdown": {}}

    rows = {"kopt-fp8": row(142.12, 98.85), "naive-fp8-inductor": row(110.12, 106.52)}
    meta = {"description": "W1", "device": "test", "torch": "x", "date": "today"}
    write_outputs(rows, meta, tmp_path)
    table = (tmp_path / "e2e.md").read_text()
    assert "| kopt-fp8 | 142.12 |" in table and "| 0.928x |" in table
    assert "| naive-fp8-inductor | 110.12 |" in table and "| 1.000x |" in table
    rows["kopt-fp8"] |= {"graph_sm_mhz": 1440.0, "graph_power_w": 645.2}  # at the power cap
    write_outputs(rows, meta, tmp_path)
    assert "| 98.85 (1440 MHz, 645 W) | 197.70 |" in (tmp_path / "e2e.md").read_text()


def test_the_fp8_lesson_gives_error_and_time_as_ratios_of_naive_fp8(tmp_path) -> None:  # noqa: ANN001
    from benchmarks.e2e import fp8_lesson
    from kopt.kb.store import KnowledgeBase

    meta = {"fp8_layout": "rowwise", "fp8_accumulate": "fast", "fp8_activation_math": "fast",
            "model": "qwen-image", "date": "2026-12-04"}
    naive = {"rel_err_vs_eager": 0.1, "step_ms": 200.0, "graph_step_ms": 100.0,
             "calls_per_step": 1}
    fast = {"rel_err_vs_eager": 0.101, "step_ms": 150.0, "graph_step_ms": 80.0,
            "calls_per_step": 1}
    assert fp8_lesson({"naive-fp8-inductor": naive}, meta) is None
    text = fp8_lesson({"naive-fp8-inductor": naive, "kopt-fp8, default arguments": fast}, meta)
    assert "accumulate='fast'" in text and "1.010x naive FP8's" in text and "0.800x" in text
    with KnowledgeBase.open(tmp_path / "kb.sqlite") as kb:
        kb.add_lesson(text, ["numerics"], rewrite="fp8")
        assert kb.lessons()[0].text == text
