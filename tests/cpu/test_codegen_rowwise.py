"""codegen.rowwise: the spec's contract (JSON, validation, names), the generated kernel in the
interpreter against the unfused eager reference -- bitwise where the spec's tier is exact
(prologue, modulation, exact epilogues), within the tolerance tier where a norm reduces, and
quantized outputs bitwise the reference quantizers of the kernel's own result -- on small
awkward shapes; the custom op's fake and real implementations; an epilogue translated from a
captured module."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kopt.capture import capture_module
from kopt.codegen import rowwise as rw
from kopt.codegen.kernels.nvfp4 import quant_nvfp4_reference
from kopt.codegen.kernels.quant_fp8 import (
    quant_fp8_group_reference,
    quant_fp8_rowwise_reference,
)
from kopt.codegen.pointwise import Instr, Operand, PointwiseProgram, from_fx
from kopt.codegen.rowwise import (
    Launch,
    RowwiseError,
    RowwiseSpec,
    kernel_for,
    kernel_source,
    prepare_launch,
    rowwise,
    rowwise_op,
    rowwise_reference,
    rowwise_triton,
)
from kopt.verify import RTOL_FLOOR, relative_error

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
BF = torch.bfloat16
ALL_OUTPUTS = ("out", "residual", "fp8_row", "fp8_group", "nvfp4")


def _inputs(spec: RowwiseSpec, b: int, t: int, c: int, **extra: torch.Tensor) -> dict:
    dt = getattr(torch, spec.dtype)
    make = {
        "x": lambda: torch.randn(b, t, c, dtype=dt),
        "y": lambda: torch.randn(b, t, c, dtype=dt),
        "residual_bias": lambda: torch.randn(c, dtype=dt),
        "gate": lambda: torch.randn(b, c, dtype=dt),
        "weight": lambda: (1 + 0.1 * torch.randn(c)).to(dt),
        "bias": lambda: (0.1 * torch.randn(c)).to(dt),
        "scale": lambda: (0.3 * torch.randn(b, 1, c)).to(dt),
        "shift": lambda: torch.randn(b, c, dtype=dt),
        "global_scale": lambda: torch.tensor([0.01]),
    }
    return {n: extra[n] if n in extra else make[n]() for n in spec.input_names()}


def _run(spec: RowwiseSpec, ins: dict) -> tuple[dict, dict]:
    got = rowwise_triton(spec, [ins[n] for n in spec.input_names()])
    ref = rowwise_reference(spec, ins)
    assert list(got) == spec.output_names() and list(ref) == spec.output_names()
    for n in got:
        assert got[n].shape == ref[n].shape and got[n].dtype == ref[n].dtype, n
        assert got[n].stride() == ref[n].stride(), n
    return got, ref


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _quantized_from_out(spec: RowwiseSpec, ins: dict, got: dict) -> None:
    """Quantized outputs are exactly the reference quantizers applied to the kernel's result."""
    r = got["out"]
    if "fp8_row" in got:
        q, s = quant_fp8_rowwise_reference(r)
        assert _bitwise(got["fp8_row"], q) and torch.equal(got["fp8_row_scale"], s)
    if "fp8_group" in got:
        q, s = quant_fp8_group_reference(r)
        assert _bitwise(got["fp8_group"], q) and torch.equal(got["fp8_group_scale"], s)
    if "nvfp4" in got:
        q, s = quant_nvfp4_reference(r, ins["global_scale"])
        assert torch.equal(got["nvfp4"], q) and _bitwise(got["nvfp4_scale"], s)


def _fp64(spec: RowwiseSpec, ins: dict) -> torch.Tensor:
    """The spec's math in fp64, no intermediate rounding (for the tolerance tier)."""
    d = {k: v.double() for k, v in ins.items()}
    b, c = d["x"].shape[0], d["x"].shape[-1]
    h = d["x"]
    if spec.residual:
        t = d["y"] + d.get("residual_bias", 0)
        h = h + (d["gate"].reshape(b, 1, c) * t if spec.gate else t)
    n = h
    if spec.norm == "layer":
        n = F.layer_norm(h, [c], eps=spec.eps)
    elif spec.norm == "rms":
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.eps)
    n = n * d.get("weight", 1) + d.get("bias", 0)
    if spec.modulation:
        n = (1 + d["scale"].reshape(b, 1, c)) * n + d["shift"].reshape(b, 1, c)
    return n


def _within_tier(got: torch.Tensor, eager: torch.Tensor, exact64: torch.Tensor) -> None:
    bound = 2 * max(relative_error(eager, exact64), RTOL_FLOOR[eager.dtype])
    assert relative_error(got, exact64) <= bound


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


# -- the spec --------------------------------------------------------------------------------------

def _epilogue(dtype: str = "bfloat16") -> PointwiseProgram:
    return PointwiseProgram(
        (Operand("x", "tile", dtype), Operand("up", "tile", dtype)),
        (Instr("silu", ("x",), dtype), Instr("mul", ("%0", "up"), dtype)), ("%1",))


def test_spec_json_round_trip_and_names() -> None:
    spec = RowwiseSpec("bfloat16", norm="rms", eps=1e-5, weight=True, affine_after_round=True,
                       residual=True, residual_bias=True, gate=True, modulation=True,
                       epilogue=_epilogue(), outputs=("nvfp4", "out", "residual", "fp8_row"))
    assert spec.outputs == ("out", "residual", "fp8_row", "nvfp4")  # canonical order
    again = RowwiseSpec.from_json(spec.to_json())
    assert again == spec and again.to_json() == spec.to_json()
    assert spec.input_names() == ["x", "y", "residual_bias", "gate", "weight", "scale", "shift",
                                  "ep_up", "global_scale"]
    assert spec.output_names() == ["out", "residual", "fp8_row", "fp8_row_scale", "nvfp4",
                                   "nvfp4_scale"]
    assert spec.tier == "tolerance"
    assert RowwiseSpec("float16", residual=True, modulation=True).tier == "exact"


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dtype="float64"), "dtype"),
    (dict(dtype="bfloat16", norm="group"), "norm"),
    (dict(dtype="bfloat16", weight=True), "need a norm"),
    (dict(dtype="bfloat16", gate=True), "need residual"),
    (dict(dtype="bfloat16", outputs=("residual",)), "needs residual"),
    (dict(dtype="bfloat16", outputs=("fp4",)), "not one of"),
    (dict(dtype="bfloat16", outputs=()), "non-empty"),
    (dict(dtype="bfloat16", outputs=("out", "out")), "twice"),
    (dict(dtype="bfloat16", norm="rms", eps=float("nan")), "eps"),
    (dict(dtype="bfloat16", residual=1), "bool"),
    (dict(dtype="float16", epilogue=_epilogue()), "must be a float16 tile"),
    (dict(dtype="bfloat16", epilogue=PointwiseProgram(
        (Operand("h", "tile", "bfloat16"),), (Instr("neg", ("h",), "bfloat16"),), ("%0",))),
     "no operand 'x'"),
])
def test_spec_validation(kwargs: dict, reason: str) -> None:
    with pytest.raises(RowwiseError, match=reason):
        RowwiseSpec(**kwargs)


def _spec_doc(**change) -> str:
    doc = json.loads(RowwiseSpec("bfloat16", norm="layer", epilogue=_epilogue()).to_json())
    doc.update(change)
    return json.dumps(doc)


@pytest.mark.parametrize("text, reason", [
    ("[1, 2", "not valid JSON"),
    ("[]", "must be an object"),
    (_spec_doc(unknown=1), "unknown"),
    (_spec_doc(version=7), "version"),
    (_spec_doc(weight="yes"), "bool"),
    (_spec_doc(eps="1e-6"), "eps"),
    (_spec_doc(outputs="out"), "list"),
    (_spec_doc(epilogue={"version": 1, "operands": [["x", "tile", "bfloat16"]],
                         "instrs": [["eval", ["x"], "bfloat16"]], "outputs": ["%0"]}),
     "unknown op 'eval'"),
])
def test_spec_json_rejects_bad_input(text: str, reason: str) -> None:
    with pytest.raises(RowwiseError, match=reason):
        RowwiseSpec.from_json(text)


def test_intermediates_in_the_spec() -> None:
    eager = RowwiseSpec("bfloat16", residual=True, modulation=True, outputs=("out", "fp8_row"))
    fp32 = RowwiseSpec("bfloat16", residual=True, modulation=True, outputs=("out", "fp8_row"),
                       intermediates="fp32")
    assert eager.tier == "exact" and fp32.tier == "tolerance"
    assert RowwiseSpec.from_json(fp32.to_json()) == fp32 and fp32.to_json() != eager.to_json()
    # a spec written before the field existed reads as the eager order
    old = {k: v for k, v in json.loads(eager.to_json()).items() if k != "intermediates"}
    assert RowwiseSpec.from_json(json.dumps(old)) == eager
    with pytest.raises(RowwiseError, match="intermediates 'fp16'"):
        RowwiseSpec("bfloat16", intermediates="fp16")
    # the epilogue's own rounding is compiled in: one kernel per order
    ep = RowwiseSpec("bfloat16", epilogue=_epilogue())
    assert kernel_for(ep) is not kernel_for(RowwiseSpec("bfloat16", epilogue=_epilogue(),
                                                        intermediates="fp32"))
    # eager order: every op of the epilogue rounded; fp32 order: none (it has no cast)
    names = {"x": "n", "up": "ev_up"}
    rounded, _ = _epilogue().triton_source(names)
    unrounded, _ = _epilogue().triton_source(names, round_steps=False)
    assert len(rounded) == 2 and all("pw_round(" in line for line in rounded)
    assert not any("pw_round(" in line for line in unrounded)
    assert ("pw_round(" in kernel_source(_epilogue())) and (
        kernel_source(_epilogue()) != kernel_source(_epilogue(), round_steps=False))


# -- the kernel against the unfused ops ----------------------------------------------------------

@pytest.mark.parametrize("b, t, c", [(1, 1, 16), (2, 65, 80), (1, 3, 208), (2, 3, 384)])
def test_prologue_and_modulation_are_bitwise(b: int, t: int, c: int) -> None:
    # 2 x 65 = 130 rows: the NVFP4 scales span two 128-row tiles; 80 and 208 are not powers of 2;
    # 384 runs as two tiles (256 + 128 columns)
    spec = RowwiseSpec("bfloat16", residual=True, residual_bias=True, gate=True,
                       modulation=True, outputs=ALL_OUTPUTS)
    assert spec.tier == "exact"
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    for n in spec.output_names():
        assert _bitwise(got[n], ref[n]), n
    if b * t * c >= 1000:  # the check can fail: one rounding less (1 + scale kept in fp32)
        h = ref["residual"].float()
        fewer = (((1 + ins["scale"].float()) * h).bfloat16().float()
                 + ins["shift"].float().reshape(b, 1, c)).bfloat16()
        assert not torch.equal(fewer, ref["out"])


@pytest.mark.parametrize("b, t, c", [(1, 1, 200), (2, 3, 200), (1, 2, 4000), (1, 2, 3072)])
def test_layernorm_adaln_fp8_within_tier(b: int, t: int, c: int) -> None:  # 3072: two tiles
    # W1/W2's pre-attention norm: LayerNorm without affine, adaLN modulation, FP8 for the GEMM
    spec = RowwiseSpec("bfloat16", norm="layer", eps=1e-6, modulation=True,
                       outputs=("out", "fp8_row", "fp8_group"))
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    _within_tier(got["out"], ref["out"], _fp64(spec, ins))
    _quantized_from_out(spec, ins, got)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("after_round", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_norm_with_affine_within_one_ulp(norm: str, after_round: bool, dtype: str) -> None:
    spec = RowwiseSpec(dtype, norm=norm, eps=1e-5, weight=True, bias=True,
                       affine_after_round=after_round)
    ins = _inputs(spec, 1, 3, 1000)
    got, ref = _run(spec, ins)
    if dtype == "float32":
        assert torch.allclose(got["out"], ref["out"], rtol=1e-5, atol=1e-5)
    else:
        assert int(_ulps(got["out"], ref["out"]).max()) <= 1
    _within_tier(got["out"], ref["out"], _fp64(spec, ins))


def test_fp32_weight_with_bf16_rows() -> None:
    spec = RowwiseSpec("bfloat16", norm="rms", weight=True)
    ins = _inputs(spec, 2, 2, 64, weight=1 + 0.1 * torch.randn(64))
    got, ref = _run(spec, ins)
    assert int(_ulps(got["out"], ref["out"]).max()) <= 1
    with pytest.raises(RowwiseError, match="expected bfloat16"):
        rowwise_reference(RowwiseSpec("bfloat16", norm="rms", weight=True,
                                      affine_after_round=True), ins)


def test_gated_residual_layernorm_modulation_all_outputs() -> None:
    # FLUX.2 / Qwen-Image between attention and MLP: h = x + gate * attn; norm2(h) modulated
    spec = RowwiseSpec("bfloat16", norm="layer", eps=1e-6, residual=True, gate=True,
                       modulation=True, outputs=ALL_OUTPUTS)
    ins = _inputs(spec, 2, 65, 96)
    got, ref = _run(spec, ins)
    assert _bitwise(got["residual"], ref["residual"])
    _within_tier(got["out"], ref["out"], _fp64(spec, ins))
    _quantized_from_out(spec, ins, got)


def test_exact_epilogue_with_every_operand_kind_is_bitwise() -> None:
    bf, f32 = "bfloat16", "float32"
    ep = PointwiseProgram(
        (Operand("x", "tile", bf), Operand("u", "tile", bf), Operand("r", "row", f32),
         Operand("c", "col", bf), Operand("m", "batch", bf), Operand("k", "scalar", f32)),
        (Instr("mul", ("x", "u"), bf), Instr("add", ("%0", "c"), bf),
         Instr("div", ("%1", "m"), bf), Instr("mul", ("%2", "r"), f32),
         Instr("sub", ("%3", "k"), f32), Instr("div", ("%4", 7.0), f32)), ("%5",))
    spec = RowwiseSpec(bf, residual=True, epilogue=ep, outputs=("out", "fp8_row", "fp8_group"))
    assert spec.tier == "exact" and spec.result_dtype == torch.float32
    b, t, c = 2, 3, 136
    ins = _inputs(spec, b, t, c, ep_u=torch.randn(b, t, c, dtype=BF),
                  ep_r=torch.rand(b, t, 1) + 0.5, ep_c=torch.randn(c, dtype=BF),
                  ep_m=(torch.rand(b, 1, c) + 0.5).bfloat16(), ep_k=torch.tensor(0.25))
    got, ref = _run(spec, ins)
    for n in spec.output_names():
        assert _bitwise(got[n], ref[n]), n


def test_swiglu_like_epilogue_with_fp8_within_two_ulps() -> None:
    spec = RowwiseSpec("bfloat16", epilogue=_epilogue(), outputs=("out", "fp8_row"))
    ins = _inputs(spec, 1, 5, 300, ep_up=torch.randn(1, 5, 300, dtype=BF))
    got, ref = _run(spec, ins)
    assert int(_ulps(got["out"], ref["out"]).max()) <= 2
    _quantized_from_out(spec, ins, got)


def test_strided_rows_and_batch_vectors() -> None:
    # x and y as the halves of a wider buffer (row stride 2C); gate as a [B, 1, C] view
    c = 48
    wide = torch.randn(4, 2 * c, dtype=BF)
    spec = RowwiseSpec("bfloat16", norm="rms", residual=True, gate=True, outputs=ALL_OUTPUTS)
    gate = torch.randn(2, 1, 3 * c, dtype=BF)[..., c: 2 * c]
    ins = _inputs(spec, 2, 2, c, x=wide[:, :c].reshape(2, 2, c),
                  y=wide[:, c:].reshape(2, 2, c), gate=gate)
    assert not ins["x"].is_contiguous()
    got, ref = _run(spec, ins)
    assert _bitwise(got["residual"], ref["residual"])
    assert int(_ulps(got["out"], ref["out"]).max()) <= 1
    _quantized_from_out(spec, ins, got)


# -- fp32 intermediates -----------------------------------------------------------------------

def _fp8_steps_apart(got: dict, ref: dict) -> torch.Tensor:
    """How many e4m3 grid steps apart two quantized outputs are, per value (scales included)."""
    a = got["fp8_row"].float() * got["fp8_row_scale"]
    b = ref["fp8_row"].float() * ref["fp8_row_scale"]
    # the e4m3 step at a value: 2^(exponent - 3), 2^-9 among subnormals; of the scaled value
    v = torch.maximum(got["fp8_row"].float().abs(), ref["fp8_row"].float().abs())
    step = torch.exp2(torch.floor(torch.log2(v.clamp(min=2.0**-6))) - 3) * ref["fp8_row_scale"]
    return ((a - b).abs() / step).round()


@pytest.mark.parametrize("b, t, c", [(1, 1, 16), (2, 65, 80), (1, 3, 208)])
def test_fp32_intermediates_kernel_is_its_reference(b: int, t: int, c: int) -> None:
    """Gated residual + LayerNorm + adaLN + every output, no rounding between steps: the
    residual (fp32 arithmetic, one rounding) is bitwise, the norm's output within one ulp, and
    the FP8 values quantize the kernel's unrounded result: at most one e4m3 step from the
    reference's, on few values."""
    spec = RowwiseSpec("bfloat16", norm="layer", eps=1e-6, residual=True, residual_bias=True,
                       gate=True, modulation=True, outputs=ALL_OUTPUTS, intermediates="fp32")
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    assert _bitwise(got["residual"], ref["residual"])
    assert int(_ulps(got["out"], ref["out"]).max()) <= 1
    apart = _fp8_steps_apart(got, ref)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 0.05
    assert torch.allclose(got["fp8_row_scale"], ref["fp8_row_scale"], rtol=2**-20, atol=0)


def test_fp32_intermediates_are_closer_to_fp64_than_the_eager_order() -> None:
    """The point of the order: one rounding instead of five between the residual update and the
    modulated output. Fails if the kernel or the reference rounded a step anyway."""
    kw = dict(norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
              outputs=("out", "fp8_row"))
    eager, fp32 = RowwiseSpec("bfloat16", **kw), RowwiseSpec("bfloat16", **kw,
                                                             intermediates="fp32")
    ins = _inputs(eager, 2, 8, 256)
    exact64 = _fp64(eager, ins)
    for run in (rowwise_triton, rowwise_reference):
        e_eager = relative_error(run(eager, [ins[n] for n in eager.input_names()])["out"], exact64)
        e_fp32 = relative_error(run(fp32, [ins[n] for n in fp32.input_names()])["out"], exact64)
        assert e_fp32 < 0.8 * e_eager, (run.__name__, e_fp32, e_eager)


def test_fp32_intermediates_keep_the_epilogues_explicit_casts() -> None:
    """An epilogue computes in fp32 between ops, but a cast the model wrote still rounds:
    x * 3 -> bf16 -> * 5 differs from x * 15 on some values."""
    bf, f32 = "bfloat16", "float32"
    ep = PointwiseProgram((Operand("x", "tile", bf),),
                          (Instr("cast", ("x",), f32), Instr("mul", ("%0", 3.0), f32),
                           Instr("cast", ("%1",), bf), Instr("mul", ("%2", 5.0), bf)), ("%3",))
    spec = RowwiseSpec(bf, epilogue=ep, intermediates="fp32")
    ins = _inputs(spec, 1, 4, 200)
    got, ref = _run(spec, ins)
    assert _bitwise(got["out"], ref["out"])
    x = ins["x"].float()
    assert torch.equal(ref["out"], ((x * 3).bfloat16().float() * 5).bfloat16())
    assert not torch.equal(ref["out"], (x * 15).bfloat16())


# -- the custom op ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    RowwiseSpec("bfloat16"),  # out is x itself in the reference: must not alias the input
    RowwiseSpec("bfloat16", norm="layer", residual=True, gate=True, modulation=True,
                outputs=ALL_OUTPUTS),
    RowwiseSpec("float16", norm="rms", weight=True, epilogue=_epilogue("float16"),
                outputs=("out", "fp8_group")),
])
def test_custom_op_fake_and_real_agree(spec: RowwiseSpec) -> None:
    ins = _inputs(spec, 2, 3, 64, ep_up=torch.randn(2, 3, 64, dtype=getattr(torch, spec.dtype)))
    args = [ins[n] for n in spec.input_names()]
    torch.library.opcheck(rowwise_op, (args, spec.to_json()))
    outs = rowwise(spec, **ins)
    ref = rowwise_reference(spec, ins)
    assert list(outs) == spec.output_names()
    assert all(_bitwise(outs[n], ref[n]) for n in outs)


def test_custom_op_traces_under_torch_compile() -> None:
    spec = RowwiseSpec("bfloat16", norm="layer", modulation=True, outputs=("out", "fp8_row"))
    ins = _inputs(spec, 1, 4, 64)

    def f(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        out = rowwise(spec, x=x, scale=scale, shift=shift)
        return out["fp8_row"].float() * out["fp8_row_scale"]

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(**ins)
    assert torch.equal(got, f(**ins))


@pytest.mark.parametrize("change, reason", [
    (dict(x=torch.randn(2, 64)), "x is torch.float32"),
    (dict(y=torch.randn(2, 32, dtype=BF)), "y has shape"),
    (dict(scale=torch.randn(2, 64)), "scale is torch.float32"),
    (dict(gate=torch.randn(3, 64, dtype=BF)), "do not divide"),
    (dict(gate=torch.randn(2, 4, 64, dtype=BF)), "expected \\[B, 64\\]"),
    (dict(global_scale=torch.tensor([1.0, 2.0])), "one fp32 value"),
])
def test_call_validation(change: dict, reason: str) -> None:
    spec = RowwiseSpec("bfloat16", norm="layer", residual=True, gate=True, modulation=True,
                       outputs=("out", "nvfp4"))
    ins = {**_inputs(spec, 2, 1, 64), **change}
    ins["x"] = ins["x"].reshape(2, 64)
    if "y" not in change:
        ins["y"] = ins["y"].reshape(2, 64)
    with pytest.raises(RowwiseError, match=reason):
        rowwise_triton(spec, [ins[n] for n in spec.input_names()])
    with pytest.raises(RowwiseError, match=reason):
        rowwise_reference(spec, ins)


def test_call_validation_of_sizes_and_names() -> None:
    spec = RowwiseSpec("bfloat16", outputs=("nvfp4",))
    with pytest.raises(RowwiseError, match="cols % 16"):
        rowwise_triton(spec, [torch.randn(2, 40, dtype=BF), torch.tensor([1.0])])
    with pytest.raises(RowwiseError, match="at most 32768"):
        rowwise_triton(RowwiseSpec("bfloat16"), [torch.empty(1, 40000, dtype=BF)])
    with pytest.raises(RowwiseError, match="missing \\['global_scale'\\]"):
        rowwise(spec, x=torch.randn(2, 48, dtype=BF))


# -- generated source ---------------------------------------------------------------------------

def test_generated_source_is_a_readable_module_keyed_by_epilogue() -> None:
    a = RowwiseSpec("bfloat16", norm="rms", epilogue=_epilogue())
    b = RowwiseSpec("bfloat16", norm="layer", modulation=True, epilogue=_epilogue(),
                    outputs=("fp8_row",))
    assert kernel_for(a) is kernel_for(b)  # flags are constexprs of one kernel
    assert kernel_for(a) is not kernel_for(RowwiseSpec("bfloat16", norm="rms"))
    src = kernel_source(_epilogue())
    assert "def rowwise_kernel(" in src
    assert "e0 = pw_round(pw_silu((n), CUDA), 1, CUDA)" in src
    assert "ev_up = tl.load(ep_up_ptr + row64[:, None] * ep_up_stride" in src
    path = kernel_for(a).fn.__code__.co_filename
    assert os.path.exists(path) and open(path).read() == src


# -- an epilogue translated from a captured module -----------------------------------------------

class _NormModGelu(nn.Module):
    def forward(self, x, scale, shift):  # noqa: ANN001, ANN201
        n = F.layer_norm(x, [x.shape[-1]], eps=1e-6)
        m = (1 + scale) * n + shift
        return F.gelu(m, approximate="tanh") * 0.5


def test_epilogue_from_a_captured_module_matches_the_module() -> None:
    b, t, c = 2, 3, 96
    x = torch.randn(b, t, c, dtype=BF)
    scale, shift = (0.3 * torch.randn(b, 1, c)).bfloat16(), torch.randn(b, 1, c, dtype=BF)
    module = _NormModGelu()
    gm = capture_module(module, (x, scale, shift)).gm
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    gelu = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.gelu.default)
    prog = from_fx(nodes[gelu:], [nodes[gelu - 1]], names=["x"])  # after the modulation
    assert [i.op for i in prog.instrs] == ["gelu_tanh", "mul"]
    spec = RowwiseSpec("bfloat16", norm="layer", eps=1e-6, modulation=True, epilogue=prog,
                       outputs=("out", "fp8_row"))
    got = rowwise(spec, x=x, scale=scale, shift=shift)  # the CPU path: the reference
    kernel = rowwise_triton(spec, [x, scale, shift])
    eager = module(x, scale, shift)
    assert torch.equal(got["out"], eager)
    exact64 = module(x.double(), scale.double(), shift.double())
    _within_tier(kernel["out"], eager, exact64)
    _quantized_from_out(spec, {}, kernel)


# -- the compiled (not interpreted) kernels ------------------------------------------------------

_COMPILE_SM90 = r'''
import torch
from benchmarks.probes.ptx_sm90 import Launch, compile_sm90
from kopt.codegen import rowwise as rw
from kopt.codegen.kernels import nvfp4 as nv, quant_fp8 as qf
from kopt.codegen.pointwise import Instr, Operand, PointwiseProgram

def build(kernel, args, constexprs, warps):
    # specialised as the JIT specialises a launch of these arguments
    bound = dict(zip(kernel.arg_names, args), **constexprs)
    return compile_sm90(Launch(kernel, bound, warps, {"enable_fp_fusion": False}))["ptx"]

bf, f32 = "bfloat16", "float32"
ep = PointwiseProgram(
    (Operand("x", "tile", bf), Operand("u", "tile", bf), Operand("r", "row", f32),
     Operand("c", "col", bf), Operand("m", "batch", bf), Operand("k", "scalar", f32)),
    tuple(Instr(*i) for i in [
        ("silu", ("x",), bf), ("mul", ("%0", "u"), bf), ("gelu_tanh", ("%1",), bf),
        ("gelu_erf", ("%2",), bf), ("div", ("%3", 3.0), bf), ("sigmoid", ("%4",), f32),
        ("mul", ("%5", "r"), f32), ("add", ("%6", "c"), f32), ("div", ("%7", "m"), f32),
        ("rsqrt", ("k",), f32), ("axpy", ("%8", "%9", 2.0), f32), ("tanh", ("%10",), f32),
        ("exp", ("%11",), bf), ("sqrt", ("%12",), bf), ("cast", ("%13",), "float16")]),
    ("%14",))
b, t, c = 2, 96, 3072
x = torch.randn(b, t, c, dtype=torch.bfloat16)
pool = {"x": x, "y": x, "residual_bias": x[0, 0], "gate": x[:, 0], "weight": x[0, 0],
        "bias": x[0, 0], "scale": x[:, 0], "shift": x[:, 0],
        "global_scale": torch.tensor([1.0]), "ep_u": x, "ep_r": torch.rand(b, t, 1),
        "ep_c": x[0, 0], "ep_m": x[:, 0], "ep_k": torch.rand(1)}
specs = [
    rw.RowwiseSpec(bf, norm="layer", residual=True, residual_bias=True, gate=True,
                   modulation=True, outputs=("out", "residual", "fp8_row", "fp8_group", "nvfp4")),
    rw.RowwiseSpec(bf, norm="rms", weight=True, bias=True, affine_after_round=True, epilogue=ep,
                   outputs=("out", "fp8_row")),
    rw.RowwiseSpec(bf, norm="layer", residual=True, residual_bias=True, gate=True,
                   modulation=True, outputs=("out", "residual", "fp8_row", "fp8_group", "nvfp4"),
                   intermediates="fp32"),
    rw.RowwiseSpec(bf, norm="rms", weight=True, bias=True, affine_after_round=True, epilogue=ep,
                   outputs=("out", "fp8_row"), intermediates="fp32"),
]
ptx = []
for spec in specs:
    launch = rw.prepare_launch(spec, [pool[n] for n in spec.input_names()])
    ptx.append(build(launch.kernel, launch.args, dict(launch.constexprs, CUDA=True),
                     launch.num_warps))
for grouped in (False, True):
    ptx.append(build(qf._quant_fp8_kernel, [x, x.view(torch.uint8), torch.rand(1), 1, c, c],
                     dict(GROUPED=grouped, ROWS=1, BLOCK=2048, BLOCK2=1024, EVEN=grouped,
                          CUDA=True), 8))
ptx.append(build(nv._quant_nvfp4_kernel, [x, x.view(torch.uint8), x.view(torch.uint8),
                                          torch.rand(1), 1, c, c],
                 dict(ROWS=1, BLOCK=2048, BLOCK2=1024, EVEN=False, CUDA=True), 8))
for i, p in enumerate(ptx):
    print(i, "e4m3" if "cvt.rn.satfinite.e4m3x2.f32" in p else "-",
          "div.rn" if "div.rn.f32" in p else "-",
          "bf16" if ("cvt.rn.bf16.f32" in p or "cvt.rn.bf16x2.f32" in p) else "-",
          "approx-div" if ("div.full.f32" in p or "div.approx.f32" in p) else "-")
# the FP8 default's LayerNorm + adaLN + FP8 on rows the tiles cover (3072 = 2048 + 1024)
spec = rw.RowwiseSpec(bf, norm="layer", modulation=True, outputs=("fp8_row",),
                      intermediates="fp32")
xs = torch.randn(1, 64, c, dtype=torch.bfloat16)
ins = {"x": xs, "scale": xs[:, 0], "shift": xs[:, 0]}
launch = rw.prepare_launch(spec, [ins[n] for n in spec.input_names()])
p = build(launch.kernel, launch.args, dict(launch.constexprs, CUDA=True), launch.num_warps)
print("even", launch.constexprs["EVEN"], "selp", p.count("selp."), "min", p.count("min.f32"))
'''


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """The interpreter does not type-check like the compiler: compile the generated kernel (all
    flags, an epilogue with every op family and operand kind) and the producers for sm_90 with
    Triton's bundled ptxas, and check the PTX for what the numerics rely on."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    # hardware e4m3 casts, IEEE divisions, bf16 rounding; never an approximate division
    # (the first two specs with every step rounded, the next two with fp32 intermediates:
    # the last one's only rounding is its epilogue's explicit cast to fp16)
    assert lines[:4] == [f"{i} e4m3 div.rn bf16 -" for i in range(3)] + ["3 e4m3 div.rn - -"]
    assert lines[4:7] == ["4 e4m3 div.rn - -", "5 e4m3 div.rn - -", "6 e4m3 div.rn - -"]
    # no per-value selects or clamps left in it (it had 240 selp and 48 min for its 48 values
    # per thread: masks that were all true, the quotient's guards, the clamp the saturating
    # e4m3 cast makes redundant; RESULTS.md, 2026-12-01)
    assert lines[7] == "even True selp 0 min 0"


@pytest.mark.parametrize("rows_per", [1, 4])
def test_rows_per_program_override_keeps_the_result(rows_per: int) -> None:
    """Benchmarks sweep rows per program: with 7 rows and 4 per program the last program is
    partly masked; every output must stay bitwise the default tiling's."""
    spec = RowwiseSpec("bfloat16", residual=True, gate=True, modulation=True,
                       outputs=("out", "residual", "fp8_row"))
    ins = _inputs(spec, 1, 7, 48)
    names = spec.input_names()
    want = rowwise_triton(spec, [ins[n] for n in names])
    got = rowwise_triton(spec, [ins[n] for n in names], rows_per=rows_per, num_warps=2)
    for n in spec.output_names():
        assert _bitwise(got[n], want[n]), n
    with pytest.raises(ValueError, match="power of two"):
        rowwise_triton(spec, [ins[n] for n in names], rows_per=3)


# -- launch plans ----------------------------------------------------------------------------------

_EVERY_KIND = PointwiseProgram(
    (Operand("x", "tile", "bfloat16"), Operand("u", "tile", "bfloat16"),
     Operand("r", "row", "float32"), Operand("c", "col", "bfloat16"),
     Operand("m", "batch", "bfloat16"), Operand("k", "scalar", "float32")),
    (Instr("mul", ("x", "u"), "bfloat16"), Instr("add", ("%0", "c"), "bfloat16"),
     Instr("div", ("%1", "m"), "bfloat16"), Instr("mul", ("%2", "r"), "float32"),
     Instr("sub", ("%3", "k"), "float32")), ("%4",))


def _prologue_case() -> tuple[RowwiseSpec, list[torch.Tensor]]:
    # every prologue step, every output, 2 batch items of gate/scale/shift
    spec = RowwiseSpec("bfloat16", norm="layer", residual=True, residual_bias=True, gate=True,
                       modulation=True, outputs=ALL_OUTPUTS)
    ins = _inputs(spec, 2, 5, 64)
    return spec, [ins[n] for n in spec.input_names()]


def _epilogue_case() -> tuple[RowwiseSpec, list[torch.Tensor]]:
    spec = RowwiseSpec("bfloat16", residual=True, epilogue=_EVERY_KIND,
                       outputs=("out", "fp8_row", "fp8_group"))
    b, t, c = 2, 3, 136
    ins = _inputs(spec, b, t, c, ep_u=torch.randn(b, t, c, dtype=BF),
                  ep_r=torch.rand(b, t, 1) + 0.5, ep_c=torch.randn(c, dtype=BF),
                  ep_m=(torch.rand(b, 1, c) + 0.5).bfloat16(), ep_k=torch.tensor(0.25))
    return spec, [ins[n] for n in spec.input_names()]


def _strided_case() -> tuple[RowwiseSpec, list[torch.Tensor]]:
    # x, y, gate views with row strides (passed as they are); a transposed epilogue tile, a
    # strided weight and row operand (copied by the checks, so copied on every call)
    b, t, c = 2, 2, 48
    ep = PointwiseProgram(
        (Operand("x", "tile", "bfloat16"), Operand("u", "tile", "bfloat16"),
         Operand("r", "row", "bfloat16")),
        (Instr("mul", ("x", "u"), "bfloat16"), Instr("add", ("%0", "r"), "bfloat16")), ("%1",))
    spec = RowwiseSpec("bfloat16", norm="rms", weight=True, residual=True, gate=True,
                       epilogue=ep, outputs=("out", "residual", "fp8_row", "nvfp4"))
    wide = torch.randn(b * t, 2 * c, dtype=BF)
    ins = _inputs(spec, b, t, c, x=wide[:, :c].reshape(b, t, c),
                  y=wide[:, c:].reshape(b, t, c),
                  gate=torch.randn(b, 1, 3 * c, dtype=BF)[..., c: 2 * c],
                  weight=torch.randn(2 * c)[::2],
                  ep_u=torch.randn(c, b * t, dtype=BF).t().reshape(b, t, c),
                  ep_r=torch.randn(b * t, 2, dtype=BF)[:, 0])
    assert not ins["x"].is_contiguous() and not ins["ep_u"].is_contiguous()
    return spec, [ins[n] for n in spec.input_names()]


def _fp16_one_row_case() -> tuple[RowwiseSpec, list[torch.Tensor]]:
    spec = RowwiseSpec("float16", norm="rms", eps=1e-5, weight=True, bias=True,
                       outputs=("nvfp4",))
    ins = _inputs(spec, 1, 1, 32, weight=torch.randn(32), bias=torch.randn(32))
    return spec, [ins[n] for n in spec.input_names()]


def _no_rows_case() -> tuple[RowwiseSpec, list[torch.Tensor]]:
    spec = RowwiseSpec("bfloat16", residual=True, outputs=("out", "fp8_group"))
    return spec, [torch.empty(0, 3, 64, dtype=BF), torch.empty(0, 3, 64, dtype=BF)]


_CASES = [_prologue_case, _epilogue_case, _strided_case, _fp16_one_row_case, _no_rows_case]


def _facts(launch: Launch, inputs: list[torch.Tensor]) -> tuple:
    """A launch in terms that hold for any call of one key: each tensor argument as the input
    it points into, the output it is, or a copy (its values); scalars with their type (an int
    and a float are different kernel arguments); outputs by shape, strides, dtype, device."""
    outs = {v.data_ptr(): n for n, v in launch.outputs.items()}

    def arg(a: object) -> tuple:
        if not isinstance(a, torch.Tensor):
            return type(a), a
        at = [k for k, v in enumerate(inputs) if v.data_ptr() == a.data_ptr()]
        if at:
            return "input", at, a.dtype
        if a.data_ptr() in outs:
            return "output", outs[a.data_ptr()], a.dtype
        return "copy", a.dtype, tuple(a.shape), a.stride(), a.float().tolist()

    return (launch.kernel, launch.grid, [arg(a) for a in launch.args], launch.constexprs,
            launch.num_warps,
            [(n, tuple(v.shape), v.stride(), v.dtype, v.device)
             for n, v in launch.outputs.items()])


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> dict:
    """An empty plan cache for the test (the module's is restored after it)."""
    monkeypatch.setattr(rw, "_PLANS", {})
    return rw._PLANS


@pytest.mark.parametrize("case", _CASES)
def test_cached_launch_is_the_uncached_one(case: Callable[[], tuple], plans: dict) -> None:
    spec, first = case()
    got = prepare_launch(spec, first)
    assert len(plans) == 1
    plan = next(iter(plans.values()))
    assert _facts(got, first) == _facts(rw._assemble(rw._plan(spec, first), first, None), first)
    # another call of the key (other tensors, same layouts): the plan is reused, the launch is
    # the one an uncached plan of this call gives, with outputs of its own
    spec, second = case()
    assert rw._plan_key(spec, second) == rw._plan_key(spec, first)
    again = prepare_launch(spec, second)
    assert len(plans) == 1 and next(iter(plans.values())) is plan
    want = rw._assemble(rw._plan(spec, second), second, None)
    assert _facts(again, second) == _facts(want, second)
    assert not {v.data_ptr() for v in got.outputs.values() if v.numel()} & {
        v.data_ptr() for v in again.outputs.values() if v.numel()}
    assert list(again.outputs) == spec.output_names()
    if again.kernel is not None:
        assert any(a is v for a in again.args for v in second)  # inputs passed as they are
        assert prepare_launch(spec, second, num_warps=2).num_warps == 2
        override = prepare_launch(spec, second, rows_per=1)  # bypasses the cache
        assert override.constexprs["ROWS"] == 1 and len(plans) == 1


def test_cached_launch_with_copied_inputs_computes_the_reference(plans: dict) -> None:
    spec, first = _strided_case()
    rowwise_triton(spec, first)
    spec, second = _strided_case()
    got = rowwise_triton(spec, second)  # from the first call's plan
    assert len(plans) == 1
    ref = rowwise_reference(spec, second)
    assert _bitwise(got["residual"], ref["residual"])
    assert int(_ulps(got["out"], ref["out"]).max()) <= 2


def test_a_new_shape_stride_or_dtype_gets_its_own_plan(plans: dict) -> None:
    spec = RowwiseSpec("bfloat16", norm="rms", weight=True, residual=True,
                       outputs=("out", "fp8_row"))
    x, y, w = torch.randn(4, 32, dtype=BF), torch.randn(4, 32, dtype=BF), torch.randn(32)
    wide = torch.randn(4, 64, dtype=BF)
    calls = [
        [x, y, w],
        [x[:3], y[:3], w],  # fewer rows
        [x, wide[:, :32], w],  # y with a row stride
        [x, y, w.bfloat16()],  # the weight in the rows' dtype
    ]
    launches = [prepare_launch(spec, ins) for ins in calls]
    assert len(plans) == len(calls)
    for ins, launch in zip(calls, launches, strict=True):
        want = rw._assemble(rw._plan(spec, ins), ins, None)
        assert _facts(launch, ins) == _facts(want, ins)
    assert launches[1].args[launches[1].kernel.arg_names.index("rows")] == 3
    assert launches[2].args[launches[2].kernel.arg_names.index("stride_y")] == 64


def test_bad_calls_raise_and_are_not_cached(plans: dict) -> None:
    spec = RowwiseSpec("bfloat16", residual=True, gate=True, outputs=("out", "nvfp4"))
    x = torch.randn(2, 3, 64, dtype=BF)
    good = [x, torch.randn_like(x), torch.randn(2, 64, dtype=BF), torch.tensor([1.0])]
    prepare_launch(spec, good)
    bad = {
        "gate is torch.float32": [*good[:2], torch.randn(2, 64), good[3]],
        "do not divide": [*good[:2], torch.randn(4, 64, dtype=BF), good[3]],
        "y has shape": [x, torch.randn(2, 3, 32, dtype=BF), *good[2:]],
        "one fp32 value": [*good[:3], torch.tensor([1.0, 2.0])],
        "takes 4 inputs": good[:3],
    }
    for reason, ins in bad.items():
        for _ in range(2):
            with pytest.raises(RowwiseError, match=reason):
                prepare_launch(spec, ins)
    assert len(plans) == 1


def test_the_plan_cache_is_bounded(plans: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rw, "_MAX_PLANS", 2)
    spec = RowwiseSpec("bfloat16")
    calls = [[torch.randn(rows, 16, dtype=BF)] for rows in (1, 2, 3)]
    for ins in calls:
        prepare_launch(spec, ins)
    assert list(plans) == [rw._plan_key(spec, ins) for ins in calls[1:]]  # the oldest went


@pytest.mark.parametrize(("t", "c", "even"), [(8, 384, True), (6, 384, False), (8, 320, False)],
                         ids=["covered", "partial-program", "partial-tile"])
def test_launches_that_cover_their_rows_run_without_masks(t: int, c: int, even: bool) -> None:
    """Where the programs' rows and the tiles' columns cover the rows exactly (4 rows of 256 +
    128 columns per program here), the kernel runs with constant masks (``EVEN``); its outputs
    are the reference's either way."""
    spec = RowwiseSpec("bfloat16", norm="layer", modulation=True,
                       outputs=("out", "fp8_row", "fp8_group"))
    ins = _inputs(spec, 1, t, c)
    launch = prepare_launch(spec, [ins[n] for n in spec.input_names()])
    assert launch.constexprs["EVEN"] is even
    assert (launch.constexprs["ROWS"], launch.constexprs["BLOCK"]) == (4, 256)
    got, ref = _run(spec, ins)
    torch.testing.assert_close(got["out"].float(), ref["out"].float(), rtol=8e-3, atol=1e-5)
    _quantized_from_out(spec, ins, got)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_row_in_two_tiles_is_the_one_tile_row(norm: str) -> None:
    """384 columns run as 256 + 128 (``row_split``): every output bitwise the one-tile kernel's
    but the norm's, whose row sums are added in another order (its tier: tolerance)."""
    spec = RowwiseSpec("bfloat16", norm=norm, residual=True, gate=True, modulation=True,
                       outputs=("out", "residual", "fp8_row", "fp8_group", "nvfp4"))
    ins = _inputs(spec, 2, 3, 384)
    args = [ins[n] for n in spec.input_names()]
    assert prepare_launch(spec, args).constexprs["BLOCK2"] == 128
    assert prepare_launch(spec, args, one_tile=True).constexprs["BLOCK2"] == 0
    split, whole = rowwise_triton(spec, args), rowwise_triton(spec, args, one_tile=True)
    assert _bitwise(split["residual"], whole["residual"])
    torch.testing.assert_close(split["out"].float(), whole["out"].float(), rtol=8e-3, atol=1e-5)
    _quantized_from_out(spec, ins, split)
