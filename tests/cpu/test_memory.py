"""What an optimized module holds (kopt.memory): each allocation counted once, by kind."""

from __future__ import annotations

import torch
from torch import nn

import kopt
from kopt.models import build


class _Block(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(1024, 1024) for _ in range(4))
        if tie:
            self.k.weight = self.q.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.relu(self.q(x)) * self.k(x) + self.v(x))


def _linears(m: nn.Module) -> list[nn.Linear]:
    return [c for c in m.modules() if isinstance(c, nn.Linear)]


def test_fp8_weights_are_packed_and_the_bf16_copies_only_the_original_reads():
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16).eval()
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    opt = kopt.optimize(model, (x,), config=kopt.PassConfig(fp8=kopt.FP8Config()))
    held = opt.memory()
    linears = _linears(model)
    assert held.original_only == sum(m.weight.nbytes for m in linears)  # the bf16 weights
    # one byte per FP8 weight value and one fp32 scale per output row
    assert held.packed == sum(m.weight.numel() + 4 * m.out_features for m in linears)
    assert held.weights == sum(m.bias.nbytes for m in linears)  # the biases, read as they are
    assert held.caches == 0 and held.graph_pool is None
    assert held.optimized == held.weights + held.packed
    assert "4.0 MiB packed constants" in str(opt.report)
    assert "8.0 MiB of the model's weights that only the original model reads" in str(opt.report)


def test_a_tied_weight_is_counted_once():
    torch.manual_seed(0)
    model = _Block(tie=True).eval()
    x = torch.randn(8, 1024)
    opt = kopt.optimize(model, (x,), config=kopt.PassConfig(merge_projections=False))
    held = opt.memory()
    unique = {id(p): p.nbytes for p in model.parameters()}  # the tied weight once
    assert held.weights + held.original_only == sum(unique.values())
    assert held.weights == sum(unique.values())  # without FP8 or merging the graph reads all


def test_hoisted_caches_count_what_they_hold_after_a_call():
    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    assert opt.memory().caches == 0
    opt(*w.args, **w.kwargs)
    held = opt.memory().caches
    entries = [out for region in opt._all_regions() for _, _, out in region._entries]
    expected = sum(t.untyped_storage().nbytes()
                   for t in torch.utils._pytree.tree_leaves(entries)
                   if isinstance(t, torch.Tensor))
    assert held > 0
    assert held <= expected  # views of one output share its storage, counted once
    opt.clear_caches()
    assert opt.memory().caches == 0


def test_the_backend_reports_what_its_graph_holds():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _Block().to(torch.bfloat16).eval()
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    reports: list = []
    compiled = torch.compile(model, backend="kopt", options={
        "config": kopt.PassConfig(fp8=kopt.FP8Config()), "reports": reports, "inner": "eager"})
    with torch.no_grad():
        compiled(x)
    assert len(reports) == 1
    text = str(reports[0])
    assert "4.0 MiB packed constants" in text
    assert "8.0 MiB of the model's weights that only the original model reads" in text


def test_optimizing_a_model_again_shares_the_merged_weights_the_first_packed():
    """The first optimization made q, k and v views of one merged buffer; a second one (a new
    module for the same model) holds those rows, not another copy of them."""
    torch.manual_seed(0)
    model = _Block().eval()
    x = torch.randn(8, 1024)
    first = kopt.optimize(model, (x,), cuda_graphs=False)
    merged = first.memory()
    assert merged.weights > 3 * 1024 * 1024 * 4
    assert model.q.weight.untyped_storage().nbytes() == 3 * model.q.weight.nbytes  # q; k; v
    second = kopt.optimize(model, (x,), cuda_graphs=False)
    assert second.memory().packed == merged.packed
    assert second.memory().weights == merged.weights
    assert first.memory() == merged  # the model's rows are still the first module's buffer
    assert torch.equal(second(x), first(x)) and torch.equal(second(x), model(x))
    with torch.no_grad():
        model.k.weight.mul_(2)  # changed in place: both modules see it
    assert torch.equal(second(x), model(x)) and torch.equal(first(x), model(x))
