"""Per-head RMSNorm of q and k followed by rotary position embedding, in one launch:
``kopt::qk_norm_rope``.

For every token t, head h and head-dim position d of q (and likewise k, with its own weight):

    rstd[t, h]   = 1 / sqrt(mean_d(x[t, h, :]^2) + eps)          (fp32)
    y[t, h, d]   = x[t, h, d] * rstd[t, h] * w[d]                 (rounding: see ``norm``)
    out[t, h, d] = y[t, h, d] * cos[t, d] + rot(y)[t, h, d] * sin[t, d]

``rope`` says what ``rot`` is and how the model writes it:

* ``"pairs"`` -- interleaved pairs (FLUX.2's ``apply_rotary_emb``): rot(y)[2j] = -y[2j+1],
  rot(y)[2j+1] = y[2j]; ``cos``/``sin`` have one value per head-dim position.
* ``"complex"`` -- the same rotation written as a complex product (Qwen-Image):
  ``view_as_complex(y) * (cos + i sin)``, ``cos``/``sin`` with one value per pair (head_dim / 2).
* ``"half"`` -- rotate-half (Llama, Qwen3): rot(y) = cat(-y[D/2:], y[:D/2]).

With ``q_bias`` / ``k_bias`` (one ``[H, D]`` tensor per segment, or none) ``x`` is first
``x + bias``, rounded to x's dtype: the bias of the projection before, where its GEMM does not
add it (the blockwise FP8 GEMM's output: :mod:`kopt.patterns.bias` splits that add per q / k / v
slice, and the rewrite takes the q and k ones here).

``norm`` says where the model rounds:

* ``"rms_norm"`` -- ``aten.rms_norm``: x * rstd * w in fp32, rounded once to x's dtype.
* ``"cast"`` -- the hand-written RMSNorm of diffusers/transformers: x * rstd rounded to x's dtype,
  then times w (same dtype) rounded again.

The rotation is computed in the promoted dtype of y and the tables, like the model's own ops:
fp32 tables (FLUX.2, Qwen-Image) mean one rounding at the end; tables in y's dtype (a bf16 LLM)
mean every product and the sum round to that dtype.

Inputs come as *segments* along the sequence axis, each ``[B, S_i, H, D]`` read through its
strides (a view of the merged QKV projection's output: no copy), with its own norm weight and
rotary tables (4-d, broadcastable to ``[B, S_i, H, D]``, or ``[.., D/2]`` for "complex"; read
with stride 0 along broadcast axes); the outputs are the segments concatenated,
``[B, sum S_i, H, D]`` contiguous: the joint [text; image] sequence of a double-stream DiT block,
laid out as the ``permute`` feeding SDPA expects it. One launch per segment handles q and k
together; a program holds BLOCK_R (token, head) rows, each as its rotation pairs' two members
(rotate-half: two contiguous half rows; interleaved: one row split in registers).

Numerics: the Triton kernel sums the squares in another order than torch's reduction, and the
libdevice ``rsqrt`` / complex-multiply contraction may differ from torch's CUDA kernels, so it is
*not* bitwise equal to the unfused ops; the rewrite declares the tolerance tier. The PyTorch
reference below is the model's own op sequence (bitwise equal to the unfused graph on the same
device); it is the CPU implementation and the one tests and benchmarks compare against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from kopt.codegen import fp64_reference
from kopt.codegen.launch import launch
from kopt.codegen.ops import define

NORMS = ("rms_norm", "cast")
ROPES = ("pairs", "complex", "half")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of one program's [rows, head_dim] tile.
_TILE = 2048


# --------------------------------------------------------------------------------------------
# PyTorch reference: the models' own op sequences
# --------------------------------------------------------------------------------------------
def _upcast(x: torch.Tensor) -> torch.Tensor:
    # What the models' ``.float()`` means: half types to fp32; an fp64 verification run stays fp64.
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    if norm == "rms_norm":
        return torch.ops.aten.rms_norm(x, [x.shape[-1]], w, eps)
    xf = _upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def _rope_reference(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    rope: str) -> torch.Tensor:
    if rope == "complex":
        pairs = torch.view_as_complex(_upcast(y).reshape(*y.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(y)
    if rope == "pairs":
        real, imag = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
        rot = torch.stack([-imag, real], dim=-1).flatten(-2)
    else:
        half = y.shape[-1] // 2
        rot = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return (y * cos + rot * sin).to(y.dtype)


def qk_norm_rope_reference(
    q: Sequence[torch.Tensor], k: Sequence[torch.Tensor],
    q_weight: Sequence[torch.Tensor], k_weight: Sequence[torch.Tensor],
    cos: Sequence[torch.Tensor], sin: Sequence[torch.Tensor],
    eps: float, norm: str, rope: str,
    q_bias: Sequence[torch.Tensor] = (), k_bias: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops, segment by segment, concatenated along the sequence axis."""
    outs = []
    for xs, ws, bs in ((q, q_weight, q_bias), (k, k_weight, k_bias)):
        if bs:
            xs = [x + b for x, b in zip(xs, bs, strict=True)]
        outs.append(torch.cat([
            _rope_reference(_norm_reference(x, w, eps, norm), c, s, rope)
            for x, w, c, s in zip(xs, ws, cos, sin, strict=True)
        ], dim=1))
    return outs[0], outs[1]


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def round_to(x, dt: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 ``x`` rounded to ``dt`` (nearest even), returned in fp32: where torch stores a value
    in the activation's dtype. NATIVE is False under the interpreter, whose bf16 cast truncates:
    there the rounding is done on the bits."""
    if NATIVE:
        return x.to(dt).to(tl.float32)
    else:
        if dt == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)


@triton.jit
def widen(x, NATIVE: tl.constexpr):
    """``x`` in fp32. On the GPU a bf16 pair is one 32-bit register, and each value's fp32 is
    its bits moved to the top half: one shift or one and per value (Triton's conversion extracts
    the high value first, two instructions)."""
    if NATIVE and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, -65536;", "=r,=r,r", [x],
            dtype=tl.float32, is_pure=True, pack=2)
    else:
        return x.to(tl.float32)


@triton.jit
def round_pairs(x, dt: tl.constexpr, NATIVE: tl.constexpr, PAIRS: tl.constexpr):
    """:func:`round_to`, with bf16 pairs on the GPU where each thread holds an even number of
    ``x``'s values (``PAIRS``): one ``cvt.rn.bf16x2.f32`` per two values (Triton's cast
    converts one at a time), then :func:`widen`'s shift and and. (Where ``x`` is a sum or
    product of two bf16 values, ptxas makes ``round_to`` one packed bf16 instruction per two
    values: better than this.)"""
    if NATIVE and PAIRS and dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 t;\n\tcvt.rn.bf16x2.f32 t, $3, $2;\n\tshl.b32 $0, t, 16;\n\t"
            "and.b32 $1, t, -65536;\n\t}", "=r,=r,r,r", [x],
            dtype=tl.float32, is_pure=True, pack=2)
    else:
        return round_to(x, dt, NATIVE)


@triton.jit
def _rsqrt(x, NATIVE: tl.constexpr):
    # libdevice's rsqrtf is what torch's CUDA rsqrt calls; NATIVE is False under the
    # interpreter, which has no libdevice.
    if NATIVE:
        return libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)


@triton.jit
def _normed(x, rstd, w, dt: tl.constexpr, NORM_CAST: tl.constexpr, NATIVE: tl.constexpr):
    if NORM_CAST:
        y = round_to(x * rstd[:, None], dt, NATIVE)
        return round_to(y * w, dt, NATIVE)
    else:
        return round_to(x * rstd[:, None] * w, dt, NATIVE)


@triton.jit
def _pair_members(ptr, offs, rmask, stride, D: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """The two members (a, b) of every rotation pair of ROWS rows starting at ``ptr + offs``,
    each [ROWS, BLOCK_H] in fp32: rotate-half pairs (j, j + D/2) as two contiguous half rows;
    interleaved pairs (2j, 2j + 1) as one contiguous row split in registers."""
    j = tl.arange(0, BLOCK_H)
    if HALF:
        mask = rmask[:, None] & (j < D // 2)[None, :]
        a = tl.load(ptr + offs[:, None] + j[None, :] * stride, mask=mask, other=0.0)
        b = tl.load(ptr + offs[:, None] + (j + D // 2)[None, :] * stride, mask=mask, other=0.0)
    else:
        d = tl.arange(0, 2 * BLOCK_H)
        mask = rmask[:, None] & (d < D)[None, :]
        row = tl.load(ptr + offs[:, None] + d[None, :] * stride, mask=mask, other=0.0)
        a, b = tl.split(tl.reshape(row, [ROWS, BLOCK_H, 2]))
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def _norm_rope_rows(
    x_ptr, o_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr,
    sxb, sxs, sxh, sxd, scb, scs, sch, scd, ssb, sss, ssh, ssd,
    pid, n_rows, S, H, S_OUT, SEQ_OFF, eps,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, TDIV: tl.constexpr,
    NORM_CAST: tl.constexpr, ROPE_HALF: tl.constexpr, ROUND_EACH: tl.constexpr,
    HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr,
):
    # Row indices fit int32 (the divisions stay cheap); addresses are int64.
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    b = (rows // (S * H)).to(tl.int64)
    s = ((rows // H) % S).to(tl.int64)
    h = (rows % H).to(tl.int64)
    dt = o_ptr.dtype.element_ty

    # x = the pairs' members (xa, xb): out_a = ya cos_a - yb sin_a, out_b = yb cos_b + ya sin_b
    xa, xb = _pair_members(x_ptr, b * sxb + s * sxs + h * sxh, rmask, sxd, D, BLOCK_R, BLOCK_H,
                           ROPE_HALF)
    if HAS_BIAS:  # [H, D] contiguous; x + bias rounded as the model's add
        ba, bb = _pair_members(b_ptr, h * D, rmask, 1, D, BLOCK_R, BLOCK_H, ROPE_HALF)
        xa = round_to(xa + ba, dt, NATIVE)
        xb = round_to(xb + bb, dt, NATIVE)
    rstd = _rsqrt((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) * (1.0 / D) + eps, NATIVE)
    one = tl.zeros((1,), dtype=tl.int64)
    wa, wb = _pair_members(w_ptr, one, one == 0, 1, D, 1, BLOCK_H, ROPE_HALF)
    ya = _normed(xa, rstd, wa, dt, NORM_CAST, NATIVE)
    yb = _normed(xb, rstd, wb, dt, NORM_CAST, NATIVE)

    c_offs = b * scb + s * scs + h * sch
    s_offs = b * ssb + s * sss + h * ssh
    if TDIV == 2:  # one table value per pair (complex frequencies)
        j = tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (j < D // 2)[None, :]
        ca = tl.load(cos_ptr + c_offs[:, None] + j[None, :] * scd, mask=mask, other=0.0)
        sa = tl.load(sin_ptr + s_offs[:, None] + j[None, :] * ssd, mask=mask, other=0.0)
        ca, sa = ca.to(tl.float32), sa.to(tl.float32)
        cb, sb = ca, sa
    else:  # one per position
        ca, cb = _pair_members(cos_ptr, c_offs, rmask, scd, D, BLOCK_R, BLOCK_H, ROPE_HALF)
        sa, sb = _pair_members(sin_ptr, s_offs, rmask, ssd, D, BLOCK_R, BLOCK_H, ROPE_HALF)
    if ROUND_EACH:
        out_a = round_to(ya * ca, dt, NATIVE) - round_to(yb * sa, dt, NATIVE)
        out_b = round_to(yb * cb, dt, NATIVE) + round_to(ya * sb, dt, NATIVE)
    else:
        out_a = ya * ca - yb * sa
        out_b = yb * cb + ya * sb
    out_a = round_to(out_a, dt, NATIVE).to(dt)
    out_b = round_to(out_b, dt, NATIVE).to(dt)

    o_offs = ((b * S_OUT + SEQ_OFF + s) * H + h) * D
    j = tl.arange(0, BLOCK_H)
    if ROPE_HALF:
        mask = rmask[:, None] & (j < D // 2)[None, :]
        tl.store(o_ptr + o_offs[:, None] + j[None, :], out_a, mask=mask)
        tl.store(o_ptr + o_offs[:, None] + (j + D // 2)[None, :], out_b, mask=mask)
    else:
        d = tl.arange(0, 2 * BLOCK_H)
        out = tl.reshape(tl.join(out_a, out_b), [BLOCK_R, 2 * BLOCK_H])
        tl.store(o_ptr + o_offs[:, None] + d[None, :], out, mask=rmask[:, None] & (d < D)[None, :])


@triton.jit
def _segment(
    pid, q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, qb_ptr, kb_ptr, cos_ptr, sin_ptr,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd,
    scb, scs, sch, scd, ssb, sss, ssh, ssd,
    S, HQ, HK, S_OUT, SEQ_OFF, eps, q_programs, n_q_rows, n_k_rows,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, TDIV: tl.constexpr,
    NORM_CAST: tl.constexpr, ROPE_HALF: tl.constexpr, ROUND_EACH: tl.constexpr,
    HAS_QB: tl.constexpr, HAS_KB: tl.constexpr, NATIVE: tl.constexpr,
):
    """Program ``pid`` of one segment: the first ``q_programs`` take q, the rest k."""
    if pid < q_programs:
        _norm_rope_rows(q_ptr, qo_ptr, qw_ptr, qb_ptr, cos_ptr, sin_ptr,
                        sqb, sqs, sqh, sqd, scb, scs, sch, scd, ssb, sss, ssh, ssd,
                        pid, n_q_rows, S, HQ, S_OUT, SEQ_OFF, eps,
                        D, BLOCK_H, BLOCK_R, TDIV, NORM_CAST, ROPE_HALF, ROUND_EACH, HAS_QB,
                        NATIVE)
    else:
        _norm_rope_rows(k_ptr, ko_ptr, kw_ptr, kb_ptr, cos_ptr, sin_ptr,
                        skb, sks, skh, skd, scb, scs, sch, scd, ssb, sss, ssh, ssd,
                        pid - q_programs, n_k_rows, S, HK, S_OUT, SEQ_OFF, eps,
                        D, BLOCK_H, BLOCK_R, TDIV, NORM_CAST, ROPE_HALF, ROUND_EACH, HAS_KB,
                        NATIVE)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, qb_ptr, kb_ptr, cos_ptr, sin_ptr,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd,
    scb, scs, sch, scd, ssb, sss, ssh, ssd,
    S, HQ, HK, S_OUT, SEQ_OFF, eps, q_programs, n_q_rows, n_k_rows,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, TDIV: tl.constexpr,
    NORM_CAST: tl.constexpr, ROPE_HALF: tl.constexpr, ROUND_EACH: tl.constexpr,
    HAS_QB: tl.constexpr, HAS_KB: tl.constexpr, NATIVE: tl.constexpr,
):
    """One program normalises and rotates BLOCK_R (token, head) rows of q or of k of one
    segment. See the module docstring for the math."""
    _segment(tl.program_id(0), q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, qb_ptr, kb_ptr,
             cos_ptr, sin_ptr, sqb, sqs, sqh, sqd, skb, sks, skh, skd,
             scb, scs, sch, scd, ssb, sss, ssh, ssd,
             S, HQ, HK, S_OUT, SEQ_OFF, eps, q_programs, n_q_rows, n_k_rows,
             D, BLOCK_H, BLOCK_R, TDIV, NORM_CAST, ROPE_HALF, ROUND_EACH, HAS_QB, HAS_KB, NATIVE)


@triton.jit
def _qk_norm_rope2_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, qb_ptr, kb_ptr, cos_ptr, sin_ptr,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd,
    scb, scs, sch, scd, ssb, sss, ssh, ssd,
    S, SEQ_OFF, q_programs, n_q_rows, n_k_rows, programs,
    q2_ptr, k2_ptr, qw2_ptr, kw2_ptr, qb2_ptr, kb2_ptr, cos2_ptr, sin2_ptr,
    sqb2, sqs2, sqh2, sqd2, skb2, sks2, skh2, skd2,
    scb2, scs2, sch2, scd2, ssb2, sss2, ssh2, ssd2,
    S2, SEQ_OFF2, q_programs2, n_q_rows2, n_k_rows2,
    qo_ptr, ko_ptr, HQ, HK, S_OUT, eps,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    TDIV: tl.constexpr, TDIV2: tl.constexpr, ROUND_EACH: tl.constexpr,
    ROUND_EACH2: tl.constexpr, NORM_CAST: tl.constexpr, ROPE_HALF: tl.constexpr,
    HAS_QB: tl.constexpr, HAS_KB: tl.constexpr, NATIVE: tl.constexpr,
):
    """Two segments of the joint sequence (a DiT's text and image tokens) in one launch: the
    first ``programs`` programs take the first segment, the rest the second; each as
    :func:`_qk_norm_rope_kernel` would."""
    pid = tl.program_id(0)
    if pid < programs:
        _segment(pid, q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, qb_ptr, kb_ptr,
                 cos_ptr, sin_ptr, sqb, sqs, sqh, sqd, skb, sks, skh, skd,
                 scb, scs, sch, scd, ssb, sss, ssh, ssd,
                 S, HQ, HK, S_OUT, SEQ_OFF, eps, q_programs, n_q_rows, n_k_rows,
                 D, BLOCK_H, BLOCK_R, TDIV, NORM_CAST, ROPE_HALF, ROUND_EACH, HAS_QB, HAS_KB,
                 NATIVE)
    else:
        _segment(pid - programs, q2_ptr, k2_ptr, qo_ptr, ko_ptr, qw2_ptr, kw2_ptr, qb2_ptr,
                 kb2_ptr, cos2_ptr, sin2_ptr, sqb2, sqs2, sqh2, sqd2, skb2, sks2, skh2, skd2,
                 scb2, scs2, sch2, scd2, ssb2, sss2, ssh2, ssd2,
                 S2, HQ, HK, S_OUT, SEQ_OFF2, eps, q_programs2, n_q_rows2, n_k_rows2,
                 D, BLOCK_H, BLOCK_R, TDIV2, NORM_CAST, ROPE_HALF, ROUND_EACH2, HAS_QB, HAS_KB,
                 NATIVE)


def native(kernel: object, x: torch.Tensor) -> bool:
    """The ``NATIVE`` constexpr: compiled for the GPU (libdevice, hardware casts), not run by
    Triton's interpreter (``TRITON_INTERPRET=1`` when the kernel was defined)."""
    return x.is_cuda and not isinstance(kernel, InterpretedFunction)


def on_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it x's."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _config(head_dim: int) -> dict[str, int]:
    """Tile shape: whole heads per row (two halves of BLOCK_H), about _TILE elements per
    program."""
    block_h = triton.next_power_of_2(head_dim // 2)
    return {"BLOCK_H": block_h, "BLOCK_R": max(1, _TILE // (2 * block_h)), "num_warps": 4}


def _broadcast_strides(t: torch.Tensor) -> list[int]:
    """Strides of a table, 0 along the axes it is broadcast over (size 1)."""
    return [0 if n == 1 else st for n, st in zip(t.shape, t.stride(), strict=True)]


def check_args(
    q: Sequence[torch.Tensor], k: Sequence[torch.Tensor],
    q_weight: Sequence[torch.Tensor], k_weight: Sequence[torch.Tensor],
    cos: Sequence[torch.Tensor], sin: Sequence[torch.Tensor], norm: str, rope: str,
    q_bias: Sequence[torch.Tensor] = (), k_bias: Sequence[torch.Tensor] = (),
) -> None:
    """Shape and dtype contract shared by the fake, the reference and the kernel."""
    if norm not in NORMS or rope not in ROPES:
        raise ValueError(f"norm must be one of {NORMS}, rope one of {ROPES}; got {norm}, {rope}")
    n = len(q)
    if n == 0 or not len(k) == len(q_weight) == len(k_weight) == len(cos) == len(sin) == n:
        raise ValueError("q, k, weights and tables need one entry per segment")
    b, _, _, d = q[0].shape
    if d % 2:
        raise ValueError(f"head_dim {d} is odd: no rotation pairs")
    table_d = d // 2 if rope == "complex" else d
    for i in range(n):
        qs, ks = q[i], k[i]
        if qs.dim() != 4 or ks.dim() != 4:
            raise ValueError("segments are [batch, seq, heads, head_dim]")
        if qs.shape[0] != b or ks.shape[0] != b or qs.shape[1] != ks.shape[1]:
            if qs.shape[2] == ks.shape[2] and qs.stride(1) < qs.stride(2):
                raise ValueError(
                    f"segment {i}: q {list(qs.shape)} and k {list(ks.shape)} are "
                    "[batch, heads, seq, head_dim] views (normed after the transpose to "
                    "heads first); the op takes [batch, seq, heads, head_dim]")
            raise ValueError(f"segment {i}: q {list(qs.shape)} and k {list(ks.shape)} differ "
                             "in batch or sequence length")
        if qs.shape[3] != d or ks.shape[3] != d or qs.shape[2] != q[0].shape[2] \
                or ks.shape[2] != k[0].shape[2]:
            raise ValueError(f"segment {i}: heads or head_dim differ from segment 0")
        if qs.dtype != q[0].dtype or ks.dtype != q[0].dtype:
            raise ValueError(f"segment {i}: q and k must share one dtype")
        if q_weight[i].shape != (d,) or k_weight[i].shape != (d,):
            raise ValueError(f"segment {i}: norm weights must be [{d}]")
        for t in (cos[i], sin[i]):
            if t.dim() != 4 or t.shape[-1] != table_d:
                raise ValueError(f"segment {i}: rotary tables must be 4-d [.., {table_d}], got "
                                 f"{list(t.shape)}")
            if t.shape[0] not in (1, b) or t.shape[1] not in (1, qs.shape[1]) \
                    or t.shape[2] not in (1, qs.shape[2]) or t.shape[2] not in (1, ks.shape[2]):
                raise ValueError(f"segment {i}: table {list(t.shape)} does not broadcast to "
                                 f"{list(qs.shape)} and {list(ks.shape)}")
        if rope == "complex" and not (cos[i].dtype == sin[i].dtype and
                                      cos[i].dtype in (torch.float32, torch.float64)):
            raise ValueError("complex rotation tables must be fp32/fp64 real and imaginary parts")
    for name, biases, xs in (("q_bias", q_bias, q), ("k_bias", k_bias, k)):
        if biases and len(biases) != n:
            raise ValueError(f"{name} needs one [heads, head_dim] tensor per segment, or none")
        for i, bias in enumerate(biases):
            if tuple(bias.shape) != tuple(xs[i].shape[2:]) or bias.dtype != xs[i].dtype:
                raise ValueError(f"segment {i}: {name} {bias.dtype}{list(bias.shape)} must be "
                                 f"{xs[i].dtype}{list(xs[i].shape[2:])}")


def qk_norm_rope_triton(
    q: Sequence[torch.Tensor], k: Sequence[torch.Tensor],
    q_weight: Sequence[torch.Tensor], k_weight: Sequence[torch.Tensor],
    cos: Sequence[torch.Tensor], sin: Sequence[torch.Tensor],
    eps: float, norm: str, rope: str,
    q_bias: Sequence[torch.Tensor] = (), k_bias: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``)."""
    check_args(q, k, q_weight, k_weight, cos, sin, norm, rope, q_bias, k_bias)
    if q[0].dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {q[0].dtype}")
    if norm == "cast" and any(w.dtype != q[0].dtype for w in (*q_weight, *k_weight)):
        raise ValueError("norm 'cast' multiplies by the weight in the activation's dtype")
    b, _, hq, d = q[0].shape
    hk = k[0].shape[2]
    s_out = sum(t.shape[1] for t in q)
    dtype, device = q[0].dtype, q[0].device
    q_out = torch.empty((b, s_out, hq, d), dtype=dtype, device=device)
    k_out = torch.empty((b, s_out, hk, d), dtype=dtype, device=device)
    cfg = _config(d)
    qbs = [b.contiguous() for b in q_bias] if q_bias else [None] * len(q)
    kbs = [b.contiguous() for b in k_bias] if k_bias else [None] * len(q)
    segments = []  # the kernel's arguments and constexprs of each segment with tokens
    offset = 0
    for qs, ks, qw, kw, qb, kb, c, sn in zip(q, k, q_weight, k_weight, qbs, kbs, cos, sin,
                                             strict=True):
        seq = qs.shape[1]
        if seq and b:
            round_each = torch.promote_types(dtype, c.dtype) == dtype and dtype != torch.float32
            n_q, n_k = b * seq * hq, b * seq * hk
            q_programs = triton.cdiv(n_q, cfg["BLOCK_R"])
            programs = q_programs + triton.cdiv(n_k, cfg["BLOCK_R"])
            segments.append((
                [qs, ks, qw, kw, qb if qb is not None else qw, kb if kb is not None else kw,
                 c, sn, *qs.stride(), *ks.stride(), *_broadcast_strides(c),
                 *_broadcast_strides(sn), seq, offset, q_programs, n_q, n_k],
                programs, d // c.shape[3], bool(round_each and rope != "complex")))
        offset += seq
    common = dict(D=d, BLOCK_H=cfg["BLOCK_H"], BLOCK_R=cfg["BLOCK_R"],
                  NORM_CAST=norm == "cast", ROPE_HALF=rope == "half",
                  HAS_QB=bool(q_bias), HAS_KB=bool(k_bias),
                  NATIVE=native(_qk_norm_rope_kernel, q[0]), num_warps=cfg["num_warps"],
                  # Eager runs x*cos, rot*sin and their sum as separate kernels: no fma.
                  enable_fp_fusion=False)
    with on_device(q[0]):
        if len(segments) == 2:  # a joint sequence of two parts: one launch
            (a, pa, ta, ra), (b2, pb, tb, rb) = segments
            launch(_qk_norm_rope2_kernel, (pa + pb,), *a, pa, *b2, q_out, k_out, hq, hk, s_out,
                   float(eps), TDIV=ta, TDIV2=tb, ROUND_EACH=ra, ROUND_EACH2=rb, **common)
        else:
            for args, programs, tdiv, round_each in segments:
                seg = args[:8]
                launch(_qk_norm_rope_kernel, (programs,), seg[0], seg[1], q_out, k_out,
                       *seg[2:], *args[8:24], args[24], hq, hk, s_out, args[25], float(eps),
                       *args[26:], TDIV=tdiv, ROUND_EACH=round_each, **common)
    return q_out, k_out


# --------------------------------------------------------------------------------------------
# The op (kopt.codegen.ops: no custom_op layers on the hot path)
# --------------------------------------------------------------------------------------------
def _qk_norm_rope_reference(
    q: list[torch.Tensor], k: list[torch.Tensor],
    q_weight: list[torch.Tensor], k_weight: list[torch.Tensor],
    cos: list[torch.Tensor], sin: list[torch.Tensor],
    eps: float, norm: str, rope: str,
    q_bias: list[torch.Tensor] = (), k_bias: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(q, k, q_weight, k_weight, cos, sin, norm, rope, q_bias, k_bias)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, norm, rope, q_bias,
                                  k_bias)


def _qk_norm_rope_cuda(
    q: list[torch.Tensor], k: list[torch.Tensor], q_weight: list[torch.Tensor],
    k_weight: list[torch.Tensor], cos: list[torch.Tensor], sin: list[torch.Tensor],
    eps: float, norm: str, rope: str,
    q_bias: list[torch.Tensor] = (), k_bias: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> tuple[torch.Tensor, torch.Tensor]:
    weights_ok = norm != "cast" or all(w.dtype == q[0].dtype for w in (*q_weight, *k_weight))
    if q[0].dtype in KERNEL_DTYPES and weights_ok:
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, norm, rope, q_bias,
                                   k_bias)
    # fp64 (verification's reference run) and mixed dtypes: the reference.
    check_args(q, k, q_weight, k_weight, cos, sin, norm, rope, q_bias, k_bias)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, norm, rope, q_bias,
                                  k_bias)


def _qk_norm_rope_fake(
    q: list[torch.Tensor], k: list[torch.Tensor], q_weight: list[torch.Tensor],
    k_weight: list[torch.Tensor], cos: list[torch.Tensor], sin: list[torch.Tensor],
    eps: float, norm: str, rope: str,
    q_bias: list[torch.Tensor] = (), k_bias: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(q, k, q_weight, k_weight, cos, sin, norm, rope, q_bias, k_bias)
    b, _, hq, d = q[0].shape
    s_out = sum(t.shape[1] for t in q)
    return (q[0].new_empty((b, s_out, hq, d)), k[0].new_empty((b, s_out, k[0].shape[2], d)))


qk_norm_rope = define(
    "qk_norm_rope", "(Tensor[] q, Tensor[] k, Tensor[] q_weight, Tensor[] k_weight, Tensor[] cos, "
    "Tensor[] sin, float eps, str norm, str rope, Tensor[] q_bias, Tensor[] k_bias) -> "
    "(Tensor, Tensor)",
    _qk_norm_rope_reference, fake=_qk_norm_rope_fake, cuda=_qk_norm_rope_cuda)


@fp64_reference(torch.ops.kopt.qk_norm_rope.default)
def _qk_norm_rope64(q: list[torch.Tensor], k: list[torch.Tensor], q_weight: list[torch.Tensor],
                    k_weight: list[torch.Tensor], cos: list[torch.Tensor],
                    sin: list[torch.Tensor], eps: float, norm: str, rope: str,
                    q_bias: list[torch.Tensor] = (),  # type: ignore[assignment]
                    k_bias: list[torch.Tensor] = ()  # type: ignore[assignment]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    # With every operand in fp64 the reference's casts are no-ops: the exact math.
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, norm, rope, q_bias,
                                  k_bias)
