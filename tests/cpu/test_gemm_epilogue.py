"""gemm_epilogue: the (gated) residual add after an FP8 GEMM moves into kopt's GEMM. Fires on
every residual branch the reference models end with; not on a GEMM output with another user or
a gate that is not one vector per batch item; numerics verified (on the CPU the fused op runs
the unfused ops, so outputs are bitwise equal)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kopt

aten = torch.ops.aten
FUSED = torch.ops.kopt.fp8_gemm.default
# the eager rounding order in the row-wise kernels: the residual then is the same tensor whether
# the GEMM's epilogue or the norm's prologue adds it (CPU outputs compared bitwise)
CONFIG = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16, intermediates="eager"),
                         gemm_epilogue=True)


def _count(gm, target) -> int:  # noqa: ANN001
    """Nodes calling ``target`` in the graph and its hoisted regions."""
    return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.target is target)


@pytest.mark.parametrize(("name", "sites", "tapped"), [
    # 2 blocks x {img, txt} x {attention, feed-forward}, less the two the last norm also reads
    ("qwen-image-tiny", 6, 2),
    ("flux2-tiny", 11, 6),  # one of them the timestep + guidance embedding sum (hoisted)
    ("llm-tiny", 4, 0),  # 2 layers x {attention, MLP} residual adds, no gate
])
def test_fires_on_the_residual_branches(name: str, sites: int, tapped: int) -> None:
    from kopt.models import build
    w = build(name, dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, CONFIG)
    result = opt.report.result("gemm_epilogue")
    assert result.matched == sites and result.verdict.passed
    assert result.verdict.tier == "tolerance"
    assert result.rejected.get("the GEMM's output has other users", 0) == tapped
    gm = opt.graph_module
    assert _count(gm, FUSED) == sites
    plain = kopt.optimize(w.model, w.args, w.kwargs, CONFIG.replace(gemm_epilogue=False))
    assert _count(plain.graph_module, aten._scaled_mm.default) - _count(
        gm, aten._scaled_mm.default) == sites
    with torch.no_grad():
        assert torch.equal(opt(*w.args, **w.kwargs)[0], plain(*w.args, **w.kwargs)[0])


class _Branch(nn.Module):
    def __init__(self, gate_shape: tuple[int, ...], tap: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)
        self.gate = nn.Parameter(torch.randn(gate_shape))
        self.tap = tap

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x)
        out = h + self.gate * y
        return (out, y * 2) if self.tap else (out,)


@pytest.mark.parametrize(("gate", "tap", "why"), [
    ((3, 1, 32), False, None),  # one gate per batch item: fires
    ((32,), False, None),
    ((3, 5, 32), False, "gate (3, 5, 32) is not one vector per batch item of (3, 5, 32)"),
    ((3, 1, 32), True, "the GEMM's output has other users"),
])
def test_near_misses_are_rejected_with_the_reason(gate: tuple, tap: bool, why: str | None) -> None:
    h, x = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    opt = kopt.optimize(_Branch(gate, tap).eval(), (h, x), config=CONFIG)
    result = opt.report.result("gemm_epilogue")
    if why is None:
        assert result.matched == 1 and result.verdict.passed
    else:
        assert result.matched == 0 and result.rejected == {why: 1}


# --- triton_gemm: every FP8 GEMM left to cuBLAS on kopt's template ------------------------------

TEMPLATE = CONFIG.replace(gemm_epilogue=False, triton_gemm=True)


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_triton_gemm_takes_every_fp8_gemm_hoisted_ones_too(name: str) -> None:
    from kopt.models import build
    w = build(name, dtype=torch.bfloat16)
    plain = kopt.optimize(w.model, w.args, w.kwargs, TEMPLATE.replace(triton_gemm=False))
    gemms = _count(plain.graph_module, aten._scaled_mm.default)
    opt = kopt.optimize(w.model, w.args, w.kwargs, TEMPLATE)
    result = opt.report.result("triton_gemm")
    assert gemms > 0 and result.matched == gemms and result.verdict.passed
    assert result.verdict.tier == "tolerance"
    gm = opt.graph_module
    assert _count(gm, aten._scaled_mm.default) == 0 and _count(gm, FUSED) == gemms
    with torch.no_grad():  # on the CPU the op runs _scaled_mm's reference: the same values
        assert torch.equal(opt(*w.args, **w.kwargs)[0], plain(*w.args, **w.kwargs)[0])


class _ScaledMM(nn.Module):
    """A hand-written FP8 GEMM with one argument kopt's template does not take."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.w = nn.Parameter(torch.randn(48, 32).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.to(torch.float8_e4m3fn)
        if self.change == "column-major A":
            a = a.t().contiguous().t()
        sa, sb = torch.ones(x.shape[0], 1), torch.ones(1, 48)
        kw: dict = {"out_dtype": torch.bfloat16, "use_fast_accum": self.change != "exact"}
        if self.change == "scale_result":
            kw["scale_result"] = torch.tensor(2.0)
        if self.change == "tensorwise":
            sa, sb = torch.tensor(1.0), torch.tensor(1.0)
        if self.change == "fp8 out":
            kw["out_dtype"] = torch.float8_e4m3fn
        return torch._scaled_mm(a, self.w.t(), sa, sb, **kw).float()


@pytest.mark.parametrize(("change", "why"), [
    ("none", None),
    ("scale_result", "the GEMM scales its result (scale_result)"),
    ("tensorwise", "scales are not rowwise ([M, 1] x [1, N])"),
    ("column-major A", "A is not row-major [M, K] (strides (1, 16))"),
    ("fp8 out", "GEMM output dtype torch.float8_e4m3fn (kopt's GEMM writes bf16/fp16/fp32)"),
    ("exact", "the GEMM accumulates exactly (FP8Config(accumulate='exact')); kopt's template "
              "accumulates fast"),
])
def test_triton_gemm_near_misses(change: str, why: str | None) -> None:
    x = torch.randn(16, 32)
    try:
        torch._scaled_mm(x.to(torch.float8_e4m3fn), torch.zeros(48, 32, dtype=torch.float8_e4m3fn
                                                                ).t(), torch.ones(16, 1),
                         torch.ones(1, 48), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:  # this CPU build has no FP8 GEMM
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    opt = kopt.optimize(_ScaledMM(change).eval(), (x,), config=kopt.PassConfig(triton_gemm=True))
    result = opt.report.result("triton_gemm")
    if why is None:
        assert result.matched == 1 and result.verdict.passed
    else:
        assert result.matched == 0 and result.rejected == {why: 1}
