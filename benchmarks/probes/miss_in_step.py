"""A hoisted region's miss inside the ablation's step, against the same miss run alone.

    python -m benchmarks.probes.miss_in_step --model qwen-image --fp8 --without merge_projections

Session 24's interleaved probe put W1's unmerged miss at about 3.9 ms a step (steps on new
timesteps less steps that hit), where :func:`benchmarks.probes.hoist_miss.phased` measured
6.2-10.9 ms of host time for it (session 25, c1 and c2), and the cost model prices 6.7. This
builds one graph (all passes less ``--without``, or all without it) and prints, in rounds:

- the step's ms per call on new timesteps (a miss per step) and on one timestep (hits);
- the host time of each prelude call inside those steps (the miss is the step's first call);
- each region's kind (step / static), node and GEMM counts, and its misses in the steps;
- the prelude alone (synchronized) with the step regions emptied, and with every region.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.probes.hoist_miss import step_ms, workload
from kopt.ablate import _off
from kopt.api import optimize_captured
from kopt.cost.counts import region_kind
from kopt.cudagraphs import CudaGraphRunner
from kopt.passes.hoist import CachedRegion
from kopt.verify import VerifyOptions


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


def alone(runner: CudaGraphRunner, prelude, flat: list, regions: list[CachedRegion]) -> tuple:
    torch.cuda.synchronize()
    for r in regions:
        r.clear()
    t0 = time.perf_counter()
    prelude(*flat)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--without", metavar="PASS")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    cap, config, inputs, calls = workload(args.model, args.fp8)
    if args.without:
        config = config.replace(**{args.without: _off(args.without)})
    with torch.no_grad():
        gm = optimize_captured(cap, config, VerifyOptions(enabled=False), None, "probe", 0.0).gm
        runner = CudaGraphRunner(gm)
        prelude = runner.prelude
        runner.prelude = timed = TimedPrelude(prelude)
        step_ms(runner, inputs, calls, 2)
        kinds = {}  # by key names: the runner's prelude holds copies of gm's regions
        for node in gm.graph.nodes:
            if node.op == "call_module" and isinstance(gm.get_submodule(node.target),
                                                        CachedRegion):
                kinds[gm.get_submodule(node.target).key_names] = region_kind(gm, node)
        regions = [m for m in prelude.modules() if isinstance(m, CachedRegion)]
        for m in regions:
            gemms = sum(1 for n in m.region.graph.nodes if "mm" in str(n.target))
            print(f"region: {kinds.get(m.key_names, '?')}, keys {m.key_names}, "
                  f"{len(m.region.graph.nodes)} nodes, {gemms} GEMMs", flush=True)
        step_regions = [m for m in regions if kinds.get(m.key_names) == "step"]
        rows = []
        for r in range(args.rounds):
            before = {id(m): m.misses for m in regions}
            timed.times.clear()
            miss = step_ms(runner, inputs, calls, args.steps)
            miss_host = timed.times[::calls]
            hit_host = timed.times[1::calls]
            misses = {id(m): m.misses - before[id(m)] for m in regions}
            timed.times.clear()
            hit = step_ms(runner, inputs[:1], calls, args.steps)
            all_hits = list(timed.times)
            step_alone = [alone(runner, prelude, inputs[0], step_regions) for _ in range(3)]
            every_alone = [alone(runner, prelude, inputs[0], regions) for _ in range(3)]
            row = {"miss steps": miss, "hit steps": hit,
                   "prelude host, 1st call": statistics.median(miss_host),
                   "prelude host, 2nd call": statistics.median(hit_host),
                   "prelude host, hit steps": statistics.median(all_hits),
                   "step regions alone host": statistics.median(h for h, _ in step_alone),
                   "step regions alone wall": statistics.median(w for _, w in step_alone),
                   "every region alone host": statistics.median(h for h, _ in every_alone),
                   "every region alone wall": statistics.median(w for _, w in every_alone)}
            rows.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                  + f"; misses per region in the miss steps: {sorted(misses.values())}",
                  flush=True)
        print("medians: " + ", ".join(f"{k} {statistics.median(x[k] for x in rows):.3f}"
                                      for k in rows[0]))


if __name__ == "__main__":
    main()
