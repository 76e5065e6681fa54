"""The blockwise FP8 layout on CUDA: kopt::fp8_blockwise_mm (F.scaled_mm's blockwise recipe)
against the exact product of the same quantized operands, and the fp8 pass in that layout
verifying end to end on a module with 128-multiple features."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kopt
from kopt.codegen.kernels.fp8_blockwise import blockwise_mm_exact, quant_fp8_block128_reference
from kopt.codegen.kernels.quant_fp8 import quant_fp8_group_reference
from kopt.verify import relative_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("m", "n", "k"), [(4224, 3072, 3072), (1, 18432, 3072), (130, 256, 512)])
def test_blockwise_gemm_matches_the_exact_product(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qx, sx = torch.ops.kopt.quant_fp8_group(x)
    qw, sw = quant_fp8_block128_reference(w)
    ref_q, ref_s = quant_fp8_group_reference(x)
    assert torch.equal(qx.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sx, ref_s)
    got = torch.ops.kopt.fp8_blockwise_mm(qx, sx, qw, sw, torch.bfloat16)
    exact = blockwise_mm_exact(qx, sx, qw, sw)
    # the library GEMM accumulates in fp32 and rounds once to bf16
    assert relative_error(got, exact) < 2**-8


def test_fp8_pass_in_blockwise_layout_verifies_on_cuda() -> None:
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(approximate="tanh"), nn.Linear(1024, 512))
    model = model.to("cuda", torch.bfloat16).eval()
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(layout="blockwise", min_features=16))
    opt = kopt.optimize(model, (x,), config=config)
    fp8 = opt.report.result("fp8")
    assert fp8.matched == 2 and fp8.verdict.passed, str(opt.report)
    with torch.no_grad():
        assert relative_error(opt(x), model(x)) < 0.1
