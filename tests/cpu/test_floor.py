"""kopt.floor: the forward's GEMM and attention work, and each variant against the floor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kopt.floor import Attention, Floor, floor_lines, forward_work
from kopt.models import build


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny"])
def test_the_work_of_a_forward_is_its_linears_and_its_attention_calls(name: str) -> None:
    """GEMM FLOPs from the flop counter equal the linears' 2 x rows x in x out summed by
    hooks; each SDPA call (one per block) is recorded with its shapes, and its FLOPs are
    4 B H Sq Sk D."""
    w = build(name)
    linear_flops = []

    def hook(m: nn.Linear, args: tuple, _out: torch.Tensor) -> None:
        linear_flops.append(2 * args[0].numel() // m.in_features * m.in_features
                            * m.out_features)

    handles = [m.register_forward_hook(hook) for m in w.model.modules()
               if isinstance(m, nn.Linear)]
    try:
        work = forward_work(w.model, w.args, w.kwargs)
    finally:
        for h in handles:
            h.remove()
    assert work.gemm_flops == sum(linear_flops) > 0
    blocks = sum(len(getattr(w.model, n, ())) for n in ("transformer_blocks",
                                                         "single_transformer_blocks"))
    assert sum(a.calls for a in work.attention) == blocks
    for a in work.attention:
        b, h, sq, d = a.q
        assert a.k[0] == b and a.k[3] == d and not a.masked
        assert a.flops == 4 * b * h * sq * a.k[2] * d * a.calls
    assert work.attention_flops == sum(a.flops for a in work.attention)


def test_each_variant_is_set_against_the_floor_at_its_clock() -> None:
    """A variant whose graph ran at half the highest clock has twice the floor; one without a
    sampled clock gets the floor at the highest clock; FP8 variants take the FP8 GEMM term."""
    floor = Floor(gemm_tflop=2.0, attention_tflop=0.5, gemm_ms={"bf16": 2.0, "fp8": 1.0},
                  attention_ms=0.5, attention_tflops=1000.0, max_mhz=2000.0)
    assert floor.at_clock(True, 1000.0) == 3.0 and floor.at_clock(False, None) == 2.5
    rows = {
        "kopt-fp8": {"forward_ms": 9.0, "graph_forward_ms": 6.0, "graph_sm_mhz": 1000.0,
                     "graph_breakdown": {"gemm": 2.5, "attention": 1.5}},
        "eager-bf16": {"forward_ms": 5.0, "breakdown": {"gemm": 3.0, "attention": 1.0}},
    }
    lines = floor_lines(rows, floor)
    fp8 = next(x for x in lines if x.startswith("| kopt-fp8"))
    assert fp8 == "| kopt-fp8 | 1000 | 2.50 (2.00) | 1.50 (1.00) | 2.00 | 6.00 | 3.00 | 2.00x |"
    bf16 = next(x for x in lines if x.startswith("| eager-bf16"))
    assert bf16 == "| eager-bf16 | - | 3.00 (2.00) | 1.00 (0.50) | 1.00 | 5.00 | 2.50 | 2.00x |"


def test_an_attention_call_counts_both_products() -> None:
    a = Attention(q=(1, 2, 8, 4), k=(1, 2, 16, 4), calls=3, masked=False)
    assert a.flops == 2 * (2 * 1 * 2 * 8 * 16 * 4) * 3
