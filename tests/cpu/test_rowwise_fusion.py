"""rowwise_fusion: norms with their residual update, modulation and FP8 quantization become one
kopt::rowwise call. Fires on the three tiny reference models (exact counts, the ops it removes
gone, the fused op present), not on near misses (with the reason), a larger fusion outranks the
one it contains, and the rewritten graph computes the same function (on the CPU the op runs the
unfused ops: bitwise; and at the declared tolerance tier)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import kopt
import kopt.codegen.rowwise as rowwise_module
from kopt.capture import flatten_inputs
from kopt.codegen import FP64_REFERENCES
from kopt.codegen.rowwise import RowwiseSpec, rowwise_triton
from kopt.graph import copy_graph_module
from kopt.models import build
from kopt.passes import build_passes
from kopt.passes.base import PassResult, RewritePass
from kopt.patterns.core import exact
from kopt.patterns.rowwise_fusion import (
    NORM_MODULATION,
    NORM_QUANT,
    NUMERICS,
    NUMERICS_FP32,
    RESIDUAL_NORM,
    RESIDUAL_NORM_QUANT,
    ROWWISE_FUSIONS,
    rowwise_fusions,
)
from kopt.verify import VerifyOptions, compare, random_inputs, relative_error, run_fp64

aten = torch.ops.aten
ROWWISE = torch.ops.kopt.rowwise.default
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
# the graphs these rewrites start from: the default passes, without this one
FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), rowwise_fusion=False)
CONFIGS = {"fp8": FP8, "bf16": FP8.replace(fp8=None), "fp8_gemm_epilogue": FP8.replace(
    gemm_epilogue=True), "fp8_unhoisted": FP8.replace(hoist=False)}
RNQ, NQ, RN, NM = (r.name for r in (RESIDUAL_NORM_QUANT, NORM_QUANT, RESIDUAL_NORM,
                                    NORM_MODULATION))


@functools.cache
def _optimized(name: str, config: str) -> tuple[fx.GraphModule, tuple]:
    """The bf16 tiny model after kopt's default passes (verification off: the tests verify) and
    its flat example inputs."""
    w = build(name, dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, CONFIGS[config],
                        verify=VerifyOptions(enabled=False))
    return opt.graph_module, tuple(flatten_inputs(w.args, w.kwargs)[0])


def _module_graph(model: nn.Module, *args: torch.Tensor,
                  config: kopt.PassConfig = FP8) -> tuple[fx.GraphModule, tuple]:
    opt = kopt.optimize(model.eval(), args, config=config, verify=VerifyOptions(enabled=False))
    return opt.graph_module, args


def _fuse(gm: fx.GraphModule, rewrites: tuple = tuple(ROWWISE_FUSIONS)) -> tuple[
        fx.GraphModule, PassResult]:
    after = copy_graph_module(gm)
    return after, RewritePass("rowwise_fusion", list(rewrites)).run(after)


def _count(gm: fx.GraphModule, *targets: object) -> int:
    return sum(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def _specs(gm: fx.GraphModule) -> list[RowwiseSpec]:
    return [RowwiseSpec.from_json(n.args[1]) for n in gm.graph.nodes if n.target is ROWWISE]


def _same_function(before: fx.GraphModule, after: fx.GraphModule, inputs: tuple,
                   tier: bool = False) -> None:
    """Bitwise equal on the CPU, where the op runs its reference (the unfused ops); with
    ``tier``, also verified at the declared tier against fp64 as the pipeline does."""
    verdict = compare(before, after, list(inputs), exact("CPU reference"),
                      VerifyOptions(seeds=(0,)))
    assert verdict.passed, verdict
    if tier:
        verdict = compare(before, after, list(inputs), NUMERICS, VerifyOptions(seeds=(1,)))
        assert verdict.passed and verdict.tier == "tolerance", verdict


def _fired(gm: fx.GraphModule) -> dict[str, int]:
    """Sites per rewrite, read off the fused ops' specs (what each one fuses)."""
    kinds = {(True, True): RNQ, (False, True): NQ, (True, False): RN, (False, False): NM}
    return dict(Counter(kinds[(s.residual, any(o.startswith("fp8") for o in s.outputs))]
                        for s in _specs(gm)))


# -- the reference models ----------------------------------------------------------------------
# (model, graph): sites per rewrite, sites whose residual later blocks read.
# Qwen-Image: img/txt norm1 and norm2 of 2 blocks (block 1's txt norm2 feeds nothing) and
# norm_out; all but block 0's norm1s follow a gated residual add; txt_norm, an RMSNorm, feeds
# txt_in (fused with its quantizer; in bf16 there is nothing to fuse it with).
# FLUX.2: 2 double blocks x norm1/norm2 x {img, context}, 2 single blocks (block 0's reads the
# concatenated streams, not an add) and norm_out (a slice of the last residual).
# Qwen3: input/post-attention RMSNorm of 2 layers (3 after a residual add) and the final norm
# after the last add (no FP8 GEMM after it: the bf16 output). QK norms are other rewrites'.
EXPECTED = {
    ("qwen-image-tiny", "fp8"): ({RNQ: 6, NQ: 3}, 4),
    ("flux2-tiny", "fp8"): ({RNQ: 7, NQ: 4}, 7),
    ("llm-tiny", "fp8"): ({RNQ: 3, NQ: 1, RN: 1}, 3),
    ("qwen-image-tiny", "bf16"): ({RN: 6, NM: 2}, 4),
    ("flux2-tiny", "bf16"): ({RN: 7, NM: 4}, 7),
    ("llm-tiny", "bf16"): ({RN: 4}, 3),  # layer 0's input norm: a plain RMSNorm, left alone
    # residual adds already in the FP8 GEMM's epilogue: the norm + quantization is what is left
    ("qwen-image-tiny", "fp8_gemm_epilogue"): ({NQ: 9}, 0),
    ("llm-tiny", "fp8_gemm_epilogue"): ({NQ: 4}, 0),  # the final norm has nothing to fuse
}


@pytest.mark.parametrize(("name", "config"), list(EXPECTED))
def test_fires_on_the_reference_models(name: str, config: str) -> None:
    gm, inputs = _optimized(name, config)
    after, result = _fuse(gm)
    sites, residuals = EXPECTED[(name, config)]
    assert _fired(after) == sites, result.details
    assert result.matched == sum(sites.values()) and result.rejected == {}
    assert _count(after, ROWWISE) == result.matched
    fp8 = sites.get(RNQ, 0) + sites.get(NQ, 0)
    assert _count(after, QUANT) == _count(gm, QUANT) - fp8
    assert sum("residual" in s.outputs for s in _specs(after)) == residuals
    # every LayerNorm is fused; each fused RMSNorm takes its rsqrt with it
    assert _count(after, aten.layer_norm.default) == 0
    rms = sum(s.norm == "rms" for s in _specs(after))
    assert rms == {"qwen-image-tiny": int(config != "bf16"), "flux2-tiny": 0,
                   "llm-tiny": sum(sites.values())}[name]
    assert _count(gm, aten.rsqrt.default) - _count(after, aten.rsqrt.default) == rms
    # the gated residual adds are gone with the norms they fed
    assert _count(gm, aten.add.Tensor) - _count(after, aten.add.Tensor) >= sites.get(
        RNQ, 0) + sites.get(RN, 0)
    _same_function(gm, after, inputs, tier=config == "fp8")


@pytest.mark.parametrize(("config", "modulation"), [("fp8_unhoisted", True), ("fp8", False)])
def test_adaln_is_the_modulation_step_unless_one_plus_scale_was_hoisted(
        config: str, modulation: bool) -> None:
    # in the pipeline the rewrites run before hoisting and see (1 + scale) * n + shift; on a
    # hoisted graph 1 + scale is a cached value and n * s1 + shift a generated epilogue
    gm, inputs = _optimized("qwen-image-tiny", config)
    after, _ = _fuse(gm)
    layer = [s for s in _specs(after) if s.norm == "layer"]
    assert len(layer) == 8 and all(s.modulation == modulation for s in layer)
    assert all((s.epilogue is None) == modulation for s in layer)
    _same_function(gm, after, inputs)


def test_a_larger_fusion_outranks_the_one_it_contains() -> None:
    benefits = [r.benefit for r in (RESIDUAL_NORM_QUANT, NORM_QUANT, RESIDUAL_NORM,
                                    NORM_MODULATION)]
    assert benefits == sorted(benefits, reverse=True) and len(set(benefits)) == 4
    gm, inputs = _optimized("qwen-image-tiny", "fp8")
    # alone, norm + quant takes all 9 norms; with the residual rewrite 6 of them grow a prologue
    alone, result = _fuse(gm, (NORM_QUANT,))
    assert result.matched == 9 and _fired(alone) == {NQ: 9}
    both, _ = _fuse(gm, (NORM_QUANT, RESIDUAL_NORM_QUANT))
    assert _fired(both) == {RNQ: 6, NQ: 3}
    assert _count(both, aten.add.Tensor) < _count(alone, aten.add.Tensor)


def test_the_fused_op_has_an_exact_fp64_reference() -> None:
    assert ROWWISE in FP64_REFERENCES
    for config in ("fp8", "bf16"):
        gm, inputs = _optimized("flux2-tiny", config)
        after, _ = _fuse(gm)
        fresh = random_inputs(list(inputs), 5)
        for want, got in zip(run_fp64(gm, fresh), run_fp64(after, fresh), strict=True):
            assert got.dtype == torch.float64 and relative_error(got, want) < 1e-12


@pytest.mark.parametrize(("name", "config"), [
    ("qwen-image-tiny", "fp8"), ("qwen-image-tiny", "fp8_unhoisted"), ("llm-tiny", "bf16")])
def test_the_triton_kernels_of_the_sites_verify_in_the_interpreter(
        name: str, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The specs the rewrites build compile in the row-wise template and verify at the tier
    with the kernel (Triton's interpreter) in place of the op's CPU reference."""
    gm, inputs = _optimized(name, config)
    after, result = _fuse(gm)
    specs: list[RowwiseSpec] = []

    def kernel(spec: RowwiseSpec, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        specs.append(spec)
        return rowwise_triton(spec, tensors)

    monkeypatch.setattr(rowwise_module, "rowwise_reference", kernel)
    verdict = compare(gm, after, list(inputs), NUMERICS, VerifyOptions(seeds=(2,)))
    assert verdict.passed, verdict
    assert len(specs) >= result.matched and set(specs) == set(_specs(after))


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny"])
def test_fp32_intermediates_fuse_the_same_sites_and_verify(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``FP8Config(intermediates="fp32")``: the same sites, every spec in fp32 order, verified
    at its tier with the Triton kernels (interpreter) in place of the references -- and the
    graph's output moves (a rewrite that rounded as before would leave it bitwise)."""
    gm, inputs = _optimized(name, "fp8")
    eager, _ = _fuse(gm)
    fp32, result = _fuse(gm, rowwise_fusions("fp32"))
    assert _fired(fp32) == _fired(eager) and result.matched == len(_specs(eager))
    assert all(s.intermediates == "fp32" and s.tier == "tolerance" for s in _specs(fp32))
    fresh = random_inputs(list(inputs), 3)
    assert not all(torch.equal(a, b) for a, b in zip(eager(*fresh), fp32(*fresh), strict=True))
    monkeypatch.setattr(rowwise_module, "rowwise_reference",
                        lambda spec, tensors: rowwise_triton(spec, tensors))
    verdict = compare(gm, fp32, list(inputs), NUMERICS_FP32, VerifyOptions(seeds=(4,)))
    assert verdict.passed and verdict.tier == "tolerance", verdict


def test_fp32_intermediates_is_part_of_the_fp8_config() -> None:
    with pytest.raises(ValueError, match="intermediates 'bf16'"):
        kopt.FP8Config(intermediates="bf16")
    passes = {}
    for order in ("eager", "fp32"):
        config = kopt.PassConfig(fp8=kopt.FP8Config(intermediates=order))
        passes[order] = next(p for p in build_passes(config) if p.name == "rowwise_fusion")
    assert passes["eager"].numerics == NUMERICS and passes["fp32"].numerics == NUMERICS_FP32
    # compile caches and the knowledge base key on the pass's uuid
    assert passes["eager"].uuid() != passes["fp32"].uuid()
    with pytest.raises(ValueError, match="intermediates 'x'"):
        rowwise_fusions("x")


# -- small modules: variants and near misses ---------------------------------------------------
class AdaLN(nn.Module):
    """A DiT block's seam: ``h = x + gate * proj(y)``, then ``fc(norm(h) * (1 + scale) +
    shift)``; returns h (the residual stream) and fc's output. ``scale1`` passes ``1 + scale``
    precomputed (as after hoisting); ``tap`` also returns the modulated value before the shift;
    ``axes`` normalises over the last ``axes`` dims."""

    def __init__(self, dim: int = 48, *, scale1: bool = False, tap: bool = False,
                 axes: int = 1, out: int = 32) -> None:
        super().__init__()
        self.proj, self.fc = nn.Linear(dim, dim), nn.Linear(dim, out)
        self.scale1, self.tap, self.axes = scale1, tap, axes

    def forward(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x + gate * self.proj(y)
        n = F.layer_norm(h, h.shape[-self.axes:], eps=1e-6)
        m = n * (scale if self.scale1 else 1 + scale)
        out = self.fc(m + shift)
        return (h, out, m) if self.tap else (h, out)


def _adaln_inputs(b: int = 3, t: int = 5, dim: int = 48, *, gate: tuple | None = None,
                  vec_batch: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  gate_dtype: torch.dtype | None = None) -> tuple:
    vb = b if vec_batch is None else vec_batch
    g = torch.randn(gate if gate is not None else (vb, 1, dim))
    x, y, g, scale, shift = (v.to(dtype) for v in (
        torch.randn(b, t, dim), torch.randn(b, t, dim), g, 0.1 * torch.randn(vb, 1, dim),
        torch.randn(vb, 1, dim)))
    return x, y, g.to(gate_dtype or dtype), scale, shift


@pytest.mark.parametrize(("kwargs", "inputs", "modulation"), [
    ({}, {}, True),  # (1 + scale) * n + shift: the template's modulation step
    ({"scale1": True}, {}, False),  # 1 + scale computed elsewhere: a generated epilogue
    ({}, {"vec_batch": 1}, True),  # one vector for all batch items
    ({}, {"b": 1, "t": 1}, True),  # one row
    ({"dim": 80}, {"dim": 80, "dtype": torch.float32}, True),
])
def test_gated_residual_norm_modulation_quant(kwargs: dict, inputs: dict,
                                              modulation: bool) -> None:
    dtype = inputs.get("dtype", torch.bfloat16)
    gm, args = _module_graph(AdaLN(**kwargs).to(dtype), *_adaln_inputs(**inputs))
    after, result = _fuse(gm)
    assert _fired(after) == {RNQ: 1} and result.rejected == {}
    (spec,) = _specs(after)
    assert spec.outputs == ("residual", "fp8_row") and spec.gate and spec.norm == "layer"
    assert spec.modulation == modulation and (spec.epilogue is None) == modulation
    assert _count(after, aten.layer_norm.default, aten.mul.Tensor) == 0
    _same_function(gm, after, args, tier=True)


def test_blockwise_fp8_quantizer_fuses_with_its_1x128_groups() -> None:
    blockwise = kopt.PassConfig(fp8=kopt.FP8Config(layout="blockwise", min_features=16),
                                rowwise_fusion=False)
    # in-features a multiple of 512: what blockwise FP8 takes (cuBLAS pads K/128 scales to 4)
    gm, args = _module_graph(AdaLN(dim=512, out=128).bfloat16(), *_adaln_inputs(dim=512, t=3),
                             config=blockwise)
    group = torch.ops.kopt.quant_fp8_group.default
    after, result = _fuse(gm)
    assert _fired(after) == {RNQ: 1}, result.rejections
    (spec,) = _specs(after)
    assert spec.outputs == ("residual", "fp8_group")
    assert _count(after, group) == _count(gm, group) - 1
    # the blockwise GEMM adds no bias: proj's bias add goes into the prologue, x + g * (y + b)
    assert spec.residual_bias and "x + g * (y + b)" in result.details[0]
    # of the adds (proj's bias, the residual, 1 + scale, + shift, fc's bias) only fc's is left
    assert _count(gm, aten.add.Tensor) == 5 and _count(after, aten.add.Tensor) == 1
    _same_function(gm, after, args, tier=True)


@pytest.mark.parametrize("config", ["fp8", "bf16"])
def test_a_bias_the_gemm_already_adds_is_not_taken_again(config: str) -> None:
    """Rowwise FP8 (``_scaled_mm`` adds the bias) and BF16 (``linear``): no bias add is left
    before the gated residual, so the prologue has none."""
    gm, args = _module_graph(AdaLN().bfloat16(), *_adaln_inputs(), config=CONFIGS[config])
    after, _ = _fuse(gm)
    (spec,) = _specs(after)
    assert spec.residual and spec.gate and not spec.residual_bias
    _same_function(gm, after, args)


class RMSBlock(nn.Module):
    """An LLM seam: ``h = x + o(a)``, ``up(norm(h))``, the norm written as Llama/Qwen3 do
    (``w * normed.to(dtype)``), as F.rms_norm, or as a LayerNorm with weight and bias."""

    def __init__(self, style: str, dim: int = 48) -> None:
        super().__init__()
        self.style = style
        self.o, self.up = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 64, bias=False)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.o(a)
        if self.style == "llama":
            hf = h.float()
            n = self.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                h.dtype)
        elif self.style == "aten":
            n = F.rms_norm(h, h.shape[-1:], self.weight, 1e-6)
        else:
            n = F.layer_norm(h, h.shape[-1:], self.weight, self.bias, 1e-5)
        return h, self.up(n)


@pytest.mark.parametrize(("style", "norm", "after_round"), [
    ("llama", "rms", True), ("aten", "rms", False), ("layer", "layer", False)])
def test_affine_order_follows_the_matched_norm(style: str, norm: str, after_round: bool) -> None:
    args = (torch.randn(2, 7, 48, dtype=torch.bfloat16), torch.randn(2, 7, 48,
                                                                      dtype=torch.bfloat16))
    gm, args = _module_graph(RMSBlock(style).to(torch.bfloat16), *args)
    after, result = _fuse(gm)
    assert _fired(after) == {RNQ: 1}, result.rejections
    (spec,) = _specs(after)
    assert (spec.norm, spec.affine_after_round, spec.weight) == (norm, after_round, True)
    assert spec.bias == (style == "layer") and not spec.gate
    assert spec.outputs == ("residual", "fp8_row")
    _same_function(gm, after, args, tier=True)


class Modulated(nn.Module):
    """``fc(layer_norm(x) * (1 + scale) + shift)``; ``tap`` also returns the modulated rows."""

    def __init__(self, dim: int = 48, tap: bool = False) -> None:
        super().__init__()
        self.fc, self.tap = nn.Linear(dim, 16), tap

    def forward(self, x: torch.Tensor, scale: torch.Tensor,
                shift: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift
        return (self.fc(m), m.sum(-1)) if self.tap else (self.fc(m),)


def _modulated_inputs(dim: int = 48) -> tuple[torch.Tensor, ...]:
    return tuple(v.bfloat16() for v in (torch.randn(2, 5, dim), 0.1 * torch.randn(2, 1, dim),
                                        torch.randn(2, 1, dim)))


def test_bf16_result_is_an_output_when_something_else_reads_it() -> None:
    gm, args = _module_graph(Modulated(tap=True).to(torch.bfloat16), *_modulated_inputs())
    after, _ = _fuse(gm)
    (spec,) = _specs(after)
    assert _fired(after) == {NQ: 1} and spec.outputs == ("out", "fp8_row") and spec.modulation
    _same_function(gm, after, args)


def test_rows_wider_than_one_tile_are_rejected() -> None:
    gm, args = _module_graph(Modulated(32784).to(torch.bfloat16), *_modulated_inputs(32784))
    after, result = _fuse(gm)
    assert _reasons(result, NQ) == ["rows of 32784 values: the template keeps a row in one tile "
                                    "(at most 32768)"]
    assert _count(after, ROWWISE) == 0


def _reasons(result: PassResult, rewrite: str) -> list[str]:
    return [r.reason for r in result.rejections if r.rewrite == rewrite and not r.near_miss]


@pytest.mark.parametrize(("model", "inputs", "rewrite", "reason", "fired"), [
    # the modulated value is also returned: it must be written, the site cannot end in quant;
    # residual + norm + the multiplication still fuse (writing the returned value)
    (AdaLN(tap=True), {}, NQ, "(aten.mul) is also used by output", {RN: 1}),
    # a gate per token (or per element) is not the template's per-batch gate
    (AdaLN(), {"gate": (3, 5, 1)}, RNQ, "gate (3, 5, 1) is not one vector per batch item of "
     "(3, 5, 48)", {NQ: 1}),
    (AdaLN(), {"gate": (3, 5, 48)}, RNQ, "gate (3, 5, 48) is not one vector per batch item of "
     "(3, 5, 48)", {NQ: 1}),
    # an fp32 gate promotes the sum: the template keeps one dtype for x, y and gate
    (AdaLN(), {"gate_dtype": torch.float32}, RNQ, "residual operand x is torch.bfloat16[3, 5, "
     "48], the sum torch.float32[3, 5, 48]", {NQ: 1}),
    # LayerNorm over [T, C]: not a row-wise norm
    (AdaLN(axes=2), {}, NQ, "layer_norm over the last 2 axes, not over one row", {}),
])
def test_near_misses_are_rejected_with_the_reason(model: nn.Module, inputs: dict, rewrite: str,
                                                  reason: str, fired: dict) -> None:
    gm, args = _module_graph(model.to(torch.bfloat16), *_adaln_inputs(**inputs))
    after, result = _fuse(gm)
    assert any(reason in r for r in _reasons(result, rewrite)), result.rejections
    assert _fired(after) == fired
    _same_function(gm, after, args)


def test_rms_statistics_over_another_axis_are_rejected() -> None:
    class AxisOne(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            return self.fc((xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6)).to(x.dtype))

    gm, args = _module_graph(AxisOne().to(torch.bfloat16),
                             torch.randn(2, 6, 32, dtype=torch.bfloat16))
    after, result = _fuse(gm)
    assert _reasons(result, NQ) == ["RMS statistics over axis [1] of a rank-3 tensor, not the "
                                    "last"]
    assert _count(after, ROWWISE) == 0


def test_a_chain_that_branches_off_the_norm_is_rejected() -> None:
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = F.layer_norm(x, (32,))
            return self.fc(n * torch.sigmoid(n))

    gm, _ = _module_graph(Branch().to(torch.bfloat16), torch.randn(2, 6, 32).bfloat16())
    after, result = _fuse(gm)
    (reason,) = _reasons(result, NQ)
    assert "is computed from the site's own value layer_norm" in reason
    assert _count(after, ROWWISE) == 0
