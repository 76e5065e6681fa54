"""fold_gqa: grouped-query attention without the per-head copies of K and V. It fires on
repeat_kv + SDPA in decode, not on near misses (causal, prefill, a repeat read elsewhere, no
repeat), and the graph keeps its numerics (tolerance tier, checked against fp64); on the LLM's
decode step every layer's copies go."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.models import build
from kopt.passes import PassConfig
from kopt.passes.gqa import FoldGroupedQueryHeads
from kopt.verify import VerifyOptions, compare

aten = torch.ops.aten
B, HKV, REP, S, D = 3, 2, 4, 10, 8


def _repeat(x: torch.Tensor) -> torch.Tensor:  # transformers' repeat_kv
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, REP, s, d).reshape(b, h * REP, s, d)


class Attention(nn.Module):
    def __init__(self, causal: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.causal, self.reuse = causal, reuse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        kr, vr = _repeat(k), _repeat(v)
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, is_causal=self.causal,
                                             scale=0.3)
        out = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)  # as the models do
        return out + kr.sum() if self.reuse else out


def _inputs(length: int = 1, mask_heads: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HKV * REP, length, D, generator=g)
    k, v = (torch.randn(B, HKV, S, D, generator=g) for _ in range(2))
    out = [q, k, v]
    if mask_heads is not None:
        out.append(torch.rand(B, mask_heads, length, S, generator=g) > 0.3)
        out[-1][..., 0] = True  # every row attends somewhere
    return out


def _run(model: nn.Module, inputs: list[torch.Tensor]):  # noqa: ANN202
    cap = capture_module(model.eval(), tuple(inputs))
    after = copy_graph_module(cap.gm)
    result = FoldGroupedQueryHeads().run(after)
    verdict = compare(cap.gm, after, inputs, FoldGroupedQueryHeads.numerics)
    assert verdict.passed, verdict
    return cap.gm, after, result


def _clones(gm: fx.GraphModule) -> int:
    return sum(n.target is aten.clone.default for n in gm.graph.nodes)


@pytest.mark.parametrize("mask_heads", [None, 1, HKV * REP])
def test_decode_attention_reads_k_and_v_once(mask_heads: int | None) -> None:
    before, after, result = _run(Attention(), _inputs(1, mask_heads))
    assert result.matched == 1 and _clones(before) == 2 and _clones(after) == 0
    (sdpa,) = [n for n in after.graph.nodes if n.target is aten.scaled_dot_product_attention
               .default]
    # the K/V heads as they are, the query heads folded into rows, the scale kept
    assert tuple(sdpa.args[1].meta["val"].shape) == (B, HKV, S, D)
    assert tuple(sdpa.args[0].meta["val"].shape) == (B, HKV, REP, D)
    assert sdpa.kwargs == {"scale": 0.3}
    inputs = _inputs(1, mask_heads)
    torch.testing.assert_close(after(*inputs), before(*inputs), rtol=1e-5, atol=1e-6)


def test_near_misses_are_left_alone_with_the_reason() -> None:
    _, _, causal = _run(Attention(causal=True), _inputs(1))
    assert causal.matched == 0 and "causal" in next(iter(causal.rejected))
    _, _, prefill = _run(Attention(), _inputs(5, 1))
    assert prefill.matched == 0 and "several query rows" in next(iter(prefill.rejected))
    _, after, reused = _run(Attention(reuse=True), _inputs(1))
    assert reused.matched == 0 and _clones(after) == 2
    assert "read elsewhere" in next(iter(reused.rejected))

    class Plain(nn.Module):  # multi-head attention: nothing repeated
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, k)

    q = torch.randn(B, HKV, 1, D)
    _, _, plain = _run(Plain(), [q, torch.randn(B, HKV, S, D)])
    assert plain.matched == 0 and not plain.rejected


def test_llm_decode_steps_drop_every_layers_kv_copies() -> None:
    """The LLM decode step (GQA, static KV cache): every layer's repeat goes, and three steps
    of the optimized step (its cache written in place) give what the captured graph gives."""
    w = build("llm-tiny", mode="decode")
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fold_gqa=False)
    off = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0)
    on = optimize_captured(cap, config.replace(fold_gqa=True), VerifyOptions(seeds=(0, 1)),
                           None, w.name, 0.0)
    layers = w.model.model.config.num_hidden_layers
    fold = on.report.result("fold_gqa")
    assert fold.matched == layers and fold.verdict.passed
    assert _clones(off.gm) - _clones(on.gm) == 2 * layers
    inputs = list(cap.example_inputs)
    buffers = {n: b.clone() for n, b in w.model.named_buffers()}
    with torch.no_grad():
        want = [off.gm(*inputs)[0].clone() for _ in range(3)]
        for n, b in w.model.named_buffers():
            b.copy_(buffers[n])
        got = [on.gm(*inputs)[0].clone() for _ in range(3)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
