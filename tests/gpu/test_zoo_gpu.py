"""kopt on the zoo's models (kopt.models.zoo: DiTs and LLMs nobody tuned it for) on CUDA in
bf16, with and without FP8: every pass verifies (its Triton kernels at shapes of models it was
not written against), nothing is reverted, and the output stays within the tier of the
model's own bf16 output (with FP8: within a tenth of the FP8 recipe's own error)."""

from __future__ import annotations

import pytest
import torch

import kopt
from kopt.capture import capture_module, flatten_inputs
from kopt.models import main_output
from kopt.models.zoo import ZOO, build
from kopt.verify import RTOL_FLOOR, relative_error, run_fp64
from tests.zoo_errors import fp8_errors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_on_cuda(name: str, fp8: bool) -> None:
    w = build(name, device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16)) if fp8 else kopt.PassConfig()
    opt = kopt.optimize(w.model, w.args, w.kwargs, config)
    report = opt.report
    assert report.verified, str(report)
    assert not [r.name for r in report.passes if r.reverted], str(report)
    got = w.run(opt)
    flat, _ = flatten_inputs(w.args, w.kwargs)
    ref = main_output(run_fp64(capture_module(w.model, w.args, w.kwargs).gm, flat))
    eager = relative_error(w.run(), ref)
    if fp8:
        # the FP8 recipe alone (the fp8 pass, nothing else) sets the error; the fusions,
        # each verified in its tier, add at most a tenth to it end to end
        kopt_error, recipe_error = fp8_errors(w, opt, config.fp8)
        assert kopt_error <= 1.1 * recipe_error, str(report)
    else:
        assert relative_error(got, ref) <= 2 * max(eager, RTOL_FLOOR[torch.bfloat16])
