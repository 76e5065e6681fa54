"""NVFP4 quantization: ``kopt::quant_nvfp4(x, global_scale) -> (q, scales)``.

NVFP4 is FP4 E2M1 values with one FP8 E4M3 scale per 16 consecutive values of a row and one FP32
scale per tensor (the "global scale" ``g``, a decode factor: x ~= e2m1 * e4m3 * g). For a row
``x[r, :]`` and its block ``b`` of 16 values:

    s[r, b] = e4m3(min(amax_b / (g * 6), 448))        6 = E2M1's largest value; e4m3 nearest even
    d       = float(s[r, b]) * g                     (fp32)
    q[r, k] = e2m1(x[r, k] / d), 0 where d == 0     (IEEE division; nearest even, saturating at 6)

Choose ``g = amax(|x|) / (448 * 6)`` (:func:`nvfp4_global_scale`) to use the full range; a fused
producer takes ``g`` as an input (a calibrated or previous-step amax), since a tensor-wide amax
needs its own pass. ``g`` must be positive and finite.

Storage, as Blackwell block-scaled GEMMs read it (cuBLASLt's
``CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3``, CUTLASS ``Sm1xxBlkScaledConfig``,
``torch._scaled_mm`` with ``float4_e2m1fn_x2`` operands):

* ``q``: uint8 ``[..., K / 2]``, two codes per byte, element ``2j`` in the low nibble and ``2j+1``
  in the high nibble; a code is sign << 3 | {0, 0.5, 1, 1.5, 2, 3, 4, 6}.index(|v|). View it as
  ``torch.float4_e2m1fn_x2`` for ``torch._scaled_mm``.
* ``scales``: e4m3, 1-D, ``round_up(M, 128) * round_up(K / 16, 4)`` bytes in the 128x4 swizzled
  ("blocked") layout of the cuBLAS docs, section "1D Block Scaling Factors Layout"
  (https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout): the [M, K/16] scale
  matrix, zero-padded to [round_up(M, 128), round_up(K/16, 4)], is cut into 128x4 tiles stored
  row-of-tiles major, 512 bytes each; inside a tile, scale (r, c) lies at byte
  ``(r % 32) * 16 + (r // 32) * 4 + c``. This is the size ``torch._scaled_mm``'s BlockWise1x16
  check expects (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``is_blockwise_1x16_scaling``).

K must be a multiple of 16. The H200 has no FP4 tensor cores: here NVFP4 is a storage format
(producers exact, GEMMs emulated); :func:`dequant_nvfp4` decodes it for tests and emulation.

The Triton producer is bitwise equal to :func:`quant_nvfp4_reference` on the same device (only
IEEE divisions, products and comparisons; e4m3 by hardware on CUDA, by a bit-exact software
rounding in the interpreter).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from kopt.codegen.kernels.qk_norm_rope import widen
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    E4M3_MAX,
    e4m3_bits,
    e4m3_value,
    even_tiles,
    in_range,
    mirror_cuda,
    row_split,
    row_tiling,
    triton_supported,
)
from kopt.codegen.launch import launch
from kopt.codegen.pointwise import pw_div, pw_div_by, pw_recip

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# nearest-even thresholds between consecutive E2M1 magnitudes: (value, inclusive)
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def scale_numel(rows: int, cols: int) -> int:
    """Bytes of the swizzled scales of a [rows, cols] tensor."""
    return _round_up(rows, 128) * _round_up(cols // BLOCK_SIZE, 4)


def swizzle_128x4(s: torch.Tensor) -> torch.Tensor:
    """[M, N] scales -> the flat 128x4-tiled layout (zero padding), see the module docstring."""
    m, n = s.shape
    mp, np_ = _round_up(m, 128), _round_up(n, 4)
    padded = torch.zeros((mp, np_), dtype=s.dtype, device=s.device)
    padded[:m, :n] = s
    return padded.view(mp // 128, 4, 32, np_ // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_128x4(flat: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: the [m, n] scale matrix."""
    mp, np_ = _round_up(m, 128), _round_up(n, 4)
    tiles = flat.reshape(mp // 128, np_ // 4, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(mp, np_)[:m, :n]


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8, 0..15): nearest even, saturating at +-6, sign kept."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t, inclusive in _E2M1_STEPS:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The usual global scale: amax(|x|) / (448 * 6), fp32, shape [1] (never 0)."""
    amax = x.float().abs().amax().clamp(min=1e-12)
    return (amax / (E4M3_MAX * E2M1_MAX)).reshape(1)


def _check(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs rows that are a multiple of {BLOCK_SIZE} values, got "
                         f"shape {list(x.shape)}")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError(f"global_scale must be one fp32 value, got {global_scale.dtype} "
                         f"{list(global_scale.shape)}")
    if global_scale.device != x.device:
        raise ValueError(f"global_scale is on {global_scale.device}, x on {x.device}")


def quant_nvfp4_reference(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The reference quantizer: ``(q, scales)`` as described in the module docstring."""
    _check(x, global_scale)
    k = x.shape[-1]
    xf = x.float().reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)
    g = global_scale.reshape(())
    amax = xf.abs().amax(dim=-1)
    s = (amax / (g * E2M1_MAX)).clamp(max=E4M3_MAX).to(E4M3)
    d = (s.float() * g).unsqueeze(-1)
    q = torch.where(d == 0, 0.0, xf / d)
    codes = e2m1_codes(q).reshape(-1, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = swizzle_128x4(s.view(torch.uint8)).view(E4M3)
    return packed.reshape(*x.shape[:-1], k // 2), scales


def dequant_nvfp4(q: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``(q, scales)`` of :func:`quant_nvfp4_reference` back to ``[..., K]``."""
    k = q.shape[-1] * 2
    packed = q.reshape(-1, k // 2)
    rows = packed.shape[0]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(rows, k)
    table = torch.tensor(E2M1_VALUES, device=q.device)
    vals = table[(codes & 7).long()] * torch.where((codes & 8) != 0, -1.0, 1.0)
    s = unswizzle_128x4(scales.view(torch.uint8), rows, k // BLOCK_SIZE).view(E4M3).float()
    out = vals.reshape(rows, k // BLOCK_SIZE, BLOCK_SIZE) * s.unsqueeze(-1) * global_scale.float()
    return out.reshape(*q.shape[:-1], k).to(dtype)


@torch.library.custom_op("kopt::quant_nvfp4", mutates_args=())
def quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_nvfp4_reference(x, global_scale)


@quant_nvfp4.register_fake
def _(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, global_scale)
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    return (torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device),
            torch.empty(scale_numel(rows, k), dtype=E4M3, device=x.device))


# -- device code shared with the row-wise template ----------------------------------------------

@triton.jit
def e2m1_code(v):
    """fp32 -> E2M1 code (int32, 0..15): nearest even, saturating at 6 (the thresholds of
    :data:`_E2M1_STEPS`), the sign bit kept; NaN -> 0 with its sign bit, as the reference's
    comparisons give. By arithmetic instead of seven comparisons (11 instead of about 20 SASS
    instructions per value): |v| is rounded to the E2M1 grid, whose step is 2^(e - 1) for
    |v| in [2^e, 2^(e+1)), e >= 0 (0.5 below 2), by adding and subtracting
    ``magic = 1.5 * 2^23 * step`` (fp32's own nearest-even rounding at that step), and the
    rounded value r scaled by 2^-126 has E2M1's bits as its fp32 bits 22..24: 0.5 -> 2^-127,
    a denormal with bit 22 set (code 1); 1 -> 2^-126 (code 2); 6 = 1.5 * 4 -> code 7."""
    a = tl.minimum(tl.maximum(tl.abs(v), 0.0), 6.0)  # max(NaN, 0) = 0 (PTX max.f32)
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127)  # biased exponent, at least 2^0
    magic = (((e + 22) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(e-105)
    r = (a + magic) - magic
    code = (r * 1.1754943508222875e-38).to(tl.int32, bitcast=True) >> 22  # r * 2^-126
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def nvfp4_store(v, row, rows, col, cols, q_ptr, s_ptr, g, ROWS: tl.constexpr,
                BLOCK: tl.constexpr, C0: tl.constexpr, EVEN: tl.constexpr,
                CUDA: tl.constexpr):
    """Quantize the [ROWS, BLOCK] fp32 tile ``v`` of columns C0 .. C0 + BLOCK (zero outside
    the valid rows and columns; BLOCK >= 64, C0 a multiple of 64) to NVFP4 with global scale
    ``g`` (fp32 scalar). Programs must cover round_up(rows, 128) rows and the tiles
    round_up(cols, 64) columns: those past ``rows``/``cols`` write the zero padding of the
    scales. ``EVEN``: the launch covers the rows and columns exactly (no masks).

    ``x / d`` is the IEEE quotient through d's reciprocal (:func:`pw_div_by`: one division per
    16 values instead of one per value), exact where ``b q - x`` does not underflow: for
    |x| > 2^-100 or so, as the FP8 quantizers' (d ~ amax / 6 here)."""
    v3 = tl.reshape(v, [ROWS, BLOCK // 16, 16])
    amax = tl.max(tl.abs(v3), axis=2)
    s = tl.minimum(pw_div(amax, g * 6.0), 448.0)
    s_bits = e4m3_bits(s, CUDA)
    d = e4m3_value(s_bits, CUDA) * g
    q = pw_div_by(v3, d[:, :, None], pw_recip(d)[:, :, None], CUDA)
    q = tl.where(d[:, :, None] == 0.0, 0.0, q)
    pairs = tl.reshape(e2m1_code(q), [ROWS, BLOCK // 2, 2])
    lo, hi = tl.split(pairs)
    packed = (lo | (hi << 4)).to(tl.uint8)
    half = C0 // 2 + tl.arange(0, BLOCK // 2)
    r = row[:, None]
    q_offs = r.to(tl.int64) * (cols // 2) + half[None, :]
    tl.store(q_ptr + q_offs, packed,
             mask=in_range(r, rows, EVEN) & in_range(half, cols // 2, EVEN)[None, :])
    nvfp4_store_scales(s_bits, r, rows, cols, s_ptr, BLOCK, C0, EVEN)


@triton.jit
def nvfp4_store_scales(s_bits, r, rows, cols, s_ptr, BLOCK: tl.constexpr, C0: tl.constexpr,
                       EVEN: tl.constexpr):
    """The [ROWS, BLOCK / 16] e4m3 scales of rows ``r`` ([ROWS, 1]) from column C0 on, into
    the swizzled layout: 128x4 tiles of 512 bytes, row-of-tiles major."""
    b = C0 // 16 + tl.arange(0, BLOCK // 16)[None, :]
    col_tiles = (cols // 16 + 3) // 4
    tile = (r // 128).to(tl.int64) * col_tiles + b // 4
    s_offs = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + b % 4
    s_mask = in_range(r, (rows + 127) // 128 * 128, EVEN) & in_range(b, col_tiles * 4, EVEN)
    tl.store(s_ptr + s_offs, s_bits, mask=s_mask)


@triton.jit
def _e2m1_words(v, d, rd, CUDA: tl.constexpr):
    """[ROWS, G, 8] fp32 values of half groups, their groups' decode scales ``d`` [ROWS, G]
    and ``rd = RN(1 / d)``: each half group's 8 E2M1 codes as one int32, value i in bits
    4i .. 4i + 3 (little-endian: the bytes of the packed pairs, in order)."""
    q = pw_div_by(v, d[:, :, None], rd[:, :, None], CUDA)
    codes = e2m1_code(tl.where(d[:, :, None] == 0.0, 0.0, q))
    return tl.sum(codes << (4 * tl.arange(0, 8))[None, None, :], axis=2)


@triton.jit
def _nvfp4_groups(x_ptr, q_ptr, s_ptr, g, row, rows, cols, stride_x, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, C0: tl.constexpr, EVEN: tl.constexpr,
                  CUDA: tl.constexpr, PAIRS: tl.constexpr):
    """Columns C0 .. C0 + BLOCK of rows ``row``, each group of 16 loaded as its two halves of
    8: one thread holds both (8 contiguous bf16 a load), so a group's amax, scale, division
    and packing stay in that thread. As a [ROWS, BLOCK] tile a group spans two threads, which
    both computed its scale (two divisions) after a shuffle; this form divides once per group
    and stores the codes as two words a group. ``q_ptr``: the codes as int32 words."""
    G: tl.constexpr = BLOCK // 16
    col = C0 + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 8)[None, :]  # first halves
    r3 = row[:, None, None]
    mask = in_range(r3, rows, EVEN) & in_range(col, cols, EVEN)[None, :, :]
    ptr = x_ptr + r3.to(tl.int64) * stride_x + col[None, :, :]
    lo = widen(tl.load(ptr, mask=mask, other=0.0), CUDA and PAIRS)
    hi = widen(tl.load(ptr + 8, mask=mask, other=0.0), CUDA and PAIRS)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
    s_bits = e4m3_bits(tl.minimum(pw_div(amax, g * 6.0), 448.0), CUDA)
    d = e4m3_value(s_bits, CUDA) * g
    rd = pw_recip(d)
    words = tl.reshape(tl.join(_e2m1_words(lo, d, rd, CUDA), _e2m1_words(hi, d, rd, CUDA)),
                       [ROWS, 2 * G])
    w = C0 // 8 + tl.arange(0, 2 * G)
    r = row[:, None]
    tl.store(q_ptr + r.to(tl.int64) * (cols // 8) + w[None, :], words,
             mask=in_range(r, rows, EVEN) & in_range(w, cols // 8, EVEN)[None, :])
    nvfp4_store_scales(s_bits, r, rows, cols, s_ptr, BLOCK, C0, EVEN)


@triton.jit
def _quant_nvfp4_kernel(x_ptr, q_ptr, s_ptr, g_ptr, rows, cols, stride_x, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK2: tl.constexpr, EVEN: tl.constexpr,
                        CUDA: tl.constexpr, PAIRS: tl.constexpr = False):
    """A row is one BLOCK-wide tile, or two: BLOCK, then BLOCK2 > 0 more (``row_split``), each
    as half groups (:func:`_nvfp4_groups`; ``q_ptr`` the codes as int32 words). ``EVEN``: the
    programs' rows and the tiles' columns are all in range (no masks). ``PAIRS``: the half
    groups load as 16-byte vectors (rows 16-byte aligned), so bf16 widens two at a time."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.load(g_ptr)
    _nvfp4_groups(x_ptr, q_ptr, s_ptr, g, row, rows, cols, stride_x, ROWS, BLOCK, 0, EVEN, CUDA,
                  PAIRS)
    if BLOCK2 > 0:
        _nvfp4_groups(x_ptr, q_ptr, s_ptr, g, row, rows, cols, stride_x, ROWS, BLOCK2, BLOCK,
                      EVEN, CUDA, PAIRS)


def nvfp4_launch_rows(rows: int) -> int:
    """Rows the programs of an NVFP4 producer must cover (the scales' 128-row padding)."""
    return _round_up(rows, 128)


def quant_nvfp4_triton(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The Triton producer of ``kopt::quant_nvfp4`` (bitwise the reference's result)."""
    _check(x, global_scale)
    if triton_supported(x) is not None:
        return quant_nvfp4_reference(x, global_scale)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty(scale_numel(rows, k), dtype=E4M3, device=x.device)
    if rows == 0 or k == 0:
        return q, scales
    launch_rows = nvfp4_launch_rows(rows)
    _, rows_per, warps = row_tiling(k, launch_rows, 64)
    # Half the row-wise kernels' warps (about 48 values a thread at W1/W2 widths): H200,
    # benchmarks/probes/act_onepass.py, W2 36.8 -> 35.4 us, W1 18.5 -> 18.2 (RESULTS.md,
    # 2026-12-01).
    warps = max(1, warps // 2)
    block, block2 = row_split(k, 64)
    grid = (triton.cdiv(launch_rows, rows_per),)
    # 16-byte half groups where Triton knows it (it specialises strides divisible by 16)
    aligned = x2.stride(0) % 16 == 0 and x2.data_ptr() % 16 == 0
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch(_quant_nvfp4_kernel, grid,
            x2, q.view(-1, k // 2).view(torch.int32), scales.view(torch.uint8), global_scale,
            rows, k, x2.stride(0), ROWS=rows_per, BLOCK=block, BLOCK2=block2,
            EVEN=launch_rows == rows and even_tiles(rows, rows_per, k, block, block2),
            CUDA=mirror_cuda(_quant_nvfp4_kernel, x), PAIRS=aligned,
            num_warps=warps, enable_fp_fusion=False,
        )
    return q, scales


quant_nvfp4.register_kernel("cuda")(quant_nvfp4_triton)
