"""kopt::attention_q8 on the GPU: the Triton kernel against its reference and fp64 attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kopt.codegen.kernels import attention_q8 as A

pytestmark = pytest.mark.gpu


def _inputs(b, h, sq, skv, d, seed, bshd=True):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(s, offset=0.0):
        x = torch.randn(b, s, h, d, device="cuda", generator=g)
        x = (x + offset * torch.randn(d, device="cuda", generator=g)).bfloat16()
        return x.transpose(1, 2) if bshd else x.transpose(1, 2).contiguous()
    return rnd(sq), rnd(skv, 4.0), rnd(skv)


def _fp64(q, k, v, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v.double()


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("pv", A.PV_MODES)
@pytest.mark.parametrize("shape", [(1, 4, 1000, 1000, 128), (2, 3, 300, 700, 64),
                                   (1, 2, 4224, 4224, 128), (1, 1, 1, 130, 128)])
@pytest.mark.parametrize("bshd", [True, False])
def test_within_the_declared_bound_of_fp64(pv, shape, bshd):
    b, h, sq, skv, d = shape
    q, k, v = _inputs(b, h, sq, skv, d, seed=sq + skv, bshd=bshd)
    scale = 1 / math.sqrt(d)
    out = A.attention_q8(q, k, v, scale, pv, bshd)
    ref64 = _fp64(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.stride() == A._out(q, bshd).stride()
    err = _rel(out, ref64)
    assert err <= A.BOUND[pv], err
    # the reference quantizes as the kernel does; P's rounding is the step it leaves out
    ref = A._reference(q.cpu(), k.cpu(), v.cpu(), scale, pv, bshd)
    assert _rel(out.cpu(), ref.double()) < (2**-6 if pv == "bf16" else 2**-4)
    # and the kernel's error is that of its 8-bit operands, not of a wrong result
    assert _rel(F.scaled_dot_product_attention(q, k, v), ref64) < err / 2


def test_quantizers_match_the_reference_quantizers():
    q, k, v = _inputs(1, 2, 256, 300, 128, seed=3)
    q8, k8, sq, sk = A.quantize_qk(q, k, 1 / A._LOG2E)  # sq: q's own scale (times 1.0)
    qc, kc = q.cpu().float(), k.cpu().float()
    want_q8, want_sq = A._int8_rows(qc)
    want_k8, want_sk = A._int8_rows(kc - kc.mean(2, keepdim=True))
    for got8, got_s, want8, want_s in ((q8, sq, want_q8, want_sq), (k8, sk, want_k8, want_sk)):
        got8 = got8.cpu().float().view(want8.shape)
        # k's mean is summed in another order on the GPU: its scales move by a few ulp
        torch.testing.assert_close(got_s.cpu().view(want_s.shape), want_s, rtol=1e-5, atol=0)
        # the same codes, but next to a tie (those ulps): one step, on few values
        differ = got8 != want8
        assert differ.float().mean().item() < 1e-3, differ.float().mean().item()
        assert (got8 - want8).abs().max().item() <= 1
    vt, vs = A.quantize_v(v)
    _, _, want_v = A.quantized_operands(q.cpu(), k.cpu(), v.cpu(), "fp8")
    got_v = (vt.float().transpose(1, 2) * vs.repeat_interleave(A.QB, 1)[:, :300]).view(v.shape)
    differ = got_v.cpu() != want_v  # v is not centred: the same e4m3 values but at ties
    assert differ.float().mean().item() < 1e-3, differ.float().mean().item()
    assert ((got_v.cpu() - want_v).abs() <= want_v.abs() * 2**-3 + 1e-6).all()
