"""The GEMM template's blockwise scales and quantized output on the H200: the blockwise GEMM
against cuBLAS's (``kopt::fp8_blockwise_mm``) and the exact product; its act + quant epilogue
bitwise equal to ``kopt::act_quant_fp8_group`` applied to the same GEMM's output, both load
paths, replayed from a CUDA graph.

    pytest -q tests/gpu/test_gemm_blockwise_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kopt.codegen.gemm import FP8_GEMM_BOUND, QuantOut, gemm, gemm_config, gemm_reference
from kopt.codegen.kernels.fp8_blockwise import quant_fp8_block128_reference
from kopt.codegen.kernels.quant_fp8 import quant_fp8_group_reference
from kopt.verify import relative_error

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# (M, N, K): W1's image MLP up and QKV, its text QKV (128 rows), an awkward one (M, N off tiles)
# (cuBLAS's blockwise GEMM takes K in multiples of 512 only)
SHAPES = [(4096, 12288, 3072), (4096, 9216, 3072), (128, 9216, 3072), (333, 640, 1536)]


def operands(m: int, n: int, k: int, seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=BF16, generator=g) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=BF16, generator=g)
    return (*quant_fp8_group_reference(x), *quant_fp8_block128_reference(w), bias)


def ids(s: tuple) -> str:
    return "x".join(map(str, s))


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_blockwise_gemm_within_the_bound_of_the_exact_product_like_cublas(shape: tuple) -> None:
    a, sa, w, sw, _ = operands(*shape)
    out = torch.ops.kopt.fp8_blockwise_gemm(a, sa, w, sw, None, BF16)  # autotuned
    lib = torch.ops.kopt.fp8_blockwise_mm(a, sa, w, sw, BF16)
    exact = gemm_reference(a, w.t(), sa, sw, None, None, None, blockwise=True, upcast=True)
    err, lib_err = relative_error(out, exact), relative_error(lib, exact)
    print(f"{ids(shape)}: kopt {err:.2e}, cuBLAS {lib_err:.2e}")
    assert err < FP8_GEMM_BOUND
    assert err < 2 * lib_err + 2**-9  # no worse than cuBLAS's beyond a bf16 rounding


@pytest.mark.parametrize("persistent", [False, True], ids=["tile", "persistent"])
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
def test_tiles_and_load_paths_agree(persistent: bool, use_tma: bool) -> None:
    a, sa, w, sw, _ = operands(333, 640, 1152)
    cfg = [gemm_config(128, 128, 128, 8, 4, 8, persistent=persistent)]
    out = gemm(a, w.t(), sa, sw, blockwise=True, use_tma=use_tma, configs=cfg)
    ref = gemm(a, w.t(), sa, sw, blockwise=True, use_tma=True,
               configs=[gemm_config(64, 128, 128, 8, 4, 4)])
    exact = gemm_reference(a, w.t(), sa, sw, None, None, None, blockwise=True, upcast=True)
    assert relative_error(out, exact) < FP8_GEMM_BOUND
    # the same products scaled in the same order per K step: equal but for accumulation order
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("activation", ["gelu_tanh:fast", "gelu_tanh", None])
@pytest.mark.parametrize("shape", [(4096, 12288, 3072), (333, 640, 1536)], ids=ids)
def test_act_quant_epilogue_is_act_quant_group_of_the_same_gemm_output(
        shape: tuple, activation: str | None) -> None:
    a, sa, w, sw, bias = operands(*shape)
    cfg = [gemm_config(128, 128, 128, 8, 4, 8, persistent=True)]
    y = gemm(a, w.t(), sa, sw, blockwise=True, configs=cfg)
    q, s = gemm(a, w.t(), sa, sw, blockwise=True, configs=cfg, quant=QuantOut(activation),
                quant_bias=bias)
    if activation is None:
        q_ref, s_ref = torch.ops.kopt.quant_fp8_group(y + bias)
    else:
        q_ref, s_ref = torch.ops.kopt.act_quant_fp8_group(y, None, activation, bias, None, True)
    assert s.stride() == s_ref.stride() == (1, shape[0])
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fused_op_against_cublas_and_act_quant_and_in_a_cuda_graph() -> None:
    a, sa, w, sw, bias = operands(4096, 12288, 3072)
    act = "gelu_tanh:fast"
    fused = lambda: torch.ops.kopt.fp8_blockwise_gemm_act_quant(a, sa, w, sw, bias, act, BF16)
    q, s = fused()
    y = torch.ops.kopt.fp8_blockwise_mm(a, sa, w, sw, BF16)  # what the unfused graph runs
    q_ref, s_ref = torch.ops.kopt.act_quant_fp8_group(y, None, act, bias, None, True)
    # another GEMM's accumulation order: the scales within its error, the values within one
    # e4m3 step of the dequantized activation
    torch.testing.assert_close(s, s_ref, rtol=2**-6, atol=0)
    deq, deq_ref = (t.float() * u.repeat_interleave(128, 1) for t, u in ((q, s), (q_ref, s_ref)))
    assert relative_error(deq, deq_ref) < 2**-4
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q2, s2 = fused()
    a.copy_(operands(4096, 12288, 3072, seed=1)[0])  # another activation, the same scales
    g.replay()
    q3, s3 = fused()
    assert torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(s2, s3)
    assert not torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
