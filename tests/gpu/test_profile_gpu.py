"""The device model's calibration on CUDA: host times measured without the profiler.

    pytest -q tests/gpu/test_profile_gpu.py -s
"""

from __future__ import annotations

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
