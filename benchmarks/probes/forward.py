"""Forward time of a reference workload: the model as is vs kopt.optimize (eager inner).

    python -m benchmarks.probes.forward --model qwen-image --device cuda --dtype bf16 --out w1.json

Variants: eager (the model), kopt (all passes), kopt-no-merge (merge_projections off). Median of
CUDA-event timings after warm-up, on the workload's random inputs. Also records the time to the
optimized module and the output's relative error vs the model. This measures the foundation's
passes only (merge, CSE, load-time folding); the end-to-end harness is benchmarks/e2e.py.
"""

from __future__ import annotations

import argparse
import time

import torch

import kopt
from benchmarks.cfg_step import report, time_ms
from kopt.models import build
from kopt.verify import VerifyOptions, relative_error

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seeds", type=int, default=1, help="verification seeds")
    p.add_argument("--out")
    args = p.parse_args()

    t0 = time.perf_counter()
    w = build(args.model, device=args.device, dtype=DTYPES[args.dtype])
    build_s = time.perf_counter() - t0
    print(f"{w.description}; built in {build_s:.1f} s", flush=True)
    row: dict = {"model": args.model, "description": w.description,
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d")}
    ref = w.run()
    row["eager_ms"] = time_ms(lambda: w.run(), args.iters)
    print(f"eager {row['eager_ms']:.2f} ms", flush=True)
    verify = VerifyOptions(seeds=tuple(range(args.seeds)))
    for variant, config in [("kopt", kopt.PassConfig()),
                            ("kopt-no-merge", kopt.PassConfig(merge_projections=False))]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt = kopt.optimize(w.model, w.args, w.kwargs, config, verify=verify,
                            keep_original=True)
        row[f"{variant}_optimize_s"] = time.perf_counter() - t0
        print(opt.report, flush=True)
        row[f"{variant}_ms"] = time_ms(lambda opt=opt: w.run(opt), args.iters)
        row[f"{variant}_rel_err_vs_eager"] = relative_error(w.run(opt), ref)
        row[f"{variant}_verified"] = opt.report.verified
        row[f"{variant}_merged"] = opt.report.result("merge_projections").matched if \
            config.merge_projections else 0
        print(f"{variant} {row[f'{variant}_ms']:.2f} ms "
              f"({row[f'{variant}_ms'] / row['eager_ms']:.3f}x eager), optimize "
              f"{row[f'{variant}_optimize_s']:.1f} s", flush=True)
        del opt
        torch.cuda.empty_cache()
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    report(row, args.out)


if __name__ == "__main__":
    main()
