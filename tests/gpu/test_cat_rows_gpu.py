"""cat_rows on the H200: ``kopt::cat_rows`` bitwise ``torch.cat`` at the W1/W2 joint-V shapes
(the V slices of merged QKV outputs, [text; image]), replayed from a CUDA graph, and the pass
verified on Qwen-Image (tiny) on CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels_cat import SHAPES, joint_v
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.codegen.kernels.cat_rows import cat_rows_triton
from kopt.models import build
from kopt.passes import PassConfig
from kopt.verify import VerifyOptions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cat_rows_bitwise_at_joint_v_shapes(shape: tuple, dtype: torch.dtype) -> None:
    xs = joint_v(*shape, dtype=dtype, batch=2)
    got = torch.ops.kopt.cat_rows(xs, 1)
    assert torch.equal(got, torch.cat(xs, 1)) and got.is_contiguous()
    assert torch.equal(cat_rows_triton(xs, 1), got)


@pytest.mark.parametrize("shape", SHAPES)
def test_cat_rows_with_biases_bitwise_at_joint_v_shapes(shape: tuple) -> None:
    """The blockwise FP8 recipe's V: each slice's bias added in the copy, as torch's add."""
    xs = joint_v(*shape, dtype=torch.bfloat16, batch=2)
    inner = xs[0].shape[2] * xs[0].shape[3]
    biases = [torch.randn(inner, device="cuda").bfloat16() for _ in xs]
    want = torch.cat([x + b.view(x.shape[2:]) for x, b in zip(xs, biases, strict=True)], 1)
    assert torch.equal(torch.ops.kopt.cat_rows(xs, 1, biases), want)


def test_cat_rows_replays_in_a_cuda_graph() -> None:
    xs = joint_v(*SHAPES[0])
    torch.ops.kopt.cat_rows(xs, 1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kopt.cat_rows(xs, 1)
    for x in xs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(xs, 1))


def test_cat_rows_pass_verifies_on_cuda() -> None:
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    cap = capture_module(w.model.eval(), w.args, w.kwargs)
    spec = optimize_captured(cap, PassConfig(cat_rows=True), VerifyOptions(seeds=(0, 1)), None,
                             "qwen-image-tiny", 0.0)
    assert spec.report.result("cat_rows").matched == len(w.model.transformer_blocks)
    assert spec.report.verified
