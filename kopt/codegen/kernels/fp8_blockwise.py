"""Blockwise FP8: weights in 128x128 blocks, activations in 1x128 groups (DeepSeek-V3's recipe).

    sw[i, j] = max |W[128i:128i+128, 128j:128j+128]| / 448     (fp32, one per weight block)
    qw       = e4m3(W / sw)                                      (scale broadcast over its block)
    y        = sum_j (qa[:, Kj] @ qw[:, Kj].T) * sa[:, j] * sw[:, j].T   (Kj: the j-th 128 of K)

A block scale follows local magnitudes more closely than one scale per row, at the cost of a
GEMM that applies a scale per K-block. ``kopt::quant_fp8_block128`` quantizes a weight (at load:
it depends on a parameter only, so the folding pass evaluates it once);
``kopt::quant_fp8_group`` (:mod:`kopt.codegen.kernels.quant_fp8`) the activations per call, with
the scales ``[M, K/128]`` column-major. ``kopt::fp8_blockwise_mm`` is the GEMM: on CUDA
``torch.nn.functional.scaled_mm`` with the BlockWise1x128 x BlockWise128x128 recipe (which wants
exactly these scale layouts, probed on the H200: benchmarks/probes/blockwise_scaled_mm.py); on
the CPU, where torch has no blockwise FP8 GEMM, the exact product of the dequantized operands
rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kopt.codegen import fp64_reference
from kopt.codegen.kernels.quant_fp8 import E4M3, E4M3_MAX, MIN_AMAX

BLOCK = 128
# rows of the activation operand the CUDA GEMM is given: padded up to a multiple of this
M_ALIGN = 16


# the weight is upcast to fp32 at most this many bytes at a time: W1's 120 modulation linears
# merged into one weight (2.2M x 3072) would take 27 GB in fp32 at once
QUANT_CHUNK_BYTES = 1 << 30


def quant_fp8_block128_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: q [N, K] e4m3, scale [N/128, K/128] fp32; N and K multiples of 128.
    Quantized 128-row groups at a time (each block's scale depends on its own values only)."""
    n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"blockwise FP8 needs both weight dims to be multiples of {BLOCK}, "
                         f"got {n} x {k}")
    q = torch.empty((n, k), dtype=E4M3, device=w.device)
    scale = torch.empty((n // BLOCK, k // BLOCK), dtype=torch.float32, device=w.device)
    rows = max(BLOCK, QUANT_CHUNK_BYTES // (4 * max(k, 1)) // BLOCK * BLOCK)
    for j in range(0, n, rows):
        m = min(rows, n - j)
        blocks = w[j:j + m].float().reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=MIN_AMAX)
        s = amax / E4M3_MAX
        q[j:j + m] = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(m, k)
        scale[j // BLOCK:(j + m) // BLOCK] = s.reshape(m // BLOCK, k // BLOCK)
    return q, scale


@torch.library.custom_op("kopt::quant_fp8_block128", mutates_args=())
def quant_fp8_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_fp8_block128_reference(w)


@quant_fp8_block128.register_fake
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    return (torch.empty((n, k), dtype=E4M3, device=w.device),
            torch.empty((n // BLOCK, k // BLOCK), dtype=torch.float32, device=w.device))


def _dequant(q: torch.Tensor, scale: torch.Tensor, rows_per_scale: int,
             dtype: torch.dtype) -> torch.Tensor:
    s = scale.to(dtype).repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]
    if rows_per_scale > 1:
        s = s.repeat_interleave(rows_per_scale, dim=0)[: q.shape[0]]
    return q.to(dtype) * s


# the weight is dequantized to fp64 at most this many bytes at a time (as the verifier's GEMMs)
EXACT_CHUNK_BYTES = 1 << 30


def blockwise_mm_exact(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                       scale_w: torch.Tensor) -> torch.Tensor:
    """The exact product in fp64 (each dequantized operand is exact in fp64; so are the sums
    for any K that fits in memory). The weight is dequantized a block of 128-row groups at a
    time: an fp64 copy of a whole large weight (W1's merged modulation, 55 GB) would not fit."""
    a64 = _dequant(a, scale_a, 1, torch.float64)
    n, k = w.shape
    rows = max(BLOCK, EXACT_CHUNK_BYTES // (8 * max(k, 1)) // BLOCK * BLOCK)
    out = a64.new_empty((a64.shape[0], n))
    for j in range(0, n, rows):
        block = _dequant(w[j:j + rows], scale_w[j // BLOCK:(j + rows) // BLOCK], BLOCK,
                         torch.float64)
        out[:, j:j + rows] = a64 @ block.t()
    return out


@torch.library.custom_op("kopt::fp8_blockwise_mm", mutates_args=())
def fp8_blockwise_mm(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                     scale_w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` [M, K] e4m3 with ``scale_a`` [M, K/128]; ``w`` [N, K] e4m3 with ``scale_w``
    [N/128, K/128]; result [M, N] in ``out_dtype``."""
    return blockwise_mm_exact(a, scale_a, w, scale_w).to(out_dtype)


@fp8_blockwise_mm.register_kernel("cuda")
def _(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
      out_dtype: torch.dtype) -> torch.Tensor:
    m = a.shape[0]
    pad = -m % M_ALIGN
    if pad:  # cuBLAS has no heuristic for other row counts (M = 1 fails on the H200)
        a = F.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(a.dtype)
        scale_a = F.pad(scale_a, (0, 0, 0, pad), value=1.0)
    if scale_a.stride() != (1, a.shape[0]):  # the layout the library kernel checks for
        scale_a = scale_a.t().contiguous().t()
    out = F.scaled_mm(a, w.t(), scale_a, F.ScalingType.BlockWise1x128, scale_w.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m] if pad else out


@fp8_blockwise_mm.register_fake
def _(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
      out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype, device=a.device)


@fp64_reference(torch.ops.kopt.fp8_blockwise_mm.default)
def _(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
      out_dtype: torch.dtype) -> torch.Tensor:
    return blockwise_mm_exact(a, scale_a, w, scale_w)
