"""Host time of kopt's optimization of a reference workload built on the ``meta`` device (no
weights, no GPU): what an ablation row's build and a user's ``kopt.optimize`` pay before any
kernel runs.

    python -m benchmarks.probes.optimize_time --model qwen-image --fp8 [--split] [--profile N]

Prints the capture's and the optimization's seconds, the rewrites applied and the nodes left;
``--split`` first times the capture's steps apart (export, decompositions, the module);
``--profile N`` adds cProfile's N most expensive calls (cumulative) of the optimization.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--split", action="store_true", help="also time the capture's steps apart")
    args = p.parse_args()
    w = build(args.model, device="meta", dtype=torch.bfloat16)
    if args.split:  # the capture's three steps, timed apart
        s0 = time.perf_counter()
        ep = torch.export.export(w.model, tuple(w.args), dict(sorted(w.kwargs.items())),
                                 strict=False)
        s1 = time.perf_counter()
        ep = ep.run_decompositions({})
        s2 = time.perf_counter()
        ep.module()
        s3 = time.perf_counter()
        print(f"{w.name}: torch.export.export {s1 - s0:.1f} s, run_decompositions {s2 - s1:.1f} "
              f"s, ExportedProgram.module() {s3 - s2:.1f} s")
        del ep
    t0 = time.perf_counter()
    cap = capture_module(w.model, w.args, w.kwargs)
    t1 = time.perf_counter()
    config = PassConfig(fuse_allreduce_norm=False)
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    prof = cProfile.Profile() if args.profile else None
    t2 = time.perf_counter()
    if prof is not None:
        prof.enable()
    spec = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0)
    if prof is not None:
        prof.disable()
    t3 = time.perf_counter()
    print(f"{w.name}: capture {t1 - t0:.1f} s ({len(cap.gm.graph.nodes)} nodes), optimize "
          f"{t3 - t2:.1f} s ({spec.report.applied} rewrites, {len(spec.gm.graph.nodes)} nodes "
          f"left, {type(spec.gm).__mro__[1].__name__})")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
