"""fold_gqa on CUDA: the LLM decode step with the query heads folded into the K/V heads' rows
verifies at its tier on the GPU's attention kernels, replays from a CUDA graph, and keeps the
cache updates of consecutive steps equal to the unfolded step's."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.models import build

pytestmark = pytest.mark.gpu


def test_decode_step_with_folded_query_heads_verifies_and_replays_on_cuda() -> None:
    w = build("llm-tiny", mode="decode", device="cuda", dtype=torch.bfloat16)
    layers = w.model.model.config.num_hidden_layers
    buffers = {n: b.clone() for n, b in w.model.named_buffers()}
    plain = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(fold_gqa=False))
    assert "fold_gqa" not in [r.name for r in plain.report.passes]
    folded = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=True)
    result = folded.report.result("fold_gqa")
    assert result.matched == layers and result.verdict.passed, str(folded.report)

    def steps(opt: kopt.OptimizedModule) -> list[torch.Tensor]:
        for n, b in w.model.named_buffers():
            b.copy_(buffers[n])
        with torch.no_grad():
            return [opt(*w.args, **w.kwargs)[0].float().clone() for _ in range(4)]

    want, got = steps(plain), steps(folded)  # the folded module replays from its 3rd call
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=lambda m, step=step: (
            f"step {step} ({'eager' if step < 2 else 'replayed'}): {m}"))
