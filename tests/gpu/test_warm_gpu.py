"""Warm start on CUDA (``kopt.warm``): a second optimization of the same model, FP8 with the
default pipeline, restores the recorded graph (its end-to-end check run on the GPU) and
computes bitwise what the cold one did, replayed from CUDA graphs as by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import kopt
from kopt.kb import KnowledgeBase, using
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["qwen-image-tiny", "llm-tiny"])
def test_warm_start_fp8_cuda(tmp_path: Path, name: str) -> None:
    config = PassConfig(fp8=FP8Config(min_features=16))

    def optimize(kb: KnowledgeBase) -> tuple[kopt.OptimizedModule, list]:
        w = build(name, device="cuda", dtype=torch.bfloat16)
        with using(kb):
            opt = kopt.optimize(w.model, w.args, w.kwargs, config,
                                verify=VerifyOptions(seeds=(0,)))
        outs = [pytree.tree_leaves(opt(*w.args, **w.kwargs)) for _ in range(4)]  # graphs
        return opt, outs[-1]

    with KnowledgeBase.open(tmp_path / "kb.sqlite") as kb:
        cold, want = optimize(kb)
        hit, got = optimize(kb)
    assert not cold.report.warm and cold.report.result("fp8").matched > 0
    assert "end-to-end check on seed 0 passed" in hit.report.warm, hit.report.warm
    assert hit.graph_module.code == cold.graph_module.code
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
