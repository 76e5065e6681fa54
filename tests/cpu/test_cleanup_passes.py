"""remove_noops and cse: they fire where they should (exact counts), not on near misses, and
the graph computes bitwise the same function afterwards (their tier is exact)."""

from __future__ import annotations

import torch
from torch import fx, nn

from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.passes.cse import EliminateCommonSubexpressions
from kopt.passes.noop import ReinplaceCacheUpdates, RemoveNoOps
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


class Casts(nn.Module):
    """Gemma's RMSNorm: computed in fp32, cast back with ``type_as`` of its own input."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x.float()
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return n.type_as(x), (x * 3).type_as(x), x.type_as(x)


def test_remove_noops_turns_type_as_into_a_cast_of_one_tensor() -> None:
    before, after, result = _check_exact(RemoveNoOps(), Casts(),
                                         torch.randn(4, 8, dtype=torch.bfloat16))
    assert _count(before, aten.type_as.default) == 3
    assert result.matched == 2 and _count(after, aten.type_as.default) == 1
    assert result.rejected == {
        "type_as of a graph input returned: the output would be the caller's tensor": 1}
    casts = [n for n in after.graph.nodes if n.target is aten._to_copy.default
             and n.kwargs == {"dtype": torch.bfloat16}]
    assert len(casts) == 1  # the norm's: it no longer reads x
    assert casts[0].args[0].target is aten.mul.Tensor


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


class Cache(nn.Module):
    """A cache written in place at positions ``pos`` (as HF's StaticCache does), then read."""

    def __init__(self, read_before: bool = False) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(2, 6, 4))
        self.read_before = read_before

    def forward(self, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = self.k.sum() if self.read_before else 0  # reads the cache before the update
        self.k.index_copy_(1, pos, new)
        return self.k * 2 + old


def test_reinplace_writes_the_cache_update_into_its_buffer() -> None:
    pos, new = torch.tensor([1, 3]), torch.randn(2, 2, 4)
    cap = capture_module(Cache().eval(), (pos, new))
    # the capture made the update functional: a new cache, copied back into the buffer
    assert _count(cap.gm, aten.index_copy.default) == 1 and _count(cap.gm, aten.copy_.default) == 1
    after = copy_graph_module(cap.gm)
    result = ReinplaceCacheUpdates().run(after)
    assert result.matched == 1
    assert _count(after, aten.index_copy_.default) == 1
    assert _count(after, aten.index_copy.default) == 0 and _count(after, aten.copy_.default) == 0
    # step after step, the same outputs and the same cache as the captured graph
    ref, got = copy_graph_module(cap.gm), after
    for step in range(3):
        p, v = torch.tensor([step, 5 - step]), torch.randn(2, 2, 4)
        assert torch.equal(ref(p, v)[0], got(p, v)[0])
    (ref_k,) = [t for n, t in ref.named_buffers() if n.endswith("k")]
    (got_k,) = [t for n, t in got.named_buffers() if n.endswith("k")]
    assert torch.equal(ref_k, got_k) and got_k.abs().sum() > 0


def test_reinplace_leaves_a_cache_read_elsewhere() -> None:
    pos, new = torch.tensor([1, 3]), torch.randn(2, 2, 4)
    cap = capture_module(Cache(read_before=True).eval(), (pos, new))
    result = ReinplaceCacheUpdates().run(copy_graph_module(cap.gm))
    assert result.matched == 0
    assert result.rejected == {
        "the buffer is read elsewhere: writing it in place would change what that reads": 1}


def test_reinplace_on_the_llm_decode_step_keeps_every_step_bitwise() -> None:
    import kopt
    from kopt.models import build
    from kopt.passes import PassConfig

    none = PassConfig().replace(**dict.fromkeys(PassConfig().enabled(), False))
    # the captured graph as it is, and with only this pass: two models with their own caches
    plain, w = (build("llm-tiny", mode="decode", seed=5) for _ in range(2))
    ref = kopt.optimize(plain.model, plain.args, plain.kwargs, none)
    opt = kopt.optimize(w.model, w.args, w.kwargs, none.replace(reinplace=True))
    result = opt.report.result("reinplace")
    assert result.matched == 2 * 2 and result.verdict.passed  # K and V of 2 layers
    ids = w.kwargs["input_ids"]
    with torch.no_grad():
        for step in range(3):  # each step appends a token to what the steps before wrote
            kw = {"input_ids": torch.randint(0, 512, ids.shape, generator=torch.Generator()
                                             .manual_seed(step)),
                  "cache_position": w.kwargs["cache_position"] + step}
            assert torch.equal(opt(**kw), ref(**kw))
    caches = [{n: t for n, t in m.named_buffers() if "cache" in n}
              for m in (plain.model, w.model)]
    assert caches[0].keys() == caches[1].keys() and len(caches[0]) == 4
    assert all(torch.equal(caches[0][n], caches[1][n]) for n in caches[0])
    fresh = dict(build("llm-tiny", mode="decode", seed=5).model.named_buffers())
    assert not any(torch.equal(fresh[n], caches[1][n]) for n in caches[1])  # written


def test_the_qk_norm_rope_fusion_still_reaches_attention_through_the_inplace_cache() -> None:
    import kopt
    from kopt.models import build

    w = build("llm-tiny", mode="decode", seed=5)
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    assert opt.report.result("reinplace").matched == 4
    assert opt.report.result("fuse_qk_norm_rope").matched == 2 and opt.report.verified
