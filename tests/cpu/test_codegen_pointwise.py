"""codegen.pointwise: the FX -> IR translator on captured modules, the IR's JSON contract (round
trip, rejection of anything but known ops), and the generated Triton code in the interpreter
against the aten reference: bitwise for exact ops, within one ulp for transcendentals, with
every intermediate bf16 rounding kept."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kopt.capture import capture_module
from kopt.codegen.pointwise import (
    OPS,
    Instr,
    Operand,
    PointwiseError,
    PointwiseProgram,
    classify,
    from_fx,
    try_from_fx,
)
from kopt.codegen.rowwise import RowwiseSpec, rowwise_triton

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
B, T, C = 2, 3, 40  # C: not a power of two


class Epilogue(nn.Module):
    """Every op family the translator supports, on every operand kind."""

    def forward(self, x, g, s, r, t, k):  # noqa: ANN001, ANN201
        h = F.silu(x) * g
        h = F.gelu(h, approximate="tanh") + F.gelu(x)
        h = h.float() * torch.rsqrt(t + 1e-6)
        h = torch.sigmoid(h).to(torch.bfloat16)
        h = (1 + s) * h - r / 3
        h = torch.tanh(h) + torch.exp(-h)
        h = h.clamp(-2, 2) + torch.maximum(h, r) + x.type_as(h) + 2.0 * h + h.pow(2).sqrt()
        h = h * k
        return (h.float() / 7).to(torch.float16), 1 - h.sub(r, alpha=2)


def _inputs() -> tuple[torch.Tensor, ...]:
    bf = torch.bfloat16
    return (torch.randn(B, T, C, dtype=bf), torch.randn(B, T, C, dtype=bf),
            torch.randn(B, 1, C, dtype=bf), torch.randn(C, dtype=bf),
            torch.rand(B, T, 1) + 0.1, torch.tensor(1.5))


def _program(module: nn.Module, inputs: tuple) -> tuple[PointwiseProgram, list]:
    gm = capture_module(module, inputs).gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return from_fx(nodes, placeholders), nodes


def test_translates_a_captured_subgraph_and_evaluates_bitwise_like_eager() -> None:
    inputs = _inputs()
    prog, nodes = _program(Epilogue(), inputs)
    kinds = {o.name: o.kind for o in prog.operands}
    assert kinds == {"x": "tile", "g": "tile", "s": "batch", "r": "col", "t": "row", "k": "scalar"}
    ops = {i.op for i in prog.instrs}
    assert {"silu", "gelu_tanh", "gelu_erf", "rsqrt", "sigmoid", "tanh", "exp", "cast", "div",
            "clamp_min", "clamp_max", "maximum", "axpy", "sub", "square", "sqrt"} <= ops
    assert prog.output_dtypes == [torch.float16, torch.bfloat16]
    assert prog.tier == "tolerance"
    want = Epilogue()(*inputs)
    got = prog.evaluate(dict(zip("xgsrtk", inputs, strict=True)))
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_json_round_trip_is_lossless() -> None:
    prog, _ = _program(Epilogue(), _inputs())
    text = prog.to_json()
    again = PointwiseProgram.from_json(text)
    assert again == prog and again.to_json() == text
    inputs = _inputs()
    a = prog.evaluate(dict(zip("xgsrtk", inputs, strict=True)))
    b = again.evaluate(dict(zip("xgsrtk", inputs, strict=True)))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _doc(**change) -> str:
    base = {"version": 1, "operands": [["x", "tile", "bfloat16"]],
            "instrs": [["silu", ["x"], "bfloat16"], ["mul", ["%0", 2.0], "bfloat16"]],
            "outputs": ["%1"]}
    base.update(change)
    return json.dumps(base)


@pytest.mark.parametrize("text, reason", [
    (_doc(instrs=[["__import__('os').system('true')", ["x"], "bfloat16"]]), "unknown op"),
    (_doc(instrs=[["silu", ["%1"], "bfloat16"], ["neg", ["%0"], "bfloat16"]]), "not computed"),
    (_doc(instrs=[["silu", ["y"], "bfloat16"]], outputs=["%0"]), "unknown value"),
    (_doc(instrs=[["mul", ["x", "NaN"], "bfloat16"]], outputs=["%0"]), "unknown value"),
    (_doc(instrs=[["mul", ["x", float("inf")], "bfloat16"]], outputs=["%0"]), "non-finite"),
    (_doc(instrs=[["silu", ["x", "x"], "bfloat16"]], outputs=["%0"]), "takes 1 arguments"),
    (_doc(instrs=[["silu", ["x"], "float64"]], outputs=["%0"]), "dtype"),
    (_doc(instrs=[["silu", [1.0], "bfloat16"]], outputs=["%0"]), "must be a value"),
    (_doc(operands=[["x; import os", "tile", "bfloat16"]]), "not an identifier"),
    (_doc(operands=[["x", "diagonal", "bfloat16"]]), "kind"),
    (_doc(outputs=["%7"]), "not a value"),
    (_doc(version=2), "version"),
    (_doc(extra=1), "keys"),
    ("{not json", "not valid JSON"),
])
def test_json_parsing_rejects_anything_but_the_ir(text: str, reason: str) -> None:
    with pytest.raises(PointwiseError, match=reason):
        PointwiseProgram.from_json(text)


def test_classify_broadcast_kinds() -> None:
    main = (2, 5, 8)
    assert classify((2, 5, 8), main) == "tile"
    assert classify((8,), main) == "col"
    assert classify((1, 1, 8), main) == "col"
    assert classify((2, 5, 1), main) == "row"
    assert classify((2, 1, 8), main) == "batch"
    assert classify((), main) == "scalar"
    assert classify((1, 1, 1, 1), main) == "scalar"
    assert classify((5, 8), main) is None  # per token, shared across the batch: not a kind
    assert classify((2, 5, 4), main) is None
    assert classify((2, 8), (10, 8)) is None


class _Where(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.where(x > 0, x, x * 2)


class _Reduce(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        return x - x.sum(-1, keepdim=True)


class _Pow3(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        return x.pow(3)


class _PerToken(nn.Module):
    def forward(self, x, p):  # noqa: ANN001, ANN201
        return x * p


@pytest.mark.parametrize("module, inputs, reason", [
    (_Where(), (torch.randn(2, 8),), "bf16/fp16/fp32 tensor"),
    (_Reduce(), (torch.randn(2, 8),), "aten.sum"),
    (_Pow3(), (torch.randn(2, 8),), "exponent 3"),
    (_PerToken(), (torch.randn(2, 5, 8), torch.randn(5, 8)), "does not broadcast"),
    (_PerToken(), (torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64)), "float64"),
])
def test_translator_rejects_with_a_reason(module: nn.Module, inputs: tuple, reason: str) -> None:
    gm = capture_module(module, inputs).gm
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    got = try_from_fx(nodes, phs)
    assert isinstance(got, str) and reason in got
    with pytest.raises(PointwiseError, match=reason.replace(".", r"\.")):
        from_fx(nodes, phs)


def _single(op: str, dtype: str, *extra: object) -> PointwiseProgram:
    return PointwiseProgram((Operand("x", "tile", dtype),),
                            (Instr(op, ("x", *extra), dtype),), ("%0",))


def _run_kernel(prog: PointwiseProgram, values: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = prog.operand("x").dtype
    spec = RowwiseSpec(dtype, epilogue=prog)
    return rowwise_triton(spec, [values[n.removeprefix("ep_")] for n in spec.input_names()])["out"]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place between two bf16/fp16 tensors, per element."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> monotone integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


# sqrt is exact against CUDA's IEEE sqrtf (tests/gpu); PyTorch's vectorised CPU sqrt is not
# correctly rounded, so on the CPU it is checked to one ulp with the transcendentals.
EXACT_OPS = ["neg", "abs", "relu", "square", "reciprocal"]
TOLERANCE_OPS = ["exp", "rsqrt", "sigmoid", "tanh", "silu", "gelu_erf", "gelu_tanh"]
CPU_ONE_ULP = [*TOLERANCE_OPS, "sqrt"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_exact_unary_ops_are_bitwise_in_the_kernel(dtype: str) -> None:
    x = torch.randn(5, 37).to(getattr(torch, dtype))
    for op in EXACT_OPS:
        prog = _single(op, dtype)
        assert prog.tier == "exact"
        arg = x.abs() + 0.5 if op == "reciprocal" else x
        got, want = _run_kernel(prog, {"x": arg}), prog.evaluate({"x": arg})[0]
        assert torch.equal(got, want), op


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transcendentals_within_one_ulp(dtype: str) -> None:
    # wide range, tiny values (tanh's series branch) and both signs
    x = torch.cat([torch.linspace(-9, 9, 301), torch.linspace(-0.12, 0.12, 97)]).reshape(
        2, -1).to(getattr(torch, dtype))
    for op in CPU_ONE_ULP:
        prog = _single(op, dtype)
        assert prog.tier == ("exact" if op == "sqrt" else "tolerance")
        arg = x.abs() + 1e-2 if op in ("rsqrt", "sqrt") else x
        got, want = _run_kernel(prog, {"x": arg}), prog.evaluate({"x": arg})[0]
        if dtype == "bfloat16":
            close = _ulps(got, want) <= 1
        else:
            close = (got - want).abs() <= 4e-7 * want.abs()
        if op.startswith("gelu"):
            # 1 + erf(x) (1 + tanh(.)) cancels for negative x in any implementation: there the
            # bound is absolute, relative to x
            close |= (got.float() - want.float()).abs() <= 2.0**-21 * arg.float().abs()
        assert close.all(), op


def test_binary_ops_constants_and_casts_are_bitwise() -> None:
    bf, f32 = "bfloat16", "float32"
    prog = PointwiseProgram(
        (Operand("x", "tile", bf), Operand("y", "tile", bf), Operand("c", "col", f32),
         Operand("w", "row", bf), Operand("m", "batch", bf), Operand("k", "scalar", f32)),
        (Instr("mul", ("x", "y"), bf), Instr("div", ("%0", 3.0), bf),
         Instr("div", ("%1", "m"), bf), Instr("sub", ("%2", "w"), bf),
         Instr("add", ("%3", "c"), f32), Instr("mul", ("%4", "k"), f32),
         Instr("sub", (1.0, "%5"), f32), Instr("maximum", ("%6", "x"), f32),
         Instr("clamp_max", ("%7", 2.5), f32), Instr("cast", ("%8",), bf),
         Instr("minimum", ("%9", "y"), bf), Instr("clamp_min", ("%10", -1.75), bf)),
        ("%11",))
    assert prog.tier == "exact"
    rows = B * T
    v = {"x": torch.randn(rows, C, dtype=torch.bfloat16),
         "y": torch.randn(rows, C, dtype=torch.bfloat16), "c": torch.randn(C),
         "w": torch.randn(rows, dtype=torch.bfloat16), "m": torch.randn(B, C).bfloat16() + 3,
         "k": torch.tensor([0.7])}
    got = _run_kernel(prog, v)
    ref = prog.evaluate({"x": v["x"].reshape(B, T, C), "y": v["y"].reshape(B, T, C),
                         "c": v["c"], "w": v["w"].reshape(B, T, 1),
                         "m": v["m"].reshape(B, 1, C), "k": v["k"].reshape(())})[0]
    assert torch.equal(got, ref.reshape(rows, C))


def test_bf16_rounding_between_ops_is_kept() -> None:
    # (x * y) rounded to bf16, then * z: the same product in fp32 only rounds once
    bf = "bfloat16"
    prog = PointwiseProgram(
        (Operand("x", "tile", bf), Operand("y", "tile", bf), Operand("z", "tile", bf)),
        (Instr("mul", ("x", "y"), bf), Instr("mul", ("%0", "z"), bf)), ("%1",))
    lines, outs = prog.triton_source({"x": "a", "y": "b", "z": "c"})
    assert lines == ["pw0 = pw_round((a) * (b), 1, CUDA)", "pw1 = pw_round(pw0 * (c), 1, CUDA)"]
    assert outs == ["pw1"]
    v = {n: torch.randn(64, 48, dtype=torch.bfloat16) for n in "xyz"}
    got = _run_kernel(prog, v)
    assert torch.equal(got, prog.evaluate(v)[0])
    once = (v["x"].float() * v["y"].float() * v["z"].float()).bfloat16()
    assert not torch.equal(got, once)  # so the test above would catch a dropped rounding


def test_division_by_a_python_scalar_follows_the_device() -> None:
    prog = _single("div", "float32", 3.0)
    lines, _ = prog.triton_source({"x": "v"})
    # CUDA multiplies by float(1 / 3.0); the CPU divides
    assert lines == ["pw0 = pw_div_const((v), 3.0, 0.3333333432674408, CUDA)"]


def test_evaluate_checks_operand_dtypes() -> None:
    prog = _single("silu", "bfloat16")
    with pytest.raises(PointwiseError, match="expects bfloat16"):
        prog.evaluate({"x": torch.randn(2, 3)})
    with pytest.raises(PointwiseError, match="no value"):
        prog.evaluate({})


def test_every_op_has_a_reference_and_emits_code() -> None:
    for op, spec in OPS.items():
        args: list[object] = ["x"] * spec.arity
        for j in spec.const_args:
            args[j] = 2.0
        prog = PointwiseProgram((Operand("x", "tile", "float32"),),
                                (Instr(op, tuple(args), "float32"),), ("%0",))
        lines, _ = prog.triton_source({"x": "v"})
        assert len(lines) == 1 and "pw0 =" in lines[0]
        out = prog.evaluate({"x": torch.rand(3, 4) + 0.5})[0]
        assert out.shape == (3, 4)
