"""Activation followed by FP8 e4m3 per-token quantization, fused: ``kopt::act_quant_fp8_rowwise``.

For each row r (token) of the activation's input, with N features:

    a[r, n]  = act(x[r, n], up[r, n])                       (rounded to x's dtype)
    scale[r] = max(max_n |a[r, n]|, 1e-12) / 448            (fp32)
    q[r, n]  = e4m3(clamp(a[r, n] / scale[r], -448, 448))  (round to nearest even)

with ``act`` one of

* ``"silu_mul"`` (SwiGLU): silu(x) * up, silu(x) = x / (1 + exp(-x)), the silu rounded to x's
  dtype before the product; ``x`` (gate) and ``up`` are two tensors or two halves of one merged
  GEMM output (strided views: no copy).
* ``"gelu_tanh"``: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
* ``"gelu_erf"``: 0.5 x (1 + erf(x / sqrt(2))).

``kopt::cat_act_quant_fp8_rowwise(other, x, up, act, other_first)`` quantizes the row
``cat([other, a])`` (or ``[a, other]``) instead, ``other`` read as it is: FLUX.2's single-stream
blocks feed their output projection the attention output and the SwiGLU output side by side.

Outputs: ``q`` [rows, N] e4m3 and ``scale`` [rows, 1] fp32, rows = all leading dims flattened: the
operands ``torch._scaled_mm`` takes with rowwise scaling, as :mod:`kopt.codegen.kernels.quant_fp8`
produces them.

Numerics tier: exact. The reference is the unfused graph's own op sequence (``F.silu``, ``*``,
``F.gelu``, then :func:`quant_fp8_rowwise_reference`), and the kernel repeats torch's CUDA
kernels step by step: the activation in fp32 with libdevice's expf/tanhf/erff (what torch's
``::exp``/``tanh``/``::erf`` compile to), IEEE division (``div_rn``), the fma nvcc forms in GELU's
``x + 0.044715 x^3`` and no other contraction, the activation rounded to x's dtype (torch stores
it), ``amax * fp32(1/448)`` (torch's CUDA division by a Python scalar multiplies by the
reciprocal), the quotient rounded as a true division (on the GPU through the scale's reciprocal
and two fma corrections, :func:`kopt.codegen.pointwise.pw_div_by`), and the e4m3 cast rounding
to nearest even.

``"silu_mul:fast"`` and ``"gelu_tanh:fast"`` (``FP8Config(activation_math="fast")``) compute
the activation as ``x * sigmoid(v)`` (v = x for SiLU, v = 2 sqrt(2/pi) (x + 0.044715 x^3) for
GELU: ``0.5 (1 + tanh(u)) = sigmoid(2u)``) as ``x * rcp(1 + ex2(-log2(e) v))`` with the GPU's
approximate, flush-to-zero ``ex2`` and reciprocal (one MUFU instruction each) instead of
libdevice's expf/tanhf and an IEEE division: a few fp32 ulp from the exact value and no
cancellation, so the activation rounded to bf16 differs from torch's where the exact value lies
within those ulp of a rounding boundary, and in GELU's negative tail (x from about -5 to -10),
where torch's ``1 + tanh(u)`` cancels to a coarse value or 0 and the fast form keeps the tiny
true value (in FP8 both are 0 unless the whole row is that small); further out (SiLU below
-87, GELU below about -10) the flushed reciprocal gives -0, as torch's GELU does.
The quotient by the row's scale is then the product with its reciprocal (no corrections):
within 1.5 fp32 ulp of the IEEE quotient, so an e4m3 value one step off where the quotient lies
that close to a rounding midpoint, the size of difference the fast activation already makes;
the scales are the exact formula's.
Numerics tier: tolerance (tested against the exact reference and fp64).

``NATIVE`` (the kernel compiled for the GPU) is False under ``TRITON_INTERPRET=1``: there is no
libdevice there (numpy's exp/erf instead; tanh from exp, see :func:`_tanh`), and its casts
truncate, so the e4m3 cast is emulated on the grid (see :func:`to_e4m3`) and bf16 rounding on
the bits (:func:`round_to`); ``amax / 448`` divides there, as torch's CPU kernel does. The math
functions still differ from torch's CPU ones in the last bit: CPU tests compare with tolerance,
GPU tests bitwise.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kopt.codegen import fp64_reference
from kopt.codegen.kernels.qk_norm_rope import native, on_device, round_pairs, round_to, widen
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    E4M3_MAX,
    MIN_AMAX,
    e4m3_clamp,
    in_range,
    quant_fp8_rowwise_reference,
    row_split,
)
from kopt.codegen.launch import launch
from kopt.codegen.ops import define
from kopt.codegen.pointwise import fp32, pw_div_by, pw_recip

ACTIVATIONS = ("silu_mul", "gelu_tanh", "gelu_erf")
FAST = ":fast"  # suffix of an activation computed with the GPU's approximate exp and division
FAST_ACTIVATIONS = ("silu_mul", "gelu_tanh")
# The kernels' ACT constexpr: the exact activations, then the fast ones.
ACT_CODES = {a: i for i, a in enumerate(ACTIVATIONS + tuple(a + FAST for a in FAST_ACTIVATIONS))}
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# torch's GELU constants, built like ATen's ``constexpr opmath_t``: double arithmetic, then fp32.
_M_SQRT2, _M_2_SQRTPI, _M_SQRT1_2 = 1.41421356237309504880, 1.12837916709551257390, \
    0.70710678118654752440
_K_BETA = tl.constexpr(fp32(_M_SQRT2 * _M_2_SQRTPI * 0.5))
_K_KAPPA = tl.constexpr(fp32(0.044715))
_K_ALPHA = tl.constexpr(fp32(_M_SQRT1_2))
_K_NEG_LOG2E = tl.constexpr(fp32(-math.log2(math.e)))
# The fast GELU's exponent in one product: -2 log2(e) kBeta (u = kBeta (x + kKappa x^3)).
_K_GELU_EXP2 = tl.constexpr(fp32(-2.0 * math.log2(math.e) * _M_SQRT2 * _M_2_SQRTPI * 0.5))
_K_GELU_EXP2_CUBE = tl.constexpr(fp32(-2.0 * math.log2(math.e) * _M_SQRT2 * _M_2_SQRTPI * 0.5
                                        * 0.044715))
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_MIN_AMAX = tl.constexpr(fp32(MIN_AMAX))
# fp32(1 / 448): the reciprocal torch multiplies by for ``amax / 448`` on CUDA.
_INV_E4M3_MAX = fp32(1.0 / E4M3_MAX)
# Rows up to this many features are held in registers in one pass; longer rows take two passes
# over their input (amax, then quantize), in _CHUNK-wide chunks at 8 warps: the best of 12
# configs on 5 of 6 W1/W2/LLM shapes on the H200 (one pass over a register-resident 12288-wide
# row was slower at every warp count; RESULTS.md, 2026-11-29). The activation
# is the kernel's cost (an instruction-bound tanh/exp per value), so the first pass stashes it
# (``STASH``) for the second to read back from L2 instead of computing it again: a persistent
# grid of _STASH_CTAS_PER_SM programs per SM, one stash row each. H200, a sweep of 30 configs
# (RESULTS.md, 2026-11-30): the best on W1 GELU, W2 SwiGLU, W3 SwiGLU and GELU(erf) image
# shapes, 116-193 us against 150-237 recomputing (the text shapes within 1 us of their best).
_ONE_PASS_MAX = 2048
_CHUNK = 2048
# The fast activations cost about half the instructions (no range checks around ex2/rcp, a
# bf16 running maximum: 36-38 -> 20-23 SASS instructions per value), and with that the whole
# row in registers, as one or two power-of-two tiles, beats the stash: H200
# (benchmarks/probes/act_onepass.py, CUDA graph, bitwise the same output; RESULTS.md,
# 2026-12-01) W1 GELU 71.0 -> 63.1 us (8 warps), W2 SwiGLU 146.9 -> 120.6 (16 warps), W3
# 47.6 -> 37.5 (8 warps); 32 warps slower everywhere. Warps so that a thread holds at most
# _ONE_PASS_VALUES values, 8 to 16; rows up to _ONE_PASS_FAST_MAX (48 values per thread at 16
# warps; longer rows were not measured) without a concatenated tensor (its loop would take the
# row's wide tiles).
# bf16 is widened and rounded two values at a time and GELU's exponent is one fma (19 -> 16.5
# SASS instructions per value): W1 GELU 54.2 -> 44.3 us, 0.89 of a same-size copy (RESULTS.md,
# 2026-12-01, H200).
_ONE_PASS_FAST_MAX = 24576
_ONE_PASS_VALUES = 48
_STASH_CTAS_PER_SM = 8
# A stashing kernel loads a SwiGLU's two inputs with L2's evict-first policy (``STREAM``), so
# that the stash stays in L2 instead of going out to HBM and back: H200
# (benchmarks/probes/act_stream.py, bitwise the same output), W2's image SwiGLU 185.5 -> 166.7
# us, W3's prefill 66.2 -> 61.5; not GELU's one input (W1 85.5 -> 86.3). Nsight Compute had
# W2's kernel moving ~1.6x its bytes through HBM at 79% of its peak (RESULTS.md, 2026-12-01).
# Programs of a persistent grid under the interpreter (no SMs): fewer than the tests' rows.
_INTERPRETER_PROGRAMS = 3


# --------------------------------------------------------------------------------------------
# PyTorch reference: the unfused graph's ops
# --------------------------------------------------------------------------------------------
def activation_reference(x: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The unfused ops; a ``:fast`` activation's reference is the exact one."""
    activation = activation.removesuffix(FAST)
    if activation == "silu_mul":
        return F.silu(x) * up
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def act_quant_reference(x: torch.Tensor, up: torch.Tensor | None,
                        activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = activation_reference(x, up, activation)
    return quant_fp8_rowwise_reference(a.reshape(-1, a.shape[-1]))


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x, NATIVE: tl.constexpr):
    if NATIVE:
        return libdevice.tanh(x)
    else:
        # The interpreter has no libdevice: tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) in
        # (0, 1], which cannot overflow for any x; the sign is put back after.
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def _exp(x, NATIVE: tl.constexpr):
    # tl.exp is ex2.approx on NVIDIA; torch's ::exp(float) is libdevice's expf.
    if NATIVE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _erf(x, NATIVE: tl.constexpr):
    if NATIVE:
        return libdevice.erf(x)
    else:
        return tl.math.erf(x)


@triton.jit
def to_e4m3(v, dt: tl.constexpr, NATIVE: tl.constexpr):
    if NATIVE:
        return v.to(dt, fp_downcast_rounding="rtne")  # like torch's cast: nearest even
    else:
        # The interpreter's cast truncates and does not carry a rounded-up mantissa into the
        # exponent (124 -> 64): round to the e4m3 grid first (step 2^(exponent - 3), 2^-9 among
        # subnormals; adding and subtracting 1.5 * 2^23 * step rounds to nearest even), so that
        # the cast is exact.
        bits = v.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)
        magic = step * 12582912.0
        r = (tl.abs(v) + magic) - magic
        return tl.where(bits < 0, -r, r).to(dt)


@triton.jit
def _fast_sigmoid_mul(x, v, NATIVE: tl.constexpr):
    """``x / (1 + 2^v)``, the fast activations' form: on the GPU ``ex2.approx.ftz`` and
    ``rcp.approx.ftz`` (one MUFU instruction each) and a multiply. Triton's ``tl.exp`` and
    ``/`` are the same approximations with denormal and range handling around them (session
    15's first pass had 24 FSETP and 96 FMUL per 8 values against 0 and 32 now, with the
    other session-16 changes; ``benchmarks/probes/ptx_sm90.py``). Flushing changes nothing
    above 2^-126: the only values it moves are quotients under 2^-126 (``1 + 2^v`` above
    2^126: SiLU below x = -87, the fast GELU below about -10), which become -0, as torch's
    exact GELU's ``1 + tanh(u)`` already cancels to below -5."""
    d = 1.0 + tl.exp2(v)
    if NATIVE:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = 1.0 / d
    return x * r


@triton.jit
def act_values(x, up, dt: tl.constexpr, ACT: tl.constexpr, NATIVE: tl.constexpr,
               PAIRS: tl.constexpr = False):
    """The activation of fp32 values ``x`` (and ``up``, SwiGLU's other half; ignored by the
    GELUs), in fp32, rounded to ``dt`` as torch stores it. ``PAIRS``: each thread holds an even
    number of values (:func:`round_pairs` may take them two at a time)."""
    if ACT == 0 or ACT == 3:
        if ACT == 0:
            silu = round_to(tl.math.div_rn(x, 1.0 + _exp(-x, NATIVE)), dt, NATIVE)
        else:  # fast: x sigmoid(x), exp(-x) = 2^(-log2(e) x)
            silu = round_to(_fast_sigmoid_mul(x, x * _K_NEG_LOG2E, NATIVE), dt, NATIVE)
        # (two values rounded to dt, and their product rounded to it: ptxas makes this one
        # packed bf16 multiply per two values)
        a = silu * up
    elif ACT == 1:
        # nvcc contracts torch's ``x + kKappa * x_cube`` into one fma, and nothing else.
        inner = _K_BETA * tl.fma(x * x * x, _K_KAPPA, x)
        a = 0.5 * x * (1.0 + _tanh(inner, NATIVE))
    elif ACT == 4:  # fast: 0.5 x (1 + tanh(u)) = x sigmoid(2u), exp(-2u) = 2^(-2 log2(e) u)
        a = _fast_sigmoid_mul(x, x * tl.fma(x * x, _K_GELU_EXP2_CUBE, _K_GELU_EXP2), NATIVE)
    else:
        a = x * 0.5 * (1.0 + _erf(x * _K_ALPHA, NATIVE))
    if ACT != 0 and ACT != 3:
        a = round_pairs(a, dt, NATIVE, PAIRS)
    else:
        a = round_to(a, dt, NATIVE)
    return a


@triton.jit
def _activation(x_row, u_row, cols, mask, sxn, sun, dt: tl.constexpr, ACT: tl.constexpr,
                NATIVE: tl.constexpr, STREAM: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """The activation of one chunk of a row, in fp32, rounded to ``dt`` as torch stores it.
    ``STREAM``: its inputs, read once, are the first lines L2 evicts (the stash stays)."""
    if STREAM:
        x = tl.load(x_row + cols * sxn, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_row + cols * sxn, mask=mask, other=0.0)
    x = widen(x, NATIVE and PAIRS)
    if ACT == 0 or ACT == 3:
        if STREAM:
            up = tl.load(u_row + cols * sun, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            up = tl.load(u_row + cols * sun, mask=mask, other=0.0)
        up = up.to(tl.float32)
    else:
        up = x
    return act_values(x, up, dt, ACT, NATIVE, PAIRS)


@triton.jit
def _quotient(a, scale, r_scale, ACT: tl.constexpr, NATIVE: tl.constexpr):
    """``a / scale`` before the e4m3 cast: the IEEE quotient (:func:`pw_div_by`: a multiply,
    four fmas and an or per value) for the exact activations; for the fast ones (ACT >= 3) on
    the GPU the product with the scale's reciprocal, within 1.5 fp32 ulp of it, which moves an
    e4m3 value by one step only where the quotient lies that close to a rounding midpoint: the
    same kind and size of difference the fast activation itself makes."""
    if ACT >= 3 and NATIVE:
        q = a * r_scale
    else:
        q = pw_div_by(a, scale, r_scale, NATIVE)
    return q


@triton.jit
def _rows(row, x_ptr, u_ptr, o_ptr, y_ptr, R2, N, P, sx0, sx1, su0, su1, so0, so1,
          OTHER_FIRST: tl.constexpr):
    """Row ``row``'s gate, up and other input rows, and where in the output row of ``N + P``
    values the activation and the other tensor go."""
    row = tl.cast(row, tl.int64)
    r1 = row // R2
    r2 = row % R2
    y_row = y_ptr + row * (N + P)
    if OTHER_FIRST:
        ya_row = y_row + P
        yo_row = y_row
    else:
        ya_row = y_row
        yo_row = y_row + N
    return (row, x_ptr + r1 * sx0 + r2 * sx1, u_ptr + r1 * su0 + r2 * su1,
            o_ptr + r1 * so0 + r2 * so1, ya_row, yo_row)


@triton.jit
def _act_quant_row(
    row, x_ptr, u_ptr, o_ptr, q_ptr, scale_ptr, stash_row,
    R2, N, P, sx0, sx1, sxn, su0, su1, sun, so0, so1, son, inv_max,
    ACT: tl.constexpr, BLOCK: tl.constexpr, BLOCK2: tl.constexpr, ONE_PASS: tl.constexpr,
    STASH: tl.constexpr, HAS_OTHER: tl.constexpr, OTHER_FIRST: tl.constexpr,
    EVEN: tl.constexpr, STREAM: tl.constexpr, NATIVE: tl.constexpr, ONE_REDUCTION: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """One row: the activation, its absolute maximum, the scale and the e4m3 values. One pass
    holds the row in registers as one BLOCK-wide tile, or two (BLOCK2 > 0 more columns after
    it: no masked lanes where N is not a power of two, e.g. 18432 = 16384 + 2048). With
    ``HAS_OTHER`` the row quantized is ``cat([other, act])`` (``OTHER_FIRST``) or
    ``cat([act, other])``: P more features read as they are. Two passes over a long row compute
    the activation twice, or (``STASH``) once: the first pass also stores it, in x's dtype,
    at ``stash_row``, and the second reads it back. ``EVEN``: the blocks cover the N (and P)
    features exactly (no masks). ``ONE_REDUCTION``: a one-pass row's two tiles share one
    reduction across the threads (each thread folds the first tile's values onto the second's
    columns, which it also holds: the launcher sets it where the layouts make that free).
    See the module docstring."""
    row, x_row, u_row, o_row, qa_row, qo_row = _rows(
        row, x_ptr, u_ptr, o_ptr, q_ptr, R2, N, P, sx0, sx1, su0, su1, so0, so1, OTHER_FIRST)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = in_range(cols, N, EVEN)
        a = _activation(x_row, u_row, cols, mask, sxn, sun, dt, ACT, NATIVE, PAIRS=PAIRS)
        if not ONE_REDUCTION:
            amax = tl.max(tl.where(mask, tl.abs(a), 0.0), axis=0)
        if BLOCK2 > 0:
            cols2 = BLOCK + tl.arange(0, BLOCK2)
            mask2 = in_range(cols2, N, EVEN)
            a2 = _activation(x_row, u_row, cols2, mask2, sxn, sun, dt, ACT, NATIVE,
                             PAIRS=PAIRS)
            if ONE_REDUCTION:  # the first tile folded onto the second's columns in each thread
                m = tl.max(tl.reshape(tl.where(mask, tl.abs(a), 0.0), (BLOCK // BLOCK2, BLOCK2)),
                           axis=0)
                amax = tl.max(tl.maximum(m, tl.where(mask2, tl.abs(a2), 0.0)), axis=0)
            else:
                amax = tl.maximum(amax, tl.max(tl.where(mask2, tl.abs(a2), 0.0), axis=0))
    else:
        # The running maximum in x's dtype: the activation is already rounded to it (the
        # conversion is exact and folds away), and the maximum of such values is exact in it
        # (bf16: two values per instruction, no conversion back to fp32 per value).
        amax_a = tl.zeros((BLOCK,), dtype=dt)
        for start in range(0, N, BLOCK):
            mask = in_range(start + cols, N, EVEN)
            a = _activation(x_row, u_row, start + cols, mask, sxn, sun, dt, ACT, NATIVE,
                            STASH and STREAM, PAIRS).to(dt)
            # (Triton 3.6 computes a bf16 maximum in fp32: the cast back keeps the loop's type)
            amax_a = tl.maximum(amax_a, tl.where(mask, tl.abs(a), tl.zeros_like(a))).to(dt)
            if STASH:
                tl.store(stash_row + start + cols, a, mask=mask, eviction_policy="evict_last")
        amax = tl.max(amax_a, axis=0).to(tl.float32)
    if HAS_OTHER:
        amax_o = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, P, BLOCK):
            m = in_range(start + cols, P, EVEN)
            v = tl.load(o_row + (start + cols) * son, mask=m, other=0.0).to(tl.float32)
            amax_o = tl.maximum(amax_o, tl.where(m, tl.abs(v), 0.0))
        amax = tl.maximum(amax, tl.max(amax_o, axis=0))
    if NATIVE:  # torch's CUDA kernel multiplies by the fp32 reciprocal of the Python scalar
        scale = tl.maximum(amax, _MIN_AMAX) * inv_max
    else:  # its CPU kernel, which the interpreter stands in for, divides
        scale = tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), tl.full((), _E4M3_MAX, tl.float32))
    tl.store(scale_ptr + row, scale)
    r_scale = pw_recip(scale)
    qt = q_ptr.dtype.element_ty
    if ONE_PASS:
        q = e4m3_clamp(_quotient(a, scale, r_scale, ACT, NATIVE), NATIVE)
        tl.store(qa_row + cols, to_e4m3(q, qt, NATIVE), mask=mask)
        if BLOCK2 > 0:
            q2 = e4m3_clamp(_quotient(a2, scale, r_scale, ACT, NATIVE), NATIVE)
            tl.store(qa_row + cols2, to_e4m3(q2, qt, NATIVE), mask=mask2)
    else:
        if STASH:
            tl.debug_barrier()  # the whole stash written before any thread reads it back
        for start in range(0, N, BLOCK):
            mask = in_range(start + cols, N, EVEN)
            if STASH:
                a = tl.load(stash_row + start + cols, mask=mask, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
            else:
                a = _activation(x_row, u_row, start + cols, mask, sxn, sun, dt, ACT, NATIVE,
                                PAIRS=PAIRS)
            q = e4m3_clamp(_quotient(a, scale, r_scale, ACT, NATIVE), NATIVE)
            tl.store(qa_row + start + cols, to_e4m3(q, qt, NATIVE), mask=mask)
        if STASH:
            tl.debug_barrier()  # read back before the next row overwrites it
    if HAS_OTHER:
        for start in range(0, P, BLOCK):
            m = in_range(start + cols, P, EVEN)
            v = tl.load(o_row + (start + cols) * son, mask=m, other=0.0).to(tl.float32)
            q = e4m3_clamp(_quotient(v, scale, r_scale, ACT, NATIVE), NATIVE)
            tl.store(qo_row + start + cols, to_e4m3(q, qt, NATIVE), mask=m)


@triton.jit
def _act_quant_kernel(
    x_ptr, u_ptr, o_ptr, q_ptr, scale_ptr, stash_ptr,
    R, R2, N, P, sx0, sx1, sxn, su0, su1, sun, so0, so1, son, inv_max,
    ACT: tl.constexpr, BLOCK: tl.constexpr, BLOCK2: tl.constexpr, ONE_PASS: tl.constexpr,
    STASH: tl.constexpr, HAS_OTHER: tl.constexpr, OTHER_FIRST: tl.constexpr,
    EVEN: tl.constexpr, STREAM: tl.constexpr, NATIVE: tl.constexpr,
    ONE_REDUCTION: tl.constexpr = False, PAIRS: tl.constexpr = False,
):
    """One program per row; with ``STASH`` a persistent grid instead, each program going
    through rows pid, pid + programs, ... with its own stash row (programs x N values, small
    enough to stay in L2 between the two passes)."""
    pid = tl.program_id(0)
    if STASH:
        stash_row = stash_ptr + pid.to(tl.int64) * N
        for row in range(pid, R, tl.num_programs(0)):
            _act_quant_row(
                row, x_ptr, u_ptr, o_ptr, q_ptr, scale_ptr, stash_row, R2, N, P, sx0, sx1, sxn,
                su0, su1, sun, so0, so1, son, inv_max, ACT, BLOCK, BLOCK2, ONE_PASS, STASH,
                HAS_OTHER, OTHER_FIRST, EVEN, STREAM, NATIVE, ONE_REDUCTION, PAIRS)
    else:
        _act_quant_row(
            pid, x_ptr, u_ptr, o_ptr, q_ptr, scale_ptr, stash_ptr, R2, N, P, sx0, sx1, sxn,
            su0, su1, sun, so0, so1, son, inv_max, ACT, BLOCK, BLOCK2, ONE_PASS, STASH,
            HAS_OTHER, OTHER_FIRST, EVEN, STREAM, NATIVE, ONE_REDUCTION, PAIRS)


@triton.jit
def _act_kernel(
    x_ptr, u_ptr, o_ptr, y_ptr,
    R2, N, P, sx0, sx1, sxn, su0, su1, sun, so0, so1, son,
    ACT: tl.constexpr, BLOCK: tl.constexpr, HAS_OTHER: tl.constexpr, OTHER_FIRST: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """One program per row: the activation in the input's dtype (rounded as torch stores it)
    and, with ``HAS_OTHER``, the other tensor's row beside it: ``cat([other, act])`` (or
    ``[act, other]``) written once, in one row of ``N + P`` values."""
    _, x_row, u_row, o_row, ya_row, yo_row = _rows(
        tl.program_id(0), x_ptr, u_ptr, o_ptr, y_ptr, R2, N, P, sx0, sx1, su0, su1, so0, so1,
        OTHER_FIRST)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        a = _activation(x_row, u_row, start + cols, mask, sxn, sun, dt, ACT, NATIVE)
        tl.store(ya_row + start + cols, a.to(dt), mask=mask)
    if HAS_OTHER:
        for start in range(0, P, BLOCK):
            m = start + cols < P
            tl.store(yo_row + start + cols, tl.load(o_row + (start + cols) * son, mask=m), mask=m)


def _launch_shape(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                  other: torch.Tensor | None) -> tuple[int, int, int]:
    """Check a kernel call; (features, other's features, rows)."""
    check_args(x, up, activation)
    if other is not None:
        check_other(other, x)
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {x.dtype}")
    return x.shape[-1], 0 if other is None else other.shape[-1], math.prod(x.shape[:-1])


def act_triton(x: torch.Tensor, up: torch.Tensor | None, activation: str,
               other: torch.Tensor | None = None, other_first: bool = True) -> torch.Tensor:
    """:func:`act_reference` with the kernel (CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``): ``[*rows, N (+ P)]`` in x's dtype."""
    n, p, rows = _launch_shape(x, up, activation, other)
    y = torch.empty((*x.shape[:-1], n + p), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    x3 = as_3d(x)
    u3 = as_3d(up) if up is not None else x3
    o3 = as_3d(other) if other is not None else x3
    block = min(triton.next_power_of_2(max(n, p, 1)), _CHUNK)
    with on_device(x):
        launch(_act_kernel, (rows,),
            x3, u3, o3, y, x3.shape[1], n, p, *x3.stride(), *u3.stride(), *o3.stride(),
            ACT=ACT_CODES[activation], BLOCK=block, HAS_OTHER=other is not None,
            OTHER_FIRST=other_first, NATIVE=native(_act_kernel, x),
            num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False,
        )
    return y


def act_reference(other: torch.Tensor | None, x: torch.Tensor, up: torch.Tensor | None,
                  activation: str, other_first: bool) -> torch.Tensor:
    """The unfused ops: the activation, then the concatenation with ``other`` (if any)."""
    a = activation_reference(x, up, activation)
    if other is None:
        return a
    return torch.cat([other, a] if other_first else [a, other], -1)


def _config(n: int, activation: str = "", other: bool = False) -> dict[str, int]:
    """Whole row in one block up to _ONE_PASS_MAX features; a fast activation's row up to
    _ONE_PASS_FAST_MAX in one pass of two tiles (no ``other``); else _CHUNK-wide chunks with the
    activation stashed between the passes."""
    block = triton.next_power_of_2(n)
    if block <= _ONE_PASS_MAX:
        return {"BLOCK": block, "ONE_PASS": True, "STASH": False,
                "num_warps": max(1, min(8, block // 256))}
    if activation.endswith(FAST) and not other and n <= _ONE_PASS_FAST_MAX:
        block, block2 = row_split(n, 16)
        warps = max(8, min(16, triton.next_power_of_2(-(-n // (32 * _ONE_PASS_VALUES)))))
        return {"BLOCK": block, "BLOCK2": block2, "ONE_PASS": True, "STASH": False,
                "num_warps": warps, "ONE_REDUCTION": _one_reduction(activation, block, block2,
                                                                    warps)}
    return {"BLOCK": _CHUNK, "ONE_PASS": False, "STASH": True, "num_warps": 8}


def _one_reduction(activation: str, block: int, block2: int, warps: int) -> bool:
    """Whether a one-pass row's two tiles share one reduction (``ONE_REDUCTION``): where the
    first tile's reshape onto the second's columns compiles to no data movement (SASS on the
    CPU, ``benchmarks/probes/ptx_sm90.py``: 8192 + 4096 at 8 warps; elsewhere, e.g. at 16
    warps, Triton moves the tile through shared memory) and where it does not cost registers
    (SwiGLU's two inputs: 64 -> 69 registers a thread, a CTA fewer per SM)."""
    return not activation.startswith("silu_mul") and block == 2 * block2 and warps == 8


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _stash_programs(rows: int, cfg: dict[str, int], x: torch.Tensor) -> int:
    """A stashing kernel's persistent grid: ``CTAS_PER_SM`` programs per SM (default
    _STASH_CTAS_PER_SM), at most one per row."""
    if not x.is_cuda:
        return min(rows, _INTERPRETER_PROGRAMS)
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return min(rows, cfg.get("CTAS_PER_SM", _STASH_CTAS_PER_SM) * _sm_count(device))


def check_args(x: torch.Tensor, up: torch.Tensor | None, activation: str) -> None:
    if activation not in ACT_CODES:
        raise ValueError(f"activation must be one of {tuple(ACT_CODES)}, got {activation!r}")
    if (activation.removesuffix(FAST) == "silu_mul") != (up is not None):
        raise ValueError("'silu_mul' takes gate and up; the GELUs take one input")
    if x.dim() < 1:
        raise ValueError("the activation needs a feature dimension")
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"gate {x.dtype}{list(x.shape)} and up {up.dtype}{list(up.shape)} "
                         "must match (no broadcasting)")


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """[R1, R2, N] with the rows' strides kept (a view where the leading dims allow it)."""
    if t.dim() == 3:
        return t
    if t.dim() < 3:
        return t.reshape((1,) * (3 - t.dim()) + tuple(t.shape))
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def act_quant_triton(x: torch.Tensor, up: torch.Tensor | None, activation: str,
                     config: dict[str, int] | None = None, other: torch.Tensor | None = None,
                     other_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``). ``config``
    (``BLOCK``, ``BLOCK2``, ``ONE_PASS``, ``STASH``, ``CTAS_PER_SM``, ``STREAM``, ``num_warps``)
    overrides :func:`_config`'s choice (benchmarks sweep it; ``STREAM`` defaults to whether the
    activation has two inputs); a one-pass block (BLOCK + BLOCK2, the second a one-pass row's
    tail tile) must hold the whole row.
    ``other``: the rows quantized are ``cat([other, act])`` (or ``[act, other]`` unless
    ``other_first``)."""
    n, p, rows = _launch_shape(x, up, activation, other)
    q = torch.empty((rows, n + p), dtype=E4M3, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    x3 = as_3d(x)
    u3 = as_3d(up) if up is not None else x3
    o3 = as_3d(other) if other is not None else x3
    cfg = _config(n, activation, other is not None) if config is None else config
    block2 = cfg.get("BLOCK2", 0) if cfg["ONE_PASS"] else 0
    if cfg["ONE_PASS"] and cfg["BLOCK"] + block2 < n:
        raise ValueError(f"a one-pass block of {cfg['BLOCK'] + block2} cannot hold rows of {n}")
    stash = bool(cfg.get("STASH", False)) and not cfg["ONE_PASS"]
    programs = _stash_programs(rows, cfg, x) if stash else rows
    # One stash row per program (a placeholder when unused).
    buf = torch.empty((programs, n) if stash else (1,), dtype=x.dtype, device=x.device)
    with on_device(x):
        launch(_act_quant_kernel, (programs,),
            x3, u3, o3, q, scale, buf, rows, x3.shape[1], n, p, *x3.stride(), *u3.stride(),
            *o3.stride(), _INV_E4M3_MAX, ACT=ACT_CODES[activation], BLOCK=cfg["BLOCK"],
            BLOCK2=block2, ONE_PASS=cfg["ONE_PASS"], STASH=stash, HAS_OTHER=other is not None,
            OTHER_FIRST=other_first, NATIVE=native(_act_quant_kernel, x),
            EVEN=(n == cfg["BLOCK"] + block2 if cfg["ONE_PASS"] else n % cfg["BLOCK"] == 0)
            and p % cfg["BLOCK"] == 0,
            STREAM=bool(cfg.get("STREAM", up is not None)),
            ONE_REDUCTION=block2 > 0 and bool(cfg.get("ONE_REDUCTION", False)),
            PAIRS=min(cfg["BLOCK"], block2 or cfg["BLOCK"]) >= 64 * cfg["num_warps"],
            num_warps=cfg["num_warps"],
            # Contractions are written out (tl.fma) where torch's build has them; none else.
            enable_fp_fusion=False,
        )
    return q, scale


def check_other(other: torch.Tensor, x: torch.Tensor) -> None:
    if other.dtype != x.dtype or other.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"the tensor concatenated with the activation, {other.dtype}"
                         f"{list(other.shape)}, must have the activation's dtype and rows "
                         f"({x.dtype}{list(x.shape[:-1])})")


def cat_act_quant_reference(other: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None,
                            activation: str, other_first: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    a = activation_reference(x, up, activation)
    row = torch.cat([other, a] if other_first else [a, other], -1)
    return quant_fp8_rowwise_reference(row.reshape(-1, row.shape[-1]))


# --------------------------------------------------------------------------------------------
# The ops (kopt.codegen.ops: no custom_op layers on the hot path)
# --------------------------------------------------------------------------------------------
def _act_quant_fp8_rowwise_reference(x: torch.Tensor, up: torch.Tensor | None,
                                     activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(x, up, activation)
    return act_quant_reference(x, up, activation)


def _act_quant_fp8_rowwise_cuda(x: torch.Tensor, up: torch.Tensor | None,
                                activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype in KERNEL_DTYPES:
        return act_quant_triton(x, up, activation)
    check_args(x, up, activation)  # fp64 (verification's reference run): the reference
    return act_quant_reference(x, up, activation)


def _act_quant_fp8_rowwise_fake(x: torch.Tensor, up: torch.Tensor | None,
                                activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(x, up, activation)
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    return (torch.empty((rows, n), dtype=E4M3, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


act_quant_fp8_rowwise = define(
    "act_quant_fp8_rowwise", "(Tensor x, Tensor? up, str activation) -> (Tensor, Tensor)",
    _act_quant_fp8_rowwise_reference, fake=_act_quant_fp8_rowwise_fake,
    cuda=_act_quant_fp8_rowwise_cuda)


@fp64_reference(torch.ops.kopt.act_quant_fp8_rowwise.default)
def _act_quant64(x: torch.Tensor, up: torch.Tensor | None,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    # The activation in fp64, then the quantizer as the unfused graph's fp64 run applies it
    # (kopt::quant_fp8_rowwise quantizes whatever it is given): the same yardstick.
    return act_quant_reference(x, up, activation)


def _cat_act_quant_fp8_rowwise_reference(
    other: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None, activation: str,
    other_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant(cat([other, act(x, up)], -1))`` (or ``[act, other]``): FLUX.2's single-stream
    blocks quantize the attention output and the SwiGLU output side by side for one GEMM."""
    check_args(x, up, activation)
    check_other(other, x)
    return cat_act_quant_reference(other, x, up, activation, other_first)


def _cat_act_quant_fp8_rowwise_cuda(
    other: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None, activation: str,
    other_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype in KERNEL_DTYPES:
        return act_quant_triton(x, up, activation, other=other, other_first=other_first)
    check_args(x, up, activation)
    check_other(other, x)
    return cat_act_quant_reference(other, x, up, activation, other_first)


def _cat_act_quant_fp8_rowwise_fake(
    other: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None, activation: str,
    other_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(x, up, activation)
    check_other(other, x)
    rows = math.prod(x.shape[:-1])
    return (torch.empty((rows, x.shape[-1] + other.shape[-1]), dtype=E4M3, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


cat_act_quant_fp8_rowwise = define(
    "cat_act_quant_fp8_rowwise",
    "(Tensor other, Tensor x, Tensor? up, str activation, bool other_first) -> (Tensor, Tensor)",
    _cat_act_quant_fp8_rowwise_reference, fake=_cat_act_quant_fp8_rowwise_fake,
    cuda=_cat_act_quant_fp8_rowwise_cuda)


@fp64_reference(torch.ops.kopt.cat_act_quant_fp8_rowwise.default)
def _cat_act_quant64(other: torch.Tensor, x: torch.Tensor, up: torch.Tensor | None,
                     activation: str, other_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return cat_act_quant_reference(other, x, up, activation, other_first)


def _fused_act_reference(other: torch.Tensor | None, x: torch.Tensor, up: torch.Tensor | None,
                         activation: str, other_first: bool) -> torch.Tensor:
    """``act(x, up)`` in one kernel (SwiGLU: one instead of two), written beside ``other``
    when given (``cat([other, act], -1)``, or ``[act, other]``): no copy for the cat."""
    check_args(x, up, activation)
    if other is not None:
        check_other(other, x)
    return act_reference(other, x, up, activation, other_first).contiguous()


def _fused_act_cuda(other: torch.Tensor | None, x: torch.Tensor, up: torch.Tensor | None,
                    activation: str, other_first: bool) -> torch.Tensor:
    if x.dtype in KERNEL_DTYPES:
        return act_triton(x, up, activation, other=other, other_first=other_first)
    return act_reference(other, x, up, activation, other_first).contiguous()


def _fused_act_fake(other: torch.Tensor | None, x: torch.Tensor, up: torch.Tensor | None,
                    activation: str, other_first: bool) -> torch.Tensor:
    check_args(x, up, activation)
    p = 0
    if other is not None:
        check_other(other, x)
        p = other.shape[-1]
    return x.new_empty((*x.shape[:-1], x.shape[-1] + p))


fused_act = define(
    "fused_act",
    "(Tensor? other, Tensor x, Tensor? up, str activation, bool other_first) -> Tensor",
    _fused_act_reference, fake=_fused_act_fake, cuda=_fused_act_cuda)


@fp64_reference(torch.ops.kopt.fused_act.default)
def _fused_act64(other: torch.Tensor | None, x: torch.Tensor, up: torch.Tensor | None,
                 activation: str, other_first: bool) -> torch.Tensor:
    return act_reference(other, x, up, activation, other_first)
