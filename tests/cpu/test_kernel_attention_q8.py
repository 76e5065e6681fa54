"""kopt::attention_q8 under Triton's interpreter: the kernel against its reference (the same
INT8 / e4m3 operands, the softmax without P's rounding) and fp64 attention on small awkward
shapes, the quantizers against the reference's, and the op's contract. The interpreter
multiplies the INT8 operands as the fp32 integers they hold (exact) and its bf16 arithmetic is
fp32, so values are compared with tolerance here and on the GPU in tests/gpu."""

from __future__ import annotations

import math

import pytest
import torch

from kopt.codegen.kernels import attention_q8 as A


def _inputs(b, h, sq, skv, d, seed=0, bshd=True, key_offset=0.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(s, offset=0.0):
        x = torch.randn(b, s, h, d, generator=g) + offset * torch.randn(d, generator=g)
        x = x.bfloat16()
        return x.transpose(1, 2) if bshd else x.transpose(1, 2).contiguous()
    return rnd(sq), rnd(skv, key_offset), rnd(skv)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _fp64(q, k, v, scale):
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()


@pytest.mark.parametrize("pv", A.PV_MODES)
@pytest.mark.parametrize(("shape", "config"), [
    ((1, 2, 70, 200, 64), (64, 64, 4, 1)),   # keys: three v-scale blocks, the last partial
    ((2, 1, 1, 130, 128), (64, 64, 4, 1)),   # one query row
    ((1, 1, 40, 128, 64), (32, 128, 4, 1)),  # one key block of the scale's width
], ids=["partial-key-block", "one-query", "one-scale-block"])
@pytest.mark.parametrize("bshd", [True, False], ids=["bshd", "bhsd"])
def test_kernel_is_the_reference_up_to_ps_rounding(shape, config, pv, bshd):
    b, h, sq, skv, d = shape
    q, k, v = _inputs(b, h, sq, skv, d, seed=sq + skv, bshd=bshd)
    scale = 1 / math.sqrt(d)
    out = A.attention_q8_triton(q, k, v, scale, pv, bshd, config)
    ref = A._reference(q, k, v, scale, pv, bshd)
    assert out.shape == q.shape and out.stride() == ref.stride() and out.dtype == q.dtype
    # P's rounding (BF16: 2^-9 relative per weight, e4m3: 2^-4) is the one step the reference
    # leaves out, averaged by the sum; a wrong scale, layout or block would be off by O(1)
    assert _rel(out, ref) < (2**-6 if pv == "bf16" else 2**-4)
    assert _rel(out, _fp64(q, k, v, scale)) <= A.BOUND[pv]


def test_keys_with_a_large_common_offset_stay_within_the_bound():
    """The smoothing: keys that share a per-channel offset 20x their spread (a DiT's keys
    share such offsets) lose nothing, since the offset is subtracted before the per-key scale
    is taken; without it the INT8 step would grow with the offset."""
    q, k, v = _inputs(1, 2, 64, 192, 64, seed=5, key_offset=20.0)
    scale = 1 / math.sqrt(64)
    out = A.attention_q8_triton(q, k, v, scale, "bf16", True, (32, 64, 4, 1))
    plain = _inputs(1, 2, 64, 192, 64, seed=5)[1]
    assert _rel(out, _fp64(q, k, v, scale)) <= A.BOUND["bf16"]
    # same error size as the same keys without the offset
    err_plain = _rel(A.attention_q8_triton(q, plain, v, scale, "bf16", True, (32, 64, 4, 1)),
                     _fp64(q, plain, v, scale))
    assert _rel(out, _fp64(q, k, v, scale)) < 3 * err_plain


def test_quantizers_match_the_reference():
    q, k, v = _inputs(1, 2, 50, 300, 64, seed=2)
    q8, k8, sq, sk = A.quantize_qk(q, k, 1 / A._LOG2E)  # sq: q's own scale (times 1.0)
    assert q8.dtype == k8.dtype == torch.int8 and q8.shape == (2, 50, 64)
    assert k8.shape == (2, 300, 64) and sq.shape == (2, 50) and sk.shape == (2, 300)
    q32, k32, _ = A.quantized_operands(q, k, v, "bf16")
    got_q = (q8.float() * sq[..., None]).view(1, 2, 50, 64)
    got_k = (k8.float() * sk[..., None]).view(1, 2, 300, 64)
    torch.testing.assert_close(got_q, q32, rtol=0, atol=0)
    torch.testing.assert_close(got_k, k32, rtol=0, atol=0)
    assert k8.abs().max() == 127 and q8.abs().max() == 127  # each row's max is on the grid's end
    vt, vs = A.quantize_v(v)
    assert vt.dtype == A.E4M3 and vt.shape == (2, 64, 300) and vs.shape == (2, 3, 64)
    _, _, v32 = A.quantized_operands(q, k, v, "fp8")
    vscale = vs.repeat_interleave(A.QB, 1)[:, :300]  # [BH, S, D]
    torch.testing.assert_close((vt.float().transpose(1, 2) * vscale).view(1, 2, 300, 64), v32,
                               rtol=0, atol=0)


@pytest.mark.parametrize(("args", "message"), [
    (dict(pv="int4"), "unknown pv mode"),
    (dict(q=torch.randn(1, 2, 8, 64)), "bf16 or fp16"),
    (dict(k=torch.randn(1, 2, 16, 32).bfloat16()), "do not match"),
    (dict(q=torch.randn(2, 8, 64).bfloat16()), "takes \\[B, H, S, D\\]"),
], ids=["mode", "dtype", "head-dim", "rank"])
def test_bad_operands_say_what_is_wrong(args, message):
    q, k, v = _inputs(1, 2, 8, 16, 64)
    call = dict(q=q, k=k, v=v, scale=0.125, pv="bf16", bshd=False) | args
    if "k" in args:
        call["v"] = args["k"]
    with pytest.raises(ValueError, match=message):
        A.attention_q8_triton(**call)
    with pytest.raises(ValueError, match=message):
        A.attention_q8(**call)


def test_head_dims_the_kernel_has_no_tile_for_are_refused():
    q, k, v = _inputs(1, 1, 8, 16, 96)
    with pytest.raises(ValueError, match="head dim 96"):
        A.attention_q8_triton(q, k, v, 0.1, "bf16", True)
