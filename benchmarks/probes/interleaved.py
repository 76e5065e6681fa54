"""Leave-one-out savings timed in interleaved rounds, replayed from CUDA graphs.

    python -m benchmarks.probes.interleaved --model qwen-image --fp8 --without PASS ...

The ablation times each row once, one after another; on the H200 the same W1 graph then
measures up to 3 ms apart within one run (RESULTS.md, 2026-12-02), more than a small pass
saves. Here the all-passes graph and each "all - PASS" graph are built once and timed in turn, round
after round (the ablation's step: ``calls_per_step`` calls on a new timestep, synchronized),
and each pass's saving is the median over the rounds of its row less the round's all-passes
time. ``--hits`` also times each graph on one step's inputs over and over, so that every call
hits the hoisted caches: the saving in the replay alone, the rest being the regions' miss. Each
row prints the SM clock and power it ran at (NVML): W1's merged and unmerged graphs ran at
different clocks in the timed rows of 2026-12-03 (RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.probes.hoist_miss import step_ms, workload
from kopt.ablate import _off
from kopt.api import optimize_captured
from kopt.cudagraphs import CudaGraphRunner
from kopt.power import ClockSampler
from kopt.verify import VerifyOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--without", action="append", default=[], metavar="PASS")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--hits", action="store_true",
                   help="also time every graph with its hoisted caches hit (repeated inputs)")
    args = p.parse_args()
    cap, config, inputs, calls = workload(args.model, args.fp8)
    configs = {"all": config} | {f"all - {q}": config.replace(**{q: _off(q)})
                                 for q in args.without}
    runners = {}
    with torch.no_grad():
        for name, cfg in configs.items():
            gm = optimize_captured(cap, cfg, VerifyOptions(enabled=False), None, name, 0.0).gm
            runners[name] = CudaGraphRunner(gm)
            print(f"{name}: built, {step_ms(runners[name], inputs, calls, 2):.2f} ms per call",
                  flush=True)
        rounds = []
        for r in range(args.rounds):
            times, clocks = {}, {}
            for hits in (False, True) if args.hits else (False,):
                # the order reversed every other round: a graph timed first in every round
                # would run after the idle between rounds, at a higher clock (RESULTS.md,
                # 2026-12-03)
                for name, run in (list(runners.items())[::-1 if r % 2 else 1]):
                    row = f"{name} (hits)" if hits else name
                    with ClockSampler("cuda") as sampler:  # the clock each row ran at
                        times[row] = step_ms(run, inputs[:1] if hits else inputs, calls,
                                             args.steps)
                    clocks[row] = sampler.result
            rounds.append(times)
            print(f"round {r}: " + ", ".join(
                f"{k} {v:.2f}" + (f" ({clocks[k].sm_mhz:.0f} MHz, {clocks[k].power_w:.0f} W)"
                                  if clocks[k] is not None else "")
                for k, v in times.items()), flush=True)
    print(f"ms per call saved (median over {args.rounds} rounds of the row less the round's "
          "all):")
    for q in args.without:
        for suffix in ("", " (hits)") if args.hits else ("",):
            saved = [t[f"all - {q}{suffix}"] - t[f"all{suffix}"] for t in rounds]
            print(f"{q}{suffix}: {statistics.median(saved):.2f} (rounds: "
                  + ", ".join(f"{s:.2f}" for s in saved) + ")")


if __name__ == "__main__":
    main()
