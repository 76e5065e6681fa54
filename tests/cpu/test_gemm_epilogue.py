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
