"""The GEMM template's blockwise scales and quantized output under the Triton interpreter, the
ops built on them, and the gemm_act_quant / triton_gemm rewrites of the blockwise recipe.

Kernels against the reference on awkward shapes (M and N off the tile, a partial K step, one
row), both K-step forms and both load paths; the quantized output against
``kopt::act_quant_fp8_group`` / ``kopt::quant_fp8_group`` of the reference GEMM; the rewrite
fires on a blockwise MLP and on Qwen-Image, not on SwiGLU, a tapped GEMM output or the rowwise
recipe (each with its reason), and keeps the numerics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kopt
from kopt.codegen.gemm import (
    GemmInputError,
    QuantOut,
    gemm,
    gemm_config,
    gemm_configs,
    gemm_reference,
)
from kopt.codegen.kernels.fp8_blockwise import quant_fp8_block128_reference
from kopt.codegen.kernels.quant_fp8 import quant_fp8_group_reference, quant_fp8_rowwise_reference
from kopt.patterns.gemm_epilogue import GEMM_ACT_QUANT
from kopt.verify import VerifyOptions, relative_error
from tests.cpu.test_codegen_gemm import FP8_OPCHECK
from tests.cpu.test_fusions import FP8_BLOCKWISE, MLP, _count, _rewrite, _verifies
from tests.cpu.test_kernel_act_quant import check_values

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")
BF16 = torch.bfloat16
BLOCKWISE_MM = torch.ops.kopt.fp8_blockwise_mm.default
ACT_GROUP = torch.ops.kopt.act_quant_fp8_group.default
FUSED = torch.ops.kopt.fp8_blockwise_gemm_act_quant.default
TEMPLATE = torch.ops.kopt.fp8_blockwise_gemm.default

# (M, N, K): one row; M off the 16-row interpreter tile and N off 128; K with a partial step
SHAPES = [(1, 128, 256), (37, 200, 384), (20, 256, 144)]


def blockwise_operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """a [M, K] e4m3 in 1x128 groups, w [N, K] in 128x128 blocks (padded to whole blocks for
    the quantizer, then cut), a bf16 bias; outputs ~ 1."""
    g = torch.Generator().manual_seed(seed)
    a, sa = quant_fp8_group_reference(torch.randn(m, k, generator=g))
    rows, cols = -(-n // 128) * 128, -(-k // 128) * 128
    w, sw = quant_fp8_block128_reference(torch.randn(rows, cols, generator=g) / k**0.5)
    bias = torch.randn(n, generator=g).to(BF16)
    return a, sa, w[:n, :k].contiguous(), sw, bias


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("persistent", [False, True], ids=["tile", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_blockwise_gemm_matches_the_reference(shape: tuple, persistent: bool,
                                              use_tma: bool) -> None:
    a, sa, w, sw, bias = blockwise_operands(*shape)
    cfg = [gemm_config(16, 128, 128, 2, 1, 4, persistent=persistent)]
    for b_ in (None, bias):
        out = gemm(a, w.t(), sa, sw, b_, blockwise=True, use_tma=use_tma, configs=cfg)
        ref = gemm_reference(a, w.t(), sa, sw, b_, None, None, blockwise=True)
        exact = gemm_reference(a, w.t(), sa, sw, b_, None, None, blockwise=True, upcast=True)
        assert out.shape == ref.shape and out.dtype == BF16
        assert (out == ref).float().mean().item() >= 0.97  # fp32 sums of another order
        assert relative_error(out, exact) < 2**-7
    # the scales matter: a K step's scale doubled doubles that step's part
    sa2 = sa.clone()
    sa2[:, 0] *= 2
    out = gemm(a, w.t(), sa2, sw, blockwise=True, use_tma=use_tma, configs=cfg)
    assert relative_error(out, gemm_reference(a, w.t(), sa2, sw, None, None, None,
                                              blockwise=True, upcast=True)) < 2**-7


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", [None, "gelu_tanh", "gelu_tanh:fast"])
@pytest.mark.parametrize("scales", ["blockwise", "rowwise"])
def test_quantized_output_is_the_unfused_quantizer_of_the_gemm(scales: str, activation: str,
                                                               bias: bool) -> None:
    m, n, k = 37, 256, 384
    a, sa, w, sw, b_ = blockwise_operands(m, n, k)
    if scales == "rowwise":
        a, sa = quant_fp8_rowwise_reference(torch.randn(m, k))
        w, sw = quant_fp8_rowwise_reference(torch.randn(n, k) / k**0.5)
        sw = sw.t()
    b_ = b_ if bias else None
    kw = dict(blockwise=scales == "blockwise", quant=QuantOut(activation), quant_bias=b_)
    q, s = gemm(a, w.t(), sa, sw, **kw)
    y = gemm_reference(a, w.t(), sa, sw, None, None, None, blockwise=scales == "blockwise")
    if activation is None:  # the unfused graph's ops on the GEMM's output
        want = torch.ops.kopt.quant_fp8_group(y if b_ is None else y + b_)
    else:
        want = torch.ops.kopt.act_quant_fp8_group(y, None, activation, b_, None, True)
    assert s.shape == (m, 2) and s.stride() == (1, m)
    check_values((q, s), want, BF16)
    assert all(torch.equal(x, r) for x, r in zip(gemm_reference(
        a, w.t(), sa, sw, None, None, None, **kw), want, strict=True))


def test_ops_on_cpu_run_the_reference_fake_and_opcheck() -> None:
    a, sa, w, sw, bias = blockwise_operands(36, 256, 384)
    y = torch.ops.kopt.fp8_blockwise_gemm(a, sa, w, sw, None, BF16)
    assert torch.equal(y, torch.ops.kopt.fp8_blockwise_mm(a, sa, w, sw, BF16))
    q, s = torch.ops.kopt.fp8_blockwise_gemm_act_quant(a, sa, w, sw, bias, "gelu_tanh:fast", BF16)
    q_ref, s_ref = torch.ops.kopt.act_quant_fp8_group(y, None, "gelu_tanh:fast", bias, None,
                                                      True)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    with FakeTensorMode() as mode:
        fa, fsa, fw, fsw, fb = (mode.from_tensor(t) for t in (a, sa, w, sw, bias))
        fq, fs = torch.ops.kopt.fp8_blockwise_gemm_act_quant(fa, fsa, fw, fsw, fb, "gelu_tanh",
                                                             BF16)
        assert fq.shape == q.shape and fq.dtype == q.dtype
        assert fs.shape == s.shape and fs.stride() == s.stride()
    torch.library.opcheck(TEMPLATE, (a, sa, w, sw, bias, BF16), test_utils=FP8_OPCHECK)
    torch.library.opcheck(FUSED, (a, sa, w, sw, bias, "gelu_tanh:fast", BF16),
                          test_utils=FP8_OPCHECK)


def test_a_blockwise_launch_runs_cublas_once_measured_faster() -> None:
    """The template's blockwise GEMM is the form cuBLAS's blockwise GEMM computes too (no
    epilogue, K a multiple of 512): once cuBLAS is measured faster for the launch key (CUDA
    only; set by hand here) the call returns kopt::fp8_blockwise_mm's bits."""
    from kopt.codegen import gemm as g

    a, sa, w, sw, bias = blockwise_operands(36, 256, 512)
    g._LAUNCHES.clear()
    template = gemm(a, w.t(), sa, sw, blockwise=True)
    (planned,) = g._LAUNCHES.values()
    assert planned.library_form
    planned.library = True
    routed = gemm(a, w.t(), sa, sw, blockwise=True)
    assert torch.equal(routed, torch.ops.kopt.fp8_blockwise_mm(a, sa, w, sw, BF16))
    assert (routed == template).float().mean().item() >= 0.97
    g._LAUNCHES.clear()
    for kw in (dict(bias=bias), dict(quant=QuantOut(None))):  # an epilogue: the template's
        gemm(a, w.t(), sa, sw, blockwise=True, **kw)
        (planned,) = g._LAUNCHES.values()
        assert not planned.library_form
        g._LAUNCHES.clear()
    a, sa, w, sw, _ = blockwise_operands(36, 256, 384)  # K/128 = 3 scale columns: not cuBLAS's
    gemm(a, w.t(), sa, sw, blockwise=True)
    assert not next(iter(g._LAUNCHES.values())).library_form
    g._LAUNCHES.clear()


def test_configs_fit_the_scales_and_the_quantized_output() -> None:
    for m in (1, 128, 4096):
        cfgs = gemm_configs(m, 12288, 3072, True, blockwise=True)
        assert cfgs and all(c.kwargs["BLOCK_N"] == c.kwargs["BLOCK_K"] == 128 for c in cfgs)
        quant = gemm_configs(m, 12288, 3072, True, quant_out=True)
        assert quant and all(c.kwargs["BLOCK_N"] % 128 == 0 for c in quant)


@pytest.mark.parametrize(("case", "match"), [
    ("scale shape", r"scale_a has shape \[37, 2\]; blockwise scales are \[37, 3\]"),
    ("swiglu", "a quantized output's activation must be one of"),
    ("bias dtype", "quant_bias must be one torch.bfloat16 vector"),
    ("fp32 steps", "a quantized output rounds its steps to bf16 or fp16"),
    ("config", "does not fit this launch"),
    ("blockwise config", r"blockwise scales: BLOCK_N = BLOCK_K = 128"),
    ("template activation", "a quantized output takes its activation from QuantOut"),
])
def test_bad_inputs_give_clear_errors(case: str, match: str) -> None:
    a, sa, w, sw, bias = blockwise_operands(37, 256, 384)
    kw: dict = dict(blockwise=True)
    if case == "scale shape":
        sa = sa[:, :2]
    elif case == "swiglu":
        kw["quant"] = QuantOut("silu_mul")
    elif case == "bias dtype":
        kw.update(quant=QuantOut("gelu_tanh"), quant_bias=bias.float())
    elif case == "fp32 steps":
        kw.update(quant=QuantOut(None), out_dtype=torch.float32)
    elif case == "blockwise config":
        kw["configs"] = [gemm_config(16, 256, 128)]
    elif case == "template activation":
        kw.update(quant=QuantOut(None), activation="gelu_tanh")
    else:
        kw.update(blockwise=False, quant=QuantOut(None), configs=[gemm_config(16, 64, 32)])
        a, sa = quant_fp8_rowwise_reference(torch.randn(37, 384))
        sw = torch.ones(1, 256)
    with pytest.raises(GemmInputError, match=match):
        gemm(a, w.t(), sa, sw, **kw)


# --- the rewrites ------------------------------------------------------------------------------

def _blockwise(model: torch.nn.Module, x: torch.Tensor, **flags: object) -> kopt.OptimizedModule:
    return kopt.optimize(model.eval(), (x,), config=FP8_BLOCKWISE.replace(
        fuse_act_quant=True, **flags), verify=VerifyOptions(enabled=False))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_act_quant_fires_on_a_blockwise_mlp(bias: bool) -> None:
    x = torch.randn(2, 5, 512, dtype=BF16)
    gm = _blockwise(MLP(act="gelu_tanh", dim=512, hidden=512, bias=bias), x).graph_module
    assert _count(gm, ACT_GROUP) == 1 and _count(gm, BLOCKWISE_MM) == 2
    after, result = _rewrite(gm, GEMM_ACT_QUANT)
    assert result.matched == 1 and result.rejected == {}
    assert _count(after, ACT_GROUP) == 0 and _count(after, BLOCKWISE_MM) == 1  # the down one
    [fused] = [n for n in after.graph.nodes if n.target is FUSED]
    assert (fused.args[4] is not None) == bias and fused.args[5] == "gelu_tanh:fast"
    prefix = "bias + " if bias else ""
    [detail] = result.details
    assert detail.endswith(f"blockwise GEMM 10 x 512 -> {prefix}gelu_tanh:fast + quant 1x128 "
                           "in its epilogue")
    _verifies(gm, after, (x,), GEMM_ACT_QUANT)
    with torch.no_grad():  # on the CPU the fused op runs the unfused references: bitwise
        assert torch.equal(after(x)[0], gm(x)[0])


@pytest.mark.parametrize(("flags", "fp8", "reason"), [
    (dict(act="swiglu"), "blockwise",
     "SwiGLU's halves or a concatenated tensor lie in other column tiles"),
    (dict(act="gelu_tanh", tap_pre=True), "blockwise",
     "the GEMM's output has other users: it is still needed"),
    (dict(act="gelu_tanh"), "rowwise", "per-token FP8 scales: a row's amax spans every column "
                                       "tile of the GEMM before it, not one tile (the blockwise "
                                       "recipe's 1x128 groups are tile-local: "
                                       "FP8Config(layout='blockwise'))"),
], ids=["swiglu", "tapped-gemm-output", "rowwise-recipe"])
def test_gemm_act_quant_near_misses_say_why(flags: dict, fp8: str, reason: str) -> None:
    x = torch.randn(2, 5, 512, dtype=BF16)
    config = FP8_BLOCKWISE if fp8 == "blockwise" else FP8_BLOCKWISE.replace(
        fp8=kopt.FP8Config(min_features=16))
    gm = kopt.optimize(MLP(dim=512, hidden=512, **flags).eval(), (x,), config=config.replace(
        fuse_act_quant=True), verify=VerifyOptions(enabled=False)).graph_module
    after, result = _rewrite(gm, GEMM_ACT_QUANT)
    assert result.matched == 0 and _count(after, FUSED) == 0
    assert result.rejected == {reason: 1}


def test_pipeline_fuses_qwen_images_mlps_and_moves_the_rest_to_the_template(monkeypatch) -> None:  # noqa: ANN001
    """Qwen-Image with 128-multiple widths in blockwise FP8: every act + quant after a
    blockwise GEMM (the image MLP's up projection: the 10 text tokens' MLP is not blockwise)
    moves into that GEMM (gemm_act_quant); triton_gemm then takes every other blockwise GEMM;
    verified end to end."""
    from kopt.models import qwen_image

    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(
        qwen_image.TINY_CONFIG, num_layers=1, num_attention_heads=4, attention_head_dim=128,
        joint_attention_dim=512, axes_dims_rope=(32, 48, 48)))
    w = qwen_image.build("tiny", dtype=BF16)
    config = FP8_BLOCKWISE.replace(fuse_act_quant=True, gemm_act_quant=True, triton_gemm=True)
    opt = kopt.optimize(w.model, w.args, w.kwargs, config)
    fused, template = opt.report.result("gemm_act_quant"), opt.report.result("triton_gemm")
    assert opt.report.result("fuse_act_quant").matched == fused.matched == 1
    assert fused.verdict.passed and fused.verdict.tier == "tolerance"
    assert "img_mlp" in fused.details[0]
    plain = kopt.optimize(w.model, w.args, w.kwargs, dataclasses.replace(
        config, gemm_act_quant=False, triton_gemm=False), verify=VerifyOptions(enabled=False))
    gemms = sum(n.target is BLOCKWISE_MM for m in plain.graph_module.modules()
                if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
    assert template.matched == gemms - 1 and template.verdict.passed
    assert not any(n.target is BLOCKWISE_MM for m in opt.graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
    with torch.no_grad():
        out, ref = opt(*w.args, **w.kwargs)[0], plain(*w.args, **w.kwargs)[0]
    assert torch.equal(out, ref)  # the CPU paths are the unfused references
