"""Attention at the W1/W2 shapes: cuDNN / flash BF16 SDPA against kopt's FP8 attention.

    python benchmarks/kernels_attention.py --out attention.json [--sweep]   # on the GPU

Per case (B, H, S, D; no mask, not causal; q, k, v as the models hold them, [B, S, H, D] memory
viewed as [B, H, S, D]), ``triton.testing.do_bench`` medians on random non-zero data:

* ``sdpa-cudnn`` / ``sdpa-flash``: ``F.scaled_dot_product_attention`` in BF16 on that backend;
* ``fp8`` / ``fp8-qk-bf16``: ``kopt::attention_fp8`` with q k^T in e4m3 or in BF16 (P v in e4m3
  both), its K/V quantizer included; ``--sweep`` times every tile config of the list below.

TFLOP/s on 4 B H S^2 D. Error: the output's relative error (Frobenius) against fp64 attention on
the same bf16 inputs, for two input kinds: ``randn`` (q, k, v standard normal) and ``normed``
(q and k RMS-normalized per head with a random per-channel weight, as after a QK norm, times 2,
which makes the softmax peakier, and v with a few large channels).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kopt.codegen.kernels.attention_fp8 import attention_fp8_triton, quantize_kv


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    tokens: int
    head_dim: int = 128
    batch: int = 1


CASES = (
    Case("W1 Qwen-Image 1024x1024 (4096 + 128 tokens)", 24, 4224),
    Case("W2 FLUX.2 1024x1024 (4096 + 512 tokens)", 48, 4608),
    Case("W1 Qwen-Image 512x512 (1024 + 128 tokens)", 24, 1152),
    Case("W1 Qwen-Image 2048x2048 (16384 + 128 tokens)", 24, 16512),
)
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
CONFIGS = [(128, 128, 8, s) for s in (2, 3, 4)] + [(128, 64, 8, s) for s in (2, 3, 4)] + \
          [(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (256, 64, 8, 3),
           (256, 128, 8, 2)]


@dataclass
class Row:
    case: str
    shape: tuple[int, int, int, int]
    gflop: float
    us: dict[str, float] = field(default_factory=dict)
    error: dict[str, dict[str, float]] = field(default_factory=dict)
    configs_us: dict[str, dict[str, float]] = field(default_factory=dict)
    quant_us: float | None = None


def inputs(case: Case, kind: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, s, d = case.batch, case.heads, case.tokens, case.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g)

    q, k, v = rnd(b, s, h, d), rnd(b, s, h, d), rnd(b, s, h, d)
    if kind == "normed":
        def norm(x: torch.Tensor) -> torch.Tensor:
            w = 1 + 0.3 * rnd(d)
            return 2 * w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k = norm(q), norm(k)
        v = v * (1 + 8 * (rnd(d) > 2.0))  # a few channels ~9x larger
    return tuple(t.bfloat16().transpose(1, 2) for t in (q, k, v))


def reference64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for h in range(q.shape[1]):  # one head at a time: S^2 fp64 scores per head
        s = (q[:, h].double() @ k[:, h].double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        out[:, h] = torch.softmax(s, -1) @ v[:, h].double()
    return out


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def sdpa(backend: SDPBackend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def fp8(qk: str, config=None):
    def run(q, k, v):
        return attention_fp8_triton(q, k, v, 1 / math.sqrt(q.shape[-1]), qk, True, config)
    return run


def bench(case: Case, sweep: bool, error_max_tokens: int) -> Row:
    b, h, s, d = case.batch, case.heads, case.tokens, case.head_dim
    row = Row(case.name, (b, h, s, d), 4 * b * h * s * s * d / 1e9)
    impls = {"sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "fp8": fp8("fp8"), "fp8-qk-bf16": fp8("bf16")}
    q, k, v = inputs(case, "randn")
    for name, fn in impls.items():
        try:
            row.us[name] = 1e3 * do_bench(lambda fn=fn: fn(q, k, v), warmup=50, rep=300)
        except Exception as e:  # noqa: BLE001 -- a backend missing for a shape is a result
            print(f"  {name}: {type(e).__name__}: {e}")
    row.quant_us = 1e3 * do_bench(lambda: quantize_kv(k, v, True), warmup=50, rep=300)
    if sweep:
        for qk in ("fp8", "bf16"):
            times = {}
            for cfg in CONFIGS:
                run = fp8(qk, cfg)
                try:
                    times[str(cfg)] = 1e3 * do_bench(lambda run=run: run(q, k, v), warmup=25,
                                                     rep=150)
                except Exception as e:  # noqa: BLE001 -- out of shared memory etc.
                    times[str(cfg)] = float("nan")
                    print(f"  {qk} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            row.configs_us[qk] = times
    if s <= error_max_tokens:
        for kind in ("randn", "normed"):
            qe, ke, ve = inputs(case, kind, seed=1)
            ref = reference64(qe, ke, ve)
            row.error[kind] = {name: rel(fn(qe, ke, ve), ref) for name, fn in impls.items()
                               if name in row.us}
            del ref
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--sweep", action="store_true", help="time every FP8 tile config")
    p.add_argument("--cases", default="", help="substring filter on case names")
    p.add_argument("--error-max-tokens", type=int, default=5000,
                   help="skip the fp64 error above this sequence length")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = []
    for case in CASES:
        if args.cases not in case.name:
            continue
        r = bench(case, args.sweep, args.error_max_tokens)
        rows.append(r)
        base = r.us.get("sdpa-cudnn")
        print(f"\n{r.case}  B,H,S,D={r.shape}  {r.gflop:.0f} GFLOP")
        for name, us in r.us.items():
            vs = f"  x cudnn {us / base:5.2f}" if base else ""
            print(f"  {name:<12} {us:9.1f} us  {r.gflop / us * 1e3:7.1f} TFLOP/s{vs}")
        print(f"  (the fp8 times include the K/V quantizer: {r.quant_us:.1f} us)")
        for kind, errs in r.error.items():
            print(f"  error vs fp64 ({kind}): "
                  + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        for qk, times in r.configs_us.items():
            best = min(times, key=lambda c: times[c] if times[c] == times[c] else 1e30)
            print(f"  sweep qk={qk}: " + ", ".join(f"{c} {t:.0f}" for c, t in times.items())
                  + f"; best {best}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
