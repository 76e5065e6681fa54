"""Specialised fused kernels at the W1/W2 (and W3) shapes: QK RMSNorm + RoPE, activation + FP8
quantization (per token, and the blockwise recipe's bias + activation + 1x128 groups).

    python benchmarks/kernels_specialised.py --out kernels_specialised.json  # on the GPU

Each case times three implementations of the same subgraph on random non-zero bf16 data with
``triton.testing.do_bench`` medians:

* ``fused``    -- kopt's Triton kernel (the launcher the custom op calls on CUDA);
* ``eager``    -- the unfused ops, run eagerly (the kernel module's PyTorch reference, which is the
  models' own op sequence);
* ``inductor`` -- ``torch.compile`` of that reference (Inductor's own fusion of the subgraph).

Bandwidth: GB/s on the bytes the kernel must move (inputs read once, outputs written once), next
to the copy bandwidth measured in the same run (``dst.copy_(src)`` of the same number of bytes).
The case definitions and input builders are shared with tests/gpu/test_kernels_specialised_gpu.py.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import triton
from triton.testing import do_bench

from kopt.codegen.kernels.act_quant import FAST, act_quant_reference, act_quant_triton
from kopt.codegen.kernels.act_quant_group import (
    act_quant_group_reference,
    act_quant_group_triton,
)
from kopt.codegen.kernels.qk_norm_rope import qk_norm_rope_reference, qk_norm_rope_triton
from kopt.codegen.kernels.quant_fp8 import row_split


@dataclass(frozen=True)
class QKCase:
    name: str
    segments: tuple[int, ...]  # tokens per segment: text, image
    q_heads: int
    k_heads: int
    head_dim: int
    rope: str
    norm: str
    table_dtype: torch.dtype = torch.float32
    extra_width: int = 0  # columns of the merged projection after q, k, v (FLUX.2's MLP input)


@dataclass(frozen=True)
class ActCase:
    name: str
    rows: int
    features: int
    activation: str
    merged: bool = True  # SwiGLU's gate and up: halves of one GEMM output


QK_CASES = (
    QKCase("W1 Qwen-Image block", (128, 4096), 24, 24, 128, "complex", "cast"),
    QKCase("W2 FLUX.2 double block", (512, 4096), 48, 48, 128, "pairs", "rms_norm"),
    QKCase("W2 FLUX.2 single block", (4608,), 48, 48, 128, "pairs", "rms_norm",
           extra_width=2 * 18432),
    QKCase("W3 Qwen3-8B prefill", (2048,), 32, 8, 128, "half", "cast", torch.bfloat16),
)

ACT_CASES = (
    ActCase("W1 Qwen-Image image MLP, GELU(tanh)", 4096, 12288, "gelu_tanh"),
    ActCase("W1 Qwen-Image text MLP, GELU(tanh)", 128, 12288, "gelu_tanh"),
    ActCase("W2 FLUX.2 image FF, SwiGLU", 4096, 18432, "silu_mul"),
    ActCase("W2 FLUX.2 text FF, SwiGLU", 512, 18432, "silu_mul"),
    ActCase("W3 Qwen3-8B prefill MLP, SwiGLU", 2048, 12288, "silu_mul"),
    ActCase("GELU(erf) at the W1 image shape", 4096, 12288, "gelu_erf"),
    # FP8Config(activation_math="fast"): approximate exp and division
    ActCase("W1 image MLP, GELU(tanh) fast", 4096, 12288, "gelu_tanh:fast"),
    ActCase("W1 text MLP, GELU(tanh) fast", 128, 12288, "gelu_tanh:fast"),
    ActCase("W2 image FF, SwiGLU fast", 4096, 18432, "silu_mul:fast"),
    ActCase("W2 text FF, SwiGLU fast", 512, 18432, "silu_mul:fast"),
    ActCase("W3 Qwen3-8B prefill, SwiGLU fast", 2048, 12288, "silu_mul:fast"),
)


# the blockwise recipe's act + quant (kopt::act_quant_fp8_group): W1's GELU takes its bias
GROUP_CASES = (
    ActCase("W1 image MLP, bias + GELU(tanh) fast, 1x128", 4096, 12288, "gelu_tanh:fast"),
    ActCase("W1 image MLP, bias + GELU(tanh), 1x128", 4096, 12288, "gelu_tanh"),
    ActCase("W2 image FF, SwiGLU fast, 1x128", 4096, 18432, "silu_mul:fast"),
)
GROUP_CONFIGS = [(b, r, w) for b, r in ((128, 16), (256, 8), (256, 16), (512, 4), (512, 8),
                                         (1024, 2), (1024, 4), (2048, 1), (2048, 2))
                 for w in (4, 8)]


def qk_inputs(case: QKCase, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
              seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """q/k as the models hand them over: per segment, views of one merged QKV(+MLP) GEMM output;
    rotary tables laid out as the graphs have them (FLUX.2: one fp32 table over the joint
    sequence, sliced; Qwen-Image: real and imaginary parts of complex frequencies, stride 2;
    Qwen3: a bf16 [1, 1, S, D] table seen as [1, S, 1, D])."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq, hk, d = case.q_heads, case.k_heads, case.head_dim
    width = (hq + 2 * hk) * d + case.extra_width
    q, k, cos, sin = [], [], [], []
    total = sum(case.segments)
    half = d // 2
    freqs = 1.0 / 10000 ** (torch.arange(half, device=device, dtype=torch.float64) / half)
    angle = torch.arange(total, device=device, dtype=torch.float64)[:, None] * freqs[None]
    offset = 0
    for s in case.segments:
        merged = torch.randn(1, s, width, generator=g, device=device, dtype=torch.float32)
        merged = merged.to(dtype)
        q.append(merged[..., : hq * d].view(1, s, hq, d))
        k.append(merged[..., hq * d: (hq + hk) * d].view(1, s, hk, d))
        a = angle[offset: offset + s]
        if case.rope == "complex":
            parts = torch.view_as_real(torch.polar(torch.ones_like(a), a).to(torch.complex64))
            cos.append(parts[None, :, None, :, 0])
            sin.append(parts[None, :, None, :, 1])
        elif case.rope == "pairs":
            full = a.repeat_interleave(2, -1).float()
            cos.append(full.cos()[None, :, None])
            sin.append(full.sin()[None, :, None])
        else:
            full = torch.cat([a, a], -1).float()  # cos/sin in fp32, then the model's dtype
            cos.append(full.cos().to(case.table_dtype)[None, None].transpose(1, 2))
            sin.append(full.sin().to(case.table_dtype)[None, None].transpose(1, 2))
        offset += s
    n = len(case.segments)
    w = [(1 + 0.1 * torch.randn(d, generator=g, device=device)).to(dtype) for _ in range(2 * n)]
    return dict(q=q, k=k, q_weight=w[:n], k_weight=w[n:], cos=cos, sin=sin)


def act_inputs(case: ActCase, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activation's input as a GEMM leaves it, [1, rows, features] (SwiGLU: the two halves of
    [1, rows, 2 * features]); values over several orders of magnitude across rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    swiglu = case.activation.startswith("silu_mul")
    width = 2 * case.features if swiglu else case.features
    scale = torch.logspace(-1, 1, case.rows, device=device)[None, :, None]
    x = (torch.randn(1, case.rows, width, generator=g, device=device) * 2 * scale).to(dtype)
    if not swiglu:
        return x, None
    return x[..., : case.features], x[..., case.features:]


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def qk_bytes(inputs: dict[str, list[torch.Tensor]]) -> int:
    """q and k read once and written once, the weights and each table's distinct values read."""
    qk = _nbytes(inputs["q"] + inputs["k"])
    tables = sum(t.shape[1] * t.shape[3] * t.element_size() for t in inputs["cos"] + inputs["sin"])
    return 2 * qk + tables + _nbytes(inputs["q_weight"] + inputs["k_weight"])


def act_bytes(x: torch.Tensor, up: torch.Tensor | None) -> int:
    rows = x.numel() // x.shape[-1]
    return _nbytes([x] + ([up] if up is not None else [])) + x.numel() + 4 * rows


@dataclass
class Row:
    kernel: str
    case: str
    bytes_moved: int
    fused_us: float
    eager_us: float
    inductor_us: float | None
    copy_us: float
    inductor_note: str = ""
    configs_us: dict[str, float] = field(default_factory=dict)  # config sweep (--sweep)

    @property
    def fused_gbps(self) -> float:
        return self.bytes_moved / self.fused_us / 1e3

    @property
    def copy_gbps(self) -> float:
        return self.bytes_moved / self.copy_us / 1e3


def _us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _copy_us(nbytes: int) -> float:
    """A device copy moving ``nbytes`` in all (half read, half written)."""
    src = torch.randn(max(1, nbytes // 4), device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    return _us(lambda: dst.copy_(src))


def _inductor_us(fn: Callable, *args: object, **kwargs: object) -> tuple[float | None, str]:
    try:
        compiled = torch.compile(fn, dynamic=False)
        compiled(*args, **kwargs)
        return _us(lambda: compiled(*args, **kwargs)), ""
    except Exception as exc:  # noqa: BLE001 -- a baseline that does not compile is reported
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def bench_qk(case: QKCase) -> Row:
    inputs = qk_inputs(case)
    kw = dict(eps=1e-6, norm=case.norm, rope=case.rope)
    nbytes = qk_bytes(inputs)
    inductor, note = _inductor_us(qk_norm_rope_reference, **inputs, **kw)
    return Row("qk_norm_rope", case.name, nbytes,
               fused_us=_us(lambda: qk_norm_rope_triton(**inputs, **kw)),
               eager_us=_us(lambda: qk_norm_rope_reference(**inputs, **kw)),
               inductor_us=inductor, copy_us=_copy_us(nbytes), inductor_note=note)


def act_configs(n: int) -> list[dict[str, int]]:
    """The act+quant kernel's candidate configs for rows of ``n``: one pass over a whole-row
    block, or two passes over chunks (the activation computed twice, or stashed in the first
    pass on a persistent grid of 2, 4 or 8 programs per SM), at several warp counts."""
    whole = triton.next_power_of_2(n)
    out = [{"BLOCK": whole, "ONE_PASS": True, "num_warps": w} for w in (4, 8, 16, 32)
           if whole // (32 * w) <= 64]
    block, block2 = row_split(n)  # the whole row in two tiles: no masked lanes
    if block2:
        out += [{"BLOCK": block, "BLOCK2": block2, "ONE_PASS": True, "num_warps": w}
                for w in (4, 8, 16, 32) if block // (32 * w) <= 64]
    out += [{"BLOCK": c, "ONE_PASS": False, "STASH": False, "num_warps": w}
            for c in (2048, 4096, 8192) for w in (4, 8, 16) if c < whole]
    out += [{"BLOCK": c, "ONE_PASS": False, "STASH": True, "CTAS_PER_SM": k, "num_warps": w}
            for c in (1024, 2048, 4096) for w in (4, 8) for k in (2, 4, 8) if c < whole]
    return out


def bench_act_group(case: ActCase, sweep: bool = False) -> Row:
    """kopt::act_quant_fp8_group (with a bias before a GELU, as on W1) against the unfused ops
    and Inductor's fusion of them; bytes: x (and up) and the bias read, e4m3 values and the
    1x128 scales written."""
    x, up = act_inputs(case)
    bias = None if up is not None else torch.randn(x.shape[-1], device="cuda").to(x.dtype)
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    nbytes = act_bytes(x, up) - 4 * rows + 4 * rows * -(-n // 128) + (
        bias.numel() * bias.element_size() if bias is not None else 0)
    exact = case.activation.removesuffix(FAST)
    inductor, note = _inductor_us(act_quant_group_reference, x, up, exact, bias)
    row = Row("act_quant_group", case.name, nbytes,
              fused_us=_us(lambda: act_quant_group_triton(x, up, case.activation, bias)),
              eager_us=_us(lambda: act_quant_group_reference(x, up, exact, bias)),
              inductor_us=inductor, copy_us=_copy_us(nbytes), inductor_note=note)
    if sweep:
        for b, r, w in GROUP_CONFIGS:
            try:
                row.configs_us[f"{b} x {r} rows, {w}w"] = _us(
                    lambda c=(b, r, w): act_quant_group_triton(x, up, case.activation, bias,
                                                               config=c))
            except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result
                row.configs_us[f"{b} x {r} rows, {w}w"] = float("nan")
                print(f"{case.name} {(b, r, w)}: {type(exc).__name__}")
    return row


def bench_act(case: ActCase, sweep: bool = False) -> Row:
    x, up = act_inputs(case)
    nbytes = act_bytes(x, up)
    exact = case.activation.removesuffix(FAST)  # the unfused ops of a fast case: the exact ones
    inductor, note = _inductor_us(act_quant_reference, x, up, exact)
    row = Row("act_quant_fp8", case.name, nbytes,
              fused_us=_us(lambda: act_quant_triton(x, up, case.activation)),
              eager_us=_us(lambda: act_quant_reference(x, up, exact)),
              inductor_us=inductor, copy_us=_copy_us(nbytes), inductor_note=note)
    if sweep:
        row.configs_us = {
            f"{'one' if c['ONE_PASS'] else 'two'}-pass {c['BLOCK']}"
            + (f"+{c['BLOCK2']}" if c.get("BLOCK2") else "") + f" x {c['num_warps']}w"
            + (f" stash {c['CTAS_PER_SM']}/SM" if c.get("STASH") else ""):
            _us(lambda c=c: act_quant_triton(x, up, case.activation, config=c))
            for c in act_configs(x.shape[-1])}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--only", choices=["qk", "act", "act_group"], help="one kernel family")
    p.add_argument("--sweep", action="store_true", help="also time every act+quant config")
    p.add_argument("--cases", default="", help="substring filter on case names")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows: list[Row] = []
    if args.only in (None, "qk"):
        rows += [bench_qk(c) for c in QK_CASES if args.cases in c.name]
    if args.only in (None, "act"):
        rows += [bench_act(c, args.sweep) for c in ACT_CASES if args.cases in c.name]
    if args.only in (None, "act_group"):
        rows += [bench_act_group(c, args.sweep) for c in GROUP_CASES if args.cases in c.name]
    print(f"{'kernel':<14} {'case':<38} {'MB':>7} {'fused us':>9} {'eager us':>9} "
          f"{'inductor':>9} {'GB/s':>6} {'copy GB/s':>9} {'% copy':>6} {'x eager':>7} "
          f"{'x ind.':>6}")
    for r in rows:
        ind = f"{r.inductor_us:9.1f}" if r.inductor_us is not None else f"{'n/a':>9}"
        vs_ind = f"{r.inductor_us / r.fused_us:6.2f}" if r.inductor_us is not None else "   n/a"
        print(f"{r.kernel:<14} {r.case:<38} {r.bytes_moved / 1e6:7.1f} {r.fused_us:9.1f} "
              f"{r.eager_us:9.1f} {ind} {r.fused_gbps:6.0f} {r.copy_gbps:9.0f} "
              f"{100 * r.fused_gbps / r.copy_gbps:6.1f} {r.eager_us / r.fused_us:7.2f} {vs_ind}")
        if r.inductor_note:
            print(f"{'':<14} inductor failed: {r.inductor_note}")
        if r.configs_us:
            best = min(r.configs_us, key=r.configs_us.get)
            print(f"{'':<14} configs: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                   r.configs_us.items()) + f"; best {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__,
                       "rows": [dict(asdict(r), fused_GBps=r.fused_gbps, copy_GBps=r.copy_gbps)
                                for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
