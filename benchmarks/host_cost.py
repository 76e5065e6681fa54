"""Host time per launch of each op of an optimized graph, with and without a drained queue.

    python benchmarks/host_cost.py --model qwen-image --fp8 [--shape KEY=VALUE ...]

The calibration (:func:`kopt.profile.host_times`) times each node's call as the graph runs.
On a device-bound graph the launch queue fills and a launch then waits for the device, so
those times can hold device time. This script times every node twice: as the calibration
does, and with the device drained before each node (``torch.cuda.synchronize()`` outside the
timed span), which leaves the host's own cost; then once more after a profiler session in
the same process (the calibration profiles before it times). It prints the three per op
(median per node, us) and the graph's time per call (least of ``--iters`` calls) before and
after the profiler.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch import fx

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.cli import parse_shape
from kopt.cost.calibrate import best_ms
from kopt.models import build
from kopt.passes.config import FP8Config, PassConfig
from kopt.profile import host_times, profile_graph
from kopt.verify import VerifyOptions


def per_op(gm: fx.GraphModule, times: dict[str, float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.name in times:
            out[str(n.target)].append(times[n.name] * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu: a smoke run")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--min-nodes", type=int, default=3)
    args = p.parse_args()
    w = build(args.model, device=args.device, dtype=torch.bfloat16, **parse_shape(args.shape))
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig()
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    gm = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0).gm
    inputs = list(cap.example_inputs)
    wall = best_ms(gm, inputs, args.iters)
    queued = per_op(gm, host_times(gm, inputs, args.iters))
    drained = per_op(gm, host_times(gm, inputs, args.iters, drain=True))
    profile_graph(gm, inputs, iters=3)
    after = per_op(gm, host_times(gm, inputs, args.iters))
    wall_after = best_ms(gm, inputs, args.iters)
    print(f"{w.description}: ms per call {wall:.2f} before the profiler, {wall_after:.2f} "
          f"after; host us per node, median over the op's nodes (least of {args.iters} calls)")
    print(f"{'op':44s} {'nodes':>6s} {'as run':>9s} {'drained':>9s} {'profiled':>9s}")
    rows = sorted(drained, key=lambda op: -sum(drained[op]))
    for op in rows:
        if len(drained[op]) < args.min_nodes:
            continue
        print(f"{op[:44]:44s} {len(drained[op]):6d} {statistics.median(queued[op]):9.1f} "
              f"{statistics.median(drained[op]):9.1f} {statistics.median(after[op]):9.1f}")

if __name__ == "__main__":
    main()
