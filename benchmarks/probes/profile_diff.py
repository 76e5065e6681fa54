"""Where does an optimized forward spend its time differently from the model's own?

    python -m benchmarks.probes.profile_diff --model qwen-image [--disable merge_projections ...]

Captures once, optimizes with the default config and with each --variant config (no
verification: this is a diagnosis run), times each with CUDA events, then profiles eager and the
default variant and prints the GPU kernels whose total time changed most.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cfg_step import report, time_ms
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import PassConfig
from kopt.verify import VerifyOptions


def kernel_totals(fn, iters: int = 3) -> tuple[dict[str, float], dict[str, float]]:  # noqa: ANN001
    """(GPU time per kernel name, GPU time per launching aten op), ms per forward."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] += e.device_time / 1e3 / iters
    ops: dict[str, float] = defaultdict(float)
    for a in prof.key_averages():
        if a.key.startswith("aten::") and a.self_device_time_total > 0:
            ops[a.key] += a.self_device_time_total / 1e3 / iters
    return kernels, ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--variant", action="append", default=[], metavar="PASS",
                   help="also time the default config with PASS disabled")
    p.add_argument("--out")
    args = p.parse_args()
    w = build(args.model, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    cap = capture_module(w.model, w.args, w.kwargs)
    print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
    flat = cap.example_inputs
    off = VerifyOptions(enabled=False)
    configs = {"kopt": PassConfig()}
    configs.update({f"kopt-no-{v}": PassConfig().replace(**{v: False}) for v in args.variant})
    row = {"model": args.model, "eager_ms": time_ms(lambda: w.run(), 10)}
    runners = {}
    for name, config in configs.items():
        spec = optimize_captured(cap, config, off, None, name, 0.0)
        runners[name] = lambda spec=spec: spec.gm(*flat)
        row[f"{name}_ms"] = time_ms(runners[name], 10)
        print(f"{name}: {row[f'{name}_ms']:.2f} ms (eager {row['eager_ms']:.2f})", flush=True)
    base, base_ops = kernel_totals(lambda: w.run())
    new, new_ops = kernel_totals(runners["kopt"])
    print(f"{'aten op (self GPU time)':<40} {'eager':>8} {'kopt':>8}  calls")
    op_keys = sorted(set(base_ops) | set(new_ops),
                     key=lambda k: -abs(new_ops.get(k, 0) - base_ops.get(k, 0)))
    for k in op_keys[:15]:
        print(f"{k:<40} {base_ops.get(k, 0):8.3f} {new_ops.get(k, 0):8.3f}")
    keys = sorted(set(base) | set(new), key=lambda k: -abs(new.get(k, 0) - base.get(k, 0)))
    row["eager_kernel_ms"] = sum(base.values())
    row["kopt_kernel_ms"] = sum(new.values())
    print(f"GPU kernel time per forward: eager {row['eager_kernel_ms']:.2f} ms, "
          f"kopt {row['kopt_kernel_ms']:.2f} ms")
    print(f"{'kernel':<90} {'eager':>8} {'kopt':>8}")
    row["diff"] = []
    for k in keys[:12]:
        print(f"{k:<90} {base.get(k, 0):8.3f} {new.get(k, 0):8.3f}")
        row["diff"].append((k, base.get(k, 0), new.get(k, 0)))
    if args.out:
        report(row, args.out)


if __name__ == "__main__":
    main()
