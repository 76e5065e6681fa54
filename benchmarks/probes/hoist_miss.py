"""Where a hoisted region's miss spends its time under the CUDA-graph runner.

    python -m benchmarks.probes.hoist_miss [--model qwen-image] [--fp8] [--steps 9]

Times the ablation's step (``calls_per_step`` calls on a new timestep, synchronized at the end)
for the graph with and without ``hoist``, then takes one miss call and one hit call of the
hoisted graph apart, each phase synchronized: the prelude (the regions, eager), the copy of the
inputs and region outputs into the graph's buffers (:meth:`CudaGraphRunner._copy_in`), and the
replay; host time (``perf_counter`` before the sync) and wall time (after it) per phase, median
over ``--steps`` steps. A profile of one miss call counts what the copy launched.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from kopt.ablate import step_inputs, stepper
from kopt.api import optimize_captured
from kopt.bench import median_ms
from kopt.capture import Captured, capture_module
from kopt.cudagraphs import CudaGraphRunner
from kopt.graph.regions import CachedRegion
from kopt.models import build
from kopt.passes.config import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def phased(runner: CudaGraphRunner, flat: list, miss: bool) -> dict[str, float]:
    """One call of ``runner`` in synchronized phases: ms of host and wall time per phase."""
    sync = torch.cuda.synchronize
    out: dict[str, float] = {}
    sync()
    for m in runner.prelude.modules():
        if isinstance(m, CachedRegion) and miss:
            m.clear()
    if not miss:
        runner.prelude(*flat)  # the pair's first call: the timed one hits
        sync()
    t0 = time.perf_counter()
    regions = tuple(runner.prelude(*flat))
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    runner._copy_in(tuple(flat), regions)
    t3 = time.perf_counter()
    sync()
    t4 = time.perf_counter()
    runner.graph.replay()
    t5 = time.perf_counter()
    sync()
    t6 = time.perf_counter()
    out["prelude host"], out["prelude wall"] = (t1 - t0) * 1e3, (t2 - t0) * 1e3
    out["copy host"], out["copy wall"] = (t3 - t2) * 1e3, (t4 - t2) * 1e3
    out["replay host"], out["replay wall"] = (t5 - t4) * 1e3, (t6 - t4) * 1e3
    return out


def step_ms(runner: CudaGraphRunner, inputs: list, calls: int, steps: int) -> float:
    """ms per call of the ablation's step (a new timestep each step), CUDA graph."""
    step = stepper(itertools.cycle(inputs), calls)
    return median_ms(lambda: step(runner), steps, 3, "cuda") / calls


def workload(model: str, fp8: bool, device: str = "cuda"
             ) -> tuple[Captured, PassConfig, list, int]:
    """The model's capture on ``device`` (the GPU; ``meta``: shapes only), the ablation's
    config (FP8 where asked), its steps' inputs and calls per step."""
    w = build(model, device=device, dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fuse_allreduce_norm=False)
    if fp8:
        config = config.replace(fp8=FP8Config())
    return cap, config, step_inputs(w), w.calls_per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--phases-only", action="store_true",
                   help="only the hoisted graph's phases and profiles, no step timings")
    args = p.parse_args()
    cap, config, inputs, calls = workload(args.model, args.fp8)
    runners = {}
    with torch.no_grad():
        graphs = (("all", config), ("all - hoist", config.replace(hoist=False)))
        for name, cfg in graphs[:1] if args.phases_only else graphs:
            gm = optimize_captured(cap, cfg, VerifyOptions(enabled=False), None, name, 0.0).gm
            runner = CudaGraphRunner(gm)
            ms = step_ms(runner, inputs, calls, 2 if args.phases_only else args.steps)
            print(f"{name}: {ms:.2f} ms per call, CUDA graph, {calls} calls a step "
                  f"(hoisted outside: {runner.hoisted_outside})", flush=True)
            runners[name] = (gm, runner)
        # the two back to back once more: the drift between them stays out of the difference
        for name, (_, runner) in runners.items() if not args.phases_only else ():
            ms = step_ms(runner, inputs, calls, args.steps)
            print(f"{name} (again): {ms:.2f} ms per call", flush=True)
        runners.pop("all - hoist", None)
        gm, runner = runners["all"]
        regions = [m for m in runner.prelude.modules() if isinstance(m, CachedRegion)]
        outs = sum(len(r._entries[-1][2]) for r in regions if r._entries)
        print(f"regions {len(regions)}, outputs of the last entries {outs}; region nodes "
              f"{sum(len(r.region.graph.nodes) for r in regions)}")
        for miss in (True, False):
            rows = [phased(runner, inputs[s % len(inputs)], miss) for s in range(args.steps)]
            print(("miss" if miss else "hit") + ": " + ", ".join(
                f"{k} {statistics.median(r[k] for r in rows):.3f}" for k in rows[0]))
        # what a miss's copy launches
        for r in regions:
            r.clear()
        flat = inputs[0]
        regs = tuple(runner.prelude(*flat))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner._copy_in(tuple(flat), regs)
            torch.cuda.synchronize()
        print("copy_in of a miss, profiled:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        for r in regions:
            r.clear()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner.prelude(*flat)
            torch.cuda.synchronize()
        print("prelude of a miss, profiled:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
