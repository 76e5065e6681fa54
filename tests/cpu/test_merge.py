"""merge_projections: fires (exact counts, ops removed/added), does not fire on near misses,
keeps numerics at its declared tier; fires in every block of the three reference models."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import kopt
from kopt.capture import capture_module
from kopt.graph import constant_nodes
from kopt.passes import PassConfig, RewritePass
from kopt.patterns import MERGE_PROJECTIONS
from kopt.verify import VerifyOptions, compare
from tests.fixtures import QKV

aten = torch.ops.aten
MERGE_ONLY = PassConfig(cse=False, fold_constants=False)


def _linears(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.linear.default]


def _merge(model: nn.Module, *args: torch.Tensor):  # noqa: ANN202
    cap = capture_module(model, args)
    result = RewritePass("merge_projections", [MERGE_PROJECTIONS]).run(cap.gm)
    return cap, result


def test_fires_once_on_qkv_and_replaces_three_gemms_by_one() -> None:
    cap, result = _merge(QKV().eval(), torch.randn(2, 5, 37))
    assert result.matched == 1
    linears = _linears(cap.gm)
    assert len(linears) == 2  # merged q/k/v + the output projection
    merged = linears[0]
    assert merged.meta["val"].shape[-1] == 37 + 18 + 40
    splits = [n for n in cap.gm.graph.nodes if n.target is aten.split_with_sizes.default]
    assert len(splits) == 1 and splits[0].args[1] == [37, 18, 40]
    cats = [n for n in cap.gm.graph.nodes if n.target is aten.cat.default]
    assert len(cats) == 2  # weights and biases, both load-time constants
    assert all(c in constant_nodes(cap.gm.graph) for c in cats)


def test_optimize_packs_weights_at_load_time() -> None:
    model = QKV().eval()
    x = torch.randn(2, 5, 37)
    opt = kopt.optimize(model, (x,))
    gm = opt.graph_module
    assert not any(n.target is aten.cat.default for n in gm.graph.nodes)
    consts = constant_nodes(gm.graph)
    assert all(n.op == "get_attr" for n in consts)  # no op on parameters runs per call
    assert opt.report.result("merge_projections").matched == 1
    # the weights' and the biases' concatenations, packed by the merge before its check
    assert "2 concatenations of weights packed at load, the parameters viewing them" in \
        opt.report.result("merge_projections").notes
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_numerics_tier_on_awkward_shapes(bias: bool) -> None:
    # one row, odd features, long K: the merged GEMM must stay within the tolerance tier
    for rows, dim in [(1, 37), (3, 1024), (7, 129)]:
        model = QKV(dim, bias=bias).eval()
        x = torch.randn(rows, dim)
        cap = capture_module(model, (x,))
        before = cap.gm
        after = kopt.graph.copy_graph_module(before)
        assert RewritePass("m", [MERGE_PROJECTIONS]).run(after).matched == 1
        verdict = compare(before, after, [x], MERGE_PROJECTIONS.numerics,
                          VerifyOptions(seeds=(0, 1, 2, 3)))
        assert verdict.passed, verdict


class FlattensItsProjections(nn.Module):
    """Views each projection's output whole (``view(-1)``; through a transpose for k): valid on
    a contiguous GEMM output, not on a column slice of the merged one."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(-1)
        k = self.k(x).unsqueeze(0).view(-1)
        return torch.cat([q * k, self.v(x).view(x.shape[0], -1).sum(-1)])


def test_views_after_the_split_become_reshapes() -> None:
    """SGLang's attention views its projection outputs; merged, those outputs are column slices
    of one GEMM's: the views after them become reshapes and the merge is kept, verified."""
    model, x = FlattensItsProjections().eval(), torch.randn(2, 3, 16)
    opt = kopt.optimize(model, (x,))
    result = opt.report.result("merge_projections")
    assert result.matched == 1 and not result.reverted and result.verdict.passed
    views = [n for n in opt.graph_module.graph.nodes
             if n.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)]
    assert not views
    torch.testing.assert_close(opt(x), model(x))


def test_does_not_fire_on_different_inputs() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):  # noqa: ANN001, ANN201
            return self.a(x) + self.b(y)

    cap, result = _merge(M().eval(), torch.randn(2, 8), torch.randn(2, 8))
    assert result.matched == 0 and len(_linears(cap.gm)) == 2
    assert all("no other projection" in r.reason for r in result.rejections)


def test_does_not_fire_through_an_op_in_between() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.a(x) + self.b(torch.relu(x))

    cap, result = _merge(M().eval(), torch.randn(2, 8))
    assert result.matched == 0 and len(_linears(cap.gm)) == 2


def test_does_not_fire_on_mismatched_dtypes() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.to(torch.float64)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.a(x), self.b(x.double())

    class N(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.a(x), self.b(x)

    _, result = _merge(M().eval(), torch.randn(2, 8))
    assert result.matched == 0  # x and x.double() are different activations
    _, result = _merge(N().eval(), torch.randn(2, 8))
    assert result.matched == 0
    assert any("bias/no-bias mismatch" in r for r in result.rejected)


def test_does_not_fire_on_a_per_call_weight() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))

        def forward(self, x, s):  # noqa: ANN001, ANN201
            return nn.functional.linear(x, self.w1 * s), nn.functional.linear(x, self.w2)

    _, result = _merge(M().eval(), torch.randn(2, 8), torch.randn(8, 8))
    assert result.matched == 0
    assert "weight is computed per call, not a load-time constant" in result.rejected


def test_weights_changed_in_place_are_repacked_and_replaced_ones_reoptimized() -> None:
    model = QKV().eval()
    x = torch.randn(2, 5, 37)
    opt = kopt.optimize(model, (x,), verify=VerifyOptions(seeds=(0,)))
    with torch.no_grad():
        model.k.weight.mul_(3.0)  # in place: the packed [q;k;v] must follow
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=1e-5)
    model.v.weight = nn.Parameter(torch.randn_like(model.v.weight))  # a new object
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=1e-5)


def test_a_broadcast_constant_is_repacked_through_its_storage_or_refused() -> None:
    from kopt.api import write_constant
    from kopt.errors import KoptError

    base = torch.zeros(1, 4)
    held = base.expand(3, 4)  # what a folded expand leaves: one element per 3 positions
    write_constant(held, torch.arange(4.0).expand(3, 4).clone(), "c")
    assert torch.equal(base, torch.arange(4.0)[None]) and held.stride() == (0, 1)
    with pytest.raises(KoptError, match="c now varies along dims \\[0\\]"):
        write_constant(held, torch.randn(3, 4), "c")
    with pytest.raises(KoptError, match="has shape \\(2, 4\\)"):
        write_constant(held, torch.randn(2, 4), "c")
    dense = torch.zeros(2, 3)
    write_constant(dense, torch.ones(2, 3), "d")
    assert torch.equal(dense, torch.ones(2, 3))


# Expected merges per model: (description of the group, module path suffixes merged).
EXPECTED = {
    "qwen-image-tiny": [
        "transformer_blocks.0.attn.{to_q,to_k,to_v}",
        "transformer_blocks.0.attn.{add_q_proj,add_k_proj,add_v_proj}",
        "transformer_blocks.1.attn.{to_q,to_k,to_v}",
        "transformer_blocks.1.attn.{add_q_proj,add_k_proj,add_v_proj}",
    ],
    "flux2-tiny": [
        "transformer_blocks.0.attn.{to_q,to_k,to_v}",
        "transformer_blocks.0.attn.{add_q_proj,add_k_proj,add_v_proj}",
        "transformer_blocks.1.attn.{to_q,to_k,to_v}",
        "transformer_blocks.1.attn.{add_q_proj,add_k_proj,add_v_proj}",
    ],
    "llm-tiny": [
        "layers.0.self_attn.{q_proj,k_proj,v_proj}",
        "layers.0.mlp.{gate_proj,up_proj}",
        "layers.1.self_attn.{q_proj,k_proj,v_proj}",
        "layers.1.mlp.{gate_proj,up_proj}",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fires_in_every_block_of_the_reference_models(tiny, name: str) -> None:  # noqa: ANN001
    w = tiny[name]
    opt = kopt.optimize(w.model, w.args, w.kwargs, MERGE_ONLY)
    result = opt.report.result("merge_projections")
    for group in EXPECTED[name]:
        assert sum(d.endswith(group) for d in result.details) == 1, (group, result.details)
    assert result.matched == len(EXPECTED[name])
    assert result.verdict is not None and result.verdict.passed
    torch.testing.assert_close(w.run(opt), w.run(), rtol=1e-5, atol=1e-5)


def test_after_cse_the_modulation_linears_of_all_blocks_merge(tiny) -> None:  # noqa: ANN001
    w = tiny["qwen-image-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    details = opt.report.result("merge_projections").details
    mod = [d for d in details if "img_mod" in d]
    assert len(mod) == 1  # both blocks' and the output norm's: 5 modules, in a few words
    assert mod[0].endswith(": transformer_blocks.{0..1}.img_mod.1, "
                           "transformer_blocks.{0..1}.txt_mod.1, norm_out.linear"), mod[0]


def test_many_module_paths_are_grouped_on_their_block_index() -> None:
    from kopt.graph import compact_paths

    blocks = [f"blocks.{i}.{m}" for i in range(60) for m in ("img_mod.1", "txt_mod.1")]
    assert compact_paths([*blocks, "norm_out.linear"]) == \
        "blocks.{0..59}.img_mod.1, blocks.{0..59}.txt_mod.1, norm_out.linear"
    assert compact_paths([f"l.{i}.x" for i in (0, 1, 2, 3, 5, 7, 8, 9)] + ["head"]) == \
        "l.{0..3,5,7..9}.x, head"
    assert compact_paths(["b.0.attn.to_q", "b.0.attn.to_k", "b.0.attn.to_v"]) == \
        "b.0.attn.{to_q,to_k,to_v}"


def test_merged_weights_are_packed_in_place_not_copied() -> None:
    model = QKV().eval()
    x = torch.randn(3, 37)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = model(x)
    opt = kopt.optimize(model, (x,), verify=VerifyOptions(seeds=(0,)))
    packed = [t for n, t in opt.graph_module.named_buffers() if n.startswith("_kopt_")]
    storages = {t.untyped_storage().data_ptr() for t in packed}
    for name in ("q", "k", "v"):  # weights and biases now live in the packed buffers
        lin = getattr(model, name)
        assert lin.weight.untyped_storage().data_ptr() in storages
        assert lin.bias.untyped_storage().data_ptr() in storages
    assert model.out.weight.untyped_storage().data_ptr() not in storages
    for n, p in model.named_parameters():
        assert torch.equal(p, saved[n]), n  # values unchanged
    assert torch.equal(model(x), want)
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new)  # copies into the views: the packed buffers follow
    assert torch.equal(model.k.weight, new["k.weight"])
    torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)  # merge tier: reordering
