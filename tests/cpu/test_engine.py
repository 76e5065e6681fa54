"""The rewrite engine: pattern rewrites fire, near misses explain themselves, guards record
reasons, benefit orders rewrites, uuids track code and config."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from kopt.capture import capture_module
from kopt.graph import copy_graph_module, stable_topo_sort
from kopt.passes import PassConfig, PassManager, RewritePass
from kopt.patterns import PatternRewrite, exact

aten = torch.ops.aten


def _vec() -> list[torch.Tensor]:
    return [torch.randn(4)]


# neg(neg(x)) -> x
DOUBLE_NEG = PatternRewrite(
    "double_neg", lambda x: torch.neg(torch.neg(x)), lambda x: x, _vec,
    exact("negation is exact"),
)
# neg(x) -> x * -1  (contained in DOUBLE_NEG: must lose to it)
NEG_TO_MUL = PatternRewrite(
    "neg_to_mul", lambda x: torch.neg(x), lambda x: x * -1.0, _vec, exact("x*-1 == -x"),
)
# x * c -> x + x * (c - 1), c bound as a scalar wildcard
SCALE = PatternRewrite(
    "scale", lambda x, c: x * c, lambda x, c: x + x * (c - 1), _vec, exact("demo"),
    scalars={"c": 0.123456},
)


def _graph(fn, *shapes) -> fx.GraphModule:  # noqa: ANN001
    class M(nn.Module):
        def forward(self, *xs):  # noqa: ANN002, ANN202
            return fn(*xs)

    return capture_module(M(), tuple(torch.randn(s) for s in shapes)).gm


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pattern_fires_with_exact_count_and_removes_ops() -> None:
    gm = _graph(lambda x, y: torch.neg(torch.neg(x)) + torch.neg(torch.neg(y)), (3, 4), (3, 4))
    assert _targets(gm).count(aten.neg.default) == 4
    result = RewritePass("p", [DOUBLE_NEG]).run(gm)
    assert result.matched == 2
    assert aten.neg.default not in _targets(gm)
    assert _targets(gm) == [aten.add.Tensor]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(gm(x, y)[0], x + y)


def test_near_miss_extra_user_is_explained() -> None:
    def fn(x):  # noqa: ANN001, ANN202
        inner = torch.neg(x)
        return torch.neg(inner), inner * 2  # inner escapes the pattern

    gm = _graph(fn, (3,))
    result = RewritePass("p", [DOUBLE_NEG]).run(gm)
    assert result.matched == 0
    reasons = [r.reason for r in result.rejections if r.near_miss]
    assert any("also used by" in r for r in reasons), reasons
    assert _targets(gm).count(aten.neg.default) == 2


def test_near_miss_wrong_op_is_explained() -> None:
    gm = _graph(lambda x: torch.neg(torch.relu(x)), (3,))
    result = RewritePass("p", [DOUBLE_NEG]).run(gm)
    assert result.matched == 0
    assert any("expected aten.neg where the graph has aten.relu" in r.reason
               for r in result.rejections)


def test_guard_reason_is_recorded_per_site() -> None:
    guarded = PatternRewrite(
        "double_neg_guarded", lambda x: torch.neg(torch.neg(x)), lambda x: x, _vec,
        exact("negation is exact"),
        guard=lambda gm, m: "too small" if m.bindings["x_1"].meta["val"].numel() < 10 else None,
    )
    gm = _graph(lambda x, y: (torch.neg(torch.neg(x)), torch.neg(torch.neg(y))), (3,), (4, 5))
    result = RewritePass("p", [guarded]).run(gm)
    assert result.matched == 1
    assert result.rejected == {"too small": 1}


def test_more_specific_pattern_outranks_the_one_it_contains() -> None:
    assert DOUBLE_NEG.benefit > NEG_TO_MUL.benefit
    gm = _graph(lambda x: torch.neg(torch.neg(x)), (3,))
    # Registered in the "wrong" order on purpose: the pass sorts by benefit.
    result = RewritePass("p", [NEG_TO_MUL, DOUBLE_NEG]).run(gm)
    assert result.matched == 1 and result.details[0].startswith(result.sites[0])
    assert _targets(gm) == []  # neg(neg(x)) -> x, not x*-1*-1
    gm2 = _graph(lambda x: torch.neg(x), (3,))
    assert RewritePass("p", [NEG_TO_MUL, DOUBLE_NEG]).run(gm2).matched == 1
    assert _targets(gm2) == [aten.mul.Tensor]


def test_scalar_wildcard_binds_the_literal() -> None:
    gm = _graph(lambda x: x * 3.0, (5,))
    result = RewritePass("p", [SCALE]).run(gm)
    assert result.matched == 1
    x = torch.randn(5)
    assert torch.allclose(gm(x)[0], x * 3.0)
    assert aten.add.Tensor in _targets(gm)


def test_pass_manager_uuid_is_stable_and_tracks_config_and_code() -> None:
    assert PassManager(PassConfig()).uuid() == PassManager(PassConfig()).uuid()
    assert PassManager(PassConfig()).uuid() != PassManager(PassConfig(cse=False)).uuid()
    a = RewritePass("p", [DOUBLE_NEG]).uuid()
    b = RewritePass("p", [NEG_TO_MUL]).uuid()
    assert a != b and a == RewritePass("p", [DOUBLE_NEG]).uuid()


def test_pass_config_fields_are_the_pipeline() -> None:
    from kopt.passes import PIPELINE

    assert tuple(name for name, _ in PIPELINE) == PassConfig.pass_names()
    try:
        PassConfig().replace(no_such_pass=False)
    except ValueError as exc:
        assert "no_such_pass" in str(exc)
    else:
        raise AssertionError("unknown pass accepted")


def test_stable_topo_sort_restores_order_and_keeps_the_rest() -> None:
    gm = _graph(lambda x: (x + 1) * 2 - 3, (3,))
    gm2 = copy_graph_module(gm)
    nodes = [n for n in gm2.graph.nodes if n.op == "call_function"]
    add, mul, sub = nodes
    add.prepend(sub)  # sub now before its input mul: invalid
    stable_topo_sort(gm2.graph)
    gm2.graph.lint()
    assert [n.target for n in gm2.graph.nodes if n.op == "call_function"] == [
        aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor]


def test_pattern_graphs_are_dumped(tmp_path) -> None:  # noqa: ANN001
    manager = PassManager(PassConfig(), dump_dir=tmp_path)
    manager.passes = [RewritePass("p", [DOUBLE_NEG, SCALE])]
    gm = _graph(lambda x: torch.neg(torch.neg(x)) * 3.0, (4,))
    manager.run(gm, [torch.randn(4)])
    text = (tmp_path / "patterns" / "double_neg.txt").read_text()
    assert text.count("torch.ops.aten.neg.default") == 2 and "numerics: exact" in text
    assert (tmp_path / "01_p.py").exists() and (tmp_path / "00_captured.py").exists()


def test_the_pipeline_leaves_the_collector_as_it_found_it():
    import gc

    from kopt.collect import collector_skips_what_lives_already

    gc.unfreeze()
    with collector_skips_what_lives_already():
        assert gc.get_freeze_count() > 0  # what lived before the passes is frozen
    assert gc.get_freeze_count() == 0
    keep = [object() for _ in range(10)]
    gc.freeze()  # the caller's own freeze (before a fork) is left alone
    calls = []
    try:
        with pytest.MonkeyPatch.context() as mp:  # a frozen object that dies leaves the count
            mp.setattr(gc, "freeze", lambda: calls.append("freeze"))
            mp.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            with collector_skips_what_lives_already():
                pass
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    del keep


class _RaisesHalfway(RewritePass):
    """Rewrites its sites, then raises: a bug that leaves the graph it ran on half rewritten."""

    def run(self, gm, sites=None):  # noqa: ANN001, ANN201
        super().run(gm, sites)
        raise RuntimeError("a bug in the pass")


@pytest.mark.parametrize("verify", [False, True])
def test_a_pass_that_raises_is_left_out_with_or_without_snapshots(verify, monkeypatch) -> None:  # noqa: ANN001
    """Without verification the passes share one copy of the captured graph (no snapshot per
    pass); a pass that raises there, after rewriting part of it, must still be left out as
    with a snapshot per pass, and the captured graph stays as captured either way."""
    from kopt.passes import pipeline
    from kopt.verify import VerifyOptions

    monkeypatch.delenv(pipeline.STRICT, raising=False)
    gm = _graph(lambda x: torch.neg(torch.neg(x)) * 0.5 + torch.neg(x), (4,))
    captured = _targets(gm)
    manager = PassManager(PassConfig(), VerifyOptions(enabled=verify))
    manager.passes = [_RaisesHalfway("broken", [NEG_TO_MUL]),
                      RewritePass("double_neg", [DOUBLE_NEG])]
    out, results = manager.run(gm, [torch.randn(4)])
    assert _targets(gm) == captured
    assert [r.name for r in results] == ["broken", "double_neg"]
    assert results[0].matched == 0 and "the pass raised RuntimeError" in str(results[0].verdict)
    assert results[1].matched == 1
    # the half-done rewrite (neg -> mul by -1) is not in the result; the other pass's is
    assert _targets(out).count(aten.neg.default) == 1
    x = torch.randn(4)
    got = out(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert torch.equal(got, torch.neg(torch.neg(x)) * 0.5 + torch.neg(x))


def test_fake_calls_of_equal_metadata_are_remembered_and_views_are_not() -> None:
    """A functional op's fake call is remembered by its inputs' metadata: a second call makes
    fresh fake tensors equal in metadata to what the op's fake implementation gives; other
    strides are another call; a view (aliasing its input) is never remembered."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from kopt.graph import fake_call
    from kopt.graph.splice import _OUTPUTS_BY_MODE

    mode = FakeTensorMode()
    with mode:
        a = torch.empty(8, 16, dtype=torch.bfloat16)
        b = torch.empty(16, 8, dtype=torch.bfloat16).t()  # other strides, same shape
    first = fake_call(mode, aten.mul.Tensor, (a, 2.0))
    again = fake_call(mode, aten.mul.Tensor, (a, 2.0))
    assert len(_OUTPUTS_BY_MODE[mode]) == 1
    assert isinstance(again, FakeTensor) and again is not first and again.fake_mode is mode
    assert (again.shape, again.stride(), again.dtype, again.device) == (
        first.shape, first.stride(), first.dtype, first.device)
    # made directly, not dispatched: still a storage of its own, and computes in the mode
    assert again.untyped_storage()._cdata not in {t.untyped_storage()._cdata
                                                  for t in (a, first)}
    with mode:
        assert (again + first).stride() == first.stride()
    other = fake_call(mode, aten.mul.Tensor, (b, 2.0))
    with mode:
        want = torch.mul(b, 2.0)
    assert len(_OUTPUTS_BY_MODE[mode]) == 2 and other.stride() == want.stride()
    split = fake_call(mode, aten.split.Tensor, (a, 4))
    assert len(_OUTPUTS_BY_MODE[mode]) == 2  # a view: run every time
    assert split[1].untyped_storage()._cdata == a.untyped_storage()._cdata


def test_fake_calls_on_inputs_that_start_elsewhere_share_one_memo_entry() -> None:
    """Each block's slice of a merged projection's output starts at another offset: the memo
    counts an input's storage offset only by its alignment (modulo 16 elements), so the slices
    share one entry while an unaligned slice is a call of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kopt.graph import fake_call
    from kopt.graph.splice import _OUTPUTS_BY_MODE

    mode = FakeTensorMode()
    with mode:
        merged = torch.empty(4, 6 * 64, dtype=torch.bfloat16)
        slices = [merged[:, i * 64:(i + 1) * 64] for i in range(6)]  # offsets 0, 64, ...
        odd = merged[:, 3:67]  # offset 3: another alignment
    outs = [fake_call(mode, aten.mul.Tensor, (s, 2.0)) for s in slices]
    assert len(_OUTPUTS_BY_MODE[mode]) == 1
    with mode:
        want = torch.mul(slices[5], 2.0)
    assert all((o.shape, o.stride(), o.dtype) == (want.shape, want.stride(), want.dtype)
               for o in outs)
    fake_call(mode, aten.mul.Tensor, (odd, 2.0))
    assert len(_OUTPUTS_BY_MODE[mode]) == 2


def test_dead_code_removal_keeps_what_fx_keeps() -> None:
    """kopt's dead-code removal remembers each op's purity: it drops the dead pure nodes FX
    drops and keeps the dead writes and random draws FX keeps, on the same graph."""
    from kopt.graph import remove_dead_code

    def build() -> fx.Graph:
        g = fx.Graph()
        x = g.placeholder("x")
        buf = g.placeholder("buf")
        y = g.call_function(aten.mul.Tensor, (x, 2.0))
        g.call_function(aten.add.Tensor, (y, 1.0))  # dead, pure
        g.call_function(aten.neg.default, (x,))  # dead, pure
        g.call_function(aten.copy_.default, (buf, y))  # dead result, writes buf
        g.call_function(aten.rand.default, ([4],))  # dead, random: FX keeps it
        g.call_function(aten.mul.Tensor, (x, 3.0))  # dead, pure (the same op as a live one)
        g.output(y)
        return g

    ours, theirs = build(), build()
    assert remove_dead_code(ours) and theirs.eliminate_dead_code()
    names = [str(n.target) for n in ours.nodes]
    assert names == [str(n.target) for n in theirs.nodes]
    assert "aten.copy_.default" in names and "aten.rand.default" in names
    assert "aten.add.Tensor" not in names and "aten.neg.default" not in names
    assert names.count("aten.mul.Tensor") == 1
    assert not remove_dead_code(ours)  # nothing left to remove
