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


class BreakingBlock(nn.Module):
    """A transformer-like block with a graph break inside: dynamo compiles its ``forward`` once
    and calls that graph for every block, each with its own weights."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.out = QKV(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qkv(x)
        torch._dynamo.graph_break()
        return x + self.out(torch.relu(y))


class BlockStack(nn.Module):
    """``n`` :class:`BreakingBlock` s in a ``ModuleList``, one after another."""

    def __init__(self, dim: int, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BreakingBlock(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def perturbed_kwargs(kwargs: dict, calls: int, device: str = "cuda") -> list[dict]:
    """``calls`` copies of a model's keyword inputs, each floating-point tensor moved by seeded
    noise (seed = the call's index): fresh inputs for every call of a loop."""
    out = []
    for seed in range(calls):
        g = torch.Generator(device=device).manual_seed(seed)
        out.append({k: (v + 0.05 * torch.randn(v.shape, device=device, dtype=v.dtype,
                                               generator=g)
                        if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                    for k, v in kwargs.items()})
    return out


def backend_outputs(model: nn.Module, args: tuple, calls: list[dict], options: dict,
                    cuda_graphs: bool | None = None, clone: bool = False) -> tuple[list, list]:
    """``(outputs, reports)``: the main output of ``torch.compile(model, backend="kopt")`` with
    ``options`` (plus its reports list, and ``cuda_graphs`` where given) for each call's keyword
    inputs, dynamo reset first; ``clone``: each output copied right after its call (else all
    kept as returned, to check that later replays do not overwrite them)."""
    from kopt.models import main_output

    torch._dynamo.reset()
    reports: list = []
    options = dict(options, reports=reports)
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    f = torch.compile(model, backend="kopt", dynamic=False, options=options)
    with torch.no_grad():
        outs = [main_output(f(*args, **kw)).clone() if clone else main_output(f(*args, **kw))
                for kw in calls]
    return outs, reports
