"""The device model's calibration on CUDA: host times measured without the profiler.

    pytest -q tests/gpu/test_profile_gpu.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.cost import H200, Calibration, measure
from kopt.models import build
from kopt.passes import PassConfig
from kopt.profile import host_times, profile_graph
from kopt.verify import VerifyOptions

pytestmark = pytest.mark.gpu


def test_calibration_on_cuda_takes_host_times_outside_the_profiler() -> None:
    w = build("llm-tiny", device="cuda", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    full = optimize_captured(cap, PassConfig(), VerifyOptions(enabled=False), None, w.name, 0.0)
    graphs = [(cap.gm, cap.example_inputs), (full.gm, cap.example_inputs)]
    host = host_times(full.gm, cap.example_inputs, iters=5)
    profiled = profile_graph(full.gm, cap.example_inputs, iters=3)
    launched = [k for k, v in profiled.nodes.items() if v.calls > 0 and k in host]
    assert launched and all(host[k] > 0 for k in launched)
    ratio = sum(profiled.nodes[k].host_ms for k in launched) / sum(host[k] for k in launched)
    print(f"profiled / unprofiled host time of the launching nodes: {ratio:.2f}")
    cal = measure(graphs, iters=3)
    for _counts, attribution, wall in cal.graphs:
        assert attribution.device == "cuda" and wall > 0
        assert any(n.host_ms > 0 for n in attribution.nodes.values())
    model = cal.fit(H200)
    assert model.asynchronous and model.launch_us > 0 and model.graph_launch_us == 1.0
    print(model.describe())
    assert Calibration.from_json(cal.to_json()).fit(H200) == model


class _Span:
    def __enter__(self) -> _Span:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = time.perf_counter()


@pytest.mark.parametrize("name", ["llm-tiny", "qwen-image-tiny"])
def test_replay_profile_times_every_node_of_the_replayed_graph(name: str) -> None:
    from kopt.profile import profile_replay

    w = build(name, device="cuda", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    full = optimize_captured(cap, PassConfig(), VerifyOptions(enabled=False), None, w.name, 0.0)
    eager = profile_graph(full.gm, cap.example_inputs, iters=3)
    span = _Span()
    start = time.perf_counter()
    replayed, note = profile_replay(full.gm, cap.example_inputs, eager, iters=3, steady_s=0.3,
                                    during=span)
    end = time.perf_counter()
    print(note, f"; replays {span.end - span.start:.2f} s of the call's {end - start:.2f}")
    # ``during`` holds the steady and the profiled replays, not the profiler's own work
    assert span.end - span.start >= 0.3 and start < span.start and span.end < end
    assert replayed is not None, note
    timed = {k for k, v in eager.nodes.items() if v.ms > 0}
    assert timed == {k for k, v in replayed.nodes.items() if v.ms > 0}
    odd = {k: (replayed.nodes[k].min_ms, replayed.nodes[k].ms) for k in timed
           if not 0 < replayed.nodes[k].min_ms <= replayed.nodes[k].ms}
    assert not odd, f"nodes whose least replayed time is not in (0, mean]: {odd}"
    # the same kernels: within a factor of two of their eager times in total
    assert 0.5 < replayed.attributed_ms / eager.attributed_ms < 2.0
    cal = measure([(full.gm, cap.example_inputs)], iters=3)
    assert cal.replayed, cal.notes
    assert "CUDA graph replays" in cal.fit(H200).source
    assert "CUDA graph replays" not in cal.fit(H200, source="eager").source


def test_the_clock_sampler_reads_the_gpus_clock_and_power_under_load() -> None:
    """NVML through ctypes on the device: a GEMM loop is sampled at a real SM clock and a
    power draw above idle."""
    from kopt.power import ClockSampler

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with ClockSampler(a.device) as s:
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
    assert s.result is not None and s.result.samples > 3, "no NVML samples"
    assert 300 < s.result.sm_mhz < 3000 and s.result.power_w > 100, s.result
