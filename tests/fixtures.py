"""Small modules shared by the CPU and GPU tests, each exercising one rewrite."""

from __future__ import annotations

import torch
from torch import nn


class QKV(nn.Module):
    """Three projections of one activation (plus an output projection that must not merge)."""

    def __init__(self, dim: int = 37, bias: bool = True, k_bias: bool | None = None,
                 v_extra: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim // 2, bias=bias if k_bias is None else k_bias)
        self.v = nn.Linear(dim, dim + v_extra, bias=bias)
        self.out = nn.Linear(dim + v_extra, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        mixed = v * q.sum(-1, keepdim=True) + k.mean(-1, keepdim=True)
        return self.out(mixed)
