"""rowwise_fusion on CUDA: the same sites as on the CPU fuse on the bf16 tiny models, and the
rewritten graphs, now running the Triton row-wise kernels, verify at the declared tolerance tier
against fp64; the exact parts (the residual update) stay bitwise equal to the eager ops.

    pytest -q -m gpu tests/gpu/test_rowwise_fusion_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.capture import flatten_inputs
from kopt.graph import copy_graph_module
from kopt.models import build
from kopt.passes.base import RewritePass
from kopt.patterns.rowwise_fusion import NUMERICS, NUMERICS_FP32, rowwise_fusions
from kopt.verify import VerifyOptions, compare, random_inputs, run_flat
from tests.cpu.test_rowwise_fusion import (
    CONFIGS,
    EXPECTED,
    RNQ,
    AdaLN,
    RMSBlock,
    _adaln_inputs,
    _fired,
)

pytestmark = pytest.mark.gpu


def _fuse(gm: torch.fx.GraphModule, intermediates: str = "eager") -> tuple[
        torch.fx.GraphModule, object]:
    after = copy_graph_module(gm)
    return after, RewritePass("rowwise_fusion", list(rowwise_fusions(intermediates))).run(after)


# the pipeline runs the rewrites before hoisting: adaLN is then the template's modulation step
CASES = [*EXPECTED, ("qwen-image-tiny", "fp8_unhoisted"), ("flux2-tiny", "fp8_unhoisted")]


@pytest.mark.parametrize(("name", "config"), CASES)
def test_fusions_verify_on_cuda(name: str, config: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, CONFIGS[config],
                        verify=VerifyOptions(enabled=False))
    gm, inputs = opt.graph_module, list(flatten_inputs(w.args, w.kwargs)[0])
    after, result = _fuse(gm)
    assert _fired(after) == EXPECTED[(name, config.replace("_unhoisted", ""))][0], result.details
    verdict = compare(gm, after, inputs, NUMERICS, VerifyOptions())
    assert verdict.passed, verdict
    print(f"{name} {config}: {result.matched} sites, {verdict}")


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_fp32_intermediates_verify_on_cuda(name: str) -> None:
    """``FP8Config(intermediates="fp32")``'s rewrites: the same sites, verified at their tier
    with the Triton kernels against fp64."""
    w = build(name, device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, CONFIGS["fp8"],
                        verify=VerifyOptions(enabled=False))
    gm, inputs = opt.graph_module, list(flatten_inputs(w.args, w.kwargs)[0])
    after, result = _fuse(gm, "fp32")
    assert _fired(after) == EXPECTED[(name, "fp8")][0], result.details
    verdict = compare(gm, after, inputs, NUMERICS_FP32, VerifyOptions())
    assert verdict.passed, verdict
    print(f"{name} fp32 intermediates: {result.matched} sites, {verdict}")


@pytest.mark.parametrize("kwargs", [{}, {"scale1": True}])
def test_adaln_seam_on_cuda_residual_bitwise_rest_within_tier(kwargs: dict) -> None:
    model = AdaLN(dim=80, **kwargs).to("cuda", torch.bfloat16).eval()
    args = tuple(a.cuda() for a in _adaln_inputs(dim=80))
    opt = kopt.optimize(model, args, config=CONFIGS["fp8"], verify=VerifyOptions(enabled=False))
    gm = opt.graph_module
    after, _ = _fuse(gm)
    assert _fired(after) == {RNQ: 1}
    fresh = random_inputs(list(args), 3)
    (h_want, _), (h_got, _) = run_flat(gm, fresh), run_flat(after, fresh)
    assert torch.equal(h_got, h_want)  # x + gate * y rounds like the eager ops
    verdict = compare(gm, after, list(args), NUMERICS, VerifyOptions())
    assert verdict.passed, verdict


@pytest.mark.parametrize("style", ["llama", "aten", "layer"])
def test_llm_seam_on_cuda_within_tier(style: str) -> None:
    model = RMSBlock(style).to("cuda", torch.bfloat16).eval()
    args = tuple(torch.randn(2, 7, 48, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opt = kopt.optimize(model, args, config=CONFIGS["fp8"], verify=VerifyOptions(enabled=False))
    after, _ = _fuse(opt.graph_module)
    assert _fired(after) == {RNQ: 1}
    verdict = compare(opt.graph_module, after, list(args), NUMERICS, VerifyOptions())
    assert verdict.passed, verdict
