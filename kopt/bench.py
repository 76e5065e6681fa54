"""Measuring: median wall time of a call, with device events on CUDA.

Warm-up calls first (compilation, allocator, caches), then ``iters`` timed calls; the median is
returned. On CUDA each call is bracketed by events and synchronised, so the figure is device
time including launch gaps; on the CPU it is ``perf_counter`` time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], iters: int = 10, warmup: int = 3,
              device: str | torch.device = "cpu", repeat: int = 1) -> float:
    """Median ms per call of ``fn`` over ``iters`` samples, each ``repeat`` calls back to back
    (no synchronization between them: as a loop of steps runs, the host's work for the next
    call overlaps the device's for this one; 1: each call timed alone)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / repeat)
        else:
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / repeat)
    return statistics.median(times)
