"""The same optimized graph timed eager several times in one process, around the calibration's
steps (host timing, the profiler, a pause, a garbage collection): how far apart eager times of
one graph fall on this machine.

    python -m benchmarks.probes.eager_repeat llm mode=decode
    python -m benchmarks.probes.eager_repeat qwen-image height=512 width=512

Each line: the least of 3 single calls (what the calibration's wall time is), the median of 5
calls on the same inputs, and the median per call of 5 steps as the ablation times them (the
step inputs change every step, so a hoisted region misses once per step).
"""

from __future__ import annotations

import gc
import itertools
import sys
import time

import torch

from kopt.ablate import step_inputs, stepper
from kopt.api import optimize_captured
from kopt.bench import median_ms
from kopt.capture import capture_module
from kopt.cli import parse_shape
from kopt.cost.calibrate import best_ms
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.profile import host_times, profile_graph
from kopt.verify import VerifyOptions


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = sys.argv[1]
    shape = parse_shape(sys.argv[2:], model)
    w = build(model, device=device, dtype=torch.bfloat16, **shape)
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fuse_allreduce_norm=False, fp8=FP8Config(layout="rowwise"))
    gm = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0).gm
    x = cap.example_inputs
    step = stepper(itertools.cycle(step_inputs(w)), w.calls_per_step)

    def walls(label: str) -> None:
        with torch.no_grad():
            best = best_ms(gm, x, 3)
            same = median_ms(lambda: gm(*x), 5, 2, device)
            steps = median_ms(lambda: step(gm), 5, 2, device) / w.calls_per_step
        print(f"{model} {label}: best {best:.2f} ms, median same inputs {same:.2f}, "
              f"ablation-style {steps:.2f}", flush=True)

    walls("fresh")
    host = host_times(gm, x, 3)
    print(f"host_times: {sum(host.values()):.2f} ms summed over the nodes")
    walls("after host_times")
    attribution = profile_graph(gm, x, iters=3)
    walls("right after the profiler")
    time.sleep(5)
    walls("5 s later")
    del attribution
    gc.collect()
    walls("after gc.collect()")


if __name__ == "__main__":
    main()
