"""``torch.compile(model, backend="kopt")`` moves the weights FP8 packed to host memory, as
``kopt.optimize`` does, and brings them back bit for bit for what needs them: a recompile, the
model run uncompiled, an in-place change inside ``original_weights()``, ``torch._dynamo.reset()``.
On the CPU the tests let the CPU's own tensors move (the default moves CUDA tensors only)."""

from __future__ import annotations

import gc

import pytest
import torch

import kopt
from kopt import backend, offload
from kopt.models import build

FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


@pytest.fixture(autouse=True)
def _cpu_moves(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(offload, "OFFLOAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny models' weights move too
    monkeypatch.setattr(backend, "_MOVED", backend._Moved())  # nothing restored for good yet
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


def _emptied(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() == 0]


def _compiled(model: torch.nn.Module, reports: list, **options: object) -> object:
    return torch.compile(model, backend="kopt", dynamic=False, options={
        "inner": "eager", "config": FP8, "reports": reports, **options})


def test_the_backend_moves_what_fp8_packed_and_keeps_the_output() -> None:
    w = build("qwen-image-tiny")
    expected = w.run()
    kept_reports: list = []
    want = w.run(_compiled(w.model, kept_reports, keep_original=True))
    assert _emptied(w.model) == [] and "moved to host memory" not in str(kept_reports[0])
    torch._dynamo.reset()
    reports: list = []
    f = _compiled(w.model, reports)
    got = w.run(f)
    moved = _emptied(w.model)
    # the FP8 linears' weights left; what the graph reads (norms, small embedders) stayed
    assert moved and all(n.endswith(("weight", "bias")) for n in moved)
    assert len(moved) < len(list(w.model.parameters()))
    assert "moved to host memory" in str(reports[0])
    assert torch.equal(got, want)
    assert torch.equal(w.run(f), want) and len(reports) == 1  # no recompile on moved weights
    # the original model, run uncompiled, gets them back for good and keeps working
    with pytest.warns(UserWarning, match="ran outside the compiled graphs"):
        assert torch.equal(w.run(), expected)
    assert _emptied(w.model) == []
    assert torch.equal(w.run(f), want)
    assert _emptied(w.model) == []  # nothing moves any more in this process


def test_original_weights_for_an_in_place_change_and_a_recompile() -> None:
    w = build("qwen-image-tiny")
    other = build("qwen-image-tiny", text_tokens=5)  # the same weights (seed), another signature
    reports: list = []
    f = _compiled(w.model, reports)
    w.run(f)
    moved = _emptied(w.model)
    # a new signature: dynamo recompiles with the weights moved; kopt captures and checks it
    # with them back, and they leave again
    with backend.original_weights():
        assert _emptied(w.model) == []
        want_other = other.run(w.model)
    got_other = other.run(f)
    assert len(reports) == 2 and reports[1].verified
    assert set(moved) <= set(_emptied(w.model))
    assert (got_other - want_other).abs().max() <= 0.1 * want_other.abs().max()
    name = moved[0]
    with backend.original_weights():
        with torch.no_grad():
            dict(w.model.named_parameters())[name].mul_(2)  # re-packed at the next call
    got = w.run(f)
    assert set(moved) <= set(_emptied(w.model))
    twin = build("qwen-image-tiny")  # the same weights, changed alike, kept on the device
    with torch.no_grad():
        dict(twin.model.named_parameters())[name].mul_(2)
    assert torch.equal(got, twin.run(_compiled(twin.model, [], keep_original=True)))


def test_a_reset_brings_the_weights_back() -> None:
    w = build("qwen-image-tiny")
    f = _compiled(w.model, [])
    want = w.run(f)
    assert _emptied(w.model)
    del f
    torch._dynamo.reset()
    gc.collect()
    assert _emptied(w.model) == []
    assert torch.equal(w.run(_compiled(w.model, [], keep_original=True)), want)


def test_under_inductor_the_packed_weights_move_too() -> None:
    from tests.fixtures import QKV

    model = QKV(64, v_extra=0).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = torch.compile(model, backend="kopt", dynamic=False, options={
            "inner": "inductor", "config": FP8, "keep_original": True})(x)
        torch._dynamo.reset()
        reports: list = []
        got = torch.compile(model, backend="kopt", dynamic=False, options={
            "inner": "inductor", "config": FP8, "reports": reports})(x)
    assert reports[0].result("fp8").matched == 2
    assert _emptied(model) and torch.equal(got, want)


def test_merged_weights_are_packed_in_place_and_leave_once_fp8_packed(monkeypatch) -> None:  # noqa: ANN001
    """Under dynamo too, the merge's row-concatenations become the buffer the parameters view
    (no second copy), here made through host memory and made FP8 after ``fold_weights``, as
    W1's largest: once packed, nothing but the packed copy stays on the device."""
    from kopt.memory import tensors_read
    from kopt.passes import fold
    from kopt.patterns import fp8

    monkeypatch.setattr(fold, "HOST_PACK_BYTES", 0)
    monkeypatch.setattr(fp8, "LARGE_BYTES", 4096)
    w = build("qwen-image-tiny")
    want = w.run(_compiled(w.model, [], keep_original=True))
    torch._dynamo.reset()
    reports: list = []
    got = w.run(_compiled(w.model, reports))
    assert torch.equal(got, want)
    assert reports[0].result("fp8_large").matched > 0
    gc.collect()
    runner = next(o for o in gc.get_objects()
                  if type(o) is backend.Runner and o.spec.report is reports[0])
    spec = runner.spec
    known = {t.untyped_storage()._cdata for t in (*w.model.parameters(), *tensors_read([spec.gm]))}
    known |= {c.untyped_storage()._cdata for _, c in runner.host._moved.values()}
    # what the graph, its capture and its load programs hold
    modules = [m for g in (spec.gm, spec.captured.gm, *(p.graph_module for p in spec.programs))
               for m in g.modules()]
    held = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values(),
                                         *vars(m).values()) if isinstance(t, torch.Tensor)]
    stray = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held
             if t.untyped_storage()._cdata not in known}
    merged = max(p.numel() * p.element_size() for p in w.model.parameters()) * 2
    # (before: the merged modulation weight, a copy beside the parameters, 416 KiB)
    assert max(stray.values(), default=0) < merged


def test_each_blocks_graph_finds_its_modules_in_one_scan(monkeypatch) -> None:  # noqa: ANN001
    """A graph break inside repeated blocks: one graph per block's weights, each moving its
    own; the modules owning them are found by one scan of the process's objects, not one per
    block, and a block called on its own still gets every weight back."""
    from tests.fixtures import BlockStack

    scans: list[int] = []
    real = backend._Moved._scan
    monkeypatch.setattr(backend._Moved, "_scan",
                        lambda self, ts: (scans.append(len(ts)), real(self, ts))[1])
    model = BlockStack(32).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
        reports: list = []
        got = _compiled(model, reports)(x)
    assert len(reports) >= 3 and all(r.verified for r in reports)
    assert (got - want).abs().max() <= 0.1 * want.abs().max()
    assert _emptied(model) and len(scans) == 1
    with pytest.warns(UserWarning, match="ran outside the compiled graphs"), torch.no_grad():
        assert torch.equal(model.blocks[2](x), model.blocks[2](x))
    assert _emptied(model) == []
    with torch.no_grad():
        assert torch.equal(model(x), want)
