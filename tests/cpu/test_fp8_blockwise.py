"""FP8 blockwise layout: 128x128 weight blocks (quantized at load) x 1x128 activation groups.
Fires where features are multiples of 128, says why not elsewhere; each site within the FP8
bound of its fp64 linear; the block quantizer and the GEMM's CPU path against direct math."""

from __future__ import annotations

import torch
from torch import nn

import kopt
from kopt.codegen.kernels.fp8_blockwise import (
    blockwise_mm_exact,
    quant_fp8_block128_reference,
)
from kopt.codegen.kernels.quant_fp8 import E4M3_MAX, quant_fp8_group_reference

BLOCKWISE = kopt.PassConfig(fp8=kopt.FP8Config(layout="blockwise", min_features=16))


def test_block_quantizer_scales_each_128x128_block_by_its_own_amax() -> None:
    w = torch.randn(256, 384)
    w[:128, 128:256] *= 100  # one loud block must not coarsen its neighbours
    q, s = quant_fp8_block128_reference(w)
    assert q.shape == w.shape and s.shape == (2, 3)
    assert torch.equal(s[0, 1], w[:128, 128:256].abs().max() / E4M3_MAX)
    assert torch.equal(s[1, 0], w[128:, :128].abs().max() / E4M3_MAX)
    deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()


def test_blockwise_gemm_cpu_path_is_the_rounded_exact_product() -> None:
    x, w = torch.randn(5, 256), torch.randn(128, 256)
    qx, sx = quant_fp8_group_reference(x)
    qw, sw = quant_fp8_block128_reference(w)
    got = torch.ops.kopt.fp8_blockwise_mm(qx, sx, qw, sw, torch.bfloat16)
    exact = blockwise_mm_exact(qx, sx, qw, sw)
    assert torch.equal(got, exact.to(torch.bfloat16))
    rel = (exact - x.double() @ w.double().t()).norm() / (x.double() @ w.double().t()).norm()
    assert 0 < rel < 2**-4


def test_exact_product_dequantizes_the_weight_in_128_row_groups(monkeypatch) -> None:  # noqa: ANN001
    """The fp64 yardstick of a full-size blockwise GEMM must fit: the weight is dequantized a
    group of 128 rows at a time (here 1 group), the product the same as at once (up to fp64's
    own summation order)."""
    import kopt.codegen.kernels.fp8_blockwise as B

    x, w = torch.randn(5, 256), torch.randn(384, 256)
    qx, sx = quant_fp8_group_reference(x)
    qw, sw = quant_fp8_block128_reference(w)
    whole = B._dequant(qx, sx, 1, torch.float64) @ B._dequant(qw, sw, 128, torch.float64).t()
    sizes = []
    dequant = B._dequant
    monkeypatch.setattr(B, "_dequant", lambda q, *a: sizes.append(q.shape[0]) or dequant(q, *a))
    monkeypatch.setattr(B, "EXACT_CHUNK_BYTES", 8 * 256 * 128)  # one 128-row group
    got = B.blockwise_mm_exact(qx, sx, qw, sw)
    torch.testing.assert_close(got, whole, rtol=1e-14, atol=1e-12)
    assert sizes == [5, 128, 128, 128]  # the activation, then the weight by 128-row groups


def test_block_quantizer_upcasts_the_weight_in_128_row_groups(monkeypatch) -> None:  # noqa: ANN001
    """A merged weight of 2.2M rows (W1's modulation) must not be upcast to fp32 at once: the
    result by 128-row groups is bitwise the one of a single chunk."""
    import kopt.codegen.kernels.fp8_blockwise as B

    w = torch.randn(384, 256, dtype=torch.bfloat16)
    w[128:256] *= 50
    q1, s1 = quant_fp8_block128_reference(w)
    monkeypatch.setattr(B, "QUANT_CHUNK_BYTES", 4 * 256 * 128)  # one 128-row group a time
    q2, s2 = B.quant_fp8_block128_reference(w)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    assert len(set(s2[:, 0].tolist())) == 3  # each group its own scales


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(512, 384)
        self.odd = nn.Linear(384, 200)  # 200 is not a multiple of 128
        self.down = nn.Linear(384, 256)  # 384 in-features: K/128 = 3 scale columns, not 4k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        return self.odd(h), self.down(torch.relu(h))


def test_blockwise_fires_where_features_are_multiples_of_128() -> None:
    opt = kopt.optimize(_MLP().eval(), (torch.randn(3, 7, 512),), config=BLOCKWISE)
    fp8 = opt.report.result("fp8")
    assert fp8.matched == 1 and fp8.verdict.passed and fp8.verdict.tier == "bounded"
    assert fp8.rejected == {
        "features 384 -> 200 not multiples of 128 (128x128 weight blocks)": 1,
        "in-features 384 not a multiple of 512 (cuBLAS pads blockwise scales to 4 per K)": 1}
    targets = [n.target for n in opt.graph_module.graph.nodes]
    assert torch.ops.kopt.fp8_blockwise_mm.default in targets
    assert torch.ops.kopt.quant_fp8_group.default in targets
    # the weight quantization was folded: no block quantizer runs per call
    assert torch.ops.kopt.quant_fp8_block128.default not in targets
