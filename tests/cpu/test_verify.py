"""Verification: a wrong rewrite is caught, reverted site by site, and reported; the module the
user gets computes what the model computes."""

from __future__ import annotations

import torch
from torch import nn

from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.passes import PassConfig, PassManager, RewritePass
from kopt.patterns import PatternRewrite, exact, tolerance
from kopt.verify import RTOL_FLOOR, VerifyOptions, compare, random_inputs, run_fp64

# x * y -> x * |y|: wrong exactly where y has negative entries. Declared exact on purpose.
WRONG_ABS = PatternRewrite(
    "wrong_abs", lambda x, y: x * y, lambda x, y: x * torch.abs(y),
    lambda: [torch.randn(4), torch.randn(4)], exact("(deliberately false)"),
)


class TwoScales(nn.Module):
    """x * pos + x * neg: the rewrite is right at the first site, wrong at the second."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.rand(6) + 0.5)
        self.register_buffer("neg", -(torch.rand(6) + 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.pos + x * self.neg


class _Manager(PassManager):
    def __init__(self, rewrite: PatternRewrite) -> None:
        super().__init__(PassConfig(cse=False, merge_projections=False, fold_constants=False),
                         VerifyOptions())
        self.passes = [RewritePass("under_test", [rewrite])]


def test_failing_sites_are_reverted_and_reported_good_ones_kept() -> None:
    model = TwoScales().eval()
    x = torch.randn(3, 6)
    cap = capture_module(model, (x,))
    gm, (result,) = _Manager(WRONG_ABS).run(cap.gm, cap.example_inputs)
    assert result.matched == 1 and len(result.reverted) == 1
    assert result.verdict is not None and result.verdict.passed
    assert "1 failing sites reverted" in result.verdict.detail
    abs_ops = [n for n in gm.graph.nodes if n.target is torch.ops.aten.abs.default]
    assert len(abs_ops) == 1  # the positive-scale site keeps the (there harmless) rewrite
    assert torch.equal(gm(x)[0], model(x))


def test_pass_failing_everywhere_is_fully_reverted() -> None:
    class Neg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("neg", -(torch.rand(6) + 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.neg

    model = Neg().eval()
    x = torch.randn(3, 6)
    cap = capture_module(model, (x,))
    gm, (result,) = _Manager(WRONG_ABS).run(cap.gm, cap.example_inputs)
    assert result.matched == 0 and len(result.reverted) == 1
    assert result.verdict is not None and not result.verdict.passed
    assert "reverted" in result.verdict.detail
    assert not any(n.target is torch.ops.aten.abs.default for n in gm.graph.nodes)
    assert torch.equal(gm(x)[0], model(x))


def _with_output_changed(x: torch.Tensor, change) -> tuple:  # noqa: ANN001
    """(graph of TwoScales, a copy whose output goes through ``change(graph, out_node)``)."""
    cap = capture_module(TwoScales().eval(), (x,))
    after = copy_graph_module(cap.gm)
    out = next(n for n in after.graph.nodes if n.op == "output")
    with after.graph.inserting_before(out):
        changed = change(after.graph, out.args[0][0])
    out.args = ((changed,),)
    after.recompile()
    return cap.gm, after


def test_exact_tier_detects_a_change_of_one_ulp() -> None:
    x = torch.randn(3, 6)
    before, after = _with_output_changed(
        x, lambda g, o: g.call_function(torch.ops.aten.mul.Tensor, (o, 1.0 + 2.0**-23)))
    verdict = compare(before, after, [x], exact("test"))
    assert not verdict.passed and "not bitwise equal" in verdict.detail
    # ... which the tolerance tier accepts: one ulp is far inside the fp32 floor
    assert compare(before, after, [x], tolerance("test")).passed


def test_tolerance_tier_rejects_a_real_loss_of_precision() -> None:
    def through_bf16(g, o):  # noqa: ANN001, ANN202
        cast = torch.ops.aten._to_copy.default
        low = g.call_function(cast, (o,), {"dtype": torch.bfloat16})
        return g.call_function(cast, (low,), {"dtype": torch.float32})

    x = torch.randn(64, 6)
    before, after = _with_output_changed(x, through_bf16)
    verdict = compare(before, after, [x], tolerance("test"))
    assert not verdict.passed and "relative error" in verdict.detail


def test_fp64_reference_really_runs_in_fp64() -> None:
    class Lossy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + 1e8) - 1e8  # loses x entirely in fp32, not in fp64

    x = torch.full((4,), 0.25)
    cap = capture_module(Lossy(), (x,))
    (ref,) = run_fp64(cap.gm, [x])
    assert ref.dtype == torch.float64 and torch.equal(ref, x.double())
    assert RTOL_FLOOR[torch.float32] < 1e-5


def test_random_inputs_are_fresh_and_keep_ids_and_python_values() -> None:
    floats, ids = torch.randn(5, 3) * 4 + 10, torch.arange(5)
    a = random_inputs([floats, ids, 7], seed=0)
    b = random_inputs([floats, ids, 7], seed=1)
    assert not torch.equal(a[0], floats) and not torch.equal(a[0], b[0])
    assert abs(a[0].mean().item() - 10) < 3  # drawn like the example, not from N(0, 1)
    assert torch.equal(a[1], ids) and a[2] == 7
