"""remove_noops and cse: they fire where they should (exact counts), not on near misses, and
the graph computes bitwise the same function afterwards (their tier is exact)."""

from __future__ import annotations

import torch
from torch import fx, nn

from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.passes.cse import EliminateCommonSubexpressions
from kopt.passes.noop import RemoveNoOps
from kopt.verify import compare

aten = torch.ops.aten


def _count(gm: fx.GraphModule, target) -> int:  # noqa: ANN001
    return sum(n.target is target for n in gm.graph.nodes)


def _check_exact(pass_, model: nn.Module, *args: torch.Tensor):  # noqa: ANN001, ANN202
    cap = capture_module(model.eval(), args)
    after = copy_graph_module(cap.gm)
    result = pass_.run(after)
    verdict = compare(cap.gm, after, list(args), pass_.numerics)
    assert verdict.passed, verdict
    return cap.gm, after, result


class Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(self.lin(x))  # eval-mode dropout: traced as a clone
        sliced = x[:, :4]  # not dense: its clone is contiguous, with other strides
        return h * 2, sliced.clone() + x.t().clone().sum()  # x.t() is dense: clone is a no-op


def test_remove_noops_drops_eval_dropout_copies_only() -> None:
    before, after, result = _check_exact(RemoveNoOps(), Dropouts(), torch.randn(4, 8))
    assert _count(before, aten.clone.default) == 3
    assert result.matched == 2
    assert _count(after, aten.clone.default) == 1
    assert result.rejected == {"input is not dense: the copy changes strides": 1}


def test_remove_noops_keeps_copies_of_inputs_and_outputs() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x * 2
            return x.clone(), y.clone()  # returning x itself would alias the caller's tensor

    _, after, result = _check_exact(RemoveNoOps(), M(), torch.randn(3))
    assert result.matched == 0 and _count(after, aten.clone.default) == 2
    x = torch.ones(3)
    out = after(x)
    assert out[0].data_ptr() != x.data_ptr()


class Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # every "block" recomputes silu(t), as DiT blocks do for their modulation
        return self.a(nn.functional.silu(t)) + self.b(nn.functional.silu(t)) + torch.rand_like(x)


def test_cse_merges_identical_pure_ops_but_not_random_ones() -> None:
    model = Repeated().eval()
    cap = capture_module(model, (torch.randn(2, 8), torch.randn(2, 8)))
    after = copy_graph_module(cap.gm)
    result = EliminateCommonSubexpressions().run(after)
    assert _count(cap.gm, aten.silu.default) == 2
    assert result.matched == 1 and _count(after, aten.silu.default) == 1
    assert _count(after, aten.rand_like.default) == 1


def test_cse_is_bitwise_exact_on_a_deterministic_graph() -> None:
    class M(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t * 3.0) + torch.tanh(t * 3.0) * torch.tanh(t * -3.0)

    before, after, result = _check_exact(EliminateCommonSubexpressions(), M(), torch.randn(5))
    assert result.matched == 2  # the second mul and tanh; -3.0 differs, so its pair stays
    assert _count(after, aten.tanh.default) == 2
