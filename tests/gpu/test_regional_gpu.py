"""Inductor on the GPU compiles the optimized graph's repeated blocks once (``kopt.regional``):
a 5-block tiny Qwen-Image in FP8 through ``torch.compile(backend="kopt")`` outlines its three
inner blocks, and its output is what the flat graph compiled by Inductor gives."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.models import build, qwen_image
from kopt.verify import relative_error


def test_the_backend_outlines_the_blocks_for_inductor_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=5))
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))
    outs, lines = [], []
    for regional in (True, False):
        torch._dynamo.reset()
        reports: list = []
        compiled = torch.compile(w.model, backend="kopt", dynamic=False, options={
            "config": config, "reports": reports, "regional": regional})
        outs.append(w.run(compiled))
        lines.append(reports[0].inner)
    torch._dynamo.reset()
    assert lines == ["Inductor, 3 repeated block sites compiled as 1 kind(s) of block",
                     "Inductor"]
    # the same kernels but for Inductor's own fusions at the blocks' edges
    assert relative_error(outs[0].float(), outs[1].float()) < 1e-2
