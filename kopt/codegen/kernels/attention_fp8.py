"""Attention with FP8 (e4m3) tensor-core matmuls: ``kopt::attention_fp8``.

For q [B, H, Sq, D], k, v [B, H, Skv, D] (bf16 or fp16), no mask, not causal:

    out = softmax(scale * q k^T) v

computed flash-attention style (one pass over the keys in blocks of ``BLOCK_N``, a running row
max and sum), with these operands in e4m3:

* ``qk="fp8"``: q per token (``sq[b, h, s] = max_d |q| / 448``, in the kernel), k per block of
  ``QB`` = 128 keys (``sk[b, h, j] = max |k[.., j QB : (j + 1) QB, :]| / 448``); the scores are
  ``(q8 k8^T) sq sk``, so both scales fold into the one multiply by ``scale``.
  ``qk="bf16"``: q and k stay as they are (the scores as in a BF16 kernel).
* v always: per block of ``QB`` keys (``sv``), stored transposed ([B, H, D, Skv]: the tensor
  cores read an e4m3 operand K-major, and the keys are the reduction dim of ``P v``).
* P = exp2(s - m + 8) = 256 exp(..) in [0, 256] (the 256 keeps e4m3's subnormal floor, 2^-9,
  below 2^-17 of the row max; it cancels in the division by the row sum, which is summed from
  P before its rounding); ``P v8`` is accumulated by the tensor cores per key block only and
  added to the fp32 accumulator times ``sv`` (Hopper's FP8 MMA keeps fewer accumulator bits
  than fp32, so no sum runs there across blocks).

Numerics tier: bounded. Each e4m3 value is within 2^-4 of its value relative, above the
subnormal floor (2^-9 of the block's scale unit); the errors of P and v are averaged by the
weighted sum, those of q and k move the scores (and through exp the weights) by about
2^-4 |q| |k| / sqrt(D) at most. The bound the rewrite declares and the tests check is
:data:`BOUND`: the output's relative error (Frobenius) against fp64 attention on the same
inputs. The reference (CPU path, verification) quantizes q, k and v exactly as the kernel does
and computes the softmax in fp32 without rounding P (the kernel's one extra step).

No pass uses this op. Measured on the H200 (benchmarks/kernels_attention.py; RESULTS.md,
2026-11-30) it never beat cuDNN's BF16 attention (1.11x its time at the W1 shape, 1.02x at W2,
with the best of 12 tile configs) and its error was 16-58x BF16 attention's. It stays as the
measured starting point for an FP8 attention that would have to overlap its softmax with the
MMAs (FA3's warp specialization) to win.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kopt.codegen.kernels.act_quant import to_e4m3
from kopt.codegen.kernels.qk_norm_rope import native, on_device
from kopt.codegen.launch import launch
from kopt.codegen.ops import define

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
QB = 128  # keys per k/v scale
MODES = ("fp8", "bf16")  # how q k^T is computed; P v is always e4m3
# measured max 0.103 / 0.037 (RESULTS.md, 2026-11-30, H200), x1.5
BOUND = {"fp8": 0.15, "bf16": 0.06}
_TINY = 1e-12
_LOG2E = 1.4426950408889634


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str) -> None:
    if qk not in MODES:
        raise ValueError(f"kopt::attention_fp8: unknown qk mode {qk!r}; valid: {', '.join(MODES)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("kopt::attention_fp8 takes [B, H, S, D] q, k and v; got dims "
                         f"{q.dim()}, {k.dim()}, {v.dim()}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"kopt::attention_fp8 takes bf16 or fp16 q, k, v; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"kopt::attention_fp8: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not match (no GQA, same head dim)")


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    d = q.shape[-1]
    if d not in (64, 128):
        return f"head dim {d} (the kernel takes 64 or 128)"
    if k.shape[2] < 16 or q.shape[2] < 1:
        return f"{k.shape[2]} keys (the kernel needs at least 16)"
    return None


def _out(q: torch.Tensor, bshd: bool) -> torch.Tensor:
    b, h, s, d = q.shape
    if bshd:
        return torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty(b, h, s, d, dtype=q.dtype, device=q.device)


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qk: str,
          bshd: bool) -> torch.Tensor:
    return _out(q, bshd)


# -- reference ---------------------------------------------------------------------------------
def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (as the kernels compute it: times the reciprocal) rounded to e4m3 (nearest
    even), back in fp32 times the scale."""
    return (x * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> the per-``QB``-keys scale broadcast to [B, H, S, 1]."""
    s = x.shape[2]
    pad = (-s) % QB
    xp = torch.nn.functional.pad(x.float().abs(), (0, 0, 0, pad))
    amax = xp.unflatten(2, (-1, QB)).amax(dim=(3, 4), keepdim=True)
    scale = amax.clamp_min(_TINY) / E4M3_MAX
    return scale.expand(-1, -1, -1, QB, 1).flatten(2, 3)[:, :, :s]


def quantized_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in fp32 as the kernel's tensor cores see them (dequantized)."""
    if qk == "fp8":
        qf = q.float()
        sq = qf.abs().amax(-1, keepdim=True).clamp_min(_TINY) / E4M3_MAX
        q32, k32 = _e4m3(qf, sq), _e4m3(k.float(), _block_scales(k))
    else:
        q32, k32 = q.float(), k.float()
    return q32, k32, _e4m3(v.float(), _block_scales(v))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qk: str,
               bshd: bool) -> torch.Tensor:
    _check(q, k, v, qk)
    q32, k32, v32 = quantized_operands(q, k, v, qk)
    out = _out(q, bshd)
    out.copy_(torch.softmax((q32 @ k32.transpose(-1, -2)) * scale, dim=-1) @ v32)
    return out


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def _quant_kv_kernel(k_ptr, v_ptr, k8_ptr, vt_ptr, ks_ptr, vs_ptr, H, S, nblocks,
                     skb, skh, sks, skd, svb, svh, svs, svd,
                     D: tl.constexpr, QB: tl.constexpr, QUANT_K: tl.constexpr,
                     NATIVE: tl.constexpr):
    """Program (j, b h): keys j QB .. (j + 1) QB of one head. k -> e4m3 [B, H, S, D] and one
    scale; v -> e4m3 transposed [B, H, D, S] and one scale."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_s = j * QB + tl.arange(0, QB)
    offs_d = tl.arange(0, D)
    mask = (offs_s < S)[:, None]
    out_base = bh.to(tl.int64) * S * D
    if QUANT_K:
        k = tl.load(k_ptr + b.to(tl.int64) * skb + h * skh + offs_s[:, None] * sks
                    + offs_d[None, :] * skd, mask=mask, other=0.0).to(tl.float32)
        ksc = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), 1e-12), 448.0)
        k8 = to_e4m3(k * tl.math.div_rn(1.0, ksc), tl.float8e4nv, NATIVE)
        tl.store(k8_ptr + out_base + offs_s[:, None] * D + offs_d[None, :], k8, mask=mask)
        tl.store(ks_ptr + bh * nblocks + j, ksc)
    v = tl.load(v_ptr + b.to(tl.int64) * svb + h * svh + offs_s[:, None] * svs
                + offs_d[None, :] * svd, mask=mask, other=0.0).to(tl.float32)
    vsc = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), 1e-12), 448.0)
    v8 = to_e4m3(v * tl.math.div_rn(1.0, vsc), tl.float8e4nv, NATIVE)
    tl.store(vt_ptr + out_base + offs_d[None, :] * S + offs_s[:, None], v8, mask=mask)
    tl.store(vs_ptr + bh * nblocks + j, vsc)


@triton.jit
def _attention_fp8_kernel(q_ptr, k_ptr, vt_ptr, ks_ptr, vs_ptr, o_ptr, H, SQ, SKV, nblocks,
                          qk_scale, sqb, sqh, sqs, sqd, skb, skh, sks, skd,
                          sob, soh, sos, sod,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          QB: tl.constexpr, QK_FP8: tl.constexpr, EVEN_N: tl.constexpr,
                          NATIVE: tl.constexpr):
    """Program (i, b h): query rows i BLOCK_M .. (i + 1) BLOCK_M of one head against all keys.
    ``qk_scale`` is the softmax scale times log2(e) (the kernel works in exp2).
    Not ``NATIVE`` (Triton's interpreter): it multiplies bf16 tiles as integers and its e4m3
    cast does not round, so there the values are rounded onto the e4m3 grid first
    (:func:`~kopt.codegen.kernels.act_quant.to_e4m3`) and multiplied as the fp32 values they
    hold."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < SQ
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqs
                + offs_d[None, :] * sqd, mask=rows[:, None], other=0.0)
    if QK_FP8:
        qf = q.to(tl.float32)
        qsc = tl.math.div_rn(tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-12),
                             tl.full([BLOCK_M], 448.0, tl.float32))
        r_qsc = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), qsc)
        q = to_e4m3(qf * r_qsc[:, None], tl.float8e4nv, NATIVE)
        row_scale = qsc * qk_scale
        k_base = k_ptr + bh.to(tl.int64) * SKV * D
    else:
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
        k_base = k_ptr + b.to(tl.int64) * skb + h * skh
    if not NATIVE:
        q = q.to(tl.float32)
    vt_base = vt_ptr + bh.to(tl.int64) * SKV * D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, SKV, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        keys = offs_n < SKV
        if QK_FP8:
            kt = tl.load(k_base + offs_n[None, :] * D + offs_d[:, None], mask=keys[None, :],
                         other=0.0)
            if not NATIVE:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt) * (row_scale * tl.load(ks_ptr + bh * nblocks + start // QB))[:, None]
        else:
            kt = tl.load(k_base + offs_n[None, :] * sks + offs_d[:, None] * skd,
                         mask=keys[None, :], other=0.0)
            if not NATIVE:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt) * row_scale[:, None]
        if not EVEN_N:
            s = tl.where(keys[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # 256 exp(.): e4m3's subnormal floor stays far below the row max (see the docstring).
        p = tl.math.exp2(s - (m_new - 8.0)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vt_base + offs_d[None, :] * SKV + offs_n[:, None], mask=keys[:, None],
                    other=0.0)
        p8 = to_e4m3(p, tl.float8e4nv, NATIVE)
        if not NATIVE:
            p8 = p8.to(tl.float32)
            v = v.to(tl.float32)
        pv = tl.dot(p8, v)
        acc = acc * alpha[:, None] + pv * tl.load(vs_ptr + bh * nblocks + start // QB)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sos
             + offs_d[None, :] * sod, out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


def _config(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the best of 12 configs at the W1 and W2
    shapes on the H200 (``benchmarks/kernels_attention.py --sweep``; RESULTS.md, 2026-11-30)."""
    return (64, 128, 4, 3) if d <= 128 else (64, 64, 4, 2)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, quant_k: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k8, vt, ks, vs)``: k in e4m3 [B, H, S, D] (k itself when not ``quant_k``), v in e4m3
    transposed [B, H, D, S], and their scales [B H, ceil(S / QB)] (fp32)."""
    b, h, skv, d = k.shape
    nblocks = triton.cdiv(skv, QB)
    dev = k.device
    k8 = torch.empty(b, h, skv, d, dtype=E4M3, device=dev) if quant_k else k
    vt = torch.empty(b, h, d, skv, dtype=E4M3, device=dev)
    ks = torch.empty(b * h, nblocks, dtype=torch.float32, device=dev)
    vs = torch.empty(b * h, nblocks, dtype=torch.float32, device=dev)
    with on_device(k):
        launch(_quant_kv_kernel, (nblocks, b * h),
            k, v, k8, vt, ks, vs, h, skv, nblocks, *k.stride(), *v.stride(), D=d, QB=QB,
            QUANT_K=quant_k, NATIVE=native(_quant_kv_kernel, k), num_warps=4)
    return k8, vt, ks, vs


def attention_fp8_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         qk: str, bshd: bool, config: tuple[int, int, int, int] | None = None
                         ) -> torch.Tensor:
    """The Triton implementation (CUDA, or any device under ``TRITON_INTERPRET=1``)."""
    _check(q, k, v, qk)
    why = supported(q, k, v)
    if why is not None:
        raise ValueError(f"kopt::attention_fp8: {why}")
    b, h, sq, d = q.shape
    block_m, block_n, warps, stages = config or _config(d)
    if QB % block_n:
        raise ValueError(f"BLOCK_N {block_n} must divide the scale block {QB}")
    k8, vt, ks, vs = quantize_kv(k, v, qk == "fp8")
    skv = k.shape[2]
    out = _out(q, bshd)
    with on_device(q):
        launch(_attention_fp8_kernel, (triton.cdiv(sq, block_m), b * h),
            q, k8, vt, ks, vs, out, h, sq, skv, ks.shape[1], scale * _LOG2E, *q.stride(),
            *k8.stride(), *out.stride(), D=d, BLOCK_M=block_m, BLOCK_N=block_n, QB=QB,
            QK_FP8=qk == "fp8", EVEN_N=skv % block_n == 0,
            NATIVE=native(_attention_fp8_kernel, q), num_warps=warps, num_stages=stages)
    return out


attention_fp8 = define(
    "attention_fp8", "(Tensor q, Tensor k, Tensor v, float scale, str qk, bool bshd) -> Tensor",
    _reference, fake=_fake, cuda=attention_fp8_triton)
