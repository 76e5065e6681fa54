"""kopt::act_quant_fp8_group (bias + activation + 1x128-group FP8): the Triton kernel
(interpreted here) against the reference (the unfused ops) on small awkward shapes, and the
op's contract. The interpreter's exp/erf/tanh differ from torch's CPU ones in the last bit, so
values are compared with tolerance here and bitwise in tests/gpu."""

from __future__ import annotations

import pytest
import torch

from kopt.codegen.kernels.act_quant_group import (
    act_quant_fp8_group,
    act_quant_group_reference,
    act_quant_group_triton,
)
from kopt.codegen.kernels.quant_fp8 import E4M3_MAX, quant_fp8_group_reference
from tests.cpu.test_kernel_act_quant import check_values

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")

ACTIVATIONS = ["silu_mul", "gelu_tanh", "gelu_erf", "silu_mul:fast", "gelu_tanh:fast"]


def _inputs(shape, dtype, activation, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, n = shape
    # rows and 128-groups over several orders of magnitude: every group its own scale
    mag = torch.logspace(-2, 2, n).roll(seed)
    merged = (torch.randn(*lead, 2 * n, generator=g) * torch.cat([mag, mag])).to(dtype)
    x, up = merged[..., :n], merged[..., n:]  # strided halves of one GEMM output
    b = (torch.randn(n, generator=g) * 3).to(dtype) if bias else None
    return x, up if activation.startswith("silu_mul") else None, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("shape", "config"), [
    ((1, 128), None), ((7, 300), None), ((3, 5, 129), None), ((2, 1000), (256, 2, 4)),
], ids=["one-row-one-group", "odd-rows-partial-group", "3d-one-past-a-group", "many-programs"])
def test_triton_matches_the_reference(shape, config, activation, bias, dtype):
    x, up, b = _inputs(shape, dtype, activation, bias)
    check_values(act_quant_group_triton(x, up, activation, b, config=config),
           act_quant_group_reference(x, up, activation, b), dtype)


@pytest.mark.parametrize("activation", ["silu_mul", "gelu_tanh:fast"])
@pytest.mark.parametrize(("other_width", "n", "other_first", "config"), [
    (256, 300, True, None), (128, 384, True, (128, 4, 4)), (200, 256, False, None),
    (384, 512, False, (256, 2, 4)),
], ids=["other-first", "other-first-small-blocks", "act-first-partial-other",
        "act-first-many-programs"])
def test_triton_matches_the_reference_with_a_concatenation(other_width, n, other_first, config,
                                                           activation):
    x, up, _ = _inputs((3, 5, n), torch.bfloat16, activation, False)
    other = (torch.randn(3, 5, other_width) * 10).bfloat16()
    check_values(act_quant_group_triton(x, up, activation, None, other, other_first, config),
           act_quant_group_reference(x, up, activation, None, other, other_first),
           torch.bfloat16)


def test_a_concatenation_whose_first_part_splits_a_group_is_refused():
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        act_quant_group_triton(x, None, "gelu_tanh", None, torch.randn(2, 100).bfloat16(), True)


def test_bias_is_added_before_the_activation_and_rounded_like_torch():
    x, _, b = _inputs((4, 256), torch.bfloat16, "gelu_tanh", bias=True, seed=2)
    q, s = act_quant_fp8_group(x, None, "gelu_tanh", b, None, True)  # the op (CPU: reference)
    want = quant_fp8_group_reference(torch.nn.functional.gelu(x + b, approximate="tanh"))
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
    # and it matters: without the bias the values differ
    assert not torch.equal(q.view(torch.uint8),
                           act_quant_fp8_group(x, None, "gelu_tanh", None, None,
                                               True)[0].view(torch.uint8))


def test_each_group_has_its_own_scale():
    x, _, _ = _inputs((3, 512), torch.float32, "gelu_tanh", bias=False, seed=1)
    q, s = act_quant_group_triton(x, None, "gelu_tanh")
    assert s.shape == (3, 4) and s.stride() == (1, 3)
    # every group's largest value maps to e4m3's largest
    assert (q.float().abs().reshape(3, 4, 128).amax(-1) == E4M3_MAX).all()
    assert len(set(s.flatten().tolist())) == 12


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(bias=torch.zeros(7, dtype=torch.bfloat16)), "one torch.bfloat16 vector of the 256"),
    (dict(bias=torch.zeros(256)), "one torch.bfloat16 vector"),
    (dict(activation="relu"), "activation must be one of"),
], ids=["bias-shape", "bias-dtype", "activation"])
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    args = dict(x=torch.randn(2, 256, dtype=torch.bfloat16), up=None, activation="gelu_tanh",
                bias=None, other=None, other_first=True) | kwargs
    with pytest.raises(ValueError, match=message):
        act_quant_fp8_group(**args)
    with pytest.raises(ValueError, match=message):
        act_quant_group_triton(**args)
