"""The weights FP8 replaced move to host memory once kopt is done (``kopt.offload``), and come
back bit for bit for what needs them: the original model, a new input signature, an in-place
weight change, ``restore_original``. On the CPU the tests let the CPU's own tensors move (the
default moves CUDA tensors only), which exercises the same code."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt import offload
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
