"""kopt::qk_norm_rope: the Triton kernel (interpreted on machines without a GPU) against the
PyTorch reference on small awkward shapes, the op's contract, and the reference against the
fp64 math."""

from __future__ import annotations

import pytest
import torch

from kopt.codegen.kernels.qk_norm_rope import (
    qk_norm_rope,
    qk_norm_rope_reference,
    qk_norm_rope_triton,
)
from kopt.verify import RTOL_FLOOR, relative_error


def _case(segs: list[int], hq: int, hk: int, d: int, dtype: torch.dtype, rope: str,
          *, batch: int = 1, table_dtype: torch.dtype = torch.float32, layout: str = "merged",
          seed: int = 0) -> dict:
    """Segments as the models have them: q/k are views of one merged QKV output per segment
    (``layout="merged"``), or of a [B, H, S, D] buffer (``"heads_first"``), or every other
    element of a wider one (``"stride2"``: a head-dim stride of 2)."""
    g = torch.Generator().manual_seed(seed)
    q, k, cos, sin = [], [], [], []
    for s in segs:
        if layout == "merged":
            m = torch.randn(batch, s, (hq + 2 * hk) * d, generator=g).to(dtype)
            q.append(m[..., : hq * d].view(batch, s, hq, d))
            k.append(m[..., hq * d: (hq + hk) * d].view(batch, s, hk, d))
        elif layout == "heads_first":
            q.append(torch.randn(batch, hq, s, d, generator=g).to(dtype).transpose(1, 2))
            k.append(torch.randn(batch, hk, s, d, generator=g).to(dtype).transpose(1, 2))
        else:
            q.append(torch.randn(batch, s, hq, 2 * d, generator=g).to(dtype)[..., ::2])
            k.append(torch.randn(batch, s, hk, 2 * d, generator=g).to(dtype)[..., ::2])
        td = d // 2 if rope == "complex" else d
        angle = torch.rand(1, s, 1, td, generator=g) * 8
        cos.append(angle.cos().to(table_dtype))
        sin.append(angle.sin().to(table_dtype))
    w = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2 * len(segs))]
    return dict(q=q, k=k, q_weight=w[: len(segs)], k_weight=w[len(segs):], cos=cos, sin=sin)


def _upcast(case: dict) -> dict:
    return {key: [t.double() for t in ts] for key, ts in case.items()}


CASES = [
    # (segments, q heads, k heads, head_dim, rope, norm, layout)
    ([1], 1, 1, 32, "pairs", "rms_norm", "merged"),  # one token
    ([12, 37], 3, 3, 64, "pairs", "rms_norm", "merged"),  # FLUX.2 double: text ++ image
    ([37], 2, 2, 32, "pairs", "rms_norm", "stride2"),
    ([5, 11], 2, 2, 128, "complex", "cast", "merged"),  # Qwen-Image
    ([1, 3], 3, 3, 32, "complex", "rms_norm", "heads_first"),
    ([13], 4, 2, 64, "half", "cast", "merged"),  # Qwen3, GQA
    ([7], 3, 1, 128, "half", "cast", "heads_first"),
    ([3, 2], 2, 2, 80, "pairs", "cast", "merged"),  # head_dim not a power of two: masked tiles
    ([5], 2, 1, 80, "half", "rms_norm", "stride2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("segs", "hq", "hk", "d", "rope", "norm", "layout"), CASES)
def test_triton_matches_the_reference(segs: list[int], hq: int, hk: int, d: int, rope: str,
                                      norm: str, layout: str, dtype: torch.dtype) -> None:
    # A bf16 LLM multiplies by bf16 tables; the DiTs by fp32 ones.
    table_dtype = dtype if rope == "half" else torch.float32
    case = _case(segs, hq, hk, d, dtype, rope, batch=2 if len(segs) == 1 else 1,
                 table_dtype=table_dtype, layout=layout)
    got = qk_norm_rope_triton(**case, eps=1e-6, norm=norm, rope=rope)
    want = qk_norm_rope_reference(**case, eps=1e-6, norm=norm, rope=rope)
    exact = qk_norm_rope_reference(**_upcast(case), eps=1e-6, norm=norm, rope=rope)
    for g, w, x in zip(got, want, exact, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        # The tolerance tier: at most 2x the reference's own error against fp64 (or 2x the
        # dtype's floor)...
        floor = RTOL_FLOOR[dtype]
        assert relative_error(g, x) <= 2 * max(relative_error(w, x), floor)
        if dtype == torch.float32:  # a 1-ulp different rstd moves its whole row
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:  # ... and it rounds where the models round: all but a few bf16 elements (where
            # the interpreter's sqrt and sum order flip a rounding) are bitwise the unfused
            # ops' (a missed rounding moves ~30%)
            assert (g == w).float().mean().item() >= 0.99


@pytest.mark.parametrize(("segs", "hq", "hk", "d", "rope", "norm", "layout"),
                         [CASES[1], CASES[3], CASES[5]], ids=["flux2", "qwen-image", "qwen3"])
@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_a_projection_bias_is_added_first(segs: list[int], hq: int, hk: int, d: int, rope: str,
                                          norm: str, layout: str, which: str) -> None:
    """x + bias rounded to bf16 (the model's add), then the norm and RoPE: the kernel against
    the reference with the bias, which differs from the one without."""
    case = _case(segs, hq, hk, d, torch.bfloat16, rope, layout=layout, seed=3)
    g = torch.Generator().manual_seed(4)
    bias = {f"{r}_bias": [(torch.randn(h, d, generator=g) * 2).bfloat16() for _ in segs]
            for r, h in (("q", hq), ("k", hk)) if which in (r, "both")}
    tables = torch.float32 if rope != "half" else torch.bfloat16
    case = dict(case, cos=[c.to(tables) for c in case["cos"]],
                sin=[c.to(tables) for c in case["sin"]])
    got = qk_norm_rope_triton(**case, **bias, eps=1e-6, norm=norm, rope=rope)
    want = qk_norm_rope_reference(**case, **bias, eps=1e-6, norm=norm, rope=rope)
    plain = qk_norm_rope_reference(**case, eps=1e-6, norm=norm, rope=rope)
    for r, gt, w, p in zip("qk", got, want, plain, strict=True):
        assert (gt == w).float().mean().item() >= 0.99
        assert torch.equal(w, p) != (which in (r, "both"))
    with pytest.raises(ValueError, match="q_bias torch.bfloat16"):
        qk_norm_rope_triton(**case, q_bias=[torch.zeros(hq, d + 2).bfloat16() for _ in segs],
                            eps=1e-6, norm=norm, rope=rope)


def test_segments_land_in_their_place_of_the_joint_sequence() -> None:
    case = _case([3, 5], 2, 2, 32, torch.float32, "pairs")
    q, k = qk_norm_rope_triton(**case, eps=1e-6, norm="rms_norm", rope="pairs")
    for i, (lo, hi) in enumerate([(0, 3), (3, 8)]):
        one = {key: [ts[i]] for key, ts in case.items()}
        q1, k1 = qk_norm_rope_reference(**one, eps=1e-6, norm="rms_norm", rope="pairs")
        torch.testing.assert_close(q[:, lo:hi], q1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k[:, lo:hi], k1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", ["pairs", "complex", "half"])
def test_reference_is_the_rotation_it_claims(rope: str) -> None:
    """With unit weights and inputs of unit RMS the op is the rotation alone: each pair turned
    by its angle, written here in complex numbers (fp64)."""
    d, s = 8, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, s, 1, d, generator=g, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    theta = torch.rand(1, s, 1, d // 2, generator=g, dtype=torch.float64) * 8
    if rope == "half":  # pairs (x_j, x_{j + d/2})
        pairs = torch.complex(x[..., : d // 2], x[..., d // 2:])
        table = torch.cat([theta, theta], -1)
    else:  # pairs (x_2j, x_2j+1)
        pairs = torch.view_as_complex(x.reshape(1, s, 1, d // 2, 2))
        table = theta if rope == "complex" else theta.repeat_interleave(2, -1)
    turned = pairs * torch.exp(1j * theta)
    want = (torch.cat([turned.real, turned.imag], -1) if rope == "half"
            else torch.view_as_real(turned).flatten(-2))
    one = torch.ones(d, dtype=torch.float64)
    out, _ = qk_norm_rope_reference([x], [x], [one], [one], [table.cos()], [table.sin()], 0.0,
                                    "cast", rope)
    torch.testing.assert_close(out, want)


def test_op_contract() -> None:
    case = _case([2, 3], 2, 1, 32, torch.bfloat16, "half", table_dtype=torch.bfloat16)
    args = (case["q"], case["k"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
            1e-6, "cast", "half", [], [])
    torch.library.opcheck(qk_norm_rope, args)
    q, k = torch.ops.kopt.qk_norm_rope(*args)
    assert q.shape == (1, 5, 2, 32) and k.shape == (1, 5, 1, 32) and q.dtype == torch.bfloat16


def test_rejects_what_it_cannot_compute() -> None:
    case = _case([2], 1, 1, 32, torch.float32, "pairs")
    with pytest.raises(ValueError, match="rope one of"):
        qk_norm_rope_triton(**case, eps=1e-6, norm="rms_norm", rope="rotary")
    bad = dict(case, k=[case["k"][0][:, :1]])
    with pytest.raises(ValueError, match="differ in batch or sequence length"):
        qk_norm_rope_triton(**bad, eps=1e-6, norm="rms_norm", rope="pairs")
    bad = dict(case, cos=[case["cos"][0][..., :16]])
    with pytest.raises(ValueError, match="rotary tables"):
        qk_norm_rope_triton(**bad, eps=1e-6, norm="rms_norm", rope="pairs")
