"""FP8 (e4m3) quantization: one scale per row (``kopt::quant_fp8_rowwise``) or per 1x128 group of
a row (``kopt::quant_fp8_group``).

    scale[r]    = max(|x[r, :]|) / 448                 (fp32; 448 is e4m3's largest finite value)
    q[r, k]     = e4m3(x[r, k] / scale[r])              (round to nearest even, |q| <= 448)

    scale[r, g] = max(|x[r, 128 g : 128 (g + 1)]|) / 448    (the 1x128 variant; a last group may
    q[r, k]     = e4m3(x[r, k] / scale[r, k // 128])         be partial when K % 128 != 0)

Per token for activations ([tokens, K]), per output channel for weights ([N, K]): the scales
``torch._scaled_mm`` takes with rowwise scaling. The op stays a node of its own in the graph so
that a later fusion pass can pull it into the kernel that produces ``x`` (a norm, an activation);
applied to a weight it depends only on parameters and is evaluated once, at load.

Scale layouts, as the GEMMs consume them: rowwise ``scale`` is ``[..., 1]`` fp32, contiguous
(``torch._scaled_mm`` RowWise). The group variant's ``scale`` is ``[M, ceil(K / 128)]`` fp32 with
strides ``(1, M)``: "outer-dim-major", the layout ``torch._scaled_mm``'s BlockWise1x128 checks for
its left operand (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``is_blockwise_1x128_scaling``) and
the transposed LHS-scale layout DeepGEMM-style sm_90 blockwise kernels read with TMA.

Triton producers (registered for CUDA): bitwise equal to the PyTorch references on the same
device. The division by 448 follows PyTorch per device (CUDA divides by a Python scalar by
multiplying with its fp32 reciprocal, the CPU divides); ``x / scale`` is rounded as an IEEE
division (on CUDA through the scale's reciprocal and two fma corrections, ``pw_div_by``); the
e4m3 cast is the hardware's round-to-nearest-even on CUDA and a bit-exact software rounding
in Triton's interpreter, whose own fp8 casts do not round to nearest even. NaN inputs are not
supported (torch's amax propagates NaN, ``tl.max`` need not).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kopt.codegen.launch import launch
from kopt.codegen.ops import define
from kopt.codegen.pointwise import pw_div, pw_div_by, pw_div_const, pw_recip, reciprocal_fp32

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# A row of zeros gets this scale instead of 0, so that x / scale stays 0 rather than NaN.
MIN_AMAX = 1e-12
GROUP = 128
# Widest row the row-wise kernels keep in registers (one program per row, in one or two tiles).
MAX_COLS = 32768
INV_E4M3_MAX = reciprocal_fp32(E4M3_MAX)
# Widest row tile whose quotients x / scale go through the scale's reciprocal (``pw_div_by``)
# in the per-row quantizer; wider tiles divide. Measured on the H200 (quant_variants.py): a
# 3072-wide row 21.5 -> 17.5 us, 6144: 42.9 -> 37.4, but 12288 (a 16384 tile): 89.8 -> 99.4
# (likely cause, not profiled: a whole row held in registers leaves no room for the
# corrections' live values).
RECIPROCAL_MAX_BLOCK = tl.constexpr(8192)
# the kernels below spell these constants out (constexpr literals): keep them in sync
assert (E4M3_MAX, INV_E4M3_MAX, MIN_AMAX) == (448.0, 0.0022321429569274187, 1e-12)
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quant_fp8_rowwise_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: ``(q, scale)`` with ``q * scale ~= x``, scale shaped [..., 1]."""
    # The division and the clamp happen in fp32: a bf16 quotient would round twice. Row-major
    # like the fake and the kernel's output, whatever x's strides (a GEMM reads q row-major).
    xf = x.to(torch.float32, memory_format=torch.contiguous_format)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    scale = amax / E4M3_MAX
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def _quant_fp8_rowwise_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    return q, scale


# -- the 1x128 group variant ------------------------------------------------------------------

def group_scale_empty(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, ceil(cols / 128)] fp32 tensor with strides (1, rows)."""
    groups = -(-cols // GROUP)
    return torch.empty((groups, rows), dtype=torch.float32, device=device).t()


def quant_fp8_group_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: q shaped like x (e4m3), scale [M, ceil(K / 128)] outer-dim-major."""
    k = x.shape[-1]
    xf = x.float().reshape(-1, k)
    rows, groups = xf.shape[0], -(-k // GROUP)
    padded = torch.nn.functional.pad(xf, (0, groups * GROUP - k)).reshape(rows, groups, GROUP)
    amax = padded.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)  # zeros never win
    scale = amax / E4M3_MAX
    q = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.reshape(rows, groups * GROUP)[:, :k].contiguous().reshape(x.shape)
    out_scale = group_scale_empty(rows, k, x.device)
    out_scale.copy_(scale.reshape(rows, groups))
    return q, out_scale


def _quant_fp8_group_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = math.prod(x.shape[:-1])
    return (torch.empty(x.shape, dtype=E4M3, device=x.device),
            group_scale_empty(rows, x.shape[-1], x.device))


# -- device code shared with the row-wise template ----------------------------------------------

@triton.jit
def e4m3_bits(v, CUDA: tl.constexpr):
    """fp32 ``v`` with |v| <= 448 -> the e4m3fn bit pattern (uint8), nearest even."""
    if CUDA:
        b = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
        a = tl.abs(v)
        u = a.to(tl.int32, bitcast=True)
        # normal (|v| >= 2^-6): keep 3 mantissa bits, nearest even on the integer bits
        r = (u + 0x7FFFF + ((u >> 20) & 1)) & -1048576
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        # subnormal: multiples of 2^-9; adding 2^14 (ulp 2^-9) rounds to nearest even
        sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
        b = (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)
    return b


@triton.jit
def in_range(i, n, EVEN: tl.constexpr):
    """The mask ``i < n``; with ``EVEN`` (the launch knows every index is in range: the tiles
    cover the rows exactly) a constant true mask instead, which the compiler folds away with
    the selects and load/store predicates that use it (W1's LayerNorm + adaLN + FP8 kernel,
    compiled for sm_90, had 3 selects per value on masks that were all true)."""
    if EVEN:
        m = tl.full(i.shape, 1, tl.int1)
    else:
        m = i < n
    return m


@triton.jit
def e4m3_clamp(q, CUDA: tl.constexpr):
    """``q`` clamped to e4m3's range for :func:`e4m3_bits` (and ``to_e4m3``). On CUDA the cast
    saturates (``cvt.rn.satfinite.e4m3x2.f32``): a quotient above 448 becomes 448 as it would
    clamped, so the two min/max per value are left out there."""
    if not CUDA:
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q


@triton.jit
def e4m3_value(b, CUDA: tl.constexpr):
    """The fp32 value of a non-negative e4m3fn bit pattern (uint8)."""
    if CUDA:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        c = b.to(tl.int32)
        e = (c >> 3) & 15
        normal = (((e + 120) << 23) | ((c & 7) << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, (c & 7).to(tl.float32) * 0.001953125, normal)
    return v


@triton.jit
def fp8_scale(amax, CUDA: tl.constexpr):
    """The scales of rows (or 1x128 groups) whose largest magnitude is ``amax`` (fp32)."""
    return pw_div_const(tl.maximum(amax, 1e-12), 448.0, 0.0022321429569274187, CUDA)


@triton.jit
def fp8_rowwise_write(v, scale, row, rows, col, cols, q_ptr, EVEN: tl.constexpr,
                      CUDA: tl.constexpr):
    """Store the [R, C] fp32 tile ``v`` at columns ``col`` quantized with the rows' ``scale``
    (q is [rows, cols] contiguous; ``EVEN``: every row and column of the tile is in range)."""
    if v.shape[1] <= RECIPROCAL_MAX_BLOCK:
        q = pw_div_by(v, scale[:, None], pw_recip(scale)[:, None], CUDA)
    else:
        q = pw_div(v, scale[:, None])
    q = e4m3_clamp(q, CUDA)
    offs = row.to(tl.int64)[:, None] * cols + col[None, :]
    mask = in_range(row, rows, EVEN)[:, None] & in_range(col, cols, EVEN)[None, :]
    tl.store(q_ptr + offs, e4m3_bits(q, CUDA), mask=mask)


@triton.jit
def fp8_rowwise_store(v, row, rows, col, cols, q_ptr, s_ptr, EVEN: tl.constexpr,
                      CUDA: tl.constexpr):
    """Quantize the [R, C] fp32 tile ``v`` (zero outside the valid columns) with one scale per
    row; q is stored [rows, cols] contiguous, the scale at ``s_ptr + row``."""
    scale = fp8_scale(tl.max(tl.abs(v), axis=1), CUDA)
    fp8_rowwise_write(v, scale, row, rows, col, cols, q_ptr, EVEN, CUDA)
    tl.store(s_ptr + row, scale, mask=in_range(row, rows, EVEN))


@triton.jit
def fp8_group_store(v, row, rows, col, cols, q_ptr, s_ptr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr, C0: tl.constexpr, EVEN: tl.constexpr,
                    CUDA: tl.constexpr):
    """Quantize the [ROWS, BLOCK] fp32 tile ``v`` of columns ``col`` = C0 .. C0 + BLOCK (zero
    outside the valid columns; C0 a multiple of 128) with one scale per 1x128 group; scales go
    to ``s_ptr + g * rows + row`` (outer-dim-major)."""
    v3 = tl.reshape(v, [ROWS, BLOCK // 128, 128])
    amax = tl.max(tl.abs(v3), axis=2)
    scale = fp8_scale(amax, CUDA)
    if BLOCK <= RECIPROCAL_MAX_BLOCK:
        q = pw_div_by(v3, scale[:, :, None], pw_recip(scale)[:, :, None], CUDA)
    else:
        q = pw_div(v3, scale[:, :, None])
    q = e4m3_clamp(q, CUDA)
    bits = tl.reshape(e4m3_bits(q, CUDA), [ROWS, BLOCK])
    rmask = in_range(row, rows, EVEN)
    offs = row.to(tl.int64)[:, None] * cols + col[None, :]
    tl.store(q_ptr + offs, bits, mask=rmask[:, None] & in_range(col, cols, EVEN)[None, :])
    g = C0 // 128 + tl.arange(0, BLOCK // 128)
    s_offs = g.to(tl.int64)[None, :] * rows + row[:, None]
    tl.store(s_ptr + s_offs, scale,
             mask=rmask[:, None] & in_range(g, (cols + 127) // 128, EVEN)[None, :])


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, GROUPED: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK2: tl.constexpr,
                      EVEN: tl.constexpr, CUDA: tl.constexpr):
    """Load ROWS rows of x (upcast to fp32) and quantize them per row or per 1x128 group; a
    row is one BLOCK-wide tile, or two (BLOCK, then BLOCK2 > 0 more: :func:`row_split`);
    ``EVEN``: the tiles cover the rows exactly (no masks)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = in_range(row, rows, EVEN)
    col = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + col[None, :],
                mask=rmask[:, None] & in_range(col, cols, EVEN)[None, :],
                other=0.0).to(tl.float32)
    if BLOCK2 > 0:
        col2 = BLOCK + tl.arange(0, BLOCK2)
        v2 = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + col2[None, :],
                     mask=rmask[:, None] & in_range(col2, cols, EVEN)[None, :],
                     other=0.0).to(tl.float32)
    if GROUPED:
        fp8_group_store(v, row, rows, col, cols, q_ptr, s_ptr, ROWS, BLOCK, 0, EVEN, CUDA)
        if BLOCK2 > 0:
            fp8_group_store(v2, row, rows, col2, cols, q_ptr, s_ptr, ROWS, BLOCK2, BLOCK, EVEN,
                            CUDA)
    elif BLOCK2 > 0:
        scale = fp8_scale(tl.maximum(tl.max(tl.abs(v), axis=1),
                                         tl.max(tl.abs(v2), axis=1)), CUDA)
        fp8_rowwise_write(v, scale, row, rows, col, cols, q_ptr, EVEN, CUDA)
        fp8_rowwise_write(v2, scale, row, rows, col2, cols, q_ptr, EVEN, CUDA)
        tl.store(s_ptr + row, scale, mask=rmask)
    else:
        fp8_rowwise_store(v, row, rows, col, cols, q_ptr, s_ptr, EVEN, CUDA)


# -- launching ----------------------------------------------------------------------------------

def row_tiling(cols: int, rows: int, min_block: int = 16) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)`` of kopt's row-wise kernels with the whole row in one tile
    (BLOCK = next power of two, masked; :func:`row_split` may run it as two tiles instead),
    several rows per program when rows are short, warps
    so that each thread holds 8-32 values of a tile (a 4096-wide tile at 4 warps was the best of
    12 tilings for each of the 5 ``kopt::rowwise`` specs swept at W1 shapes on the H200, more
    rows per program slower; the plain quantizers that share this tiling were not swept)."""
    block = max(triton.next_power_of_2(cols), min_block)
    rows_per = max(1, min(16, 2048 // block, triton.next_power_of_2(max(rows, 1))))
    elems = block * rows_per
    num_warps = 16 if elems >= 16384 else 8 if elems >= 8192 else 4
    return block, rows_per, num_warps


def even_tiles(rows: int, rows_per: int, cols: int, block: int, block2: int) -> bool:
    """Whether programs of ``rows_per`` rows, each row ``block`` (+ ``block2``) columns wide,
    cover ``rows`` x ``cols`` exactly: the kernels' ``EVEN`` (no masks)."""
    return rows % rows_per == 0 and cols == block + block2


def row_split(cols: int, min_block: int = 16) -> tuple[int, int]:
    """``(BLOCK, BLOCK2)``: a row of ``cols`` values as one power-of-two tile (BLOCK2 = 0) or
    two (BLOCK + BLOCK2 columns; the second starts at column BLOCK), whichever pads fewer
    lanes. Masked lanes still issue every instruction: on the H200 the norm + FP8 kernels of
    3072- and 6144-wide rows (one 4096/8192 tile, a quarter masked) ran at 0.62-0.66 of a
    same-size copy, the same kernels on 4096/8192-wide rows at 0.78-0.80 (RESULTS.md,
    2026-12-01)."""
    block = max(triton.next_power_of_2(cols), min_block)
    low = block // 2
    if low < min_block or cols <= low:
        return block, 0
    block2 = max(triton.next_power_of_2(cols - low), min_block)
    return (low, block2) if low + block2 < block else (block, 0)


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (TRITON_INTERPRET=1 when it was defined)."""
    return isinstance(kernel, InterpretedFunction)


def mirror_cuda(kernel: object, x: torch.Tensor) -> bool:
    """The ``CUDA`` constexpr: mirror PyTorch's CUDA kernels (compiled, on a CUDA tensor) or its
    CPU kernels (the interpreter)."""
    return x.is_cuda and not interpreted(kernel)


def triton_supported(x: torch.Tensor) -> str | None:
    """Why the Triton producers cannot take ``x`` (None if they can)."""
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype} (Triton producers take bf16/fp16/fp32)"
    if x.dim() == 0:
        return "a 0-d tensor"
    if x.shape[-1] > MAX_COLS:
        return f"rows of {x.shape[-1]} values (at most {MAX_COLS} in one tile)"
    return None


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_quant(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, grouped: bool) -> None:
    x2 = _as_rows(x)
    rows, cols = x2.shape
    if rows == 0 or cols == 0:
        return
    _, rows_per, warps = row_tiling(cols, rows, GROUP if grouped else 16)
    block, block2 = row_split(cols, GROUP if grouped else 16)
    grid = (triton.cdiv(rows, rows_per),)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch(_quant_fp8_kernel, grid,
            x2, q.view(torch.uint8), scale, rows, cols, x2.stride(0), GROUPED=grouped,
            ROWS=rows_per, BLOCK=block, BLOCK2=block2,
            EVEN=even_tiles(rows, rows_per, cols, block, block2),
            CUDA=mirror_cuda(_quant_fp8_kernel, x),
            num_warps=warps, enable_fp_fusion=False,
        )


def quant_fp8_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton producer of ``kopt::quant_fp8_rowwise`` (bitwise the reference's result)."""
    if triton_supported(x) is not None:
        return quant_fp8_rowwise_reference(x)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    _launch_quant(x, q, scale, grouped=False)
    return q, scale


def quant_fp8_group_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton producer of ``kopt::quant_fp8_group`` (bitwise the reference's result)."""
    if triton_supported(x) is not None:
        return quant_fp8_group_reference(x)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = group_scale_empty(math.prod(x.shape[:-1]), x.shape[-1], x.device)
    _launch_quant(x, q, scale, grouped=True)
    return q, scale


quant_fp8_rowwise = define("quant_fp8_rowwise", "(Tensor x) -> (Tensor, Tensor)",
                           quant_fp8_rowwise_reference, fake=_quant_fp8_rowwise_fake,
                           cuda=quant_fp8_rowwise_triton)
quant_fp8_group = define("quant_fp8_group", "(Tensor x) -> (Tensor, Tensor)",
                         quant_fp8_group_reference, fake=_quant_fp8_group_fake,
                         cuda=quant_fp8_group_triton)
