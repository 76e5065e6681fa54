"""A hoisted region's miss inside the ablation's step, against the same miss run alone.

    python -m benchmarks.probes.miss_in_step --model qwen-image --fp8 --without merge_projections

The interleaved probe put W1's unmerged miss at about 3.9 ms a step (steps on new timesteps
less steps that hit), where :func:`benchmarks.probes.hoist_miss.phased` measured 6.2-10.9 ms
of host time for it in two runs, and the cost model prices 6.7 (RESULTS.md, 2026-12-03, H200).
This
builds "all" and "all - PASS" and prints for each, in rounds (the order reversed every other):

- the step's ms per call on new timesteps (a miss per step) and on one timestep (hits), and
  their difference: the miss's share of a call;
- the host time of each prelude call inside those steps (the miss is the step's first call);
- each region's kind (step / static), node and GEMM counts, and its misses in the steps;
- the prelude alone (synchronized) with the step regions emptied, and with every region.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.probes.hoist_miss import step_ms
from benchmarks.probes.replay_split import build_pair, order, pair_options, print_differences
from kopt.cost.counts import region_kind
from kopt.cudagraphs import CudaGraphRunner
from kopt.graph.regions import CachedRegion


class TimedPrelude:
    """The runner's prelude, with the host time of every call recorded."""

    def __init__(self, prelude) -> None:
        self.prelude, self.graph, self.times = prelude, prelude.graph, []

    def modules(self):
        return self.prelude.modules()

    def __call__(self, *flat):
        t0 = time.perf_counter()
        out = self.prelude(*flat)
        self.times.append((time.perf_counter() - t0) * 1e3)
        return out


def alone(prelude, flat: list, regions: list[CachedRegion]) -> tuple:
    """(host ms, wall ms) of one prelude call, synchronized, with ``regions`` emptied."""
    torch.cuda.synchronize()
    for r in regions:
        r.clear()
    t0 = time.perf_counter()
    prelude(*flat)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) * 1e3


def setup(gm) -> tuple:
    """The graph's CUDA-graph runner with its prelude timed, its regions and its step regions
    (printed: kind, keys, nodes, GEMMs)."""
    runner = CudaGraphRunner(gm)
    prelude = runner.prelude
    runner.prelude = TimedPrelude(prelude)
    kinds = {}  # by key names: the runner's prelude holds copies of gm's regions
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), CachedRegion):
            kinds[gm.get_submodule(node.target).key_names] = region_kind(gm, node)
    regions = [m for m in prelude.modules() if isinstance(m, CachedRegion)]
    for m in regions:
        gemms = sum(1 for n in m.region.graph.nodes if "mm" in str(n.target))
        print(f"  region: {kinds.get(m.key_names, '?')}, keys {m.key_names}, "
              f"{len(m.region.graph.nodes)} nodes, {gemms} GEMMs", flush=True)
    return runner, prelude, regions, [m for m in regions if kinds.get(m.key_names) == "step"]


def one_round(runner, prelude, regions, step_regions, inputs, calls, steps) -> dict:
    timed = runner.prelude
    before = {id(m): m.misses for m in regions}
    timed.times.clear()
    miss = step_ms(runner, inputs, calls, steps)
    miss_host, hit_host = timed.times[::calls], timed.times[1::calls]
    misses = sorted(m.misses - before[id(m)] for m in regions)
    timed.times.clear()
    hit = step_ms(runner, inputs[:1], calls, steps)
    all_hits = list(timed.times)
    step_alone = [alone(prelude, inputs[0], step_regions) for _ in range(3)]
    every_alone = [alone(prelude, inputs[0], regions) for _ in range(3)]
    print(f"    misses per region in the miss steps: {misses}", flush=True)
    return {"miss steps": miss, "hit steps": hit,
            "miss part per call": miss - hit,
            "prelude host, 1st call": statistics.median(miss_host),
            "prelude host, 2nd call": statistics.median(hit_host),
            "prelude host, hit steps": statistics.median(all_hits),
            "step regions alone host": statistics.median(h for h, _ in step_alone),
            "step regions alone wall": statistics.median(w for _, w in step_alone),
            "every region alone host": statistics.median(h for h, _ in every_alone),
            "every region alone wall": statistics.median(w for _, w in every_alone)}


def main() -> None:
    p = pair_options(__doc__)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    gms, inputs, calls = build_pair(args)
    with torch.no_grad():
        probes = {}
        for name, gm in gms.items():
            print(f"{name}:", flush=True)
            probes[name] = setup(gm)
            step_ms(probes[name][0], inputs, calls, 2)
        rounds = []
        for r in range(args.rounds):
            row = {}
            for name in order(r):
                row[name] = one_round(*probes[name], inputs, calls, args.steps)
                print(f"round {r} {name}: " + ", ".join(f"{k} {v:.3f}"
                                                        for k, v in row[name].items()),
                      flush=True)
            rounds.append(row)
        print_differences(rounds, rounds[0]["all"], "ms")


if __name__ == "__main__":
    main()
