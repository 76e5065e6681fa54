"""kopt::act_quant_fp8_group on the GPU: bitwise the unfused ops (bias add, activation,
kopt::quant_fp8_group) for the exact activations, within one e4m3 step on under 0.1% of the
values for the fast ones; and the op on the W1/W2 image-token shapes."""

from __future__ import annotations

import pytest
import torch

from kopt.codegen.kernels.act_quant_group import (
    act_quant_group_reference,
    act_quant_group_triton,
)
from tests.gpu.test_kernels_specialised_gpu import _check_act_quant

pytestmark = pytest.mark.gpu


def _inputs(rows, n, activation, bias, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    merged = (torch.randn(rows, 2 * n, device="cuda", generator=g) * 3).to(dtype)
    b = (torch.randn(n, device="cuda", generator=g)).to(dtype) if bias else None
    return merged[:, :n], merged[:, n:] if activation.startswith("silu_mul") else None, b


@pytest.mark.parametrize(("rows", "n", "activation", "bias"), [
    (4096, 12288, "gelu_tanh", True),       # W1 image MLP (blockwise FP8: the bias is here)
    (4096, 12288, "gelu_tanh:fast", True),
    (128, 12288, "gelu_tanh", True),        # W1 text MLP
    (4096, 18432, "silu_mul", False),       # W2 image FF
    (4096, 18432, "silu_mul:fast", False),
    (333, 1000, "gelu_tanh", True),         # a partial last group, odd rows
    (333, 1000, "silu_mul", False),
])
def test_bitwise_the_unfused_ops(rows, n, activation, bias):
    x, up, b = _inputs(rows, n, activation, bias)
    q, s = act_quant_group_triton(x, up, activation, b)
    q_ref, s_ref = act_quant_group_reference(x, up, activation, b)
    assert s.stride() == s_ref.stride() == (1, rows)
    _check_act_quant(q, s, q_ref, s_ref, activation)


@pytest.mark.parametrize("activation", ["silu_mul", "silu_mul:fast"])
def test_bitwise_with_the_attention_output_beside_it(activation):
    """FLUX.2's single-stream blocks: cat([attention (6144), swiglu (18432)]) per token."""
    x, up, _ = _inputs(4608, 18432, activation, False, seed=4)
    other = torch.randn(4608, 6144, device="cuda").bfloat16() * 2
    q, s = act_quant_group_triton(x, up, activation, None, other, True)
    _check_act_quant(q, s, *act_quant_group_reference(x, up, activation, None, other, True),
                     activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bitwise_in_other_dtypes(dtype):
    x, _, b = _inputs(200, 640, "gelu_tanh", True, dtype=dtype, seed=2)
    q, s = act_quant_group_triton(x, None, "gelu_tanh", b)
    _check_act_quant(q, s, *act_quant_group_reference(x, None, "gelu_tanh", b), "gelu_tanh")


@pytest.mark.parametrize("config", [(128, 16, 4), (512, 8, 8), (2048, 1, 8)])
def test_configs_are_bitwise(config):
    x, _, b = _inputs(1000, 3072, "gelu_tanh", True, seed=3)
    q, s = act_quant_group_triton(x, None, "gelu_tanh", b, config=config)
    _check_act_quant(q, s, *act_quant_group_reference(x, None, "gelu_tanh", b), "gelu_tanh")
