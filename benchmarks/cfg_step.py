"""One true-CFG denoise step (cond + uncond call, same latents and timestep tensors) of W1:
eager vs kopt with and without the hoist pass (with ``--fp8``: also without load-time folding,
so FP8 weight quantization and the merged-weight concatenations run in every call).

Each timed step takes the next of several distinct timestep tensors, more than a hoisted region
keeps entries for, as a denoising loop does: the cond call misses the timestep cache and the
uncond call hits it. (The 2026-11-29 figures in RESULTS.md predate this: they replayed one
timestep, so both calls hit.)

    python benchmarks/cfg_step.py --model qwen-image --out step.json
    python benchmarks/cfg_step.py --model qwen-image --fp8 --cuda-graph --out step-fp8.json

``--cuda-graph`` also captures the first variant's forward in a CUDA graph, replays it with another
timestep written into the captured timestep tensor, and records the replay's time and its error
against a plain call of the optimized module on the same inputs.

Captures once and builds both variants from the same capture without verification (this is a
timing run; `kopt optimize` verifies the same passes). Median of CUDA-event timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch

from kopt.api import optimize_captured
from kopt.bench import median_ms
from kopt.capture import capture_module, flatten_inputs
from kopt.graph.regions import cached_regions
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions, relative_error


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    return median_ms(fn, iters, warmup, device="cuda")


def report(row: dict, out: str | None) -> None:
    """Print a run's figures and, with ``out``, write them as JSON for RESULTS.md."""
    print(json.dumps(row, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(row, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fp8", action="store_true", help="FP8 rowwise linears in every variant")
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="round-robin timing rounds")
    p.add_argument("--out")
    args = p.parse_args()
    fp8 = FP8Config() if args.fp8 else None
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
    with torch.no_grad():
        ref = w.model(*w.args, **cond)[0]
    prefix = "kopt-fp8" if args.fp8 else "kopt"
    variants = [(prefix, PassConfig(fp8=fp8)),
                (f"{prefix}-no-hoist", PassConfig(fp8=fp8, hoist=False))]
    if args.fp8:
        variants.append((f"{prefix}-no-fold", PassConfig(fp8=fp8, fold_constants=False)))
    steps_of: dict[str, object] = {}
    for name, config in variants:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spec = optimize_captured(cap, config, VerifyOptions(enabled=False), None, name, 0.0)
        row[f"{name}_build_s"] = time.perf_counter() - t0
        row[f"{name}_passes"] = {r.name: r.matched for r in spec.report.passes}
        with torch.no_grad():
            row[f"{name}_rel_err_vs_eager"] = relative_error(spec.gm(*flat_for(cond, t0_))[0], ref)

        counter = iter(range(10**9))

        def step(gm=spec.gm, counter=counter) -> None:
            flat_c, flat_u = pairs[next(counter) % len(pairs)]
            with torch.no_grad():
                gm(*flat_c)
                gm(*flat_u)

        steps_of[name] = (spec.gm, step)
    # Every variant is timed in each of ``rounds`` rounds, round-robin, so that a drift of the
    # GPU's clocks over the run does not favour the variant timed first.
    for r in range(args.rounds):
        for name, (_gm, step) in steps_of.items():
            ms = time_ms(step, args.iters)
            row.setdefault(f"{name}_step_ms_rounds", []).append(ms)
            print(f"round {r}: {name} step {ms:.2f} ms", flush=True)
        ms = time_ms(eager_step, args.iters)
        row.setdefault("eager_step_ms_rounds", []).append(ms)
        print(f"round {r}: eager step {ms:.2f} ms", flush=True)
    for name, (gm, _) in steps_of.items():
        row[f"{name}_step_ms"] = statistics.median(row[f"{name}_step_ms_rounds"])
        row[f"{name}_cache_hits_misses"] = [(m.hits, m.misses) for m in cached_regions(gm)]
    if args.cuda_graph:
        gm = steps_of[variants[0][0]][0]
        steps_of.clear()  # the other variants' constants are no longer needed
        gc.collect()
        torch.cuda.empty_cache()
        row.update(cuda_graph_check(gm, flat_for(cond, t0_), t0_, steps[1], args.iters))
    report(row, args.out)


def cuda_graph_check(gm: torch.nn.Module, flat: list, t: torch.Tensor, other_t: torch.Tensor,
                     iters: int) -> dict:
    """Capture one forward of ``gm`` in a CUDA graph; replay it with ``other_t`` copied into the
    captured timestep; compare with a plain call on the same inputs and time both."""
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in flat]
    t_pos = next(i for i, a in enumerate(flat) if a is t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            gm(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph), torch.no_grad():
            out = gm(*static)[0]
    except Exception as e:  # the figure to record is that it failed, and why
        print(f"CUDA graph capture failed: {e}", flush=True)
        return {"cuda_graph_captured": False, "cuda_graph_error": str(e)[:500]}
    static[t_pos].copy_(other_t)
    graph.replay()
    with torch.no_grad():
        want = gm(*static)[0]
    row = {"cuda_graph_captured": True,
           "cuda_graph_replay_rel_err_vs_plain_call": relative_error(out, want),
           "cuda_graph_forward_ms": time_ms(graph.replay, iters),
           "plain_forward_ms": time_ms(lambda: gm(*static), iters)}
    print(f"CUDA graph: {row}", flush=True)
    return row


if __name__ == "__main__":
    main()
