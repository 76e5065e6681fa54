"""The weights FP8 replaced move to host memory once kopt is done (``kopt.offload``), and come
back bit for bit for what needs them: the original model, a new input signature, an in-place
weight change, ``restore_original``. On the CPU the tests let the CPU's own tensors move (the
default moves CUDA tensors only), which exercises the same code."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt import offload
from kopt.memory import tensors_read
from kopt.models import build

FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


@pytest.fixture(autouse=True)
def _cpu_moves(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(offload, "OFFLOAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny models' weights move too


def _emptied(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() == 0]


def test_replaced_weights_leave_and_come_back_bit_for_bit() -> None:
    w = build("qwen-image-tiny")
    expected = w.run()
    kept = kopt.optimize(w.model, w.args, w.kwargs, FP8, keep_original=True)
    assert _emptied(w.model) == [] and kept.memory().host == 0
    # measured now: once the weights move, every module of this model sees them gone
    kept_original_only = kept.memory().original_only
    want = w.run(kept)
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    moved = _emptied(w.model)
    held = opt.memory()
    # the FP8 linears' weights left; what a graph reads (norms, the embedders below
    # min_features) stayed
    assert moved and all("weight" in n or "bias" in n for n in moved)
    assert held.host > 0 and held.original_only + held.host <= kept_original_only
    assert "moved to host memory" in str(opt.report)
    assert torch.equal(w.run(opt), want)
    with opt.original_weights() as model:
        assert _emptied(model) == []
        assert torch.equal(w.run(model), expected)
    assert _emptied(w.model) == moved and torch.equal(w.run(opt), want)
    assert opt.restore_original() is w.model
    assert _emptied(w.model) == [] and opt.memory().host == 0
    assert torch.equal(w.run(), expected) and torch.equal(w.run(opt), want)


def test_a_new_input_signature_and_an_in_place_change_see_the_weights() -> None:
    w = build("qwen-image-tiny")
    other = build("qwen-image-tiny", text_tokens=5)  # the same weights (seed), another signature
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    moved = _emptied(w.model)
    with opt.original_weights():
        want_other = main = other.run(w.model)
    got = other.run(opt)  # captured and verified with the weights back, then moved again
    # moved again, with what the new signature's packing superseded (its own copy of merged
    # biases the parameters view, where the graphs read the first signature's)
    assert len(opt.graph_modules) == 2 and set(moved) <= set(_emptied(w.model))
    assert (got - want_other).abs().max() <= 0.1 * main.abs().max()
    name = moved[0]
    with opt.original_weights() as model:
        with torch.no_grad():
            dict(model.named_parameters())[name].mul_(2)  # re-packed when the block ends
        want = w.run(kopt.optimize(model, w.args, w.kwargs, FP8, keep_original=True))
    assert torch.equal(w.run(opt), want)
    assert set(moved) <= set(_emptied(w.model))  # optimizing inside the block kept the move


def test_a_new_signature_reading_a_weight_the_first_superseded_keeps_it() -> None:
    """A graph for a new input signature that reads BF16 weights the first one's FP8 packing
    superseded (here: optimized without FP8) keeps them on the device, where it reads them."""
    w = build("qwen-image-tiny")
    other = build("qwen-image-tiny", text_tokens=5)  # the same weights (seed), another signature
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    assert _emptied(w.model)
    with opt.original_weights() as model:
        want = other.run(model)
    opt.config = kopt.PassConfig()  # the next signature's graph reads the BF16 weights
    got = other.run(opt)
    read = {t.untyped_storage()._cdata for t in tensors_read(opt.graph_modules)}
    assert all(offload.holder(p) is None for p in w.model.parameters()
               if p.untyped_storage()._cdata in read)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert torch.equal(other.run(opt), got)


def test_the_original_model_called_or_optimized_again_gets_its_weights_back() -> None:
    """Calling the original model (or one of its modules), or optimizing it again, puts the
    moved weights back for good, with a warning: the original model keeps working."""
    w = build("qwen-image-tiny")
    expected = w.run()
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    want = w.run(opt)
    assert _emptied(w.model)
    with pytest.warns(UserWarning, match="back on the device for good"):
        assert torch.equal(w.run(), expected)
    assert _emptied(w.model) == [] and opt.memory().host == 0
    assert torch.equal(w.run(opt), want)
    other = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    assert _emptied(w.model)
    with pytest.warns(UserWarning, match="back on the device for good"):
        again = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    # the first module gave its weights back for good; the new one moved them again
    assert other.memory().host == 0 and again.memory().host > 0
    assert torch.equal(w.run(again), w.run(other))
    linear = next(m for m in w.model.modules() if isinstance(m, torch.nn.Linear)
                  and m.weight.untyped_storage().nbytes() == 0)
    x = torch.randn(3, linear.in_features)
    with pytest.warns(UserWarning, match="Linear was called"):
        y = linear(x)  # a module of the model, called on its own
    assert again.memory().host == 0 and _emptied(w.model) == []
    assert torch.equal(y, torch.nn.functional.linear(x, linear.weight, linear.bias))


def test_keep_original_moves_nothing() -> None:
    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, keep_original=True)
    assert _emptied(w.model) == [] and opt.memory().host == 0
    assert "moved to host memory" not in str(opt.report)


def test_fp8_packing_releases_each_weight_as_its_rows_are_written() -> None:
    """A row-wise quantizer of a row-concatenation of weights runs one weight at a time into
    its output's rows (the concatenation is never made), and each weight leaves as soon as its
    rows are written: bitwise the values of the whole concatenation quantized at once."""
    import operator

    from torch import fx

    from kopt.codegen.kernels import quant_fp8  # noqa: F401 -- registers the op
    from kopt.passes.fold import LoadProgram

    root = torch.nn.Module()
    for i, rows in enumerate((3, 5, 2)):
        root.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(rows, 8) * (i + 1)))
    graph = fx.Graph()
    ws = [graph.get_attr(f"w{i}") for i in range(3)]
    q = graph.call_function(torch.ops.kopt.quant_fp8_rowwise.default,
                            (graph.call_function(torch.ops.aten.cat.default, (ws, 0)),))
    outs = [graph.call_function(torch.ops.aten.t.default,
                                (graph.call_function(operator.getitem, (q, k)),))
            for k in range(2)]
    graph.output(tuple(outs))
    program = LoadProgram(fx.GraphModule(root, graph), ("q", "s"), ("w0", "w1", "w2"))
    saved = torch.cat([root.w0, root.w1, root.w2]).detach()
    whole = torch.ops.kopt.quant_fp8_rowwise(saved)

    events: list[str] = []
    real_quant = torch.ops.kopt.quant_fp8_rowwise.default
    holder = offload.HostCopies()
    real_move = holder.move

    def move(tensors, quiet=False):  # noqa: ANN001, ANN202
        tensors = list(tensors)
        events.extend(f"release {t.shape[0]}" for t in tensors)
        return real_move(tensors, quiet)

    holder.move = move
    cats = []
    real_cat = torch.cat

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is real_quant or getattr(func, "_overloadpacket", None) is \
                    torch.ops.kopt.quant_fp8_rowwise:
                events.append(f"quant {args[0].shape[0]}")
            if func in (real_cat, torch.ops.aten.cat.default):
                cats.append(func)
            return func(*args, **(kwargs or {}))

    with offload.releasing(holder, list(root.parameters())), Spy():
        q_t, s_t = program.run(keep=frozenset())
    assert events == ["quant 3", "release 3", "quant 5", "release 5", "quant 2", "release 2"]
    assert cats == [] and all(p.untyped_storage().nbytes() == 0 for p in root.parameters())
    assert torch.equal(q_t.t().view(torch.uint8), whole[0].view(torch.uint8))
    assert torch.equal(s_t.t(), whole[1])
    holder.restore()
    assert torch.equal(torch.cat([root.w0, root.w1, root.w2]).detach(), saved)


def _three_weights_merged() -> tuple:  # noqa: ANN202
    """A graph ``linear(x, cat([w0; w1; w2]))`` as the merge pass leaves it, from export."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kopt.capture import SOURCE_KEY

    root = torch.nn.Module()
    for i, rows in enumerate((3, 5, 2)):
        root.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(rows, 8) * (i + 1)))
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = FakeTensorMode().from_tensor(torch.empty(4, 8))  # the pass's fake mode
    cat = graph.call_function(torch.ops.aten.cat.default,
                              ([graph.get_attr(f"w{i}") for i in range(3)], 0))
    graph.output(graph.call_function(torch.ops.aten.linear.default, (x, cat)))
    gm = fx.GraphModule(root, graph)
    gm.meta[SOURCE_KEY] = "export"
    return gm, list(root.parameters())


@pytest.mark.parametrize("fails", [False, True])
def test_a_large_concatenation_is_assembled_through_host_memory(monkeypatch, fails) -> None:  # noqa: ANN001
    """A concatenation of weights above ``HOST_PACK_BYTES``, packed in place while the weights
    may move, is made from host copies: every weight's device memory is freed before the
    buffer is allocated (the device never holds both), the weights then view its rows with
    their values, and the buffer is the model's to release. If the buffer cannot be allocated,
    the weights come back with their bytes and the error is the allocator's."""
    from kopt.passes import fold

    gm, weights = _three_weights_merged()
    saved = [w.detach().clone() for w in weights]
    x = torch.randn(4, 8)
    want = gm(x)
    monkeypatch.setattr(fold, "HOST_PACK_BYTES", 0)
    alive: list[list[int]] = []  # each source storage's bytes when a buffer is allocated
    real_empty = torch.empty

    def empty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if args and args[0] == (10, 8):
            alive.append([w.untyped_storage().nbytes() for w in weights])
            if fails:
                raise torch.OutOfMemoryError("no room for the buffer")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    holder = offload.HostCopies()
    with offload.releasing(holder, weights):
        if fails:
            with pytest.raises(torch.OutOfMemoryError, match="no room"):
                fold.FoldConstants("merge", in_place_only=True).run(gm)
            assert alive == [[0, 0, 0]]
            assert all(torch.equal(w, v) for w, v in zip(weights, saved, strict=True))
            return
        result = fold.FoldConstants("merge", in_place_only=True).run(gm)
        assert alive == [[0, 0, 0]] and result.matched == 1
        storage = weights[0].untyped_storage()
        assert all(w.untyped_storage().data_ptr() == storage.data_ptr() for w in weights)
        assert [w.storage_offset() for w in weights] == [0, 24, 64]
        assert all(torch.equal(w, v) for w, v in zip(weights, saved, strict=True))
        assert torch.equal(gm(x), want)
        size = storage.nbytes()
        assert size == 10 * 8 * 4 and offload.release([weights[0]]) == size  # the model's
    holder.restore()
    assert torch.equal(gm(x), want)


def test_the_passes_after_fp8_check_a_graph_whose_bf16_weights_left_already() -> None:
    """``fold_weights`` packs the FP8 weights right after the fp8 pass and moves each BF16
    weight out as its packed copy is stored: the passes after it run and verify without them,
    and the result is bit for bit the module that kept them."""
    from kopt.passes import pipeline

    w = build("qwen-image-tiny")
    kept = kopt.optimize(w.model, w.args, w.kwargs, FP8, keep_original=True)
    want = w.run(kept)
    del kept
    seen: dict[str, list[str]] = {}
    real = pipeline.PassManager._run

    def spy(self, gm, example, *a, **k):  # noqa: ANN001, ANN202
        for p in self.passes:
            def run(g, sites=None, _run=p.run, _name=p.name):  # noqa: ANN001, ANN202
                seen[_name] = _emptied(w.model)
                return _run(g) if sites is None else _run(g, sites)
            p.run = run
        return real(self, gm, example, *a, **k)

    pipeline.PassManager._run = spy
    try:
        opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    finally:
        pipeline.PassManager._run = real
    names = [r.name for r in opt.report.passes]
    assert names.index("fold_weights") == names.index("fp8") + 1
    assert seen["fold_weights"] == [] and seen["rowwise_fusion"]
    assert set(seen["rowwise_fusion"]) <= set(_emptied(w.model))
    assert all(r.verdict.passed for r in opt.report.passes if r.verdict is not None)
    assert opt.report.result("fuse_act_quant").verdict is not None  # checked, weights gone
    assert torch.equal(w.run(opt), want)


def test_weights_a_failed_packing_released_come_back(monkeypatch) -> None:  # noqa: ANN001
    """A ``fold_weights`` that raises halfway, after releasing weights, leaves the graph before
    it, which reads them: they come back, and the rest of the pipeline runs as without it."""
    from kopt.passes.fold import FoldConstants

    w = build("qwen-image-tiny")
    base = kopt.optimize(w.model, w.args, w.kwargs, FP8.replace(fold_weights=False),
                         keep_original=True)
    want = w.run(base)
    del base
    real = FoldConstants.run

    def failing(self, gm, sites=None):  # noqa: ANN001, ANN202
        result = real(self, gm, sites)
        if self.name == "fold_weights":
            assert _emptied(w.model), "nothing was released before the failure"
            raise RuntimeError("injected")
        return result

    monkeypatch.setattr(FoldConstants, "run", failing)
    monkeypatch.setenv("KOPT_STRICT", "0")  # the tests raise what a pass raises, elsewhere
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    assert "raised RuntimeError: injected" in str(opt.report.result("fold_weights").verdict)
    assert opt.report.result("fold_constants").matched > 0
    assert torch.equal(w.run(opt), want)
    with pytest.warns(UserWarning, match="back on the device for good"):
        w.run()


def test_the_largest_weight_is_quantized_last() -> None:
    """Each row-local op allocates its whole output before its weight goes: the load program
    runs them smallest weight first, after everything else, so the largest output comes when
    the other weights have left already."""
    from torch import fx

    from kopt.codegen.kernels import quant_fp8  # noqa: F401 -- registers the op
    from kopt.passes.fold import _defer_rows

    root = torch.nn.Module()
    for name, rows in (("big", 64), ("small", 4), ("other", 8)):
        root.register_parameter(name, torch.nn.Parameter(torch.randn(rows, 16)))
    graph = fx.Graph()
    quants = {}
    for name in ("big", "small"):
        quants[name] = graph.call_function(torch.ops.kopt.quant_fp8_rowwise.default,
                                           (graph.get_attr(name),))
    other = graph.call_function(torch.ops.aten.t.default, (graph.get_attr("other"),))
    graph.output((quants["big"], quants["small"], other))
    gm = fx.GraphModule(root, graph)
    _defer_rows(gm)
    order = list(gm.graph.nodes)
    assert order.index(other) < order.index(quants["small"]) < order.index(quants["big"])
    gm.graph.lint()


def test_no_check_concatenates_the_merged_weights(monkeypatch) -> None:  # noqa: ANN001
    """The merge pass packs the concatenations it makes before it is checked (the parameters
    view the packed buffer): no check, its own and FP8's included, concatenates weights per
    call (W1: 12.7 GiB each time), and the result is bit for bit the one packed later."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kopt.passes import fold, pipeline

    cats: list[str] = []
    model: list[torch.nn.Module] = []

    class Cats(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is torch.ops.aten.cat.default:
                # the weights' storages now (a storage freed by packing may be reused)
                weights = {p.untyped_storage()._cdata for p in model[0].parameters()}
                if all(t.untyped_storage()._cdata in weights  # of whole weights
                       and t.untyped_storage().nbytes() == t.nbytes for t in args[0]):
                    cats.append(func.__name__)
            return func(*args, **(kwargs or {}))

    real = pipeline.compare

    def compare(before, after, *a, **k):  # noqa: ANN001, ANN202
        with Cats():
            return real(before, after, *a, **k)

    monkeypatch.setattr(pipeline, "compare", compare)

    def optimize(**kw: object) -> torch.Tensor:
        w = build("qwen-image-tiny")
        model[:] = [w.model]
        opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, keep_original=True)
        assert any("packed at load" in n for n in opt.report.result("merge_projections").notes
                   ) == kw.get("packed", True)
        return w.run(opt)

    with monkeypatch.context() as m:  # the merge as it was: packed only by fold_constants
        m.setattr(fold.PackedAfter, "run", lambda self, gm, sites=None: self.inner.run(gm, sites))
        want = optimize(packed=False)
    assert cats  # its checks concatenate the merged weights
    cats.clear()
    assert torch.equal(optimize(), want)
    assert cats == []


@pytest.mark.parametrize("through_host", [False, True])
def test_a_warm_start_releases_the_weights_as_it_packs(tmp_path, monkeypatch, through_host  # noqa: ANN001
                                                       ) -> None:
    """A warm start runs the recorded load programs with the same releases as the cold run:
    the BF16 weights are gone once the graph is restored, its end-to-end check (the captured
    graph run first) passes, and the outputs are the cold module's, bit for bit. The merged
    weights are packed as the cold run packed them, through host memory where it did."""
    from kopt.kb import KnowledgeBase, using
    from kopt.offload import HostCopies
    from kopt.passes import fold

    through: list[int] = []
    if through_host:
        monkeypatch.setattr(fold, "HOST_PACK_BYTES", 0)
        real_out = offload.copied_out

        def copied_out(tensors):  # noqa: ANN001, ANN202
            hosts = real_out(tensors)
            through.append(0 if hosts is None else len(hosts))
            return hosts

        monkeypatch.setattr(offload, "copied_out", copied_out)

    moves: list[int] = []
    real = HostCopies.move

    def move(self, tensors, quiet=False):  # noqa: ANN001, ANN202
        n = real(self, tensors, quiet)
        moves.append(n)
        return n

    with KnowledgeBase.open(tmp_path / "kb.sqlite") as kb:
        outs = []
        for _ in range(2):
            w = build("qwen-image-tiny")
            with using(kb):
                moves.clear()
                HostCopies.move = move
                try:
                    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8,
                                        verify=kopt.VerifyOptions(seeds=(0,)))
                finally:
                    HostCopies.move = real
            outs.append(w.run(opt))
            # all but the module's last sweep moved one weight at a time, as packed
            assert len([n for n in moves if n]) > 1 and _emptied(w.model)
            assert (sum(through) > 0) == through_host  # the merged weights, copied out
            through.clear()
        assert "warm start" in opt.report.warm and "check on seed 0 passed" in opt.report.warm
    assert torch.equal(outs[0], outs[1])


def _copied_ahead(holder: offload.HostCopies) -> None:
    """Wait until the threads copying ahead have copied every storage."""
    for copy in list(holder._ahead._copies.values()):
        assert copy.done.wait(30)


def test_releases_take_the_copies_made_ahead_only_while_the_weight_is_unchanged(
        monkeypatch) -> None:  # noqa: ANN001
    """With ``ahead``, threads copy the owned weights to host memory as the block starts; a
    release then frees a weight unchanged since without copying it, and copies again one
    written in place after its copy. Each weight comes back as it was at its release."""
    weights = [torch.randn(64, 32) for _ in range(6)]
    tied = weights[2].view(32, 64)  # another tensor over a storage: its writes count too
    copied: list[int] = []
    real = offload._to_host
    monkeypatch.setattr(offload, "_to_host",
                        lambda src, *a: (copied.append(src.numel()), real(src, *a))[1])
    holder = offload.HostCopies()
    with offload.releasing(holder, [*weights, tied], ahead=True):
        _copied_ahead(holder)
        weights[1].mul_(2)
        tied[0, 0] = 7.0
        saved = [w.clone() for w in weights]
        assert offload.release(weights) == 6 * 64 * 32 * 4
    assert copied == [64 * 32 * 4] * 2  # the two written since their copies
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)
    holder.restore()
    assert all(torch.equal(w, v) for w, v in zip(weights, saved, strict=True))


def test_copies_ahead_start_only_where_fp8_packs_the_weights(monkeypatch) -> None:  # noqa: ANN001
    started: list[int] = []
    real = offload._Ahead.start
    monkeypatch.setattr(offload._Ahead, "start",
                        classmethod(lambda cls, ts: (started.append(1), real(ts))[1]))
    w = build("qwen-image-tiny")
    want = w.run()
    kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(), verify=False)
    assert started == []  # BF16: nothing leaves, so nothing is copied
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, verify=False)
    assert started == [1] and _emptied(w.model) and opt._host._ahead is None  # dropped
    with opt.original_weights() as original:
        assert torch.equal(w.run(original), want)
