"""Attention at the W1/W2 shapes: cuDNN / flash BF16 SDPA against kopt's 8-bit attentions.

    python benchmarks/kernels_attention.py --out attention.json [--sweep]   # on the GPU

Per case (B, H, S, D; no mask, not causal; q, k, v as the models hold them, [B, S, H, D] memory
viewed as [B, H, S, D]), ``triton.testing.do_bench`` medians on random non-zero data:

* ``sdpa-cudnn`` / ``sdpa-flash``: ``F.scaled_dot_product_attention`` in BF16 on that backend;
* ``q8-bf16`` / ``q8-fp8``: ``kopt::attention_q8`` (q k^T in INT8 with k smoothed, P v in BF16
  or e4m3), its quantizers included (``q8_quant_us``: q, k and v's alone); ``--sweep`` times every
  config of ``Q8_CONFIGS``.

``--kb PATH``: each case's best 8-bit time against cuDNN BF16 goes into that knowledge base as a
micro measurement of the rewrite ``attention_q8``, and a case short of the bar an FP8 attention
must clear to be worth a rewrite (:data:`BAR`: 1.35x cuDNN BF16's throughput) as a dead end there
with the measured cause.

TFLOP/s on 4 B H S^2 D. Error: the output's relative error (Frobenius) against fp64 attention on
the same bf16 inputs, for two input kinds: ``randn`` (q, k, v standard normal) and ``normed``
(q and k RMS-normalized per head with a random per-channel weight, as after a QK norm, times 2,
which makes the softmax peakier, then k offset per channel as a DiT's keys are, and v with a few
large channels).
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

from kopt.codegen.kernels.attention_q8 import attention_q8_triton, quantize_qk, quantize_v


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    tokens: int
    head_dim: int = 128
    batch: int = 1
    workload: str | None = None  # the knowledge base's workload of this shape


CASES = (
    Case("W1 Qwen-Image 1024x1024 (4096 + 128 tokens)", 24, 4224, workload="W1"),
    Case("W2 FLUX.2 1024x1024 (4096 + 512 tokens)", 48, 4608, workload="W2"),
    Case("W1 Qwen-Image 512x512 (1024 + 128 tokens)", 24, 1152),
    Case("W1 Qwen-Image 2048x2048 (16384 + 128 tokens)", 24, 16512),
)
BAR = 1.35  # the throughput over cuDNN BF16's an 8-bit attention must reach to be used

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
Q8_CONFIGS = [(bm, bn, 4 if bm == 64 else 8, st) for bm in (64, 128) for bn in (64, 128)
              for st in (2, 3)]


@dataclass
class Row:
    case: str
    shape: tuple[int, int, int, int]
    gflop: float
    us: dict[str, float] = field(default_factory=dict)
    error: dict[str, dict[str, float]] = field(default_factory=dict)
    workload: str | None = None
    configs_us: dict[str, dict[str, float]] = field(default_factory=dict)
    q8_quant_us: dict[str, float] = field(default_factory=dict)


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
        k = k + 2 * rnd(d)  # keys share per-channel offsets, as a DiT's do
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


def q8(pv: str, config=None):
    def run(q, k, v):
        return attention_q8_triton(q, k, v, 1 / math.sqrt(q.shape[-1]), pv, True, config)
    return run


def bench(case: Case, sweep: bool, error_max_tokens: int) -> Row:
    b, h, s, d = case.batch, case.heads, case.tokens, case.head_dim
    row = Row(case.name, (b, h, s, d), 4 * b * h * s * s * d / 1e9, workload=case.workload)
    impls = {"sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "q8-bf16": q8("bf16"), "q8-fp8": q8("fp8")}
    q, k, v = inputs(case, "randn")
    if sweep:
        for pv in ("bf16", "fp8"):
            times = {}
            for cfg in Q8_CONFIGS:
                run = q8(pv, cfg)
                try:
                    times[str(cfg)] = 1e3 * do_bench(lambda run=run: run(q, k, v), warmup=25,
                                                     rep=150)
                except Exception as e:  # noqa: BLE001 -- out of shared memory etc.
                    times[str(cfg)] = float("nan")
                    print(f"  q8-{pv} {cfg}: {type(e).__name__}: {str(e)[:160]}")
            row.configs_us[f"q8-{pv}"] = times
            best = min(times, key=lambda c: times[c] if times[c] == times[c] else 1e30)
            impls[f"q8-{pv}-best"] = q8(pv, eval(best))  # noqa: S307 -- our own tuple repr
    row.q8_quant_us["qk"] = 1e3 * do_bench(lambda: quantize_qk(q, k, 0.1), warmup=50, rep=300)
    row.q8_quant_us["v"] = 1e3 * do_bench(lambda: quantize_v(v), warmup=50, rep=300)
    for name, fn in impls.items():
        try:
            row.us[name] = 1e3 * do_bench(lambda fn=fn: fn(q, k, v), warmup=50, rep=300)
        except Exception as e:  # noqa: BLE001 -- a backend missing for a shape is a result
            print(f"  {name}: {type(e).__name__}: {e}")
    if s <= error_max_tokens:
        for kind in ("randn", "normed"):
            qe, ke, ve = inputs(case, kind, seed=1)
            ref = reference64(qe, ke, ve)
            row.error[kind] = {name: rel(fn(qe, ke, ve), ref) for name, fn in impls.items()
                               if name in row.us}
            del ref
    return row


def record(path: str, rows: list[Row]) -> None:
    """Each W1/W2 case's best q8 time against cuDNN BF16, and a dead end where it is short of
    :data:`BAR`, with the measured times and errors as its cause."""
    from kopt.kb import KnowledgeBase

    kb = KnowledgeBase.open(path)
    device = torch.cuda.get_device_name()
    for r in rows:
        workload = r.workload
        base = r.us.get("sdpa-cudnn")
        q8 = {n: us for n, us in r.us.items() if n.startswith("q8-")}
        if workload is None or base is None or not q8:
            continue
        best = min(q8, key=q8.get)
        kb.record_measurement("micro", workload, device, base / 1e3, q8[best] / 1e3,
                              rewrite="attention_q8", note=f"{best} against sdpa-cudnn, {r.case}")
        speedup = base / q8[best]
        if speedup >= BAR:
            continue
        errors = "; ".join(f"{kind}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()
                                                  if n in ("sdpa-cudnn", "q8-bf16", "q8-fp8"))
                           for kind, errs in r.error.items())
        kb.record_verdict(
            "attention_q8", "dead_end", workload=workload, device=device, origin="human",
            tags=("slower",),
            cause=f"{r.case}: the best 8-bit attention ({best}) {q8[best]:.0f} us against cuDNN "
                  f"BF16's {base:.0f} us, {speedup:.2f}x its throughput where {BAR}x is the bar "
                  f"(quantizers included); error against fp64 {errors}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--sweep", action="store_true", help="time every FP8 tile config")
    p.add_argument("--cases", default="", help="substring filter on case names")
    p.add_argument("--kb", help="record the q8 times and the verdict in this knowledge base")
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
        print("  (the q8 times include the quantizers: "
              + ", ".join(f"{n} {us:.1f} us" for n, us in r.q8_quant_us.items()) + ")")
        for kind, errs in r.error.items():
            print(f"  error vs fp64 ({kind}): "
                  + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        for qk, times in r.configs_us.items():
            best = min(times, key=lambda c: times[c] if times[c] == times[c] else 1e30)
            print(f"  sweep {qk}: " + ", ".join(f"{c} {t:.0f}" for c, t in times.items())
                  + f"; best {best}")
    if args.kb:
        record(args.kb, rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
