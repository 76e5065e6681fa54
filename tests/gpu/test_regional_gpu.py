"""Inductor on the GPU compiles the optimized graph's repeated blocks once (``kopt.regional``):
a 5-block tiny Qwen-Image in FP8 through ``torch.compile(backend="kopt")`` outlines its three
inner blocks, its output is what the flat graph compiled by Inductor gives, and the outlined
graph replays from a CUDA graph bitwise as it runs without one."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.models import build, qwen_image
from kopt.verify import relative_error
from tests.fixtures import backend_outputs, perturbed_kwargs

pytestmark = pytest.mark.gpu


def test_the_backend_outlines_the_blocks_for_inductor_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=5))
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))
    outs, lines = [], []
    for regional in (True, False):
        torch._dynamo.reset()
        reports: list = []
        compiled = torch.compile(w.model, backend="kopt", dynamic=False, options={
            "config": config, "reports": reports, "regional": regional})
        outs.append(w.run(compiled))
        lines.append(reports[0].inner)
    torch._dynamo.reset()
    assert lines == ["Inductor, 3 repeated block sites compiled as 1 kind(s) of block",
                     "Inductor"]
    # the same kernels but for Inductor's own fusions at the blocks' edges
    assert relative_error(outs[0].float(), outs[1].float()) < 1e-2


def test_the_outlined_blocks_replay_from_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's defaults capture the graph whose block sites call ``kopt::block`` in a CUDA
    graph from the third call; each replay, on fresh inputs, gives bitwise what the same compile
    gives with ``cuda_graphs=False``."""
    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=5))
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))
    calls = perturbed_kwargs(w.kwargs, 5)
    options = {"config": config}
    plain, plain_reports = backend_outputs(w.model, w.args, calls, options, False, clone=True)
    graphed, reports = backend_outputs(w.model, w.args, calls, options, clone=True)
    torch._dynamo.reset()
    assert [r.inner for r in plain_reports + reports] == [
        "Inductor, 3 repeated block sites compiled as 1 kind(s) of block"] * 2
    assert all("CUDA graphs: replayed from one graph" in str(r) for r in reports), \
        "\n".join(map(str, reports))
    for i, (a, b) in enumerate(zip(graphed, plain, strict=True)):
        assert torch.equal(a, b), f"call {i}"
