"""fuse_qk_norm_rope and fuse_act_quant: they fire on the three tiny reference models (exact match
counts, the ops they remove gone, the fused ops present), not on near misses (with the reason),
and the rewritten graph computes the same function at the declared tier."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import kopt
from kopt.capture import capture_module, flatten_inputs
from kopt.graph import copy_graph_module
from kopt.models import build
from kopt.passes.base import PassResult, RewritePass
from kopt.patterns.act_quant import ACT as FUSE_ACT
from kopt.patterns.act_quant import ACT_QUANT, act_quant_rewrite
from kopt.patterns.core import Rewrite, exact
from kopt.patterns.qk_norm_rope import QK_NORM_ROPE
from kopt.verify import VerifyOptions, compare

aten = torch.ops.aten
QK = torch.ops.kopt.qk_norm_rope.default
ACT = torch.ops.kopt.act_quant_fp8_rowwise.default
CAT_ACT = torch.ops.kopt.cat_act_quant_fp8_rowwise.default
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
# the graphs these rewrites start from: the default passes with FP8, without the fusions
FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), fuse_qk_norm_rope=False,
                      fuse_act_quant=False, fuse_act=False)
MODELS = ("qwen-image-tiny", "flux2-tiny", "llm-tiny")


@functools.cache
def _optimized(name: str, dtype: torch.dtype) -> tuple[fx.GraphModule, tuple]:
    """The tiny model after kopt's default passes with FP8 on (verification off: the tests
    verify), and its flat example inputs."""
    w = build(name, dtype=dtype)
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, verify=VerifyOptions(enabled=False))
    return opt.graph_module, tuple(flatten_inputs(w.args, w.kwargs)[0])


def _module_graph(model: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, tuple]:
    opt = kopt.optimize(model.eval(), args, config=FP8, verify=VerifyOptions(enabled=False))
    return opt.graph_module, args


def _rewrite(gm: fx.GraphModule, rewrite: Rewrite) -> tuple[fx.GraphModule, PassResult]:
    after = copy_graph_module(gm)
    return after, RewritePass(rewrite.name, [rewrite]).run(after)


def _count(gm: fx.GraphModule, *targets: object) -> int:
    return sum(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def _verifies(before: fx.GraphModule, after: fx.GraphModule, inputs: tuple,
              rewrite: Rewrite) -> None:
    """The rewritten graph against the original on fresh random inputs, at the declared tier."""
    verdict = compare(before, after, list(inputs), rewrite.numerics, VerifyOptions(seeds=(1,)))
    assert verdict.passed, verdict


# -- QK-norm + RoPE on the reference models ----------------------------------------------------
# sites: one per attention; q/k segments per site (text ++ image in double-stream blocks)
QK_SITES = {"qwen-image-tiny": 2, "flux2-tiny": 4, "llm-tiny": 2}
QK_DETAIL = {"qwen-image-tiny": "cast + complex RoPE, q 2 / k 2 heads x 32, tokens 10+48",
             "flux2-tiny": "rms_norm + pairs RoPE, q 2 / k 2 heads x 32, tokens 12+48",
             "llm-tiny": "cast + half RoPE, q 4 / k 2 heads x 16, tokens 20"}
# rsqrt of the hand-written norms (2 segments x q/k x 2 blocks for Qwen-Image, q/k x 2 layers for
# Qwen3; FLUX.2 uses aten.rms_norm) and the concatenations (text ++ image of q and k, or
# rotate-half's cat(-x2, x1))
RSQRT_REMOVED = {"qwen-image-tiny": 8, "flux2-tiny": 0, "llm-tiny": 4}
CAT_REMOVED = {"qwen-image-tiny": 4, "flux2-tiny": 4, "llm-tiny": 4}
ROPE_OPS = (aten.rms_norm.default, aten.view_as_complex.default, aten.type_as.default,
            aten.unbind.int, aten.stack.default, aten.neg.default)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", MODELS)
def test_qk_norm_rope_fires_on_the_reference_models(name: str, dtype: torch.dtype) -> None:
    gm, inputs = _optimized(name, dtype)
    after, result = _rewrite(gm, QK_NORM_ROPE)
    assert result.matched == QK_SITES[name] and result.rejected == {}
    assert _count(after, QK) == QK_SITES[name]
    assert _count(after, *ROPE_OPS) == 0
    assert _count(after, aten.rsqrt.default) == _count(gm, aten.rsqrt.default) - RSQRT_REMOVED[name]
    assert _count(after, aten.cat.default) == _count(gm, aten.cat.default) - CAT_REMOVED[name]
    assert QK_DETAIL[name] in result.details[0]
    _verifies(gm, after, inputs, QK_NORM_ROPE)
    # on the CPU the op runs the models' own op sequence: bitwise equal, not only within tier
    verdict = compare(gm, after, list(inputs), exact("CPU reference"), VerifyOptions(seeds=(0,)))
    assert verdict.passed, verdict


def test_qk_norm_rope_fires_in_llm_decode_through_the_kv_cache() -> None:
    # decode: the new token's k reaches attention through index_copy into the static cache
    # (the capture's functional index_copy, or the buffer's own index_copy_ after reinplace)
    for reinplace, write in ((False, aten.index_copy.default), (True, aten.index_copy_.default)):
        w = build("llm-tiny", dtype=torch.bfloat16, mode="decode", batch=3)
        opt = kopt.optimize(w.model, w.args, w.kwargs,
                            FP8.replace(fp8=None, reinplace=reinplace),
                            verify=VerifyOptions(enabled=False))
        gm, inputs = opt.graph_module, tuple(flatten_inputs(w.args, w.kwargs)[0])
        assert _count(gm, write) == 4
        after, result = _rewrite(gm, QK_NORM_ROPE)
        assert result.matched == 2 and _count(after, write) == 4
        _verifies(gm, after, inputs, QK_NORM_ROPE)


def test_qk_norm_rope_leaves_attention_without_norm_or_rope_alone() -> None:
    # FLUX.2's value path is a concatenation of plain views: every SDPA's q and k fuse, nothing
    # else is touched (v's concatenation stays, and no site is counted as rejected).
    gm, _ = _optimized("flux2-tiny", torch.bfloat16)
    after, result = _rewrite(gm, QK_NORM_ROPE)
    assert not result.rejections
    sdpa = [n for n in after.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert all(n.args[0].args[0].args[0].target is QK for n in sdpa)


# -- activation + FP8 quantization on the reference models ------------------------------------
# Qwen-Image: GELU(tanh) in img_mlp/txt_mlp of 2 blocks, but the last block's text MLP feeds
# nothing and is gone; FLUX.2: SwiGLU in ff/ff_context of 2 double blocks, and in 2 single
# blocks, which quantize cat(attention, swiglu); Qwen3: SwiGLU in 2 layers.
ACT_SITES = {"qwen-image-tiny": 3, "flux2-tiny": 6, "llm-tiny": 2}
CAT_SITES = {"qwen-image-tiny": 0, "flux2-tiny": 2, "llm-tiny": 0}


@pytest.mark.parametrize("name", MODELS)
def test_act_quant_fires_on_the_reference_models(name: str) -> None:
    gm, inputs = _optimized(name, torch.bfloat16)
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == ACT_SITES[name] and result.rejected == {}
    assert _count(after, ACT) == ACT_SITES[name] - CAT_SITES[name]
    assert _count(after, CAT_ACT) == CAT_SITES[name]
    assert _count(after, QUANT) == _count(gm, QUANT) - ACT_SITES[name]
    assert _count(after, aten.silu.default, aten.gelu.default) == 0
    kinds = {n.args[2] for n in after.graph.nodes if n.target is ACT} | {
        n.args[3] for n in after.graph.nodes if n.target is CAT_ACT}
    assert kinds == ({"gelu_tanh"} if name == "qwen-image-tiny" else {"silu_mul"})
    assert all(("mlp" in d or ".ff" in d) for d in result.details), result.details
    _verifies(gm, after, inputs, ACT_QUANT)


def test_act_quant_takes_flux2_single_blocks_cat_of_attention_and_swiglu() -> None:
    """FLUX.2's single-stream blocks quantize cat([attention, swiglu]) for their output
    projection: the concatenation and the activation go into one kernel, attention first."""
    gm, _ = _optimized("flux2-tiny", torch.bfloat16)
    after, result = _rewrite(gm, ACT_QUANT)
    fused = [n for n in after.graph.nodes if n.target is CAT_ACT]
    assert len(fused) == 2 and all(n.args[4] is True for n in fused)  # other (attention) first
    assert sum("cat after another tensor" in d for d in result.details) == 2
    # the quantized row is [attention | swiglu]: its width is both together
    for n in fused:
        other, gate = n.args[0].meta["val"], n.args[1].meta["val"]
        assert n.meta["val"][0].shape[-1] == other.shape[-1] + gate.shape[-1]


# -- near misses: small modules ----------------------------------------------------------------
class Attention(nn.Module):
    """Qwen3-style attention: q/k RMSNorm per head (hand-written), transpose, rotate-half RoPE,
    SDPA. The flags turn it into near misses."""

    def __init__(self, *, heads: int = 2, head_dim: int = 16, seq: int = 6,
                 dtype: torch.dtype = torch.float32, norm_dim: int = -1, tap_norm: bool = False,
                 cast_tables: bool = True, k_angle: float = 1.0) -> None:
        super().__init__()
        dim = heads * head_dim
        self.heads, self.head_dim, self.norm_dim = heads, head_dim, norm_dim
        self.tap_norm, self.cast_tables = tap_norm, cast_tables
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype)
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(head_dim, dtype=dtype))
        self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(head_dim, dtype=dtype))
        freqs = torch.logspace(0, -2, head_dim // 2)
        angle = torch.arange(seq)[:, None] * freqs[None]
        angle = torch.cat([angle, angle], -1)  # fp32 tables
        self.register_buffer("cos", angle.cos())
        self.register_buffer("sin", angle.sin())
        self.k_tables = ("cos", "sin")
        if k_angle != 1.0:  # k rotated by other angles than q
            self.register_buffer("k_cos", (angle * k_angle).cos())
            self.register_buffer("k_sin", (angle * k_angle).sin())
            self.k_tables = ("k_cos", "k_sin")

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(self.norm_dim, keepdim=True) + 1e-6)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.cast_tables:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.qkv(x).split(d, -1))
        qn, kn = self._rms(q, self.q_norm), self._rms(k, self.k_norm)
        q = self._rope(qn.transpose(1, 2), self.cos, self.sin)
        k = self._rope(kn.transpose(1, 2), *(getattr(self, t) for t in self.k_tables))
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2).to(q.dtype))
        o = o.transpose(1, 2).reshape(b, s, -1)
        return (o, qn) if self.tap_norm else o


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_fires_on_a_plain_attention(dtype: torch.dtype) -> None:
    gm, inputs = _module_graph(Attention(dtype=dtype), torch.randn(2, 6, 32, dtype=dtype))
    after, result = _rewrite(gm, QK_NORM_ROPE)
    assert result.matched == 1 and _count(after, QK) == 1
    _verifies(gm, after, inputs, QK_NORM_ROPE)


@pytest.mark.parametrize(("flags", "reason", "near_miss"), [
    (dict(tap_norm=True), "is also used by output outside the norm + RoPE", False),
    (dict(norm_dim=2), "takes the RMS over dim [2], not the last (head) dim", True),
    (dict(cast_tables=False, dtype=torch.bfloat16),
     "q's RoPE result is torch.float32, not torch.bfloat16 (no cast back)", False),
    (dict(k_angle=2.0), "q and k use different rotary tables", False),
], ids=["extra-user", "norm-over-heads", "no-cast-back", "other-k-tables"])
def test_qk_norm_rope_near_misses_say_why(flags: dict, reason: str, near_miss: bool) -> None:
    dtype = flags.get("dtype", torch.float32)
    gm, _ = _module_graph(Attention(**flags), torch.randn(2, 6, 32, dtype=dtype))
    after, result = _rewrite(gm, QK_NORM_ROPE)
    assert result.matched == 0 and _count(after, QK) == 0
    assert len(result.rejections) == 1
    rejection = result.rejections[0]
    assert reason in rejection.reason and rejection.near_miss == near_miss


class MLP(nn.Module):
    """An MLP whose activation feeds an FP8 linear; the flags turn it into near misses."""

    def __init__(self, *, act: str = "swiglu", dim: int = 32, hidden: int = 64,
                 dtype: torch.dtype = torch.bfloat16, tap: bool = False,
                 broadcast_up: bool = False, up_fp32: bool = False, bias: bool = False,
                 tap_pre: bool = False) -> None:
        super().__init__()
        self.act, self.tap, self.broadcast_up, self.up_fp32 = act, tap, broadcast_up, up_fp32
        self.tap_pre = tap_pre
        width = 2 * hidden if act == "swiglu" else hidden
        self.up = nn.Linear(dim, width, bias=bias, dtype=dtype)
        self.down = nn.Linear(hidden, dim, bias=False,
                              dtype=torch.float32 if up_fp32 else dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.up(x)
        if self.act == "swiglu":
            gate, up = h.chunk(2, -1)
            if self.broadcast_up:
                up = up.mean(-1, keepdim=True)
            if self.up_fp32:
                up = up.float()
            a = F.silu(gate) * up
        else:
            a = F.gelu(h, approximate="tanh" if self.act == "gelu_tanh" else "none")
        y = self.down(a)
        if self.tap_pre:
            return y, h
        return (y, a) if self.tap else y


@pytest.mark.parametrize("act", ["swiglu", "gelu_tanh"])  # GELU(erf): see the last test
def test_act_quant_fires_on_an_mlp(act: str) -> None:
    gm, inputs = _module_graph(MLP(act=act), torch.randn(2, 5, 32, dtype=torch.bfloat16))
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 1 and _count(after, ACT) == 1
    assert _count(after, aten.silu.default, aten.gelu.default) == 0
    _verifies(gm, after, inputs, ACT_QUANT)


@pytest.mark.parametrize("name", MODELS)
def test_act_quant_fast_math_takes_the_same_sites_at_the_tolerance_tier(name: str) -> None:
    """FP8Config(activation_math="fast"): the same sites, the ``:fast`` activations, declared
    tolerance (not exact), verified at that tier; the exact rewrite stays exact."""
    fast = act_quant_rewrite("fast")
    assert fast.numerics.tier == "tolerance" and ACT_QUANT.numerics.tier == "exact"
    gm, inputs = _optimized(name, torch.bfloat16)
    after, result = _rewrite(gm, fast)
    assert result.matched == ACT_SITES[name] and result.rejected == {}
    kinds = {n.args[2] for n in after.graph.nodes if n.target is ACT} | {
        n.args[3] for n in after.graph.nodes if n.target is CAT_ACT}
    assert kinds == ({"gelu_tanh:fast"} if name == "qwen-image-tiny" else {"silu_mul:fast"})
    assert all(d.endswith("(fast math)") for d in result.details), result.details
    _verifies(gm, after, inputs, fast)
    with pytest.raises(ValueError, match="activation math 'approx'"):
        act_quant_rewrite("approx")


def test_fp8_config_activation_math_reaches_the_pass() -> None:
    import kopt
    from kopt.passes.pipeline import build_passes

    with pytest.raises(ValueError, match="unknown fp8 activation_math 'approx'"):
        kopt.FP8Config(activation_math="approx")
    uuids = {}
    for math, tier in (("exact", "exact"), ("fast", "tolerance")):
        config = kopt.PassConfig(fp8=kopt.FP8Config(activation_math=math))
        [p] = [p for p in build_passes(config) if p.name == "fuse_act_quant"]
        assert [r.numerics.tier for r in p.rewrites] == [tier]
        uuids[math] = p.uuid()
    # compile caches and the knowledge base key on the pass's uuid: stable, and per math
    assert uuids["exact"] != uuids["fast"] and "0x" not in act_quant_rewrite("fast").source_key()


@pytest.mark.parametrize(("flags", "reason"), [
    (dict(tap=True), "is also used by output: the unfused value is still needed"),
    (dict(broadcast_up=True), "differ in shape (broadcast)"),
    (dict(up_fp32=True), "gate torch.bfloat16 and up torch.float32 differ in dtype"),
], ids=["extra-user", "broadcast-up", "dtype-mismatch"])
def test_act_quant_near_misses_say_why(flags: dict, reason: str) -> None:
    gm, _ = _module_graph(MLP(**flags), torch.randn(2, 5, 32, dtype=torch.bfloat16))
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 0 and _count(after, ACT) == 0
    [(said, count)] = result.rejected.items()
    assert reason in said and count == 1


# -- the 1x128-group layout (FP8Config(layout="blockwise")) --------------------------------------
ACT_GROUP = torch.ops.kopt.act_quant_fp8_group.default
QUANT_GROUP = torch.ops.kopt.quant_fp8_group.default
FP8_BLOCKWISE = dataclasses.replace(FP8, fp8=kopt.FP8Config(min_features=16, layout="blockwise"))


def _blockwise_graph(**flags: object) -> tuple[fx.GraphModule, tuple]:
    # blockwise FP8 wants features in multiples of 128 and in-features in multiples of 512
    model = MLP(dim=512, hidden=512, **flags).eval()
    x = torch.randn(2, 5, 512, dtype=torch.bfloat16)
    opt = kopt.optimize(model, (x,), config=FP8_BLOCKWISE, verify=VerifyOptions(enabled=False))
    return opt.graph_module, (x,)


@pytest.mark.parametrize("act", ["swiglu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_act_quant_group_takes_the_blockwise_quantizer_and_a_gelus_bias(act: str,
                                                                        bias: bool) -> None:
    gm, inputs = _blockwise_graph(act=act, bias=bias)
    adds = _count(gm, aten.add.Tensor)
    assert _count(gm, QUANT_GROUP) == 2  # the MLP's input and the activation
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 1 and _count(after, ACT_GROUP) == 1 and _count(after, ACT) == 0
    assert _count(after, QUANT_GROUP) == 1
    assert _count(after, aten.silu.default, aten.gelu.default) == 0
    [fused] = [n for n in after.graph.nodes if n.target is ACT_GROUP]
    # the bias add before a GELU goes into the kernel; SwiGLU's (before the split) stays
    takes_bias = bias and act == "gelu_tanh"
    assert (fused.args[3] is not None) == takes_bias
    assert _count(after, aten.add.Tensor) == adds - takes_bias
    assert ("bias + " in result.details[0]) == takes_bias and "quant 1x128" in result.details[0]
    _verifies(gm, after, inputs, ACT_QUANT)


def test_qk_norm_rope_takes_the_q_and_k_biases_the_blockwise_gemm_leaves(monkeypatch) -> None:  # noqa: ANN001
    """Qwen-Image with head_dim 128 and blockwise FP8: the merged QKV's bias add is split per
    slice (absorb_bias), and the q and k slices' adds go into the fused op."""
    from kopt.models import qwen_image

    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(
        qwen_image.TINY_CONFIG, num_layers=1, num_attention_heads=4, attention_head_dim=128,
        joint_attention_dim=512, axes_dims_rope=(32, 48, 48)))
    w = qwen_image.build("tiny", dtype=torch.bfloat16)
    gm = kopt.optimize(w.model, w.args, w.kwargs, FP8_BLOCKWISE,
                       verify=VerifyOptions(enabled=False)).graph_module
    inputs = tuple(flatten_inputs(w.args, w.kwargs)[0])
    after, result = _rewrite(gm, QK_NORM_ROPE)
    assert result.matched == 1 and result.details[0].endswith("q bias, k bias"), result.details
    [fused] = [n for n in after.graph.nodes if n.target is QK]
    assert [len(fused.args[9]), len(fused.args[10])] == [2, 2]  # text and image segments

    def slice_bias_adds(g: fx.GraphModule) -> int:  # y[..., 512] + b[512]: one per q/k/v slice
        return sum(n.target is aten.add.Tensor and n.args[1].meta["val"].shape == (512,)
                   for n in g.graph.nodes if len(n.args) == 2 and isinstance(n.args[1], fx.Node))

    # q and k of text and image, and txt_in's (cat_rows took v's into the joint V copy)
    assert slice_bias_adds(gm) == 5 and slice_bias_adds(after) == 1
    _verifies(gm, after, inputs, QK_NORM_ROPE)


def test_act_quant_group_leaves_a_bias_add_another_op_reads() -> None:
    gm, inputs = _blockwise_graph(act="gelu_tanh", bias=True, tap_pre=True)
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 0 and _count(after, ACT_GROUP) == 0
    [(said, count)] = result.rejected.items()
    assert "is also used by" in said and count == 1


def test_gelu_erf_is_not_fused_and_says_why() -> None:
    """GELU(erf)+quant would not be bitwise on the GPU (Triton's erf vs CUDA's erff, measured):
    the exact rewrite leaves it, with the reason."""
    import kopt

    class ErfMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.gelu(self.up(x)))

    opt = kopt.optimize(ErfMLP().eval(), (torch.randn(4, 32),),
                        config=kopt.PassConfig(fp8=kopt.FP8Config(min_features=16)))
    result = opt.report.result("fuse_act_quant")
    assert result.matched == 0
    assert result.rejected == {
        "GELU(erf) is not bitwise in the fused kernel (erf differs in the last bit)": 1}


class ParallelBlock(nn.Module):
    """A single-stream block's tail: ``out(cat([attn, swiglu(mlp_in)]))``; the flags make it a
    near miss or put the activation first."""

    def __init__(self, act_first: bool = False, dim0: bool = False, tap: bool = False,
                 dims: tuple[int, int, int] = (32, 16, 48)) -> None:
        super().__init__()
        self.act_first, self.dim0, self.tap = act_first, dim0, tap
        d, d_attn, self.hidden = dims  # input, attention output, SwiGLU output widths
        self.attn, self.mlp_in = nn.Linear(d, d_attn), nn.Linear(d, 2 * self.hidden)
        self.out = nn.Linear(d_attn + self.hidden if not dim0 else self.hidden, d)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.mlp_in(x)
        a = F.silu(h[..., :self.hidden]) * h[..., self.hidden:]
        if self.dim0:
            row = torch.cat([a, a], 0)
        else:
            attn = self.attn(x)
            row = torch.cat([a, attn] if self.act_first else [attn, a], -1)
        y = self.out(row)
        return (y, row) if self.tap else y


@pytest.mark.parametrize("act_first", [False, True], ids=["attention-first", "act-first"])
def test_cat_act_quant_fires_in_either_order(act_first: bool) -> None:
    gm, inputs = _module_graph(ParallelBlock(act_first=act_first),
                               torch.randn(2, 5, 32, dtype=torch.bfloat16))
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 1 and _count(after, CAT_ACT) == 1
    [fused] = [n for n in after.graph.nodes if n.target is CAT_ACT]
    assert fused.args[4] is (not act_first)
    assert _count(after, aten.cat.default, aten.silu.default) == 0
    _verifies(gm, after, inputs, ACT_QUANT)


@pytest.mark.parametrize("act_first", [False, True], ids=["attention-first", "act-first"])
def test_cat_act_quant_group_fires_where_no_group_spans_both_parts(act_first: bool) -> None:
    model = ParallelBlock(act_first=act_first, dims=(512, 128, 384)).eval()
    x = torch.randn(2, 5, 512, dtype=torch.bfloat16)
    gm = kopt.optimize(model, (x,), config=FP8_BLOCKWISE,
                       verify=VerifyOptions(enabled=False)).graph_module
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 1 and _count(after, ACT_GROUP) == 1 and _count(after, CAT_ACT) == 0
    [fused] = [n for n in after.graph.nodes if n.target is ACT_GROUP]
    assert fused.args[4] is not None and fused.args[5] is (not act_first)
    assert _count(after, aten.cat.default, aten.silu.default) == 0
    _verifies(gm, after, (x,), ACT_QUANT)


def test_cat_act_quant_group_refuses_a_group_across_both_parts() -> None:
    # attention 100 wide first: its last group would take 28 of the SwiGLU's values
    model = ParallelBlock(dims=(512, 100, 412)).eval()
    x = torch.randn(2, 5, 512, dtype=torch.bfloat16)
    gm = kopt.optimize(model, (x,), config=FP8_BLOCKWISE,
                       verify=VerifyOptions(enabled=False)).graph_module
    after, result = _rewrite(gm, ACT_QUANT)
    assert result.matched == 0 and _count(after, ACT_GROUP) == 0
    [(said, count)] = result.rejected.items()
    assert "first part is 100 wide" in said and count == 1


@pytest.mark.parametrize(("flags", "reason"), [
    (dict(tap=True), "is also used by output: the unfused value is still needed"),
    (dict(dim0=True), "the concatenation is along dim 0, not the features"),
], ids=["cat-also-returned", "cat-of-rows"])
def test_cat_act_quant_near_misses_say_why(flags: dict, reason: str) -> None:
    gm, _ = _module_graph(ParallelBlock(**flags), torch.randn(2, 5, 32, dtype=torch.bfloat16))
    after, result = _rewrite(gm, ACT_QUANT)
    assert _count(after, CAT_ACT) == 0
    assert any(reason in said for said in result.rejected), result.rejected



def test_fuse_act_takes_what_act_quant_leaves_in_bf16_models() -> None:
    """Without FP8 there is no quantizer: FLUX.2's SwiGLUs become one kernel each, and its
    single-stream blocks write the SwiGLU beside the attention output (no cat); bitwise."""
    import kopt

    w = build("flux2-tiny", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    before = cap.gm
    after, result = _rewrite(before, FUSE_ACT)
    assert result.matched == 6 and result.rejected == {}
    fused = [n for n in after.graph.nodes if n.target is torch.ops.kopt.fused_act.default]
    assert sum(n.args[0] is not None for n in fused) == 2  # the single blocks' cat
    assert _count(after, aten.silu.default) == _count(before, aten.silu.default) - 6
    assert _count(after, aten.cat.default) == _count(before, aten.cat.default) - 2
    _verifies(before, after, list(cap.example_inputs), FUSE_ACT)
    assert kopt.PassConfig().fuse_act  # on by default: W2 BF16 measured faster with it


def test_fuse_act_near_miss_says_why() -> None:
    """The silu's output is returned too: it must still exist, the product stays unfused."""
    class SiluTapped(nn.Module):
        def forward(self, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
            s = F.silu(g)
            return s * u, s

    args = (torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16))
    after, result = _rewrite(capture_module(SiluTapped(), args).gm, FUSE_ACT)
    assert _count(after, torch.ops.kopt.fused_act.default) == 0
    [(said, count)] = result.rejected.items()
    assert "is also used by output: the unfused value is still needed" in said and count == 1
