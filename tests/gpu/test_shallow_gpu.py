"""On CUDA, FP8: the passes checked on the shallow model give the whole model's checked
result, with the weights moved to host memory and packed in place as without the cut.

    pytest -q tests/gpu/test_shallow_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt import offload
from kopt.models import build, qwen_image
from kopt.verify import VerifyOptions

pytestmark = pytest.mark.gpu

FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def test_fp8_checked_on_the_shallow_model_equals_the_whole_models_checked(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's weights move too
    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=4))
    outs, held = [], []
    for blocks in (2, None):
        w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
        opt = kopt.optimize(w.model, w.args, w.kwargs, FP8,
                            verify=VerifyOptions(seeds=(0,), blocks=blocks))
        assert opt.report.verified
        assert ("cut to 2 of 4 transformer_blocks" in opt.report.verified_on) == bool(blocks)
        assert opt.report.result("fp8").matched > 0
        held.append(opt.memory())
        outs.append([w.run(opt) for _ in range(3)])  # the third call replays a CUDA graph
    assert held[0].host == held[1].host > 0  # the same BF16 weights left the GPU
    assert held[0].optimized == held[1].optimized
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
