"""The foundation on CUDA in bf16: capture, passes and verification, and the torch.compile
backend with Inductor, on the three tiny reference models; the merge tier at W1's QKV shape."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.capture import capture_module, flatten_inputs
from kopt.graph import copy_graph_module
from kopt.models import build, main_output
from kopt.passes import RewritePass
from kopt.patterns import MERGE_PROJECTIONS
from kopt.verify import RTOL_FLOOR, VerifyOptions, compare, relative_error, run_fp64
from tests.fixtures import QKV

pytestmark = pytest.mark.gpu
MODELS = ["qwen-image-tiny", "flux2-tiny", "llm-tiny"]


def _within_tier(w, got: torch.Tensor) -> None:  # noqa: ANN001
    flat, _ = flatten_inputs(w.args, w.kwargs)
    ref = main_output(run_fp64(capture_module(w.model, w.args, w.kwargs).gm, flat))
    want = w.run()
    bound = 2 * max(relative_error(want, ref), RTOL_FLOOR[want.dtype])
    assert relative_error(got, ref) <= bound


@pytest.mark.parametrize("name", MODELS)
def test_optimize_bf16_cuda(name: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    assert opt.report.verified, str(opt.report)
    assert opt.report.result("merge_projections").matched >= 4
    _within_tier(w, w.run(opt))


@pytest.mark.parametrize("name", MODELS)
def test_backend_inductor_bf16_cuda(name: str) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    reports: list = []
    compiled = torch.compile(w.model, backend="kopt",
                             options={"inner": "inductor", "reports": reports})
    got = w.run(compiled)
    assert len(reports) == 1 and reports[0].verified
    _within_tier(w, got)


def test_merge_tier_at_w1_qkv_shape() -> None:
    model = QKV(3072).to("cuda", torch.bfloat16).eval()
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    cap = capture_module(model, (x,))
    after = copy_graph_module(cap.gm)
    assert RewritePass("m", [MERGE_PROJECTIONS]).run(after).matched == 1
    verdict = compare(cap.gm, after, [x], MERGE_PROJECTIONS.numerics, VerifyOptions())
    assert verdict.passed, verdict
    bitwise = compare(cap.gm, after, [x], kopt.patterns.exact("probe"), VerifyOptions())
    print(f"merged QKV at 4096x3072 bf16 on {torch.cuda.get_device_name()}: "
          f"bitwise equal to separate GEMMs: {bitwise.passed} ({bitwise.detail})")
