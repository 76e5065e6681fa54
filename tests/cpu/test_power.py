"""kopt.power: the clock sampler, with NVML replaced by a fake (no GPU here)."""

from __future__ import annotations

import time

import torch

from kopt import power
from kopt.power import Clocks, ClockSampler


class _FakeNvml:
    lib = object()

    def __init__(self, samples: list[tuple[float, float]]) -> None:
        self.samples = list(samples)

    def sample(self) -> tuple[float, float] | None:
        return self.samples.pop(0) if self.samples else None


def test_the_sampler_reports_the_median_clock_and_mean_power(monkeypatch) -> None:  # noqa: ANN001
    fake = _FakeNvml([(1980.0, 400.0), (1500.0, 700.0), (1485.0, 690.0)])
    monkeypatch.setattr(power, "_Nvml", lambda index: fake)
    with ClockSampler("cuda", period_s=0.001) as s:
        deadline = time.monotonic() + 5
        while fake.samples and time.monotonic() < deadline:
            time.sleep(0.001)
    assert s.result == Clocks(1500.0, (400.0 + 700.0 + 690.0) / 3, 3)
    assert s.result.format() == "SM 1500 MHz, 597 W (3 samples)"


def test_no_nvml_or_a_cpu_device_records_nothing(monkeypatch) -> None:  # noqa: ANN001
    with ClockSampler("cpu") as s:
        pass
    assert s.result is None
    missing = _FakeNvml([])
    missing.lib = None
    monkeypatch.setattr(power, "_Nvml", lambda index: missing)
    with ClockSampler("cuda") as s:
        pass
    assert s.result is None and s._thread is None


def test_the_device_index_reaches_nvml_whatever_form_the_device_takes(monkeypatch) -> None:  # noqa: ANN001
    seen = []
    monkeypatch.setattr(power, "_Nvml", lambda index: seen.append(index) or _FakeNvml([]))
    for device in ("cuda", "cuda:1", torch.device("cuda", 2), None):
        ClockSampler(device)
    assert seen == [0, 1, 2, 0]


def test_the_highest_clock_comes_from_nvmls_limits(monkeypatch) -> None:  # noqa: ANN001
    fake = _FakeNvml([])
    fake.limits = lambda: (700.0, 1980.0)
    monkeypatch.setattr(power, "_Nvml", lambda index: fake)
    assert power.max_clock_mhz("cuda:0") == 1980.0
    fake.limits = lambda: None  # NVML without the query
    assert power.max_clock_mhz("cuda") is None
    assert power.max_clock_mhz("cpu") is None
