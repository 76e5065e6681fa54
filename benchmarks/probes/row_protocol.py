"""Does the ablation's timing protocol change what a pass measures? W1's merge_projections
measured 3.12-3.26 ms by the ablation's rows and 1.78-1.82 by the interleaved probe
(RESULTS.md, 2026-12-02 and 2026-12-03, H200), each stable across two calls.

    python -m benchmarks.probes.row_protocol --model qwen-image --fp8 --without merge_projections

Builds "all" and "all - PASS" once; then, round after round (order reversed every other
round), times each graph's step (``calls_per_step`` calls on a new timestep, as the ablation)
two ways:

- ``row``: as an ablation row does (:func:`kopt.ablate._measure`): the step timed eagerly
  (``--warmup`` + ``--iters`` steps), then at once from the CUDA graph;
- ``steady``: from the CUDA graph after ``--steady`` seconds of its steps (the sustained clock);

each with the SM clock and power NVML reported during the graph's timed steps. Then one miss
of each graph's hoisted regions is profiled: its kernels by name (what the calibration, which
only profiles calls that hit the caches, never sees).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.probes.replay_split import build_pair, order, pair_options, print_differences
from kopt.ablate import stepper
from kopt.bench import median_ms
from kopt.cudagraphs import CudaGraphRunner
from kopt.graph.regions import CachedRegion
from kopt.power import ClockSampler


def main() -> None:
    p = pair_options(__doc__)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steady", type=float, default=2.0)
    args = p.parse_args()
    gms, inputs, calls = build_pair(args)
    with torch.no_grad():
        runners = {name: CudaGraphRunner(gm) for name, gm in gms.items()}
        rounds = []
        for r in range(args.rounds):
            row: dict[str, dict[str, float]] = {}
            for name in order(r):
                v: dict[str, float] = {}
                step = stepper(itertools.cycle(inputs), calls)
                v["eager"] = median_ms(lambda g=gms[name], st=step: st(g), args.iters, args.warmup,
                                       "cuda") / calls
                with ClockSampler("cuda") as s:
                    v["row"] = median_ms(lambda r=runners[name], st=step: st(r), args.iters,
                                         args.warmup, "cuda") / calls
                v["row MHz"], v["row W"] = s.result.sm_mhz, s.result.power_w
                start = time.perf_counter()
                while time.perf_counter() - start < args.steady:
                    step(runners[name])
                    torch.cuda.synchronize()
                with ClockSampler("cuda") as s:
                    v["steady"] = median_ms(lambda r=runners[name], st=step: st(r), args.iters, 0,
                                            "cuda") / calls
                v["steady MHz"], v["steady W"] = s.result.sm_mhz, s.result.power_w
                row[name] = v
                print(f"round {r} {name}: " + ", ".join(f"{k} {x:.2f}" for k, x in v.items()),
                      flush=True)
            rounds.append(row)
        print_differences(rounds, rounds[0]["all"], "ms per call")
        print("\none miss of the hoisted regions, profiled (us of kernels by name):")
        for name, runner in runners.items():
            for m in runner.prelude.modules():
                if isinstance(m, CachedRegion):
                    m.clear()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                runner.prelude(*inputs[0])
                host = time.perf_counter() - t0
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            by = defaultdict(lambda: [0, 0.0])
            for e in prof.profiler.kineto_results.events():
                if e.device_type() == torch.autograd.DeviceType.CUDA:
                    by[e.name()[:80]][0] += 1
                    by[e.name()[:80]][1] += e.duration_ns() / 1e3
            total = sum(us for _, us in by.values())
            print(f"{name}: {sum(n for n, _ in by.values())} kernels, {total:.1f} us; host "
                  f"{host * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms (profiled)")
            for k, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:8]:
                print(f"  {n:4d} x {us / n:8.1f} us = {us:9.1f}  {k}")


if __name__ == "__main__":
    main()
