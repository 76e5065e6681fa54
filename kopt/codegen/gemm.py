"""GEMM template for sm_90: FP8 (e4m3 x e4m3, rowwise or tensorwise fp32 scales) and BF16/FP16,
fp32 accumulation, with a fused epilogue: ``kopt::fp8_gemm`` and ``kopt::bf16_gemm``.

    acc[m, n] = sum_k a[m, k] * b[k, n]                       (fp32 accumulator)
    acc       = acc * scale_a[m] * scale_b[n]                 (fp8 only; fp32, in this order)
    acc       = acc + bias[n]                                 (fp32, before rounding: _scaled_mm)
    y         = rnd(acc)                                      rnd = round to out_dtype (RNE)
    y         = rnd(act(y))          act: none | gelu_tanh | silu, computed in fp32
    y         = rnd(gate[g(m), n] * y)                        g(m) = m // (M / G), gate [G, N]
    y         = rnd(residual[m, n] + y)
    y         = generated epilogue lines (optional, see GemmEpilogue)

Each ``rnd`` is where eager PyTorch rounds: ``_scaled_mm``/``addmm`` round their fp32 result once,
and every bf16 pointwise op computes in fp32 and rounds its own result. The fused kernel keeps all
of those roundings, so ``residual + gate * act(gemm)`` differs from the unfused ops only through
the accumulation order of the GEMM (and ulp-level differences of exp): tier ``tolerance``.
The scale multiply and bias add may contract into one fma (Triton's default), one fp32 rounding
fewer than CUTLASS's rowwise epilogue.

Layouts (weights are pre-packed at load, so the fastest layout is the one to use):
- ``a``: [M, K] row-major (K contiguous); for FP8 the row stride must be 16-byte aligned.
- ``b``: [K, N] column-major, i.e. the ``w.t()`` view of a row-major [N, K] weight, exactly what
  ``torch._scaled_mm`` takes. Hopper's FP8 ``wgmma`` reads both operands K-major from shared
  memory, so this is the layout TMA loads straight into the MMA: the kernel builds its descriptor
  over ``b.t()`` ([N, K], K contiguous) and multiplies by the transposed tile. FP8 requires it;
  BF16 also accepts any other strides through the pointer path (slower).
- ``scale_a``: [M, 1], [M] or one value; ``scale_b``: [1, N], [N] or one value; fp32.
- ``bias``: [N] in out_dtype or fp32. ``gate``: [G, N], [G, 1, N] or [N] with G dividing M (per
  batch for a [G * T, N] activation of G sequences of T tokens; G = M is a full tensor).
  ``residual``: M * N values, last dim N. Gate and residual have out_dtype.

FP8 accumulation: Triton's default on sm_90 accumulates inside the tensor cores' own (reduced
precision) accumulator for the whole K loop, like ``_scaled_mm(use_fast_accum=True)``;
``fp8_fast_accum=False`` in :func:`gemm` adds each BLOCK_K partial product into the fp32
accumulator instead (more registers: smaller tiles win). Declared bound: ``FP8_GEMM_BOUND``.

The kernel source is generated (the template plus optional epilogue lines) and imported from a
file (``triton.jit`` reads the source of the function it compiles): see
:func:`load_generated_module`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import keyword
import logging
import textwrap
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kopt.codegen import fp64_reference
from kopt.codegen.launch import launch as triton_launch
from kopt.codegen.launch import note
from kopt.codegen.ops import define
from kopt.codegen.source import load_generated_module
from kopt.errors import KoptError
from kopt.kb import tuning as kb_tuning

log = logging.getLogger("kopt")

E4M3 = torch.float8_e4m3fn
# blockwise FP8: a's scales per 1x128 group, b's per 128x128 block; a quantized output's per
# 1x128 group (kopt.codegen.kernels.fp8_blockwise)
BLOCK = 128
ACTIVATIONS = ("none", "gelu_tanh", "silu")
# activations of a quantized output: act + quant's (kopt.codegen.kernels.act_quant), those of
# one input (SwiGLU's two halves lie in other column tiles)
QUANT_ACTIVATIONS = ("gelu_tanh", "gelu_erf", "gelu_tanh:fast")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
# FP8 rows must be 16-byte aligned for TMA; torch._scaled_mm has the same rule.
FP8_K_ALIGN = 16
# Norm-wise relative error of the FP8 GEMM's bf16 output against the fp64 product of the same
# e4m3 operands and scales: bf16 rounding (2^-9 per element) plus the tensor cores' reduced
# precision accumulation over K <= 24576.
FP8_GEMM_BOUND = 2.0**-7


class GemmInputError(KoptError, ValueError):
    """A GEMM op was called with operands it does not take (dtype, shape, layout, alignment)."""


# --------------------------------------------------------------------------------------------
# Generated epilogue: the contract
# --------------------------------------------------------------------------------------------

OperandKind = Literal["full", "group", "row", "col", "scalar"]


@dataclass(frozen=True)
class EpilogueOperand:
    """An extra tensor the generated epilogue reads, loaded as an fp32 tile named ``name``:

    - ``full``   [M, N] (any shape with M * N values, last dim N)  -> [BLOCK_M, BLOCK_N]
    - ``group``  [G, N] broadcast over M / G consecutive rows       -> [BLOCK_M, BLOCK_N]
    - ``row``    [M] (one value per output row)                     -> [BLOCK_M, 1]
    - ``col``    [N] (one value per output column)                  -> [1, BLOCK_N]
    - ``scalar`` one value                                          -> scalar
    """

    name: str
    kind: OperandKind


@dataclass(frozen=True)
class GemmEpilogue:
    """Triton source lines spliced into the kernel after the fixed epilogue, before the store.

    Lines are plain statements without leading indentation (a nested block indents by 4 spaces
    relative to its first line), produced by another module (``kopt/codegen/pointwise.py``).
    Names they may read, all tiles [BLOCK_M, BLOCK_N] unless said otherwise:

    - ``acc``: fp32, the GEMM after scales and bias, before any rounding;
    - ``y``: fp32 holding the out_dtype value after the fixed steps (rounded, activation, gate,
      residual): exactly what the unfused graph's tensor holds;
    - ``offs_m`` [BLOCK_M] / ``offs_n`` [BLOCK_N] int32 row / column indices, ``rows``
      (``offs_m`` as int64), ``mask_m``, ``mask_n``, ``mask`` (in-bounds);
    - each operand of ``operands`` by its name (fp32, see :class:`EpilogueOperand`);
    - ``M``, ``N``, ``OUT_TY`` (the output's Triton dtype), ``tl``, and the helpers
      ``_round(x, OUT_TY)`` (round fp32 to OUT_TY, RNE, back to fp32 -- call it wherever eager
      PyTorch would round), ``_gelu_tanh(x)``, ``_silu(x)``.

    The lines must leave the result in ``y`` (fp32, already rounded as eager would round it);
    the template stores ``y.to(OUT_TY)``. Names starting with ``ep_`` are free for temporaries.
    """

    lines: tuple[str, ...] = ()
    operands: tuple[EpilogueOperand, ...] = ()

    def __post_init__(self) -> None:
        for op in self.operands:
            if not op.name.isidentifier() or keyword.iskeyword(op.name):
                raise GemmInputError(f"epilogue operand name {op.name!r} is not an identifier")
            taken = {op.name, f"{op.name}_ptr", f"{op.name}_stride", f"{op.name}_group"}
            if taken & _template_names() or op.name.startswith("_"):
                raise GemmInputError(f"epilogue operand name {op.name!r} is used by the template")
            if op.kind not in ("full", "group", "row", "col", "scalar"):
                raise GemmInputError(f"epilogue operand {op.name!r}: unknown kind {op.kind!r}")
        if len({op.name for op in self.operands}) != len(self.operands):
            raise GemmInputError("epilogue operand names must be distinct")
        try:
            ast.parse(textwrap.dedent("\n".join(self.lines)))
        except SyntaxError as e:
            raise GemmInputError(f"generated epilogue lines do not parse: {e}") from e


# A reference for a generated epilogue: (y [M, N] in out_dtype, *operands broadcastable to
# [M, N] in their own dtypes) -> the final [M, N] value, computed with eager PyTorch ops.
EpilogueReference = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------------
# The kernel template
# --------------------------------------------------------------------------------------------

_TEMPLATE = '''\
"""Generated by kopt.codegen.gemm: do not edit (the file name is a hash of this text)."""
import triton
import triton.language as tl

from kopt.codegen.kernels.act_quant import act_values
from kopt.codegen.kernels.act_quant_group import group_quant_tile


@triton.jit
def _round(x, OUT_TY: tl.constexpr):
    # fp32 -> OUT_TY -> fp32, round to nearest even. bf16 by bit arithmetic: identical to the
    # hardware conversion on the GPU, and right under the interpreter (which truncates).
    if OUT_TY == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        r = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif OUT_TY == tl.float16:
        r = x.to(tl.float16).to(tl.float32)
    else:
        r = x
    return r


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3): no tanh
    # needed (triton 3.6 and the interpreter lack a common one) and no cancellation near 0
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _silu(x):
    # the formula of PyTorch's CUDA kernel: x / (1 + exp(-x))
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _split_k_sum(acc, ws_ptr, lock_ptr, tile, split, mask_m, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    # This split's fp32 partial (its rows in range: a GEMV's one row, not the tile's 64) goes
    # to the tile's slot of the workspace (L2: .cg); the last of the tile's SPLIT_K programs to
    # arrive (a counter per tile, released after a barrier so that every thread's store
    # precedes it) adds all the partials in split order, so the sum does not depend on the
    # order of arrival, and resets the counter for the next launch.
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    rows = mask_m[:, None]
    slot = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(slot + split * (BLOCK_M * BLOCK_N) + offs, acc, mask=rows, cache_modifier=".cg")
    tl.debug_barrier()
    last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    total = acc
    if last:
        total = tl.load(slot + offs, mask=rows, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(slot + s * (BLOCK_M * BLOCK_N) + offs, mask=rows, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + tile, 0)
    return total, last


@triton.jit
def _block_scaled_step(acc, part, scale_a_ptr, scale_b_ptr, sa_off, sb_off, k, stride_sak,
                       stride_sbk):
    # One K step of the blockwise product: this step's fp32 tile ``part`` times its scales
    # (a's per row, b's one per tile) added to ``acc``, as one written-out fma (the same with
    # or without the compiler's contraction, which a quantized output's launch turns off).
    # (Scaling the previous step's product instead, to overlap it with this step's MMA, was
    # 12-17% slower at W1's shapes on the H200: triton 3.6 waits for each wgmma anyway.)
    s = tl.load(scale_a_ptr + sa_off + k * stride_sak) * tl.load(scale_b_ptr + sb_off
                                                                 + k * stride_sbk)
    return tl.fma(part, s[:, None], acc)


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, a_desc, b_desc, out_ptr,
    scale_a_ptr, scale_b_ptr, bias_ptr, gate_ptr, res_ptr, ws_ptr, lock_ptr, qs_ptr, qbias_ptr,
    #@EXTRA_PARAMS@
    M, N, K, M_BUCKET, NUM_PROGRAMS,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om,
    stride_sa, stride_sb, stride_sak, stride_sbk, stride_gm, gate_group, stride_rm,
    stride_qsm, stride_qsg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_TMA: tl.constexpr, PRECISE_ACC: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    HAS_SCALES: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    QUANT_OUT: tl.constexpr, QUANT_ACT: tl.constexpr, HAS_QBIAS: tl.constexpr,
    OUT_TY: tl.constexpr, NATIVE: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    if PERSISTENT:
        # NUM_PROGRAMS (one per SM) programs walk the tiles; the flattened loop lets the
        # software pipeliner load the next tile's operands during this tile's epilogue
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS,
                             flatten=True):
            #@TILE@
    else:
        # split-K: SPLIT_K consecutive programs share a tile, each a range of K
        tile = tl.program_id(0) // SPLIT_K
        #@TILE@
'''

# One output tile: its (pid_m, pid_n) from ``tile``, the K loop, the epilogue and the store.
# Spliced into both paths of the kernel above (its markers are spliced after it).
_TILE = '''\
    # grouped ordering: GROUP_M row-tiles share each column-tile of b while it is in L2
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_lo = 0
    k_hi = k_tiles
    if SPLIT_K > 1:
        split = tl.program_id(0) % SPLIT_K
        k_lo = split * tl.cdiv(k_tiles, SPLIT_K)
        k_hi = tl.minimum(k_lo + tl.cdiv(k_tiles, SPLIT_K), k_tiles)
    if BLOCKWISE:
        # a's scale per row and 128 of K (its 1x128 groups), b's per 128 columns and 128 of K
        # (its 128x128 blocks: BLOCK_N == BLOCK_K == 128, one value per K step); rows past M
        # read the last row's scales (their results are masked at the store)
        sa_off = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1).to(tl.int64) * stride_sa
        sb_off = pid_n.to(tl.int64) * stride_sb
    if USE_TMA:
        # a_desc: [M, K] tiles [BLOCK_M, BLOCK_K]; b_desc: b.t() = [N, K] tiles [BLOCK_N, BLOCK_K]
        # (K-major, what fp8 wgmma reads); out-of-bounds boxes are zero-filled
        for k in range(k_lo, k_hi):
            a = a_desc.load([off_m, k * BLOCK_K])
            b = b_desc.load([off_n, k * BLOCK_K])
            if DOT_IN_FP32:  # the interpreter multiplies bf16 tiles as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if BLOCKWISE:
                acc = _block_scaled_step(acc, tl.dot(a, b.T), scale_a_ptr, scale_b_ptr, sa_off,
                                         sb_off, k, stride_sak, stride_sbk)
            elif PRECISE_ACC:  # fp8: add each K tile's product into the fp32 accumulator
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b.T, acc)
    else:
        offs_am = off_m + tl.arange(0, BLOCK_M)
        offs_bn = off_n + tl.arange(0, BLOCK_N)
        # clamp instead of masking rows/columns: the store masks them
        offs_am = tl.where(offs_am < M, offs_am, 0).to(tl.int64)
        offs_bn = tl.where(offs_bn < N, offs_bn, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        first_k = k_lo * BLOCK_K + offs_k
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + first_k[None, :] * stride_ak
        b_ptrs = b_ptr + first_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        for k in range(k_lo, k_hi):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if DOT_IN_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if BLOCKWISE:
                acc = _block_scaled_step(acc, tl.dot(a, b), scale_a_ptr, scale_b_ptr, sa_off,
                                         sb_off, k, stride_sak, stride_sbk)
            elif PRECISE_ACC:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SPLIT_K > 1:
        # only the tile's last split runs the epilogue: the others' loads and store are masked
        acc, last = _split_k_sum(acc, ws_ptr, lock_ptr, tile, split, mask_m, BLOCK_M, BLOCK_N,
                                 SPLIT_K)
        mask_m = tl.where(last, mask_m, False)  # (``&`` gives integers in the interpreter)
        mask_n = tl.where(last, mask_n, False)
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)
    if HAS_SCALES:
        sa = tl.load(scale_a_ptr + rows * stride_sa, mask=mask_m, other=0.0)
        sb = tl.load(scale_b_ptr + offs_n * stride_sb, mask=mask_n, other=0.0)
        acc = acc * sa[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_SCALES:  # the scale multiply and the bias add as one fma, written out
            acc = tl.fma(acc, sb[None, :], bias[None, :])
        else:
            acc = acc + bias[None, :]
    elif HAS_SCALES:
        acc = acc * sb[None, :]
    y = _round(acc, OUT_TY)
    if ACTIVATION == 1:
        y = _round(_gelu_tanh(y), OUT_TY)
    elif ACTIVATION == 2:
        y = _round(_silu(y), OUT_TY)
    if HAS_GATE:
        g_rows = rows // gate_group
        g = tl.load(gate_ptr + g_rows[:, None] * stride_gm + offs_n[None, :], mask=mask, other=0.0)
        y = _round(g.to(tl.float32) * y, OUT_TY)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = _round(r.to(tl.float32) + y, OUT_TY)
    #@EXTRA_LOADS@
    #@EPILOGUE@
    if QUANT_OUT:
        # the output as the next GEMM's operand: (bias +) activation + FP8 e4m3 per 1x128
        # group (BLOCK_N a multiple of 128: whole groups per tile), exactly the computation of
        # kopt::act_quant_fp8_group on the rounded GEMM output
        if HAS_QBIAS:
            qb = tl.load(qbias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            y = _round(y + qb[None, :], OUT_TY)
        if QUANT_ACT >= 0:
            y = act_values(y, y, OUT_TY, QUANT_ACT, NATIVE)
        bits, q_scale = group_quant_tile(tl.where(mask, y, 0.0), BLOCK_M, BLOCK_N, QUANT_ACT >= 3,
                                         NATIVE)
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], bits, mask=mask)
        groups = off_n // 128 + tl.arange(0, BLOCK_N // 128)
        tl.store(qs_ptr + rows[:, None] * stride_qsm + groups.to(tl.int64)[None, :] * stride_qsg,
                 q_scale, mask=mask_m[:, None] & (groups < tl.cdiv(N, 128))[None, :])
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], y.to(OUT_TY), mask=mask)
'''

_LOADS = {
    "full": "{n} = tl.load({n}_ptr + rows[:, None] * {n}_stride + offs_n[None, :], mask=mask, "
            "other=0.0).to(tl.float32)",
    "group": "{n} = tl.load({n}_ptr + (rows // {n}_group)[:, None] * {n}_stride + offs_n[None, :], "
             "mask=mask, other=0.0).to(tl.float32)",
    "row": "{n} = tl.load({n}_ptr + rows * {n}_stride, mask=mask_m, other=0.0).to(tl.float32)"
           "[:, None]",
    "col": "{n} = tl.load({n}_ptr + offs_n * {n}_stride, mask=mask_n, other=0.0).to(tl.float32)"
           "[None, :]",
    "scalar": "{n} = tl.load({n}_ptr).to(tl.float32)",
}


@functools.cache
def _kernel_text() -> str:
    """The template with the tile body in both of its paths (markers for the epilogue left)."""
    return _splice(_TEMPLATE, "TILE", textwrap.dedent(_TILE).splitlines())


@functools.cache
def _template_names() -> frozenset[str]:
    """Every name the template defines or reads: operands (and their ``_ptr``, ``_stride``,
    ``_group`` parameters) must not shadow them."""
    names = set()
    for node in ast.walk(ast.parse(_kernel_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return frozenset(names)


def _splice(template: str, marker: str, lines: Sequence[str]) -> str:
    """Replace the line holding ``#@marker@`` by ``lines`` at that line's indentation."""
    out = []
    for line in template.splitlines():
        if line.strip() == f"#@{marker}@":
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + ln if ln.strip() else "" for ln in lines)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def render_kernel_source(epilogue: GemmEpilogue | None = None) -> str:
    """The kernel module's source: the template with the epilogue's parameters, loads and
    lines spliced in. Deterministic, so its hash names the generated file."""
    ep = epilogue or GemmEpilogue()
    params = [f"{o.name}_ptr, {o.name}_stride, {o.name}_group," for o in ep.operands]
    loads = [_LOADS[o.kind].format(n=o.name) for o in ep.operands]
    body = textwrap.dedent("\n".join(ep.lines)).splitlines()
    src = _splice(_kernel_text(), "EXTRA_PARAMS", params)
    src = _splice(src, "EXTRA_LOADS", loads)
    return _splice(src, "EPILOGUE", body)


# --------------------------------------------------------------------------------------------
# Generated modules: written to a file named by the hash of their source, then imported
# --------------------------------------------------------------------------------------------



# --------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------

_ACT_CODE = {"none": 0, "gelu_tanh": 1, "silu": 2}
# the autotune key: one tuned config per (M bucket, N, K, epilogue) and operand dtypes
_TUNING_KEY = ["M_BUCKET", "N", "K", "USE_TMA", "PRECISE_ACC", "BLOCKWISE", "HAS_BIAS",
               "ACTIVATION", "HAS_GATE", "HAS_RESIDUAL", "QUANT_OUT", "QUANT_ACT", "HAS_QBIAS"]


def m_bucket(m: int) -> int:
    """Rows of the tuning key: powers of two up to 256, then multiples of 256 (so 4096, 4224 and
    4608 tokens each keep their own config: their wave counts differ)."""
    if m <= 256:
        return 1 << max(0, (m - 1).bit_length())
    return -(-m // 256) * 256


def gemm_config(bm: int, bn: int, bk: int, group: int = 8, stages: int = 3,
                warps: int = 8, persistent: bool = False, split_k: int = 1):  # noqa: ANN201
    """One tile config (``triton.Config``) with the pre-hook that sizes the TMA boxes.
    ``persistent``: one program per SM walks the output tiles (see the template).
    ``split_k``: that many programs per tile, each a range of K, the last to finish adding
    the fp32 partials in a fixed order (one program per tile only)."""
    import triton

    if split_k < 1 or (split_k > 1 and persistent):
        raise ValueError(f"split_k={split_k} (persistent={persistent}): split-K takes one "
                         "program per tile and split_k >= 1")
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
                          "PERSISTENT": int(persistent), "SPLIT_K": split_k},
                         num_stages=stages, num_warps=warps, pre_hook=_set_block_shapes)


def gemm_configs(m: int, n: int, k: int, fp8: bool, interpreted: bool = False, *,
                 blockwise: bool = False, quant_out: bool = False) -> list:
    """Hopper (sm_90) tile configs for one (M bucket, N, K).

    BLOCK_K is 128 bytes of K (128 fp8, 64 bf16): one TMA box row per tile row with the widest
    (128 B) shared-memory swizzle. Large M: 128x256 / 256x128 tiles, 8 warps (two warpgroups of
    64-row wgmma each, 128 fp32 accumulator registers per thread), 3-4 stages (48 KB a stage in
    fp8), one program per tile or persistent (one per SM; the next tile's loads overlap this
    one's epilogue). Small M (modulation GEMVs, decode): bandwidth-bound on b, so narrow N
    tiles give more CTAs and deep pipelines keep loads in flight; 64 rows is wgmma's smallest M;
    split-K where fewer column tiles than the H200's 132 SMs run a long K.
    The lists keep what a sweep of 30 configs on the W1/W2 shapes found within a few percent of
    the best on each (``python -m benchmarks.kernels_gemm --sweep``; RESULTS.md, 2026-12-01,
    H200). The interpreter gets one small tile, so awkward shapes exercise every mask
    quickly.

    ``blockwise`` (1x128 x 128x128 scales, applied at each K step): 128-wide column tiles and
    K steps, one scale of b per step, and the step's product held beside the accumulator
    (twice the registers: no 128x256 tiles, and 128 rows take two warpgroups). On the H200 at
    W1's shapes the two 128-row tiles were within 2% of each other, and 64 rows won on the
    128-row text GEMM with the long K (48.5 us against 62.8); 128 rows on one warpgroup were
    2-8x slower (RESULTS.md, 2026-12-03). The GEMV tiles (M <= 64) are not measured.
    ``quant_out`` (1x128 groups of the output quantized in the epilogue): column tiles of whole
    groups."""
    if blockwise:
        return _blockwise_configs(m, interpreted)
    if interpreted:
        return [gemm_config(16, 128 if quant_out else 32, 32, 2, 1, 4)]
    if quant_out:
        return [c for c in gemm_configs(m, n, k, fp8) if c.kwargs["BLOCK_N"] % BLOCK == 0
                and c.kwargs["SPLIT_K"] == 1]
    bk = 128 if fp8 else 64
    if m <= 64:
        # split-K where the column tiles leave SMs idle over a long K (an LLM's decode down
        # projection, 1 x 4096 x 12288: 29.5 -> 23.3 us, 0.61 of cuBLAS's time; RESULTS.md,
        # 2026-12-01)
        split = [gemm_config(64, 128, bk, 8, 4, 4, split_k=s) for s in (3, 4)] \
            if fp8 and -(-n // 128) < 132 and k >= 8192 else []
        return [gemm_config(64, 256, bk, 8, 4, 4), gemm_config(64, 128, bk, 1, 4, 4),
                gemm_config(64, 128, bk, 1, 6, 4), gemm_config(64, 64, bk, 1, 6, 4), *split]
    if m <= 1024:
        return [gemm_config(64, 64, bk, 8, 4, 4), gemm_config(64, 128, bk, 8, 4, 4),
                gemm_config(128, 64, bk, 8, 4, 4), gemm_config(128, 128, bk, 8, 4, 8),
                gemm_config(64, 256, bk, 8, 4, 4), gemm_config(64, 32, bk, 8, 6, 4),
                gemm_config(64, 256, bk, 8, 4, 4, persistent=True),
                gemm_config(128, 256, bk, 8, 3, 8, persistent=True)]
    return [gemm_config(128, 256, bk, 8, 3, 8, persistent=True),
            gemm_config(128, 256, bk, 8, 4, 8, persistent=True),
            gemm_config(128, 256, bk, 8, 3, 8), gemm_config(128, 256, bk, 8, 4, 8),
            gemm_config(256, 128, bk, 8, 4, 8, persistent=True),
            gemm_config(128, 256, bk // 2, 8, 5, 8, persistent=True)]


def _blockwise_configs(m: int, interpreted: bool) -> list:
    if interpreted:
        return [gemm_config(16, BLOCK, BLOCK, 2, 1, 4)]
    if m <= 64:
        return [gemm_config(64, BLOCK, BLOCK, 1, s, 4) for s in (4, 6)]
    return [gemm_config(128, BLOCK, BLOCK, 8, 4, 8),
            gemm_config(128, BLOCK, BLOCK, 8, 4, 8, persistent=True),
            gemm_config(64, BLOCK, BLOCK, 8, 5, 4)]


def _set_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: the TMA boxes follow the config's tile."""
    if nargs["a_desc"] is not None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


_LOCK = threading.Lock()  # autotuner creation
_TUNERS: dict[tuple, object] = {}


def _tuner(module: ModuleType, configs: list,
           tuning: kb_tuning.TuningKey | None = None):  # noqa: ANN202
    """One autotuner per kernel module, config list and tuning key (the same sweeps as one
    tuner for all keys; its ``best_config`` and timings are then that key's alone, for the
    knowledge base)."""
    import triton

    key = (module.__name__, tuple(str(c) for c in configs), tuning)
    with _LOCK:
        if key not in _TUNERS:
            _TUNERS[key] = triton.autotune(configs=configs, key=_TUNING_KEY)(module.gemm_kernel)
        return _TUNERS[key]


def _tuning_key(module: ModuleType, a: torch.Tensor, bias: torch.Tensor | None, p: _Problem,
                activation: str, out_dtype: torch.dtype, use_tma: bool,
                precise: bool) -> kb_tuning.TuningKey:
    """The knowledge base's name for this launch's autotune key (see ``_TUNING_KEY``)."""
    from kopt.kb import device_name

    flags = [f"m={m_bucket(p.m)} n={p.n} k={p.k} tma={use_tma:d} precise={precise:d}",
             f"bias={'none' if bias is None else str(bias.dtype).removeprefix('torch.')}",
             f"act={activation} gate={p.gate is not None:d} res={p.residual is not None:d}"]
    if p.blockwise:
        flags.append("scales=blockwise")
    if p.quant is not None:
        flags.append(f"quant=group{BLOCK} qact={p.quant.activation} "
                     f"qbias={p.quant_bias is not None:d}")
    dtypes = [a.dtype, out_dtype, *(t.dtype for t in p.extra)]
    return kb_tuning.TuningKey("gemm_fp8" if p.fp8 else "gemm_bf16",
                               module.__name__.rsplit("_", 1)[-1], " ".join(flags),
                               "/".join(str(d).removeprefix("torch.") for d in dtypes),
                               device_name(a.device))


def _config_from_params(c: Mapping[str, int]):  # noqa: ANN202
    """A stored config (integers validated against the template's allowlist) as this
    template's ``triton.Config``, pre-hook and all."""
    return gemm_config(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"],
                       c["num_stages"], c["num_warps"], bool(c["PERSISTENT"]),
                       c.get("SPLIT_K", 1))


def tuned_configs() -> list[dict]:
    """What autotuning chose so far in this process (for the knowledge base and benchmarks):
    one row per kernel module and key."""
    rows = []
    for (module, _, _), tuner in _TUNERS.items():
        for key, cfg in getattr(tuner, "cache", {}).items():
            rows.append({"module": module, "key": [str(k) for k in key], "config": str(cfg)})
    return rows


# --------------------------------------------------------------------------------------------
# Checks shared by the reference, the fake and the Triton implementation
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantOut:
    """The GEMM's output written as the next blockwise GEMM's operand: ``y`` (the output in
    ``out_dtype``, every fixed and generated epilogue step applied) then, as
    ``kopt::act_quant_fp8_group`` computes it from ``y``::

        x     = rnd(y + bias)                     (optional ``quant_bias``, out_dtype)
        a     = act(x)                            (optional; QUANT_ACTIVATIONS)
        q, s  = e4m3 per 1x128 group of a         (q [M, N] e4m3, s [M, N/128] fp32, strides
                                                   (1, M): kopt::quant_fp8_group's layout)

    A group's scale is its own 128 values': tile-local, unlike a per-token scale (the amax of a
    whole row, over every column tile)."""

    activation: str | None = None


@dataclass(frozen=True)
class _Problem:
    m: int
    n: int
    k: int
    fp8: bool
    gate: torch.Tensor | None  # [G, N], last dim contiguous
    residual: torch.Tensor | None  # [M, N], last dim contiguous
    extra: tuple[torch.Tensor, ...]  # normalised as the operand kinds say
    blockwise: bool = False
    quant: QuantOut | None = None
    quant_bias: torch.Tensor | None = None


def _fail(op: str, msg: str) -> None:
    raise GemmInputError(f"{op}: {msg}")


def _rows(t: torch.Tensor, n: int, what: str, op: str) -> torch.Tensor:
    """A tensor with last dim N as a [rows, N] matrix whose last dim is contiguous."""
    if t.dim() == 0 or t.shape[-1] != n:
        _fail(op, f"{what} has shape {list(t.shape)}; its last dim must be N = {n}")
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check(op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
           scale_b: torch.Tensor | None, bias: torch.Tensor | None, gate: torch.Tensor | None,
           residual: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
           fp8: bool, epilogue: GemmEpilogue | None = None,
           extra: Sequence[torch.Tensor] = (), blockwise: bool = False,
           quant: QuantOut | None = None, quant_bias: torch.Tensor | None = None) -> _Problem:
    if a.dim() != 2 or b.dim() != 2:
        _fail(op, f"a and b must be 2-D ([M, K] and [K, N]); got {list(a.shape)} and "
                  f"{list(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        _fail(op, f"shape mismatch: a is [M, K] = {list(a.shape)} but b is [K, N] = "
                  f"{list(b.shape)}")
    if k == 0 or n == 0:
        _fail(op, f"empty GEMM: K = {k}, N = {n}")
    if b.device != a.device:
        _fail(op, f"a is on {a.device} but b on {b.device}")
    if fp8:
        if a.dtype != E4M3 or b.dtype != E4M3:
            _fail(op, f"a and b must be float8_e4m3fn; got {a.dtype} and {b.dtype}")
        if k % FP8_K_ALIGN:
            _fail(op, f"misaligned K = {k}: must be a multiple of {FP8_K_ALIGN} (16-byte rows, "
                      "as torch._scaled_mm requires)")
        if a.stride(1) != 1:
            _fail(op, f"a must be row-major [M, K] (stride(1) == 1); got strides {a.stride()}")
        if b.stride(0) != 1:
            _fail(op, f"b must be column-major [K, N], the .t() view of a row-major [N, K] weight "
                      f"(stride(0) == 1); got strides {b.stride()}")
        kb = -(-k // BLOCK)
        for name, s, length in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
            if s is None:
                _fail(op, f"{name} is required")
            if s.dtype != torch.float32:
                _fail(op, f"{name} must be float32; got {s.dtype}")
            if blockwise:
                want = (m, kb) if name == "scale_a" else (-(-n // BLOCK), kb)
                if tuple(s.shape) != want:
                    what = "1x128 groups of a" if name == "scale_a" else \
                        "128x128 blocks of b.t()"
                    _fail(op, f"{name} has shape {list(s.shape)}; blockwise scales are "
                              f"{list(want)} ({what})")
            elif s.numel() not in (1, length):
                _fail(op, f"{name} has shape {list(s.shape)}; expected {length} values "
                          "(rowwise) or one (tensorwise)")
            if s.device != a.device:
                _fail(op, f"{name} is on {s.device}, a on {a.device}")
    else:
        if a.dtype not in HALF_DTYPES or b.dtype != a.dtype:
            _fail(op, f"a and b must both be bfloat16 or both float16; got {a.dtype} and "
                      f"{b.dtype}")
        if scale_a is not None or scale_b is not None:
            _fail(op, "a 16-bit GEMM takes no scales")
        if blockwise:
            _fail(op, "blockwise scales are for FP8 operands")
    if out_dtype not in OUT_DTYPES:
        _fail(op, f"out_dtype must be one of {OUT_DTYPES}; got {out_dtype}")
    if activation not in ACTIVATIONS:
        _fail(op, f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if bias is not None:
        if bias.shape != (n,):
            _fail(op, f"bias must have shape [N] = [{n}]; got {list(bias.shape)}")
        if bias.dtype not in (out_dtype, torch.float32):
            _fail(op, f"bias must be {out_dtype} or float32; got {bias.dtype}")
    g = r = None
    if gate is not None:
        if gate.dtype != out_dtype:
            _fail(op, f"gate must have the output dtype {out_dtype}; got {gate.dtype}")
        g = _rows(gate, n, "gate", op)
        if g.shape[0] == 0 or m % g.shape[0]:
            _fail(op, f"gate has {g.shape[0]} rows of N; they must divide M = {m} (one per "
                      "sequence of M / G tokens)")
    if residual is not None:
        if residual.dtype != out_dtype:
            _fail(op, f"residual must have the output dtype {out_dtype}; got {residual.dtype}")
        r = _rows(residual, n, "residual", op)
        if r.shape[0] != m:
            _fail(op, f"residual has shape {list(residual.shape)}; expected M * N = {m} x {n}")
    for t, what in ((bias, "bias"), (gate, "gate"), (residual, "residual")):
        if t is not None and t.device != a.device:
            _fail(op, f"{what} is on {t.device}, a on {a.device}")
    ops = epilogue.operands if epilogue is not None else ()
    if len(extra) != len(ops):
        _fail(op, f"the epilogue reads {len(ops)} operands; got {len(extra)} tensors")
    norm = []
    for o, t in zip(ops, extra, strict=True):
        if t.device != a.device:
            _fail(op, f"epilogue operand {o.name} is on {t.device}, a on {a.device}")
        if o.kind in ("row", "col", "scalar"):
            want = {"row": m, "col": n, "scalar": 1}[o.kind]
            if t.numel() != want:
                _fail(op, f"epilogue operand {o.name} ({o.kind}) needs {want} values; got "
                          f"{t.numel()}")
        t = _operand_view(o.kind, t, n, o.name, op)
        if o.kind == "full" and t.shape[0] != m:
            _fail(op, f"epilogue operand {o.name} needs M * N = {m} x {n} values")
        if o.kind == "group" and (t.shape[0] == 0 or m % t.shape[0]):
            _fail(op, f"epilogue operand {o.name}: {t.shape[0]} rows do not divide M = {m}")
        norm.append(t)
    if quant is None:
        if quant_bias is not None:
            _fail(op, "quant_bias without a quantized output")
    else:
        if quant.activation is not None and quant.activation not in QUANT_ACTIVATIONS:
            _fail(op, f"a quantized output's activation must be one of {QUANT_ACTIVATIONS} "
                      f"(SwiGLU's halves lie in other column tiles); got {quant.activation!r}")
        if out_dtype not in HALF_DTYPES:
            _fail(op, f"a quantized output rounds its steps to bf16 or fp16; got {out_dtype}")
        if activation != "none":
            _fail(op, "a quantized output takes its activation from QuantOut (act + quant's "
                      f"math), not activation={activation!r}")
        if quant_bias is not None and (quant_bias.shape != (n,) or quant_bias.dtype != out_dtype
                                       or quant_bias.device != a.device):
            _fail(op, f"quant_bias must be one {out_dtype} vector of the N = {n} columns on "
                      f"{a.device}; got {quant_bias.dtype}{list(quant_bias.shape)} on "
                      f"{quant_bias.device}")
    return _Problem(m, n, k, fp8, g, r, tuple(norm), blockwise, quant, quant_bias)


# --------------------------------------------------------------------------------------------
# The reference (CPU path, verification, tests)
# --------------------------------------------------------------------------------------------

def _library_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
                  scale_b: torch.Tensor | None, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, p: _Problem) -> torch.Tensor | None:
    """``torch._scaled_mm`` / ``torch.mm`` where they compute exactly ``rnd(acc * scales +
    bias)`` (rowwise or tensorwise scales; CUDA: bf16 out), else None."""
    if bias is not None and bias.dtype != out_dtype:
        return None
    if p.blockwise:  # kopt's op for the library's blockwise GEMM (exact emulation on the CPU)
        return None if bias is not None else torch.ops.kopt.fp8_blockwise_mm(
            a, scale_a, b.t(), scale_b, out_dtype)
    m, n = p.m, p.n
    # CUDA's rowwise kernel writes bf16 only; the CPU one any float dtype (and is what an
    # unfused graph runs there, so the CPU path of a fused op equals the unfused graph)
    out_ok = out_dtype == torch.bfloat16 or (not a.is_cuda and out_dtype.is_floating_point)
    if not a.is_cuda and not p.fp8:
        return None
    if p.fp8 and out_ok and n % 16 == 0:
        if scale_a.numel() == m and scale_b.numel() == n:  # rowwise
            sa, sb = scale_a.reshape(m, 1), scale_b.reshape(1, n)
            return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
        if scale_a.numel() == 1 and scale_b.numel() == 1:  # tensorwise
            sa, sb = scale_a.reshape(()), scale_b.reshape(())
            return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    if not p.fp8 and out_dtype == a.dtype:
        return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return None


def _gemm_rounded(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
                  scale_b: torch.Tensor | None, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, p: _Problem, upcast: bool) -> torch.Tensor:
    """``rnd(acc * scale_a * scale_b + bias)``: the library GEMM where one computes exactly
    this, else an exact emulation (fp64 products and sums of e4m3/bf16 values are exact for
    any K that fits in memory; one rounding to fp32, then the epilogue in fp32). ``upcast``:
    all of it in fp64, no rounding."""
    if not upcast:
        y = _library_gemm(a, b, scale_a, scale_b, bias, out_dtype, p)
        if y is not None:
            return y
    if p.blockwise:
        from kopt.codegen.kernels.fp8_blockwise import blockwise_mm_exact

        acc = blockwise_mm_exact(a, scale_a, b.t(), scale_b)
        if bias is not None:
            acc = acc + bias.to(acc.dtype)
        return acc if upcast else acc.float().to(out_dtype)
    acc = a.to(torch.float64) @ b.to(torch.float64)
    if not upcast:
        acc = acc.float()
    if p.fp8:
        acc = acc * scale_a.reshape(-1, 1).to(acc.dtype) * scale_b.reshape(1, -1).to(acc.dtype)
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    return acc if upcast else acc.to(out_dtype)


def _broadcast_extra(o: EpilogueOperand, t: torch.Tensor, m: int, n: int) -> torch.Tensor:
    if o.kind == "group":
        return t.repeat_interleave(m // t.shape[0], dim=0)
    if o.kind == "row":
        return t.reshape(m, 1)
    if o.kind == "col":
        return t.reshape(1, n)
    return t if o.kind == "full" else t.reshape(())


def gemm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
                   scale_b: torch.Tensor | None, bias: torch.Tensor | None,
                   gate: torch.Tensor | None, residual: torch.Tensor | None,
                   activation: str = "none", out_dtype: torch.dtype = torch.bfloat16, *,
                   epilogue: GemmEpilogue | None = None, extra: Sequence[torch.Tensor] = (),
                   epilogue_reference: EpilogueReference | None = None,
                   fp8: bool | None = None, upcast: bool = False, blockwise: bool = False,
                   quant: QuantOut | None = None, quant_bias: torch.Tensor | None = None,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation in eager PyTorch: ``torch._scaled_mm`` (CUDA, bf16 out) /
    ``kopt::fp8_blockwise_mm`` (``blockwise`` scales) / ``torch.mm`` / an exact emulation, then
    the epilogue ops in the kernel's order, and with ``quant`` the activation + quantization
    ops (:class:`QuantOut`): ``(q, scale)``. FP8 when ``fp8`` (default: when ``a`` is e4m3),
    else 16-bit (no scales). ``upcast``: the same function in fp64 without any rounding (the
    yardstick for tolerance checks; the quantizer as its fp64 reference applies it)."""
    fp8 = a.dtype == E4M3 if fp8 is None else fp8
    op = "kopt::fp8_gemm" if fp8 else "kopt::bf16_gemm"
    p = _check(op, a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype, fp8,
               epilogue, extra, blockwise, quant, quant_bias)
    y = _gemm_rounded(a, b, scale_a, scale_b, bias, out_dtype, p, upcast)
    up = (lambda t: t.to(torch.float64)) if upcast else (lambda t: t)
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = F.silu(y)
    if p.gate is not None:
        g = p.gate.shape[0]
        y = (up(p.gate).reshape(g, 1, p.n) * y.reshape(g, p.m // g, p.n)).reshape(p.m, p.n)
    if p.residual is not None:
        y = up(p.residual) + y
    if epilogue is not None and epilogue.lines:
        if epilogue_reference is None:
            _fail(op, "a generated epilogue needs its reference to compute the reference")
        ops = [up(_broadcast_extra(o, t, p.m, p.n)) for o, t in zip(epilogue.operands, p.extra,
                                                                    strict=True)]
        y = epilogue_reference(y, *ops).to(y.dtype)
    if quant is not None:
        return quant_reference(y, quant, None if quant_bias is None else up(quant_bias))
    return y


def quant_reference(y: torch.Tensor, quant: QuantOut, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`QuantOut`'s steps on the GEMM's output ``y`` as the unfused ops compute them:
    ``kopt::act_quant_fp8_group``'s reference, or with no activation the bias add and
    ``kopt::quant_fp8_group``'s."""
    from kopt.codegen.kernels.act_quant_group import act_quant_group_reference
    from kopt.codegen.kernels.quant_fp8 import quant_fp8_group_reference

    if quant.activation is not None:
        return act_quant_group_reference(y, None, quant.activation, bias)
    return quant_fp8_group_reference(y if bias is None else y + bias)


# --------------------------------------------------------------------------------------------
# The Triton launcher
# --------------------------------------------------------------------------------------------

@functools.cache
def _kernel_module(epilogue: GemmEpilogue | None, cache_dir: Path | None) -> ModuleType:
    return load_generated_module(render_kernel_source(epilogue), "gemm", cache_dir)


def _triton_type(dtype: torch.dtype):  # noqa: ANN202
    """The template's ``OUT_TY``: the dtype its epilogue rounds to (and stores, unquantized)."""
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
            torch.float32: tl.float32}[dtype]


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can describe: last dim contiguous, 16-byte aligned base and rows."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def _programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (a few under the interpreter)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class _Launch:
    """What a call's launch depends on besides its tensors' data: made (checks included) once
    per :func:`_launch_key` and reused while no knowledge-base session is active."""

    m: int
    n: int
    use_tma: bool
    kernel: Any  # the autotuner
    tuning: kb_tuning.TuningKey | None
    grid: Callable[[Mapping[str, int]], tuple[int]]
    scalars: tuple[int, ...]  # m, n, k, M_BUCKET, programs, strides, gate rows: the kernel's
    flags: dict[str, Any]  # constexpr flags
    direct: _Direct | None = None  # set after the first tuned call (CUDA)
    # the call is one cuBLAS computes too (torch._scaled_mm: plain or bias epilogue, bf16 out)
    library_form: bool = False
    library: bool = False  # cuBLAS measured faster than the tuned template: calls go there
    # split-K: fp32 partials and tile counters the largest split config needs (0: none)
    split_values: int = 0
    split_tiles: int = 0
    workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def workspace(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-K partials and counters (zero between launches: the last split of a tile
        resets its counter) of this launch key on the current stream: calls on one stream run
        one after the other, so they may share them; another stream gets its own."""
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" \
            else 0
        ws = self.workspaces.get(stream)
        if ws is None:
            ws = self.workspaces[stream] = (
                torch.empty(self.split_values, dtype=torch.float32, device=device),
                torch.zeros(self.split_tiles, dtype=torch.int32, device=device))
        return ws


@dataclass(frozen=True)
class _Direct:
    """A launch of the tuned config's compiled kernel straight through its launcher, without
    Triton's autotuner and JIT dispatch: on the H200's host they cost ~75 of the ~105 us a
    ``gemm()`` call took; the direct launch ~30 (``benchmarks/probes/gemm_host_profile.py``,
    RESULTS.md, 2026-12-01). Made once per launch key, from the first tuned call on CUDA, and
    kept only if its output equals that call's bit for bit."""

    compiled: Any  # triton's CompiledKernel
    device: int  # the CUDA device index it runs on
    grid: tuple[int, int, int]
    boxes: tuple[list[int], list[int]]  # the TMA boxes of a and b.t() (the config's tiles)
    constexprs: tuple[Any, ...]  # the kernel's constexpr arguments, in its order

    def __call__(self, args: Sequence[Any]) -> None:
        from triton import knobs

        c = self.compiled
        values = (*args, *self.constexprs)
        stream = torch._C._cuda_getCurrentRawStream(self.device)  # what Triton's launch reads
        run = c.run  # loads the module on first use, before c.function is read
        run(*self.grid, stream, c.function, c.packed_metadata,
            c.launch_metadata(self.grid, stream, *values), knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook, *values)
        note(c, self.grid, values)


_LAUNCHES: dict[tuple, _Launch] = {}
_MAX_LAUNCHES = 1024  # bounded: dynamic shapes make new keys


def _meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _launch_key(a: torch.Tensor, b: torch.Tensor, tensors: Sequence[torch.Tensor | None],
                extra: Sequence[torch.Tensor], *options: Any) -> tuple:
    """Shapes, strides, dtypes and the device of every operand, whether a and b are 16-byte
    aligned (TMA needs it), and the call's options."""
    return (_meta(a), _meta(b), a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0,
            *(_meta(t) for t in tensors), *(_meta(t) for t in extra), *options)


def _operand_view(kind: str, t: torch.Tensor, n: int, name: str, op: str) -> torch.Tensor:
    """An epilogue operand as the kernel reads it: [rows, N] (``full``, ``group``) or flat."""
    return _rows(t, n, name, op) if kind in ("full", "group") else t.reshape(-1)


def gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None = None,
         scale_b: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         gate: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         activation: str = "none", out_dtype: torch.dtype = torch.bfloat16, *,
         epilogue: GemmEpilogue | None = None, extra: Sequence[torch.Tensor] = (),
         use_tma: bool | None = None, fp8_fast_accum: bool = True,
         configs: list | None = None, cache_dir: Path | None = None,
         fp8: bool | None = None, blockwise: bool = False, quant: QuantOut | None = None,
         quant_bias: torch.Tensor | None = None,
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton GEMM (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``use_tma``: None picks TMA descriptors on sm_90+ when the operands allow them (row-major
    ``a``, K-major ``b``, 16-byte aligned), pointer loads otherwise (and on CPU); True forces
    TMA (the interpreter of triton >= 3.4 runs it too). ``configs`` overrides the autotune
    list (tests). ``fp8``, ``blockwise``, ``quant`` and ``quant_bias`` as in
    :func:`gemm_reference`: with ``quant`` the result is ``(q, scale)``.

    The checks, the config list, the autotuner and the kernel's scalar arguments depend only on
    the operands' shapes, strides, dtypes, device and alignment and on the options: they are
    worked out once per such key (a :class:`_Launch`) and reused, unless ``configs`` is given or
    a knowledge-base session is active (it looks up and files tuned configs per call). On CUDA
    the key's later calls launch the tuned config's compiled kernel directly (:class:`_Direct`),
    without Triton's autotuner and JIT dispatch."""
    fp8 = a.dtype == E4M3 if fp8 is None else fp8
    op = "kopt::fp8_gemm" if fp8 else "kopt::bf16_gemm"
    tensors = (scale_a, scale_b, bias, gate, residual, quant_bias)
    key = None
    launch = None
    if configs is None and kb_tuning.active() is None:
        key = _launch_key(a, b, tensors, extra, activation, out_dtype, epilogue, use_tma,
                          fp8_fast_accum, fp8, cache_dir, blockwise, quant)
        launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _plan_launch(op, a, b, scale_a, scale_b, bias, gate, residual, activation,
                              out_dtype, epilogue, extra, use_tma, fp8_fast_accum, configs,
                              cache_dir, fp8, blockwise, quant, quant_bias)
        if key is not None:
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.pop(next(iter(_LAUNCHES)), None)
            _LAUNCHES[key] = launch
    m, n = launch.m, launch.n
    if launch.library:
        return _library_call(a, b, scale_a, scale_b, bias, out_dtype, m, n, blockwise)
    if quant is not None:
        from kopt.codegen.kernels.quant_fp8 import group_scale_empty

        q = torch.empty((m, n), dtype=E4M3, device=a.device)
        q_scale = group_scale_empty(m, n, a.device)
        out, result = q.view(torch.uint8), (q, q_scale)
    else:
        out = result = torch.empty((m, n), dtype=out_dtype, device=a.device)
        q_scale = out  # never read: QUANT_OUT is off
    if m == 0:
        return result
    direct = launch.direct
    if launch.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # without a direct launch the block shapes are placeholders: the autotune pre-hook
        # sets each config's tile
        box_a, box_b = direct.boxes if direct is not None else ([16, 16], [16, 16])
        a_desc = TensorDescriptor.from_tensor(a, box_a)
        b_desc = TensorDescriptor.from_tensor(b.t(), box_b)
    else:
        a_desc = b_desc = None
    dummy = out  # a pointer for absent operands: never read (their flags are off)
    if blockwise:  # 2-D, read through their strides
        sa, sb = scale_a, scale_b
    else:
        sa = scale_a.reshape(-1) if scale_a is not None else dummy
        sb = scale_b.reshape(-1) if scale_b is not None else dummy
    g = _rows(gate, n, "gate", op) if gate is not None else dummy
    r = _rows(residual, n, "residual", op) if residual is not None else dummy
    extra_args: list[Any] = []
    for o, t in zip(epilogue.operands if epilogue else (), extra, strict=True):
        v = _operand_view(o.kind, t, n, o.name, op)
        extra_args += [v, v.stride(0) if v.numel() > 1 else 0,
                       m // v.shape[0] if o.kind == "group" else 1]
    ws, lock = launch.workspace(a.device) if launch.split_tiles else (dummy, dummy)
    args = [a, b, a_desc, b_desc, out, sa, sb, bias if bias is not None else dummy, g, r, ws,
            lock, q_scale, quant_bias if quant_bias is not None else dummy, *extra_args,
            *launch.scalars]
    if direct is not None and a.device.index == torch.cuda.current_device():
        direct(args)  # entering torch.cuda.device costs microseconds: only where needed
        return result
    ctx = torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext()
    with ctx:
        if direct is not None:
            direct(args)
            return result
        compiled = triton_launch(launch.kernel, launch.grid, *args, **launch.flags)
        if key is not None and a.is_cuda and not torch.cuda.is_current_stream_capturing():
            launch.direct = _direct_launch(launch, compiled, args)
            if launch.direct is not None and launch.library_form and LIBRARY_CHOICE:
                launch.library = _library_faster(launch, args, lambda: _library_call(
                    a, b, scale_a, scale_b, bias, out_dtype, m, n, blockwise))
    if launch.tuning is not None:
        kb_tuning.record_winner(launch.tuning, launch.kernel)
    return result


# Whether a launch key whose call cuBLAS also computes (see ``_library_form``) times the two
# once and keeps the faster (the extern-kernel choice of Inductor's max-autotune): the
# template loses to cuBLAS at a few shapes (W1's 128-row text QKV, 1.04-1.05x its time), and
# its blockwise GEMM at every W1 shape (1.36-1.74x; RESULTS.md, 2026-12-03, H200).
LIBRARY_CHOICE = True


def _library_form(p: _Problem, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None,
                  bias: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
                  epilogue: GemmEpilogue | None) -> bool:
    """Whether ``torch._scaled_mm`` computes this call: FP8 with rowwise or tensorwise scales,
    no epilogue beyond a bias of the output dtype, bf16 out (its rowwise kernel's only one);
    or ``kopt::fp8_blockwise_mm`` (cuBLAS's blockwise GEMM): blockwise scales, no epilogue, K
    a multiple of 512 (its scales' padding)."""
    plain = (p.fp8 and p.quant is None and activation == "none" and p.gate is None
             and p.residual is None and not p.extra and (epilogue is None or not epilogue.lines)
             and out_dtype == torch.bfloat16)
    if p.blockwise:
        return plain and bias is None and p.k % 512 == 0
    return (plain and (bias is None or bias.dtype == out_dtype) and p.n % 16 == 0
            and ((scale_a.numel() == p.m and scale_b.numel() == p.n)
                 or (scale_a.numel() == 1 and scale_b.numel() == 1)))


def _library_call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  m: int, n: int, blockwise: bool = False) -> torch.Tensor:
    """The call as ``torch._scaled_mm`` or ``kopt::fp8_blockwise_mm`` (a call
    :func:`_library_form` accepts)."""
    if blockwise:
        return torch.ops.kopt.fp8_blockwise_mm(a, scale_a, b.t(), scale_b, out_dtype)
    if scale_a.numel() == m and scale_b.numel() == n:
        sa, sb = scale_a.reshape(m, 1), scale_b.reshape(1, n)
    else:
        sa, sb = scale_a.reshape(()), scale_b.reshape(())
    return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)


def _library_faster(launch: _Launch, args: list[Any], library: Callable[[], object]) -> bool:
    """Whether cuBLAS runs this call faster than the template's tuned config, once per launch
    key: ``do_bench`` medians, which clear the L2 cache before each call (a layer's weights
    come from memory; a skinny GEMM's whole weight would stay in L2 between replays) and so
    keep the GPU busy while the host launches (a launch's host time does not count); each
    timed twice, alternately, and its faster median kept (the clock of a GPU at its power cap
    moves between timings: whichever ran first looked slower; RESULTS.md, 2026-12-01)."""
    from triton.testing import do_bench

    def timed(fn: Callable[[], object]) -> float:
        return do_bench(fn, warmup=10, rep=20, return_mode="median")

    try:
        ours, lib = timed(lambda: launch.direct(args)), timed(library)
        ours, lib = min(ours, timed(lambda: launch.direct(args))), min(lib, timed(library))
    except Exception as e:  # noqa: BLE001 -- a timing that fails keeps the template
        log.info("kopt's GEMM: cuBLAS not timed (%s: %s); the template stays", type(e).__name__,
                 e)
        return False
    log.info("kopt's GEMM %s x %s: template %.1f us, cuBLAS's _scaled_mm %.1f us: %s",
             launch.m, launch.n, 1e3 * ours, 1e3 * lib,
             "_scaled_mm runs it" if lib < ours else "the template runs it")
    return lib < ours


def _direct_launch(launch: _Launch, compiled: Any, args: list[Any]) -> _Direct | None:
    """The direct launch of the config the autotuner just ran (see :class:`_Direct`), if it
    reproduces that call's output (``args[4]``) bit for bit; else None (the autotuner's path
    stays: it is only slower on the host)."""
    try:
        config = launch.kernel.best_config
        values = {**launch.flags, **config.all_kwargs()}
        names = launch.kernel.fn.arg_names
        box_a = [values["BLOCK_M"], values["BLOCK_K"]]
        box_b = [values["BLOCK_N"], values["BLOCK_K"]]
        grid = (*launch.grid(values), 1, 1)[:3]
        direct = _Direct(compiled, args[0].device.index, grid, (box_a, box_b),
                         tuple(values[name] for name in names[len(args):]))
        again = list(args)
        again[4] = torch.empty_like(args[4])
        quant = bool(launch.flags.get("QUANT_OUT"))
        if quant:  # the quantized output's scales too, in their column-major layout
            again[12] = torch.empty_like(args[12].t()).t()
        if args[2] is not None:
            from triton.tools.tensor_descriptor import TensorDescriptor

            again[2] = TensorDescriptor.from_tensor(args[0], box_a)
            again[3] = TensorDescriptor.from_tensor(args[1].t(), box_b)
        direct(again)
        if torch.equal(again[4], args[4]) and (not quant or torch.equal(again[12], args[12])):
            return direct
        log.warning("kopt's GEMM (%s x %s): launching the tuned kernel directly gave other "
                    "values than Triton's launch; this launch keeps Triton's path", launch.m,
                    launch.n)
    except Exception as e:  # noqa: BLE001 -- another Triton's internals: keep its own path
        log.info("kopt's GEMM: no direct launch (%s: %s); Triton's launch path stays",
                 type(e).__name__, e)
    return None


def _plan_launch(op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
                 scale_b: torch.Tensor | None, bias: torch.Tensor | None,
                 gate: torch.Tensor | None, residual: torch.Tensor | None, activation: str,
                 out_dtype: torch.dtype, epilogue: GemmEpilogue | None,
                 extra: Sequence[torch.Tensor], use_tma: bool | None, fp8_fast_accum: bool,
                 configs: list | None, cache_dir: Path | None, fp8: bool,
                 blockwise: bool = False, quant: QuantOut | None = None,
                 quant_bias: torch.Tensor | None = None) -> _Launch:
    """Check a call and work out its launch (see :func:`gemm`)."""
    import triton

    from kopt.codegen.kernels.act_quant import ACT_CODES

    p = _check(op, a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype, fp8,
               epilogue, extra, blockwise, quant, quant_bias)
    m, n, k = p.m, p.n, p.k
    if m == 0:
        return _Launch(m, n, False, None, None, lambda meta: (0,), (), {})
    bt = b.t()  # [N, K]; K-major when b is the .t() view of a row-major weight
    tma_ok = _tma_ok(a) and _tma_ok(bt)
    if use_tma is None:
        use_tma = tma_ok and a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 9
    elif use_tma and not tma_ok:
        _fail(op, "use_tma=True needs row-major a and K-major b with 16-byte aligned rows")
    module = _kernel_module(epilogue, cache_dir)
    if not a.is_cuda and type(module.gemm_kernel).__name__ != "InterpretedFunction":
        _fail(op, f"the Triton kernel needs CUDA tensors (got {a.device}; CPU tensors run only "
                  "under TRITON_INTERPRET=1); the custom op runs the reference there")
    tuning = None
    if configs is None:
        configs = gemm_configs(m_bucket(m), n, k, fp8, interpreted=not a.is_cuda,
                               blockwise=blockwise, quant_out=quant is not None)
        # start from the knowledge base's winner for this key, if it has one
        tuning = _tuning_key(module, a, bias, p, activation, out_dtype, use_tma,
                             fp8 and not fp8_fast_accum)
        configs = kb_tuning.configs_for(tuning, configs, _config_from_params)
    for c in configs:
        bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        if (blockwise and (bn, bk) != (BLOCK, BLOCK)) or (quant is not None and bn % BLOCK):
            _fail(op, f"config {c} does not fit this launch (blockwise scales: BLOCK_N = "
                      f"BLOCK_K = {BLOCK}; a quantized output: BLOCK_N a multiple of {BLOCK})")
    kernel = _tuner(module, configs, tuning)
    programs = _programs(a.device)

    def tiles(meta: Mapping[str, int]) -> int:
        return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])

    def grid(meta: Mapping[str, int]) -> tuple[int]:
        return (min(tiles(meta), programs) if meta["PERSISTENT"]
                else tiles(meta) * meta["SPLIT_K"],)

    split = [c.kwargs for c in configs if c.kwargs.get("SPLIT_K", 1) > 1]

    g, r = p.gate, p.residual
    if blockwise:  # [M, K/128] and [N/128, K/128], any strides
        (sa_stride, sak_stride), (sb_stride, sbk_stride) = scale_a.stride(), scale_b.stride()
    else:
        sa_stride = scale_a.reshape(-1).stride(0) if scale_a is not None and \
            scale_a.numel() > 1 else 0
        sb_stride = scale_b.reshape(-1).stride(0) if scale_b is not None and \
            scale_b.numel() > 1 else 0
        sak_stride = sbk_stride = 0
    scalars = (m, n, k, m_bucket(m), programs,
               a.stride(0), a.stride(1), b.stride(0), b.stride(1), n,  # out: [m, n] contiguous
               sa_stride, sb_stride, sak_stride, sbk_stride,
               g.stride(0) if g is not None else 0, m // g.shape[0] if g is not None else 1,
               r.stride(0) if r is not None else 0,
               1, m)  # a quantized output's scales: [M, N / 128] with strides (1, M)
    flags = dict(
        USE_TMA=use_tma, PRECISE_ACC=fp8 and not fp8_fast_accum,
        DOT_IN_FP32=not a.is_cuda and a.dtype == torch.bfloat16,
        HAS_SCALES=fp8 and not blockwise, BLOCKWISE=blockwise, HAS_BIAS=bias is not None,
        ACTIVATION=_ACT_CODE[activation], HAS_GATE=g is not None, HAS_RESIDUAL=r is not None,
        QUANT_OUT=quant is not None,
        QUANT_ACT=-1 if quant is None or quant.activation is None else
        ACT_CODES[quant.activation],
        HAS_QBIAS=quant_bias is not None, OUT_TY=_triton_type(out_dtype),
        NATIVE=type(module.gemm_kernel).__name__ != "InterpretedFunction")
    if quant is not None:
        # contractions as the act + quant kernels have them (written out), so that the
        # quantized output equals kopt::act_quant_fp8_group's on the same GEMM output
        flags["enable_fp_fusion"] = False
    return _Launch(m, n, use_tma, kernel, tuning, grid, scalars, flags,
                   library_form=_library_form(p, scale_a, scale_b, bias, activation, out_dtype,
                                              epilogue),
                   split_values=max((tiles(c) * c["SPLIT_K"] * c["BLOCK_M"] * c["BLOCK_N"]
                                     for c in split), default=0),
                   split_tiles=max((tiles(c) for c in split), default=0))


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

def _triton_ready(a: torch.Tensor) -> bool:
    """The template's configs and TMA path are for sm_90 (Hopper); older GPUs run the
    reference (cuBLAS / _scaled_mm)."""
    return torch.cuda.get_device_capability(a.device) >= (9, 0)


def _fp8_gemm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, bias: torch.Tensor | None,
                        gate: torch.Tensor | None, residual: torch.Tensor | None,
                        activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    return gemm_reference(a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype,
                          fp8=True)


def _fp8_gemm_cuda(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor | None,
                   residual: torch.Tensor | None, activation: str,
                   out_dtype: torch.dtype) -> torch.Tensor:
    if not _triton_ready(a):
        return _fp8_gemm_reference(a, b, scale_a, scale_b, bias, gate, residual, activation,
                                   out_dtype)
    return gemm(a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype, fp8=True)


def _fp8_gemm_fake(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor | None,
                   residual: torch.Tensor | None, activation: str,
                   out_dtype: torch.dtype) -> torch.Tensor:
    p = _check("kopt::fp8_gemm", a, b, scale_a, scale_b, bias, gate, residual, activation,
               out_dtype, True)
    return a.new_empty((p.m, p.n), dtype=out_dtype)


# ``rnd(residual + rnd(gate * rnd(act(rnd(a @ b * scale_a * scale_b + bias)))))``, e4m3 operands,
# ``b`` [K, N] column-major; the reference on devices without the Triton kernel. Registered
# without torch.library.custom_op's Python layers (kopt.codegen.ops), as every hot kopt op.
fp8_gemm = define(
    "fp8_gemm", "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, "
    "Tensor? gate, Tensor? residual, str activation, ScalarType out_dtype) -> Tensor",
    _fp8_gemm_reference, fake=_fp8_gemm_fake, cuda=_fp8_gemm_cuda)


def _epilogue64(y: torch.Tensor, gate: torch.Tensor | None, residual: torch.Tensor | None,
                activation: str) -> torch.Tensor:
    m, n = y.shape
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = F.silu(y)
    if gate is not None:
        g = gate.numel() // n
        y = (gate.reshape(g, 1, n) * y.reshape(g, m // g, n)).reshape(m, n)
    if residual is not None:
        y = residual.reshape(m, n) + y
    return y


@fp64_reference(torch.ops.kopt.fp8_gemm.default)
def _fp8_gemm64(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                bias: torch.Tensor | None, gate: torch.Tensor | None,
                residual: torch.Tensor | None, activation: str,
                out_dtype: torch.dtype) -> torch.Tensor:
    y = (a.double() * scale_a.double().reshape(-1, 1)) @ (
        b.double() * scale_b.double().reshape(1, -1))
    return _epilogue64(y if bias is None else y + bias.double(), gate, residual, activation)


def _bf16_gemm_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                         gate: torch.Tensor | None, residual: torch.Tensor | None,
                         activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    return gemm_reference(a, b, None, None, bias, gate, residual, activation, out_dtype,
                          fp8=False)


def _bf16_gemm_cuda(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    gate: torch.Tensor | None, residual: torch.Tensor | None, activation: str,
                    out_dtype: torch.dtype) -> torch.Tensor:
    if not _triton_ready(a):
        return _bf16_gemm_reference(a, b, bias, gate, residual, activation, out_dtype)
    return gemm(a, b, None, None, bias, gate, residual, activation, out_dtype, fp8=False)


def _bf16_gemm_fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    gate: torch.Tensor | None, residual: torch.Tensor | None, activation: str,
                    out_dtype: torch.dtype) -> torch.Tensor:
    p = _check("kopt::bf16_gemm", a, b, None, None, bias, gate, residual, activation, out_dtype,
               False)
    return a.new_empty((p.m, p.n), dtype=out_dtype)


# ``rnd(residual + rnd(gate * rnd(act(rnd(a @ b + bias)))))`` for bf16/fp16 operands, ``b``
# [K, N] (column-major fastest); the reference on devices without the Triton kernel.
bf16_gemm = define(
    "bf16_gemm", "(Tensor a, Tensor b, Tensor? bias, Tensor? gate, Tensor? residual, "
    "str activation, ScalarType out_dtype) -> Tensor",
    _bf16_gemm_reference, fake=_bf16_gemm_fake, cuda=_bf16_gemm_cuda)


# --- the blockwise recipe (1x128 activation groups x 128x128 weight blocks) on the template ---

def _blockwise_args(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``b`` of the template: the [K, N] column-major view of the row-major [N, K] weight."""
    if w.dim() != 2:
        raise GemmInputError(f"the blockwise weight must be [N, K]; got {list(w.shape)}")
    return w.t()


def _fp8_blockwise_gemm_reference(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                                  scale_w: torch.Tensor, bias: torch.Tensor | None,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    return gemm_reference(a, _blockwise_args(a, w), scale_a, scale_w, bias, None, None,
                          out_dtype=out_dtype, fp8=True, blockwise=True)


def _fp8_blockwise_gemm_cuda(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                             scale_w: torch.Tensor, bias: torch.Tensor | None,
                             out_dtype: torch.dtype) -> torch.Tensor:
    if not _triton_ready(a):
        return _fp8_blockwise_gemm_reference(a, scale_a, w, scale_w, bias, out_dtype)
    return gemm(a, _blockwise_args(a, w), scale_a, scale_w, bias, out_dtype=out_dtype,
                fp8=True, blockwise=True)


def _fp8_blockwise_gemm_fake(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                             scale_w: torch.Tensor, bias: torch.Tensor | None,
                             out_dtype: torch.dtype) -> torch.Tensor:
    p = _check("kopt::fp8_blockwise_gemm", a, _blockwise_args(a, w), scale_a, scale_w, bias,
               None, None, "none", out_dtype, True, blockwise=True)
    return a.new_empty((p.m, p.n), dtype=out_dtype)


# ``rnd(sum_j (a[:, Kj] @ w[:, Kj].T) * scale_a[:, j] * scale_w[:, j].T + bias)``: the blockwise
# recipe's GEMM (what kopt::fp8_blockwise_mm computes through cuBLAS) on kopt's template;
# a [M, K] e4m3 with scale_a [M, K/128], w [N, K] e4m3 with scale_w [N/128, K/128].
fp8_blockwise_gemm = define(
    "fp8_blockwise_gemm", "(Tensor a, Tensor scale_a, Tensor w, Tensor scale_w, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor",
    _fp8_blockwise_gemm_reference, fake=_fp8_blockwise_gemm_fake, cuda=_fp8_blockwise_gemm_cuda)


@fp64_reference(torch.ops.kopt.fp8_blockwise_gemm.default)
def _fp8_blockwise_gemm64(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                          scale_w: torch.Tensor, bias: torch.Tensor | None,
                          out_dtype: torch.dtype) -> torch.Tensor:
    from kopt.codegen.kernels.fp8_blockwise import blockwise_mm_exact

    # (the verifier's fp64 run: scales and bias arrive in fp64, so no fp32 checks here)
    y = blockwise_mm_exact(a, scale_a, w, scale_w)
    return y if bias is None else y + bias


def _act_quant_reference(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                         scale_w: torch.Tensor, bias: torch.Tensor | None, activation: str,
                         act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return gemm_reference(a, _blockwise_args(a, w), scale_a, scale_w, None, None, None,
                          out_dtype=act_dtype, fp8=True, blockwise=True,
                          quant=QuantOut(activation), quant_bias=bias)


def _act_quant_cuda(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                    scale_w: torch.Tensor, bias: torch.Tensor | None, activation: str,
                    act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if not _triton_ready(a):
        return _act_quant_reference(a, scale_a, w, scale_w, bias, activation, act_dtype)
    return gemm(a, _blockwise_args(a, w), scale_a, scale_w, out_dtype=act_dtype, fp8=True,
                blockwise=True, quant=QuantOut(activation), quant_bias=bias)


def _act_quant_fake(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                    scale_w: torch.Tensor, bias: torch.Tensor | None, activation: str,
                    act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from kopt.codegen.kernels.quant_fp8 import group_scale_empty

    p = _check("kopt::fp8_blockwise_gemm_act_quant", a, _blockwise_args(a, w), scale_a,
               scale_w, None, None, None, "none", act_dtype, True, blockwise=True,
               quant=QuantOut(activation), quant_bias=bias)
    return (a.new_empty((p.m, p.n), dtype=E4M3), group_scale_empty(p.m, p.n, a.device))


# ``act_quant_fp8_group(fp8_blockwise_mm(a, scale_a, w, scale_w, act_dtype), None, activation,
# bias)`` in one kernel: the blockwise GEMM whose epilogue adds the bias, applies the activation
# and quantizes the result per 1x128 group for the next blockwise GEMM, so the activation's
# input is never written. (q [M, N] e4m3, scale [M, N/128] with strides (1, M)).
fp8_blockwise_gemm_act_quant = define(
    "fp8_blockwise_gemm_act_quant", "(Tensor a, Tensor scale_a, Tensor w, Tensor scale_w, "
    "Tensor? bias, str activation, ScalarType act_dtype) -> (Tensor, Tensor)",
    _act_quant_reference, fake=_act_quant_fake, cuda=_act_quant_cuda)


@fp64_reference(torch.ops.kopt.fp8_blockwise_gemm_act_quant.default)
def _act_quant64(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor,
                 scale_w: torch.Tensor, bias: torch.Tensor | None, activation: str,
                 act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # the product and the activation in fp64, then the quantizer as the unfused fp64 run
    # applies it (kopt::act_quant_fp8_group's fp64 reference)
    y = _fp8_blockwise_gemm64(a, scale_a, w, scale_w, None, act_dtype)
    return quant_reference(y, QuantOut(activation), bias)


_DEFINED: dict[str, tuple[GemmEpilogue, object]] = {}


@fp64_reference(torch.ops.kopt.bf16_gemm.default)
def _bf16_gemm64(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 gate: torch.Tensor | None, residual: torch.Tensor | None, activation: str,
                 out_dtype: torch.dtype) -> torch.Tensor:
    y = a.double() @ b.double()
    return _epilogue64(y if bias is None else y + bias.double(), gate, residual, activation)


def define_gemm_op(qualname: str, epilogue: GemmEpilogue,
                   reference: EpilogueReference):  # noqa: ANN201
    """A custom op for one generated epilogue (FP8 when ``a`` is e4m3, else 16-bit):

        qualname(Tensor a, Tensor b, Tensor? scale_a, Tensor? scale_b, Tensor? bias,
                 Tensor? gate, Tensor? residual, str activation, ScalarType out_dtype,
                 Tensor[] extra) -> Tensor

    ``extra`` holds the epilogue's operands in order; ``reference`` computes the epilogue in
    eager PyTorch (see :data:`EpilogueReference`): the CPU path and verification. Defining the
    same name twice returns the first op if the epilogue is the same, else raises."""
    if qualname in _DEFINED:
        known, op = _DEFINED[qualname]
        if known != epilogue:
            raise GemmInputError(f"{qualname} is already defined with another epilogue")
        return op

    def impl(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
             scale_b: torch.Tensor | None, bias: torch.Tensor | None,
             gate: torch.Tensor | None, residual: torch.Tensor | None, activation: str,
             out_dtype: torch.dtype, extra: list[torch.Tensor]) -> torch.Tensor:
        return gemm_reference(a, b, scale_a, scale_b, bias, gate, residual, activation,
                              out_dtype, epilogue=epilogue, extra=extra,
                              epilogue_reference=reference)

    op = torch.library.custom_op(qualname, impl, mutates_args=())

    @op.register_kernel("cuda")
    def _(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
          scale_b: torch.Tensor | None, bias: torch.Tensor | None, gate: torch.Tensor | None,
          residual: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
          extra: list[torch.Tensor]) -> torch.Tensor:
        if not _triton_ready(a):
            return impl(a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype,
                        extra)
        return gemm(a, b, scale_a, scale_b, bias, gate, residual, activation, out_dtype,
                    epilogue=epilogue, extra=extra)

    @op.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None,
          scale_b: torch.Tensor | None, bias: torch.Tensor | None, gate: torch.Tensor | None,
          residual: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
          extra: list[torch.Tensor]) -> torch.Tensor:
        fp8 = a.dtype == E4M3
        p = _check(qualname, a, b, scale_a, scale_b, bias, gate, residual, activation,
                   out_dtype, fp8, epilogue, extra)
        return a.new_empty((p.m, p.n), dtype=out_dtype)

    _DEFINED[qualname] = (epilogue, op)
    return op
