"""Measuring: median wall time of a call, with device events on CUDA.

Warm-up calls first (compilation, allocator, caches), then ``iters`` timed calls; the median is
returned. On CUDA each call is bracketed by events and synchronised, so the figure is device
time including launch gaps; on the CPU it is ``perf_counter`` time. :func:`per_call_us` times
the host's side of a call alone (what a launch costs the CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

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


def interleaved_ms(fns: Sequence[Callable[[], object]], iters: int = 10, warmup: int = 3,
                   device: str | torch.device = "cpu") -> list[float]:
    """Median ms per call of each of ``fns``, timed as :func:`median_ms` times one call, but
    interleaved: each of the ``iters`` rounds times every function once, the order rotated
    round by round. A drift of the host or the clock during the run then moves every function's
    samples alike, and their ratios hold where times taken one after another would not."""
    cuda = torch.device(device).type == "cuda"
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(iters):
        for k in range(len(fns)):
            i = (k + r) % len(fns)
            if cuda:
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
                fns[i]()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fns[i]()
                times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def per_call_us(f: Callable[[], Any], calls: int) -> float:
    """Host time (us) of one call of ``f``: the least of 5 means over ``calls`` calls back to
    back, after 10 warm-up calls. CUDA is synchronised between the batches, not inside one, so
    for kernels shorter than their launch the figure is the host's."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(10):
        f()
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter_ns() - t0) / calls / 1e3)
        sync()
    return best


# Seconds a graph runs before it is timed: a GPU at its power cap reaches its sustained clock
# only after some seconds of load. On the H200 (W1 in FP8), a graph timed right after its
# build drew 497-576 W (NVML) where the same graph drew 689-693 W after 2 s of its steps, and
# the first timing of W1's merged-projection graph read 88.2 ms against 90.6 sustained
# (RESULTS.md, 2026-12-03, H200): the more power-hungry a graph, the more its first timing
# gains, so a difference of two rows timed that way is not a difference at the sustained clock.
STEADY_S = 3.0


def sustain(fn: Callable[[], object], seconds: float,
            device: str | torch.device = "cpu") -> int:
    """Call ``fn`` (synchronized on CUDA) until ``seconds`` have passed; the number of calls.
    At least one call, so that a slow ``fn`` still warms what it uses."""
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, not {seconds}")
    cuda = torch.device(device).type == "cuda"
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < seconds:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        calls += 1
    return calls


def graphed_call(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in one CUDA graph, as a user captures a model by hand (two warm-up calls
    on a side stream, then the capture); the returned callable replays it on the same inputs."""
    from kopt.cudagraphs import capture_graph

    return capture_graph(fn, warmup=2)[0].replay
