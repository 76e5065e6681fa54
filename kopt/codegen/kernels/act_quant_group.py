"""Bias + activation + FP8 e4m3 quantization per 1x128 group, fused:
``kopt::act_quant_fp8_group``.

For each row r (token) of the activation's input, with N features and g = n // 128:

    x[r, n]     = x[r, n] + bias[n]                              (optional; rounded to x's dtype)
    a[r, n]     = act(x[r, n], up[r, n])                         (rounded to x's dtype)
    scale[r, g] = max(max_{n in group g} |a[r, n]|, 1e-12) / 448   (fp32)
    q[r, n]     = e4m3(clamp(a[r, n] / scale[r, g], -448, 448))  (round to nearest even)

``act`` is one of :data:`kopt.codegen.kernels.act_quant.ACT_CODES` (SwiGLU, GELU(tanh),
GELU(erf), and the ``:fast`` forms), computed as in :mod:`kopt.codegen.kernels.act_quant`.
With ``other`` the row quantized is ``cat([other, a])`` (or ``[a, other]``), its first part a
multiple of 128 wide so that no group spans both (FLUX.2's single-stream blocks quantize the
attention output beside the SwiGLU output). The outputs are what ``kopt::quant_fp8_group``
writes and ``kopt::fp8_blockwise_mm`` reads: ``q`` [rows, N (+ P)] e4m3 and ``scale``
[rows, ceil((N + P) / 128)] fp32 with strides (1, rows).

This is the blockwise FP8 recipe's producer (``FP8Config(layout="blockwise")``). The blockwise
GEMM cannot add a bias for free (cuBLAS's blockwise kernel with a bias took 0.306 ms against
0.259 without at 4224 x 12288 x 3072 on the H200, slower than a separate add:
RESULTS.md, 2026-11-30), so the bias of the GEMM before the activation is added
here, where x is read anyway. A group's scale depends on its 128 values only: one pass, no
row-wide reduction, each program a tile of rows x ``BLOCK`` features.

Numerics tier: exact for the exact activations (the unfused ops' order and roundings: the
bias add rounded to x's dtype as torch's add, then as the row-wise kernel, then as
``kopt::quant_fp8_group``); tolerance for the ``:fast`` ones, whose quotient by a group's
scale is also the product with its reciprocal on the GPU (as the per-token kernel's). Under
``TRITON_INTERPRET=1`` the activation's math functions differ from torch's CPU ones in the
last bit (see :mod:`kopt.codegen.kernels.act_quant`): CPU tests compare with tolerance, GPU
tests bitwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kopt.codegen import fp64_reference
from kopt.codegen.kernels.act_quant import (
    ACT_CODES,
    KERNEL_DTYPES,
    act_values,
    activation_reference,
    as_3d,
    check_args,
    check_other,
)
from kopt.codegen.kernels.qk_norm_rope import native, on_device, round_to, widen
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    GROUP,
    e4m3_bits,
    e4m3_clamp,
    fp8_scale,
    group_scale_empty,
    quant_fp8_group_reference,
)
from kopt.codegen.launch import launch
from kopt.codegen.ops import define
from kopt.codegen.pointwise import pw_div_by, pw_recip

# Features per program (a multiple of GROUP) and the rows a program takes with it: 2048
# values per program at 4 warps, 2048 of one row where the row is that wide. The best of 18
# configs at the W1 (bias + GELU) and W2 (SwiGLU) image-token shapes on the H200: 86.3 and
# 119.8 us against 100.1 and 150.9 for 1024 x 4 rows (RESULTS.md, 2026-11-30).
_BLOCK = 2048
_ELEMS = 2048


def act_quant_group_reference(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                              bias: torch.Tensor | None, other: torch.Tensor | None = None,
                              other_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops: ``x + bias``, the activation, the concatenation with ``other``,
    ``kopt::quant_fp8_group``."""
    a = activation_reference(x if bias is None else x + bias, up, activation)
    if other is not None:
        a = torch.cat([other, a] if other_first else [a, other], -1)
    return quant_fp8_group_reference(a.reshape(-1, a.shape[-1]))


@triton.jit
def _group_act(x_ptr, u_ptr, b_ptr, r64, R2, N, acol, mask, sx0, sx1, sxn, su0, su1, sun,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr,
               PAIRS: tl.constexpr):
    """The (bias +) activation of a [rows, BLOCK] tile at activation columns ``acol``.
    ``PAIRS``: each thread holds an even number of the tile's values (bf16 widened and rounded
    two at a time on the GPU)."""
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + ((r64 // R2) * sx0 + (r64 % R2) * sx1)[:, None] + acol[None, :] * sxn,
                mask=mask, other=0.0)
    if HAS_BIAS:
        # (a bf16 sum rounded to bf16: ptxas makes it one packed add per two values)
        b = tl.load(b_ptr + acol, mask=acol < N, other=0.0).to(tl.float32)
        x = round_to(x.to(tl.float32) + b[None, :], dt, NATIVE)
    else:
        x = widen(x, NATIVE and PAIRS)
    if ACT == 0 or ACT == 3:
        up = tl.load(u_ptr + ((r64 // R2) * su0 + (r64 % R2) * su1)[:, None]
                     + acol[None, :] * sun, mask=mask, other=0.0).to(tl.float32)
    else:
        up = x
    return tl.where(mask, act_values(x, up, dt, ACT, NATIVE, PAIRS), 0.0)


@triton.jit
def group_quant_tile(a, ROWS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                     NATIVE: tl.constexpr):
    """A [ROWS, BLOCK] fp32 tile (BLOCK a multiple of 128, values outside the tensor 0) ->
    (e4m3 bits [ROWS, BLOCK], scales [ROWS, BLOCK / 128]): each 1x128 group by its own amax.
    ``FAST``: the quotient by the scale as the product with its reciprocal on the GPU (the fast
    activations' tier, as the per-token kernel's ``_quotient``); else the IEEE quotient. Shared
    with the GEMM template's quantized output (:mod:`kopt.codegen.gemm`)."""
    a3 = tl.reshape(a, [ROWS, BLOCK // 128, 128])
    amax = tl.max(tl.abs(a3), axis=2)
    scale = fp8_scale(amax, NATIVE)
    if FAST and NATIVE:
        q = a3 * pw_recip(scale)[:, :, None]
    else:
        q = pw_div_by(a3, scale[:, :, None], pw_recip(scale)[:, :, None], NATIVE)
    q = e4m3_clamp(q, NATIVE)
    return tl.reshape(e4m3_bits(q, NATIVE), [ROWS, BLOCK]), scale


@triton.jit
def _act_quant_group_kernel(
    x_ptr, u_ptr, b_ptr, o_ptr, q_ptr, s_ptr, R, R2, N, P,
    sx0, sx1, sxn, su0, su1, sun, so0, so1, son,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OTHER: tl.constexpr,
    OTHER_FIRST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr,
    PAIRS: tl.constexpr = False,
):
    """Program (i, j): rows i ROWS .. (i + 1) ROWS, output columns j BLOCK .. (j + 1) BLOCK
    (BLOCK a multiple of 128: whole groups). Rows are ``[R1, R2]`` flattened, read through
    strides. With ``HAS_OTHER`` an output row is ``cat([other, act])`` (``OTHER_FIRST``) or
    ``cat([act, other])``, N + P values; BLOCK divides the first part's width, so a program's
    columns are all other's or all the activation's."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * BLOCK
    col = c0 + tl.arange(0, BLOCK)
    W = N + P
    rmask = row < R
    mask = rmask[:, None] & (col < W)[None, :]
    r64 = row.to(tl.int64)
    if HAS_OTHER:
        if OTHER_FIRST:
            in_other = c0 < P
            a_off = P
            o_off = 0
        else:
            in_other = c0 >= N
            a_off = 0
            o_off = N
        if in_other:
            ocol = col - o_off
            a = tl.load(o_ptr + ((r64 // R2) * so0 + (r64 % R2) * so1)[:, None]
                        + ocol[None, :] * son, mask=mask, other=0.0).to(tl.float32)
        else:
            a = _group_act(x_ptr, u_ptr, b_ptr, r64, R2, N, col - a_off, mask, sx0, sx1, sxn,
                           su0, su1, sun, ACT, HAS_BIAS, NATIVE, PAIRS)
    else:
        a = _group_act(x_ptr, u_ptr, b_ptr, r64, R2, N, col, mask, sx0, sx1, sxn, su0, su1,
                       sun, ACT, HAS_BIAS, NATIVE, PAIRS)
    bits, scale = group_quant_tile(a, ROWS, BLOCK, ACT >= 3, NATIVE)
    tl.store(q_ptr + r64[:, None] * W + col[None, :], bits, mask=mask)
    g = c0 // 128 + tl.arange(0, BLOCK // 128)
    tl.store(s_ptr + g.to(tl.int64)[None, :] * R + r64[:, None], scale,
             mask=rmask[:, None] & (g < (W + 127) // 128)[None, :])


def _config(n: int, rows: int, first: int | None = None) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps); with a concatenation, BLOCK divides its first part's width
    ``first`` (a multiple of 128)."""
    block = min(_BLOCK, max(GROUP, triton.next_power_of_2(n)))
    while first is not None and first % block:
        block //= 2
    rows_per = max(1, min(_ELEMS // block, triton.next_power_of_2(max(rows, 1))))
    return block, rows_per, 4 if block * rows_per <= 4096 else 8


def check_operands(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                   bias: torch.Tensor | None, other: torch.Tensor | None,
                   other_first: bool) -> None:
    """The op's contract: the act + quant kernel's, a bias of the features, and a concatenated
    tensor whose first part holds whole groups."""
    check_args(x, up, activation)
    if bias is not None and (bias.shape != x.shape[-1:] or bias.dtype != x.dtype):
        raise ValueError(f"the bias must be one {x.dtype} vector of the {x.shape[-1]} features, "
                         f"got {bias.dtype}{list(bias.shape)}")
    if other is None:
        return
    check_other(other, x)
    first = other.shape[-1] if other_first else x.shape[-1]
    if first % GROUP:
        raise ValueError(f"the concatenation's first part is {first} wide, not a multiple of "
                         f"{GROUP}: a 1x128 group would span both parts")


def act_quant_group_triton(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                           bias: torch.Tensor | None = None, other: torch.Tensor | None = None,
                           other_first: bool = True, config: tuple[int, int, int] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``config``
    ``(BLOCK, ROWS, num_warps)`` overrides :func:`_config` (benchmarks sweep it). ``other``:
    the rows quantized are ``cat([other, act])`` (``[act, other]`` unless ``other_first``)."""
    check_operands(x, up, activation, bias, other, other_first)
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {x.dtype}")
    n, rows = x.shape[-1], math.prod(x.shape[:-1])
    p = other.shape[-1] if other is not None else 0
    q = torch.empty((rows, n + p), dtype=E4M3, device=x.device)
    scale = group_scale_empty(rows, n + p, x.device)
    if rows == 0 or n + p == 0:
        return q, scale
    first = None if other is None else (p if other_first else n)
    block, rows_per, warps = config or _config(n + p, rows, first)
    if block % GROUP or (first is not None and first % block):
        raise ValueError(f"BLOCK {block} must hold whole groups of {GROUP} and divide the "
                         "concatenation's first part")
    x3 = as_3d(x)
    u3 = as_3d(up) if up is not None else x3
    o3 = as_3d(other) if other is not None else x3
    with on_device(x):
        launch(_act_quant_group_kernel, (triton.cdiv(rows, rows_per), triton.cdiv(n + p, block)),
            x3, u3, bias if bias is not None else x3, o3, q.view(torch.uint8), scale, rows,
            x3.shape[1], n, p, *x3.stride(), *u3.stride(), *o3.stride(),
            ACT=ACT_CODES[activation], HAS_BIAS=bias is not None, HAS_OTHER=other is not None,
            OTHER_FIRST=other_first, ROWS=rows_per, BLOCK=block,
            NATIVE=native(_act_quant_group_kernel, x), PAIRS=rows_per * block >= 64 * warps,
            num_warps=warps,
            # Contractions are written out (tl.fma) where torch's build has them; none else.
            enable_fp_fusion=False,
        )
    return q, scale


def _reference(x: torch.Tensor, up: torch.Tensor | None, activation: str,
               bias: torch.Tensor | None, other: torch.Tensor | None, other_first: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    check_operands(x, up, activation, bias, other, other_first)
    return act_quant_group_reference(x, up, activation, bias, other, other_first)


def _cuda(x: torch.Tensor, up: torch.Tensor | None, activation: str,
          bias: torch.Tensor | None, other: torch.Tensor | None, other_first: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype in KERNEL_DTYPES:
        return act_quant_group_triton(x, up, activation, bias, other, other_first)
    return _reference(x, up, activation, bias, other, other_first)  # fp64 (verification)


def _fake(x: torch.Tensor, up: torch.Tensor | None, activation: str,
          bias: torch.Tensor | None, other: torch.Tensor | None, other_first: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    check_operands(x, up, activation, bias, other, other_first)
    rows = math.prod(x.shape[:-1])
    n = x.shape[-1] + (other.shape[-1] if other is not None else 0)
    return (torch.empty((rows, n), dtype=E4M3, device=x.device),
            group_scale_empty(rows, n, x.device))


act_quant_fp8_group = define(
    "act_quant_fp8_group",
    "(Tensor x, Tensor? up, str activation, Tensor? bias, Tensor? other, bool other_first) "
    "-> (Tensor, Tensor)",
    _reference, fake=_fake, cuda=_cuda)


@fp64_reference(torch.ops.kopt.act_quant_fp8_group.default)
def _act_quant_group64(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                       bias: torch.Tensor | None, other: torch.Tensor | None, other_first: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    # the bias and the activation in fp64, then the quantizer as the unfused fp64 run applies it
    return act_quant_group_reference(x, up, activation, bias, other, other_first)
