"""Attention with 8-bit tensor-core matmuls: ``kopt::attention_q8``.

For q [B, H, Sq, D], k, v [B, H, Skv, D] (bf16 or fp16), no mask, not causal:

    out = softmax(scale * q k^T) v

computed flash-attention style (one pass over the keys in blocks of ``BLOCK_N``, a running row
max and sum), with q k^T in INT8 and P v in BF16 (``pv="bf16"``) or e4m3 (``pv="fp8"``):

* **k smoothed**: the mean of k over the keys (per batch, head and channel) is subtracted
  first. Every score of a query row moves by the same ``q . mean``, which softmax cancels, and
  what is left is centred, so its per-key scale is not spent on a common offset (the
  SageAttention recipe; a DiT's keys share large per-channel offsets).
* **q and k per token in INT8**: ``x8 = round(x / s)``, ``s = max_d |x| / 127``. INT8 keeps a
  uniform step of ``max / 127`` where e4m3 keeps about 2^-4 of each value, and a score's error
  goes through exp (against fp64 on normal inputs, both with e4m3 P v: 3.7e-2, where e4m3
  q k^T per block gave 5.3e-2; RESULTS.md, 2026-12-06 and 2026-11-30). The
  INT8 products are exact in the int32 accumulator; the scores are ``(q8 k8^T) sq sk`` with the
  softmax scale and log2(e) folded into ``sq``. The int32 -> fp32 conversion is one integer add
  (the product sums stay below 2^22: 127^2 D for D <= 128, so ``bits(raw + 1.5 2^23)`` is the
  float ``1.5 2^23 + raw``) folded with ``sk`` into one multiply-add, not the conversion
  instruction, which runs at the exp's rate.
* **P v**: ``pv="bf16"`` as BF16 attention does (P rounded to BF16, v as it is).
  ``pv="fp8"``: P = 256 exp(..) in e4m3 (the 256 keeps e4m3's subnormal floor, 2^-9, below 2^-17
  of the row max; it cancels in the division by the row sum, summed from P before rounding),
  v in e4m3 per block of ``QB`` keys and per channel, stored transposed (e4m3 operands are read
  K-major); each block's product is added to the fp32 accumulator times its scales, so no sum
  runs across blocks in the FP8 MMA's narrower accumulator.

Numerics tier: bounded. The output's relative error (Frobenius) against fp64 attention on the
same inputs is within :data:`BOUND` per ``pv`` mode. The reference (CPU path, verification)
quantizes q, k (smoothed) and v exactly as the kernels do and computes the softmax in fp32
without rounding P (the kernel's one extra step besides its exp).

No pass uses this op: it is accurate enough (in W1 with FP8 Linears the output error moves by
under 0.2%) but slower than cuDNN's BF16 attention at the W1 and W2 shapes (0.67-0.82x its
throughput), where a rewrite would need 1.35x. Its two matmuls alone, without the softmax, take
0.91x cuDNN's whole attention's time: Triton's flash loop runs the softmax between them, where
cuDNN and FA3 overlap the two across warp groups (RESULTS.md, 2026-12-06, H100).
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
QB = 128  # keys per v scale (pv="fp8")
PV_MODES = ("bf16", "fp8")
# the largest measured error against fp64 (0.0271 / 0.0384: RESULTS.md, 2026-12-06, H100), x1.5
BOUND = {"bf16": 0.045, "fp8": 0.06}
_TINY = 1e-12
_LOG2E = 1.4426950408889634


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str) -> None:
    if pv not in PV_MODES:
        raise ValueError(f"kopt::attention_q8: unknown pv mode {pv!r}; valid: "
                         f"{', '.join(PV_MODES)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("kopt::attention_q8 takes [B, H, S, D] q, k and v; got dims "
                         f"{q.dim()}, {k.dim()}, {v.dim()}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"kopt::attention_q8 takes bf16 or fp16 q, k, v; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"kopt::attention_q8: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
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


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pv: str,
          bshd: bool) -> torch.Tensor:
    return _out(q, bshd)


# -- reference ---------------------------------------------------------------------------------
def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 as fp32 integers, scale [.., 1]): per-row INT8 with the kernels' rounding."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(_TINY) / 127.0
    return torch.floor(x * (1.0 / s) + 0.5).clamp(-127, 127), s


def _v_scales(v: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> the per-``QB``-keys, per-channel e4m3 scale broadcast to [B, H, S, D]."""
    s = v.shape[2]
    pad = (-s) % QB
    vp = torch.nn.functional.pad(v.float().abs(), (0, 0, 0, pad))
    amax = vp.unflatten(2, (-1, QB)).amax(dim=3, keepdim=True)
    scale = amax.clamp_min(_TINY) / E4M3_MAX
    return scale.expand(-1, -1, -1, QB, -1).flatten(2, 3)[:, :, :s]


def quantized_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (smoothed), v in fp32 as the kernel's tensor cores see them (dequantized)."""
    q8, sq = _int8_rows(q.float())
    kc = k.float() - k.float().mean(2, keepdim=True)
    k8, sk = _int8_rows(kc)
    if pv == "fp8":
        sv = _v_scales(v)
        v32 = (v.float() * (1.0 / sv)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * sv
    else:
        v32 = v.float()
    return q8 * sq, k8 * sk, v32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pv: str,
               bshd: bool) -> torch.Tensor:
    _check(q, k, v, pv)
    q32, k32, v32 = quantized_operands(q, k, v, pv)
    out = _out(q, bshd)
    out.copy_(torch.softmax((q32 @ k32.transpose(-1, -2)) * scale, dim=-1) @ v32)
    return out


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def _int8_rows_kernel(x_ptr, mean_ptr, x8_ptr, s_ptr, H, S, mult,
                      sxb, sxh, sxs, sxd, smb, smh, smd,
                      D: tl.constexpr, BLOCK: tl.constexpr, CENTER: tl.constexpr):
    """Program (j, b h): rows j BLOCK .. (j + 1) BLOCK of one head -> INT8 [B H, S, D] and the
    per-row scale times ``mult`` (fp32 [B H, S]); ``CENTER``: minus the head's channel mean."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_s = j * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    rows = offs_s < S
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + offs_s[:, None] * sxs
                + offs_d[None, :] * sxd, mask=rows[:, None], other=0.0).to(tl.float32)
    if CENTER:
        x = x - tl.load(mean_ptr + b * smb + h * smh + offs_d * smd)[None, :]
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    s = tl.math.div_rn(amax, tl.full([BLOCK], 127.0, tl.float32))
    r = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s)
    x8 = tl.minimum(tl.maximum(tl.floor(x * r[:, None] + 0.5), -127.0), 127.0)
    base = bh.to(tl.int64) * S
    tl.store(x8_ptr + (base + offs_s[:, None]) * D + offs_d[None, :], x8.to(tl.int8),
             mask=rows[:, None])
    tl.store(s_ptr + base + offs_s, s * mult, mask=rows)


@triton.jit
def _v_fp8_kernel(v_ptr, vt_ptr, vs_ptr, H, S, NB, svb, svh, svs, svd,
                  D: tl.constexpr, QB: tl.constexpr, NATIVE: tl.constexpr):
    """Program (j, b h): keys j QB .. (j + 1) QB of one head -> e4m3 transposed [B H, D, S] and
    one scale per channel ([B H, NB, D])."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_s = j * QB + tl.arange(0, QB)
    offs_d = tl.arange(0, D)
    mask = (offs_s < S)[:, None]
    v = tl.load(v_ptr + b.to(tl.int64) * svb + h * svh + offs_s[:, None] * svs
                + offs_d[None, :] * svd, mask=mask, other=0.0).to(tl.float32)
    vsc = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12),
                         tl.full([D], 448.0, tl.float32))
    v8 = to_e4m3(v * tl.math.div_rn(tl.full([D], 1.0, tl.float32), vsc)[None, :],
                 tl.float8e4nv, NATIVE)
    tl.store(vt_ptr + bh.to(tl.int64) * S * D + offs_d[None, :] * S + offs_s[:, None], v8,
             mask=mask)
    tl.store(vs_ptr + (bh * NB + j) * D + offs_d, vsc)


@triton.jit
def _attention_q8_kernel(q8_ptr, k8_ptr, v_ptr, sq_ptr, sk_ptr, vs_ptr, o_ptr,
                         H, SQ, SKV, NB, svb, svh, svs, svd, sob, soh, sos, sod,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         QB: tl.constexpr, PV_FP8: tl.constexpr, EVEN_N: tl.constexpr,
                         NATIVE: tl.constexpr):
    """Program (i, b h): query rows i BLOCK_M .. (i + 1) BLOCK_M of one head against all keys.
    The running max ``m`` is kept in units of ``t = raw sk`` (the row's ``sq`` > 0 scales a
    whole row, so its max is the max of ``t``). ``v_ptr``: v as given (``pv="bf16"``, strides
    ``sv*``) or e4m3 transposed [B H, D, SKV] (``pv="fp8"``). Not ``NATIVE`` (Triton's
    interpreter): the INT8 operands are multiplied as the fp32 integers they hold (exact) and
    exp is fp32."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_nb = tl.arange(0, BLOCK_N)
    rows = offs_m < SQ
    q = tl.load(q8_ptr + (bh.to(tl.int64) * SQ + offs_m[:, None]) * D + offs_d[None, :],
                mask=rows[:, None], other=0)
    sq = tl.load(sq_ptr + bh.to(tl.int64) * SQ + offs_m, mask=rows, other=1.0)
    if not NATIVE:
        q = q.to(tl.float32)
    k_base = k8_ptr + bh.to(tl.int64) * SKV * D
    sk_base = sk_ptr + bh.to(tl.int64) * SKV
    vt_base = v_ptr + bh.to(tl.int64) * SKV * D
    v_base = v_ptr + b.to(tl.int64) * svb + h * svh
    shift = 8.0 if PV_FP8 else 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, SKV, BLOCK_N):
        offs_n = start + offs_nb
        keys = offs_n < SKV
        k = tl.load(k_base + offs_n[:, None] * D + offs_d[None, :], mask=keys[:, None], other=0)
        sk = tl.load(sk_base + offs_n, mask=keys, other=0.0)
        if NATIVE:
            raw = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            t = (raw + 0x4B400000).to(tl.float32, bitcast=True) * sk[None, :] \
                - (sk * 12582912.0)[None, :]
        else:
            t = tl.dot(q, tl.trans(k.to(tl.float32))) * sk[None, :]
        if not EVEN_N:
            t = tl.where(keys[None, :], t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, axis=1))
        alpha = tl.math.exp2((m_i - m_new) * sq)
        p = tl.math.exp2(t * sq[:, None] - (m_new * sq - shift)[:, None])
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
        if PV_FP8:
            v = tl.load(vt_base + offs_d[None, :] * SKV + offs_n[:, None], mask=keys[:, None],
                        other=0.0)
            vs = tl.load(vs_ptr + (bh * NB + start // QB) * D + offs_d)
            if NATIVE:
                pv = tl.dot(p.to(tl.float8e4nv), v)
            else:
                pv = tl.dot(to_e4m3(p, tl.float8e4nv, NATIVE).to(tl.float32), v.to(tl.float32))
            acc = acc * alpha[:, None] + pv * vs[None, :]
        else:
            v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :] * svd,
                        mask=keys[:, None], other=0.0)
            acc = acc * alpha[:, None]
            if NATIVE:
                acc = tl.dot(p.to(v.dtype), v, acc)
            else:
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sos
             + offs_d[None, :] * sod, out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages)
Config = tuple[int, int, int, int]


def _config(pv: str) -> Config:
    """The best of 8 tile configs at the W1 and W2 shapes (``benchmarks/kernels_attention.py
    --sweep``; RESULTS.md, 2026-12-06, H100): within 1% of the best at both for ``bf16``."""
    return (64, 128, 4, 3) if pv == "fp8" else (128, 128, 8, 3)


def quantize_qk(q: torch.Tensor, k: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q8, k8, sq, sk)``: q and k (smoothed) in INT8 [B H, S, D], their per-token scales
    [B H, S] (fp32; ``sq`` times ``scale log2(e)``)."""
    b, h, sq_len, d = q.shape
    skv = k.shape[2]
    dev = q.device
    mean = k.mean(2, dtype=torch.float32)  # [B, H, D]
    q8 = torch.empty(b * h, sq_len, d, dtype=torch.int8, device=dev)
    k8 = torch.empty(b * h, skv, d, dtype=torch.int8, device=dev)
    sq = torch.empty(b * h, sq_len, dtype=torch.float32, device=dev)
    sk = torch.empty(b * h, skv, dtype=torch.float32, device=dev)
    block = 64
    with on_device(q):
        launch(_int8_rows_kernel, (triton.cdiv(sq_len, block), b * h), q, mean, q8, sq, h,
               sq_len, scale * _LOG2E, *q.stride(), *mean.stride(), D=d, BLOCK=block,
               CENTER=False, num_warps=4)
        launch(_int8_rows_kernel, (triton.cdiv(skv, block), b * h), k, mean, k8, sk, h,
               skv, 1.0, *k.stride(), *mean.stride(), D=d, BLOCK=block, CENTER=True,
               num_warps=4)
    return q8, k8, sq, sk


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vt, vs)``: v in e4m3 transposed [B H, D, S] and its scales [B H, ceil(S / QB), D]."""
    b, h, skv, d = v.shape
    nb = triton.cdiv(skv, QB)
    vt = torch.empty(b * h, d, skv, dtype=E4M3, device=v.device)
    vs = torch.empty(b * h, nb, d, dtype=torch.float32, device=v.device)
    with on_device(v):
        launch(_v_fp8_kernel, (nb, b * h), v, vt, vs, h, skv, nb, *v.stride(), D=d, QB=QB,
               NATIVE=native(_v_fp8_kernel, v), num_warps=4)
    return vt, vs


def attention_q8_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        pv: str, bshd: bool, config: Config | None = None) -> torch.Tensor:
    """The Triton implementation (CUDA, or any device under ``TRITON_INTERPRET=1``)."""
    _check(q, k, v, pv)
    why = supported(q, k, v)
    if why is not None:
        raise ValueError(f"kopt::attention_q8: {why}")
    b, h, sq_len, d = q.shape
    skv = k.shape[2]
    block_m, block_n, warps, stages = config or _config(pv)
    if pv == "fp8" and QB % block_n:
        raise ValueError(f"BLOCK_N {block_n} must divide the v scale block {QB}")
    q8, k8, sq, sk = quantize_qk(q, k, scale)
    if pv == "fp8":
        vop, vs = quantize_v(v)
        vstrides = (0, 0, 0, 0)
    else:
        vop, vs = v, sk  # vs unused
        vstrides = v.stride()
    out = _out(q, bshd)
    with on_device(q):
        launch(_attention_q8_kernel, (triton.cdiv(sq_len, block_m), b * h),
               q8, k8, vop, sq, sk, vs, out, h, sq_len, skv, triton.cdiv(skv, QB),
               *vstrides, *out.stride(), D=d, BLOCK_M=block_m, BLOCK_N=block_n, QB=QB,
               PV_FP8=pv == "fp8", EVEN_N=skv % block_n == 0,
               NATIVE=native(_attention_q8_kernel, q), num_warps=warps, num_stages=stages)
    return out


attention_q8 = define(
    "attention_q8", "(Tensor q, Tensor k, Tensor v, float scale, str pv, bool bshd) -> Tensor",
    _reference, fake=_fake, cuda=attention_q8_triton)
