"""The GPU's SM clock and power draw while something runs, read from NVML.

A GPU at its power cap lowers its clocks: on the H200 (700 W) FLUX.2's FP8 graph runs at a
median 1440 MHz against 1635 for its BF16 graph, and its unchanged FP8 GEMMs take 4% less time
once the unfused QK-norm + RoPE kernels sit beside them (RESULTS.md, 2026-12-02). A kernel's
time then depends on the power drawn by the graph around it, which a per-op rate cannot see;
:class:`ClockSampler` records it beside a timing so that a measurement says at what clock it
was made.

NVML is read through ``ctypes`` (``libnvidia-ml.so.1``, which every NVIDIA driver ships): no
Python package needed. Where there is no NVML (a CPU machine) the sampler records nothing.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

_NVML_CLOCK_SM = 1


class _Nvml:
    """The few NVML calls used here; ``None`` handle when the library or device is missing."""

    def __init__(self, index: int) -> None:
        self.lib: Any = None
        self.handle = ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index),
                                                 ctypes.byref(self.handle)) != 0:
                return
            self.lib = lib
        except (OSError, AttributeError, ctypes.ArgumentError):
            self.lib = None  # no NVML: nothing is sampled

    def limits(self) -> tuple[float, float] | None:
        """(enforced power cap W, highest SM clock MHz), or None."""
        if self.lib is None:
            return None
        mw, mhz = ctypes.c_uint(), ctypes.c_uint()
        if self.lib.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(mw)):
            return None
        if self.lib.nvmlDeviceGetMaxClockInfo(self.handle, _NVML_CLOCK_SM, ctypes.byref(mhz)):
            return None
        return mw.value / 1e3, float(mhz.value)

    def sample(self) -> tuple[float, float] | None:
        """(SM clock MHz, power W) now, or None."""
        if self.lib is None:
            return None
        mhz, mw = ctypes.c_uint(), ctypes.c_uint()
        if self.lib.nvmlDeviceGetClockInfo(self.handle, _NVML_CLOCK_SM, ctypes.byref(mhz)):
            return None
        if self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(mw)):
            return None
        return float(mhz.value), mw.value / 1e3


@dataclass(frozen=True)
class Clocks:
    """What the sampler saw: median SM clock (MHz), mean power (W), and the samples' count."""

    sm_mhz: float
    power_w: float
    samples: int

    def format(self) -> str:
        return f"SM {self.sm_mhz:.0f} MHz, {self.power_w:.0f} W ({self.samples} samples)"


class ClockSampler:
    """``with ClockSampler(device) as s: run()``, then ``s.result`` (None without NVML or
    samples). Samples every ``period_s`` on a thread (NVML's power reading is itself an average
    over about a second on recent drivers, so the power is indicative; the clock is
    instantaneous)."""

    def __init__(self, device: Any = None, period_s: float = 0.01) -> None:
        cuda = device is None or torch.device(device).type == "cuda"
        index = 0 if device is None else torch.device(device).index or 0
        self._nvml = _Nvml(index) if cuda else None
        self.period_s = period_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.result: Clocks | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self._nvml.sample() if self._nvml is not None else None
            if s is not None:
                self._samples.append(s)
            time.sleep(self.period_s)

    def __enter__(self) -> ClockSampler:
        if self._nvml is not None and self._nvml.lib is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._samples:
            self.result = Clocks(statistics.median(m for m, _ in self._samples),
                                 statistics.fmean(w for _, w in self._samples),
                                 len(self._samples))


def max_clock_mhz(device: Any = "cuda") -> float | None:
    """The highest SM clock (MHz) NVML reports for a CUDA device, or None (no NVML, a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    limits = _Nvml(device.index or 0).limits()
    return limits[1] if limits else None


def read_power_limit(device: Any = "cuda", seconds: float = 3.0,
                     mib: int = 512) -> tuple[float, float, float] | None:
    """(power cap W, W a copy draws, highest SM clock MHz) of a CUDA device, or None without
    NVML. The copy: a CUDA graph of copies between two ``mib`` MiB buffers replayed for
    ``seconds``, its power the mean of the samples in the second half (NVML's reading trails
    the load)."""
    device = torch.device(device)
    nvml = _Nvml(device.index or 0)
    limits = nvml.limits() if device.type == "cuda" else None
    if limits is None:
        return None
    n = mib * 2**20 // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            dst.copy_(src)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            dst.copy_(src)
    samples: list[tuple[float, float]] = []
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        graph.replay()
        torch.cuda.synchronize(device)
        if now > seconds / 2 and (s := nvml.sample()) is not None:
            samples.append(s)
    del graph, src, dst
    torch.cuda.empty_cache()
    if not samples:
        return None
    return limits[0], statistics.fmean(w for _, w in samples), limits[1]
