"""cat_rows: a cat of strided views as whole-row copies. The Triton kernel (interpreter) is
bitwise ``torch.cat`` on awkward shapes, strides and dtypes; the pass fires on cats of slices of
a merged projection, not on near misses (contiguous inputs, rows that are not contiguous,
mixed dtypes), keeps the graph bitwise, and on Qwen-Image and FLUX.2 takes every double-stream
block's joint V cat."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.codegen.kernels.cat_rows import cat_rows_triton, row_view
from kopt.graph import copy_graph_module
from kopt.models import build
from kopt.passes import PassConfig
from kopt.passes.cat import CatRows
from kopt.verify import VerifyOptions, compare

aten = torch.ops.aten


def _slices(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0
            ) -> list[torch.Tensor]:
    """Views like a merged QKV's V: the middle third of the last dim of a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        wide = torch.randn(*s[:-1], 3 * s[-1], generator=g).to(dtype)
        out.append(wide[..., s[-1]:2 * s[-1]])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("shapes", "dim"), [
    ([(1, 7, 3, 5), (1, 130, 3, 5)], 1),      # joint [text; image] V, odd sizes
    ([(2, 3, 4, 6), (2, 5, 4, 6), (2, 1, 4, 6)], 1),  # three inputs, batch 2 (outer stride)
    ([(2, 3, 4, 6), (2, 5, 4, 6)], 1),          # two in one launch, batch 2
    ([(4, 9), (6, 9)], 0),                      # rows of a 2-d slice
    ([(2, 3, 5000), (2, 3, 5000)], 2),          # cat along the last dim, rows > one block
    ([(3, 2, 5), (3, 4, 5)], -2),               # negative dim
])
def test_kernel_is_bitwise_torch_cat(shapes: list, dim: int, dtype: torch.dtype) -> None:
    xs = _slices(shapes, dtype)
    if dim == 2:  # cat along the last dim: each input one contiguous run per (i, j)
        xs = [x.contiguous()[..., :4999] for x in xs]
    assert not all(x.is_contiguous() for x in xs)
    got = cat_rows_triton(xs, dim)
    want = torch.cat(xs, dim)
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_adds_a_bias_on_the_way_bitwise(dtype: torch.dtype) -> None:
    xs = _slices([(1, 7, 3, 5), (1, 130, 3, 5)], dtype, seed=3)
    b = torch.randn(15).to(dtype) * 4
    for biases in ([None, b], [b, b], [b, -2 * b]):
        got = cat_rows_triton(xs, 1, biases)
        want = torch.cat([x if bias is None else x + bias.view(3, 5)
                          for x, bias in zip(xs, biases, strict=True)], 1)
        assert torch.equal(got, want)
        assert torch.equal(torch.ops.kopt.cat_rows(xs, 1, biases), want)
    with pytest.raises(ValueError, match="not one torch.* vector of the 15 values"):
        cat_rows_triton(xs, 1, [None, b[:5]])


def test_kernel_falls_back_where_rows_are_not_contiguous() -> None:
    x = torch.randn(4, 6, 5).transpose(1, 2)  # [4, 5, 6], values after dim 1 strided
    assert isinstance(row_view(x, 1), str)
    assert torch.equal(cat_rows_triton([x, x], 1), torch.cat([x, x], 1))


def test_the_op_is_registered_with_a_fake() -> None:
    xs = _slices([(1, 3, 2, 4), (1, 5, 2, 4)], torch.bfloat16)
    out = torch.ops.kopt.cat_rows(xs, 1)
    assert torch.equal(out, torch.cat(xs, 1))
    torch.library.opcheck(torch.ops.kopt.cat_rows.default, (xs, 1))


class JointV(nn.Module):
    """Two streams' merged QKV projections, V sliced and joined [text; image]."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.img = nn.Linear(dim, 3 * dim)
        self.txt = nn.Linear(dim, 3 * dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        b, d = img.shape[0], img.shape[-1]
        vi = self.img(img)[..., 2 * d:].unflatten(-1, (self.heads, -1))
        vt = self.txt(txt)[..., 2 * d:].unflatten(-1, (self.heads, -1))
        joint = torch.cat([vt, vi], dim=1)
        return joint.transpose(1, 2).reshape(b, -1) * 2


class BiasedJointV(JointV):
    """JointV whose projections' bias adds stand after the GEMM, as the blockwise FP8 GEMM
    leaves them (split per slice: V's slice of each bias added to V's slice)."""

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        b, d = img.shape[0], img.shape[-1]
        vs = []
        for proj, x in ((self.txt, txt), (self.img, img)):
            y = nn.functional.linear(x, proj.weight)
            vs.append((y[..., 2 * d:] + proj.bias[2 * d:]).unflatten(-1, (self.heads, -1)))
        joint = torch.cat(vs, dim=1)
        return joint.transpose(1, 2).reshape(b, -1) * 2


def test_pass_takes_the_bias_adds_of_the_slices_into_the_copy() -> None:
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 9, 32, generator=g), torch.randn(2, 4, 32, generator=g))
    result, after = _run(BiasedJointV(), inputs)
    assert result.matched == 1
    [cat] = [n for n in after.graph.nodes if n.target is torch.ops.kopt.cat_rows.default]
    assert [b is not None for b in cat.args[2]] == [True, True]
    assert not any(n.target is aten.add.Tensor for n in after.graph.nodes)


class NearMisses(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        plain = torch.cat([x, y], 2)                              # contiguous: ATen is fine
        transposed = torch.cat([x.transpose(1, 2), y.transpose(1, 2)], 1)  # rows strided
        # a row broadcast over heads (stride 0 after the cat dim) beside a strided slice: no
        # row view (a fake tensor's view raises ValueError, not RuntimeError)
        expanded = torch.cat([x.unsqueeze(2).expand(2, 4, 5, 3),
                              x[:, :2].unsqueeze(2).expand(2, 2, 5, 3)], 1)
        # RoPE's rotate-half: a cat along the last dim, rows of one element
        half = torch.cat([-x[..., 1:], x[..., :1]], -1)
        return plain.sum() + transposed.sum() + expanded.sum() + half.sum()


def _run(model: nn.Module, inputs: tuple):  # noqa: ANN202
    cap = capture_module(model.eval(), inputs)
    after = copy_graph_module(cap.gm)
    result = CatRows().run(after)
    verdict = compare(cap.gm, after, list(inputs), CatRows.numerics)
    assert verdict.passed, verdict
    return result, after


def test_pass_fires_on_the_joint_v_cat_and_stays_bitwise() -> None:
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 9, 32, generator=g), torch.randn(2, 4, 32, generator=g))
    result, after = _run(JointV(), inputs)
    assert result.matched == 1
    targets = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert torch.ops.kopt.cat_rows.default in targets and aten.cat.default not in targets


def test_pass_rejects_near_misses_with_reasons() -> None:
    g = torch.Generator().manual_seed(2)
    inputs = (torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, 5, generator=g))
    result, _ = _run(NearMisses(), inputs)
    assert result.matched == 0
    reasons = " | ".join(result.rejected)
    assert "contiguous: ATen" in reasons and "not contiguous in each row" in reasons
    assert "do not collapse to one stride" in reasons and "too short for row copies" in reasons


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny"])
def test_joint_v_cats_of_double_stream_blocks_become_row_copies(name: str) -> None:
    """One site per double-stream block (the [text; image] V join); FLUX.2's single-stream
    blocks run on the joint sequence already and have none."""
    w = build(name, dtype=torch.float32)
    cap = capture_module(w.model.eval(), w.args, w.kwargs)
    spec = optimize_captured(cap, PassConfig(cat_rows=True), VerifyOptions(seeds=(0,)), None,
                             name, 0.0)
    blocks = len(w.model.transformer_blocks)
    assert spec.report.result("cat_rows").matched == blocks
    assert spec.report.verified
