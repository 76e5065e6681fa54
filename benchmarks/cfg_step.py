"""One true-CFG denoise step (cond + uncond call, same latents and timestep tensors) of W1:
eager vs kopt with and without the hoist pass.

Each timed step takes the next of several distinct timestep tensors, more than a hoisted region
keeps entries for, as a denoising loop does: the cond call misses the timestep cache and the
uncond call hits it. (The 2026-11-29 figures in RESULTS.md predate this: they replayed one
timestep, so both calls hit.)

    python benchmarks/cfg_step.py --model qwen-image --out step.json

Captures once and builds both variants from the same capture without verification (this is a
timing run; `kopt optimize` verifies the same passes). Median of CUDA-event timings.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.forward import report, time_ms
from kopt.api import optimize_captured
from kopt.capture import capture_module, flatten_inputs
from kopt.models import build
from kopt.passes import PassConfig
from kopt.passes.hoist import cached_regions
from kopt.verify import VerifyOptions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()
    w = build(args.model, device="cuda", dtype=torch.bfloat16)
    cond = dict(w.kwargs)
    uncond = dict(cond, encoder_hidden_states=torch.randn_like(cond["encoder_hidden_states"]))
    t0_ = cond["timestep"]
    steps = [t0_ * (1.0 - 0.1 * i) for i in range(4)]  # 4 > CACHE_ENTRIES distinct keys
    row: dict = {"model": args.model, "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}

    def eager_step() -> None:
        with torch.no_grad():
            w.model(*w.args, **cond)
            w.model(*w.args, **uncond)

    # flat inputs per step: the timestep leaf is replaced by that step's tensor (same object in
    # the cond and the uncond call of the step)
    def flat_for(kwargs: dict, t: torch.Tensor) -> list:
        return flatten_inputs(w.args, dict(kwargs, timestep=t))[0]

    row["eager_step_ms"] = time_ms(eager_step, args.iters)
    print(f"eager step {row['eager_step_ms']:.2f} ms", flush=True)
    t0 = time.perf_counter()
    cap = capture_module(w.model, w.args, cond)
    print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
    pairs = [(flat_for(cond, t), flat_for(uncond, t)) for t in steps]
    for name, config in [("kopt", PassConfig()), ("kopt-no-hoist", PassConfig(hoist=False))]:
        spec = optimize_captured(cap, config, VerifyOptions(enabled=False), None, name, 0.0)

        counter = iter(range(10**9))

        def step(gm=spec.gm, counter=counter) -> None:
            flat_c, flat_u = pairs[next(counter) % len(pairs)]
            with torch.no_grad():
                gm(*flat_c)
                gm(*flat_u)

        row[f"{name}_step_ms"] = time_ms(step, args.iters)
        row[f"{name}_cache_hits_misses"] = [(m.hits, m.misses) for m in cached_regions(spec.gm)]
        print(f"{name} step {row[f'{name}_step_ms']:.2f} ms", flush=True)
        del spec
        torch.cuda.empty_cache()
    report(row, args.out)


if __name__ == "__main__":
    main()
