"""find_norm: every LayerNorm/RMSNorm of the reference models, in fp32 and bf16, whichever way the
module wrote it; near misses (another axis, another tensor squared) are not norms."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from kopt.capture import capture_module
from kopt.models import build
from kopt.patterns.norms import find_norm


def _norms(gm):  # noqa: ANN001, ANN202
    sites = [s for n in gm.graph.nodes if (s := find_norm(n))]
    inner = {m for s in sites for m in s.nodes if m is not s.out}
    return [s for s in sites if s.out not in inner]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "want"), [
    # text-input RMSNorm + q/k/added-q/added-k RMSNorms of 2 blocks; norm1/norm2 x img/txt x 2
    ("qwen-image-tiny", {("rms", True): 9, ("layer", False): 8}),
    ("flux2-tiny", {("rms", True): 12, ("layer", False): 11}),
    # 2 layers x (input, post-attention, q, k) + final norm
    ("llm-tiny", {("rms", True): 9}),
])
def test_every_norm_of_the_reference_models_is_found(name: str, want: dict,
                                                      dtype: torch.dtype) -> None:
    w = build(name, dtype=dtype)
    sites = _norms(capture_module(w.model, w.args, w.kwargs).gm)
    assert Counter((s.kind, s.weight is not None) for s in sites) == want
    assert all(s.internal_users_only() for s in sites)
    assert all(s.eps > 0 for s in sites)


class _NearMiss(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        other_axis = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6)
        other_tensor = xf * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return other_axis, other_tensor


def test_near_misses_are_not_norms() -> None:
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    gm = capture_module(_NearMiss(), (x, y)).gm
    assert _norms(gm) == []
