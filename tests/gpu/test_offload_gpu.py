"""The BF16 weights FP8 replaced leave the GPU once kopt is done, and come back bit for bit.

    pytest -q tests/gpu/test_offload_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

import kopt
from kopt.models import build

pytestmark = pytest.mark.gpu

FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def test_replaced_weights_leave_the_gpu_and_come_back_bit_for_bit(monkeypatch) -> None:  # noqa: ANN001
    from kopt import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's weights move too
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    expected = w.run()
    # once, so that what the process sets up lazily on first use (libraries' workspaces) is
    # there in both measurements below
    kopt.optimize(w.model, w.args, w.kwargs, FP8).restore_original()
    gc.collect()
    kept = kopt.optimize(w.model, w.args, w.kwargs, FP8, keep_original=True)
    want = w.run(kept)
    gc.collect()  # what the optimization left to the collector is not what either module holds
    torch.cuda.synchronize()
    with_copies = torch.cuda.memory_allocated()
    del kept
    gc.collect()
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    w.run(opt)  # as the kept module had run once
    gc.collect()
    torch.cuda.synchronize()
    held = opt.memory()
    assert held.host > 0
    # the device holds what keep_original held, less the bytes moved to host memory
    assert torch.cuda.memory_allocated() <= with_copies - held.host
    for _ in range(3):  # the third call captures the CUDA graph
        assert torch.equal(w.run(opt), want)
    with opt.original_weights() as model:
        assert torch.equal(w.run(model), expected)
    assert torch.equal(w.run(opt), want)
    with pytest.warns(UserWarning, match="back on the device for good"):
        assert torch.equal(w.run(), expected)  # the original model called: weights back
    assert opt.memory().host == 0 and torch.equal(w.run(opt), want)


def test_the_backend_moves_the_packed_weights_off_the_gpu(monkeypatch) -> None:  # noqa: ANN001
    """``torch.compile(backend="kopt")`` moves the BF16 weights FP8 packed, as
    ``kopt.optimize`` does: the same outputs bit for bit as with ``keep_original=True`` over
    three calls (the third captures the CUDA graph where it can), no recompile on the moved (or
    in-place packed) parameters, and the model run uncompiled gets its weights back."""
    from kopt import backend, offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's weights move too
    monkeypatch.setattr(backend, "_MOVED", backend._Moved())
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    expected = w.run()
    kept = torch.compile(w.model, backend="kopt", dynamic=False,
                         options={"config": FP8, "keep_original": True})
    want = w.run(kept)
    del kept
    torch._dynamo.reset()
    gc.collect()
    reports: list = []
    f = torch.compile(w.model, backend="kopt", dynamic=False,
                      options={"config": FP8, "reports": reports})
    for _ in range(3):  # the third call captures the CUDA graph
        assert torch.equal(w.run(f), want)
    assert len(reports) == 1 and "moved to host memory" in str(reports[0])
    assert any(p.untyped_storage().nbytes() == 0 for p in w.model.parameters())
    with pytest.warns(UserWarning, match="ran outside the compiled graphs"):
        assert torch.equal(w.run(), expected)
    assert all(p.untyped_storage().nbytes() > 0 for p in w.model.parameters())
    assert torch.equal(w.run(f), want) and len(reports) == 1
    torch._dynamo.reset()
