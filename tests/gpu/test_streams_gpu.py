"""Concurrent branches on two CUDA streams (kopt.streams, off by default: the execution plan
made with ``branch_streams=True``): a double-stream model's text branch on a side stream
computes bitwise what one stream does, eagerly and replayed from a CUDA graph over changing
inputs, and its kernels do run on a second stream."""

from __future__ import annotations

import functools
import json
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import kopt
import kopt.api
from kopt.graph.regions import same_value
from kopt.models import build, main_output
from kopt.models.zoo import ZOO
from kopt.models.zoo import build as zoo_build
from kopt.runtime import build_plan
from tests.fixtures import perturbed_kwargs

pytestmark = pytest.mark.gpu
FP8_EVERYWHERE = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def _optimized(name: str, two_streams: bool, graphs, monkeypatch):  # noqa: ANN001, ANN202
    w = (zoo_build if name in ZOO else build)(name, device="cuda", dtype=torch.bfloat16)
    if two_streams:
        monkeypatch.setattr(kopt.api, "build_plan",
                            functools.partial(build_plan, branch_streams=True))
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8_EVERYWHERE, cuda_graphs=graphs)
    monkeypatch.undo()
    return w, opt


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "wan2.1"])
@pytest.mark.parametrize("graphs", [False, "auto"], ids=["eager", "cuda-graph"])
def test_the_side_stream_computes_what_one_stream_does(name, graphs, monkeypatch) -> None:  # noqa: ANN001
    w, two = _optimized(name, True, graphs, monkeypatch)
    plan = two._specs[two._first_key].plan
    assert plan is not None and plan.off is None and plan.summary.left_out is None, two.report
    assert plan.summary.streams.startswith("two streams"), plan.summary.streams
    _, one = _optimized(name, False, graphs, monkeypatch)
    assert one._specs[one._first_key].plan.summary.streams is None
    calls = perturbed_kwargs(w.kwargs, 6)
    with torch.no_grad():
        got = [main_output(two(*w.args, **kw)).clone() for kw in calls]
        want = [main_output(one(*w.args, **kw)).clone() for kw in calls]
    if graphs == "auto":
        assert two._specs[two._first_key].runner.graph is not None
    for a, b in zip(got, want, strict=True):
        assert same_value(a, b)
    assert not all(same_value(got[0], t) for t in got[1:])  # the inputs did change


def test_the_side_stream_runs_the_text_kernels(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    w, opt = _optimized("qwen-image-tiny", True, False, monkeypatch)
    with torch.no_grad():
        opt(*w.args, **w.kwargs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt(*w.args, **w.kwargs)
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    per_stream = Counter(e["args"]["stream"] for e in events if e.get("cat") == "kernel")
    assert len(per_stream) >= 2, per_stream
    assert min(per_stream.values()) >= 4, per_stream  # the text GEMMs and their neighbours


def test_a_single_stream_model_keeps_one_stream(monkeypatch) -> None:  # noqa: ANN001
    _, opt = _optimized("llm-tiny", True, "auto", monkeypatch)
    plan = opt._specs[opt._first_key].plan
    assert plan.summary.streams.startswith("one stream"), plan.summary.streams
