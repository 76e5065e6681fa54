"""Hoisting, FP8 and bias absorption on CUDA: the optimized module captured in a CUDA graph
replays correctly with a new timestep (hoisted caches never replay stale), and the FP8 path
(torch._scaled_mm rowwise, bias in its epilogue) verifies on the three tiny models."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.models import build
from kopt.verify import relative_error

pytestmark = pytest.mark.gpu
FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def test_cuda_graph_of_the_hoisted_module_replays_a_new_timestep() -> None:
    """A caller that captures the optimized module in a CUDA graph of its own (its default,
    cuda_graphs="auto", then runs the call eagerly into that capture)."""
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    assert opt.report.result("hoist").matched == 1
    static = dict(w.kwargs, timestep=w.kwargs["timestep"].clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):  # warm-up: the second call hits the cache
            opt(**static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = opt(**static)[0]
    static["timestep"].copy_(w.kwargs["timestep"] * 0.5)
    graph.replay()
    with torch.no_grad():
        want = w.model(**static)[0]
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_fp8_and_bias_absorption_verify_on_cuda(name: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    fp8 = opt.report.result("fp8")
    assert fp8.matched >= 8 and fp8.verdict.passed, str(opt.report)
    absorbed = opt.report.result("absorb_bias")
    assert absorbed.verdict is None or absorbed.verdict.passed, str(opt.report)
    if name == "qwen-image-tiny":
        assert absorbed.matched == fp8.matched
    print(f"{name}: {fp8.verdict.detail}")


def test_cuda_graph_mode_replays_cfg_pairs_with_changing_timesteps() -> None:
    """optimize(cuda_graphs=True): the forward is replayed from a CUDA graph with the hoisted
    timestep work outside it: equal to the plain optimized module at every call, for cond and
    uncond calls and new timesteps, and a kept cond output survives the uncond replay."""
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    plain = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=False)
    graphed = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=True)
    runner_checked = False
    for step in range(4):
        t = w.kwargs["timestep"] * (1.0 - 0.2 * step)
        cond = dict(w.kwargs, timestep=t)
        uncond = dict(cond, encoder_hidden_states=torch.randn_like(cond["encoder_hidden_states"]))
        with torch.no_grad():
            got_c = graphed(**cond)[0]
            got_u = graphed(**uncond)[0]
            want_c, want_u = plain(**cond)[0], plain(**uncond)[0]
        assert torch.equal(got_c, want_c), f"step {step} cond"
        assert torch.equal(got_u, want_u), f"step {step} uncond"
        runner = graphed._specs[graphed._first_key].runner
        if runner.graph is not None and not runner_checked:
            assert runner.hoisted_outside
            # the region's views run in the replay: the prelude hands over one GEMM's output
            assert [len(r) for r in runner._last_regions] == [1]
            runner_checked = True
    assert runner_checked
    (hits, misses), = graphed.cache_stats().values()
    assert hits >= 4 and misses >= 4


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_gemm_epilogue_verifies_with_the_triton_gemm(name: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), gemm_epilogue=True)
    opt = kopt.optimize(w.model, w.args, w.kwargs, config)
    result = opt.report.result("gemm_epilogue")
    assert result.matched >= 4 and result.verdict.passed, str(opt.report)
    print(f"{name}: {result.verdict.detail}")


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_triton_gemm_takes_every_fp8_gemm_and_verifies(name: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), triton_gemm=True)
    opt = kopt.optimize(w.model, w.args, w.kwargs, config, cuda_graphs=True)
    result = opt.report.result("triton_gemm")
    assert result.matched >= 4 and result.verdict.passed, str(opt.report)
    assert not any(n.target is torch.ops.aten._scaled_mm.default
                   for m in opt.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)
    plain = kopt.optimize(w.model, w.args, w.kwargs, config.replace(triton_gemm=False))
    with torch.no_grad():
        first = opt(*w.args, **w.kwargs)[0]
        for _ in range(2):  # captured, then replayed
            got = opt(*w.args, **w.kwargs)[0]
        want = plain(*w.args, **w.kwargs)[0]
    assert torch.equal(got, first)  # the replay computes what the eager call did
    # the FP8 quantizers after each GEMM round the two GEMMs' outputs to different e4m3 values
    # here and there: compared norm-wise, at the FP8 graph's own error (verified above)
    err = relative_error(got, want)
    print(f"{name}: {result.verdict.detail}; vs the cuBLAS graph {err:.2e}")
    assert err < 0.05
