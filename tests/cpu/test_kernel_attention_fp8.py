"""kopt::attention_fp8 under Triton's interpreter: the kernel against its reference (the same
e4m3 operands, the softmax without P's rounding) and fp64 attention on small awkward shapes,
and the op's contract. The interpreter's casts are emulated on the e4m3 grid (bit-exact); its
bf16 arithmetic is fp32, so values are compared with tolerance here and on the GPU in
tests/gpu."""

from __future__ import annotations

import math

import pytest
import torch

from kopt.codegen.kernels import attention_fp8 as A


def _inputs(b, h, sq, skv, d, seed=0, bshd=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(s):
        x = torch.randn(b, s, h, d, generator=g).bfloat16()
        return x.transpose(1, 2) if bshd else x.transpose(1, 2).contiguous()
    return rnd(sq), rnd(skv), rnd(skv)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("qk", A.MODES)
@pytest.mark.parametrize(("shape", "config"), [
    ((1, 2, 70, 200, 64), (64, 64, 4, 1)),   # keys: three blocks, the last partial
    ((2, 1, 1, 130, 128), (64, 64, 4, 1)),   # one query row
    ((1, 1, 40, 128, 64), (32, 128, 4, 1)),  # one key block of the scale's width
], ids=["partial-key-block", "one-query", "one-scale-block"])
@pytest.mark.parametrize("bshd", [True, False], ids=["bshd", "bhsd"])
def test_kernel_is_the_reference_up_to_ps_rounding(shape, config, qk, bshd):
    b, h, sq, skv, d = shape
    q, k, v = _inputs(b, h, sq, skv, d, seed=sq + skv, bshd=bshd)
    scale = 1 / math.sqrt(d)
    out = A.attention_fp8_triton(q, k, v, scale, qk, bshd, config)
    ref = A._reference(q, k, v, scale, qk, bshd)
    assert out.shape == q.shape and out.stride() == ref.stride() and out.dtype == q.dtype
    # P in e4m3 is the one step the reference leaves out: 2^-4 relative per weight at most,
    # averaged by the sum (a wrong scale, layout or block would be off by O(1))
    assert _rel(out, ref) < 2**-4
    f64 = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()
    assert _rel(out, f64) <= A.BOUND[qk]


def test_quantized_operands_are_on_the_e4m3_grid_of_their_block_scale():
    q, k, v = _inputs(1, 1, 5, 300, 64, seed=2)
    k8, vt, ks, vs = A.quantize_kv(k, v, True)
    assert k8.dtype == vt.dtype == A.E4M3 and vt.shape == (1, 1, 64, 300) and ks.shape == (1, 3)
    _, k32, v32 = A.quantized_operands(q, k, v, "fp8")
    scale = ks.view(-1).repeat_interleave(A.QB)[:300, None]
    torch.testing.assert_close(k8.float()[0, 0] * scale, k32[0, 0], rtol=0, atol=0)
    vscale = vs.view(-1).repeat_interleave(A.QB)[:300, None]
    torch.testing.assert_close(vt.float()[0, 0].t() * vscale, v32[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize(("args", "message"), [
    (dict(qk="int8"), "unknown qk mode"),
    (dict(q=torch.randn(1, 2, 8, 64)), "bf16 or fp16"),
    (dict(k=torch.randn(1, 2, 16, 32).bfloat16()), "do not match"),
    (dict(q=torch.randn(2, 8, 64).bfloat16()), "takes \\[B, H, S, D\\]"),
], ids=["mode", "dtype", "head-dim", "rank"])
def test_bad_operands_say_what_is_wrong(args, message):
    q, k, v = _inputs(1, 2, 8, 16, 64)
    call = dict(q=q, k=k, v=v, scale=0.125, qk="fp8", bshd=False) | args
    if "k" in args:
        call["v"] = args["k"]
    with pytest.raises(ValueError, match=message):
        A.attention_fp8_triton(**call)
    with pytest.raises(ValueError, match=message):
        A.attention_fp8(**call)


def test_head_dims_the_kernel_has_no_tile_for_are_refused():
    q, k, v = _inputs(1, 1, 8, 16, 96)
    with pytest.raises(ValueError, match="head dim 96"):
        A.attention_fp8_triton(q, k, v, 0.1, "fp8", True)
