"""Tensor-parallel reference blocks (Megatron layout) with torch's functional collectives.

Two stacks, each built once in full (``world_size=1``, no collective) and then sharded for a rank:

* ``llm``: a decoder block -- ``x + o_proj(attn(qkv(rms(x))))`` then ``x + down(silu(gate(h)) *
  up(h))`` with ``h = rms(x)`` -- and a final RMSNorm.
* ``dit``: a single-stream adaLN block (FLUX-like) -- ``x + g1 * o_proj(attn(qkv(mod1(ln(x)))))``
  then ``x + g2 * down(gelu(up(mod2(ln(x)))))`` -- with a timestep MLP, per-block modulation
  linears (replicated) and a final modulated LayerNorm + projection.

Sharding: q/k/v, gate/up and the timestep MLP's first linear are *column-parallel* (each rank
holds a slice of the output features: its heads, its part of the hidden MLP width); o_proj, down
and the timestep MLP's second linear are *row-parallel* (a slice of the input features), so each
rank's product is a partial sum, completed by
``torch.distributed._functional_collectives.all_reduce`` (``_c10d_functional.all_reduce`` +
``wait_tensor`` in a captured graph). A row-parallel bias is added once, after the sum. Every
other weight (norms, modulation, final projection) is replicated. Activations entering a block
are replicated on every rank, so every rank gets the same inputs.

So every row-parallel output is followed by the residual add and the next norm: the
``all_reduce -> x + [g *] y -> norm [-> modulation]`` site that kopt's ``fuse_allreduce_norm`` pass
fuses. The DiT's timestep MLP puts a collective on the conditioning path (it depends on the
timestep alone), which the hoisting pass must leave per call.

:func:`shard` slices a full model's weights for a rank: a parameter whose shape differs between
the full and the sharded module is cut along that one axis, contiguously by rank; any other is
copied. Sizes must divide by the world size (heads, MLP width, hidden width of the timestep MLP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kopt.models._common import Workload, generator, init_random_

Kind = Literal["llm", "dit"]
TIME_FREQS = 256  # sinusoidal timestep features (diffusers' default)


@dataclass(frozen=True)
class TPConfig:
    kind: Kind
    hidden: int
    heads: int
    ffn: int  # the MLP's hidden width (SwiGLU: per branch)
    layers: int
    tokens: int
    batch: int = 1
    eps: float = 1e-6
    out_channels: int = 16  # dit: the final projection's width

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY_LLM = TPConfig("llm", hidden=64, heads=4, ffn=128, layers=2, tokens=12)
TINY_DIT = TPConfig("dit", hidden=64, heads=4, ffn=192, layers=2, tokens=12)
# FLUX.2-dev's width at W2 (1024x1024: 4096 image + 512 text tokens): 48 heads x 128, MLP x3.
W2_DIT = TPConfig("dit", hidden=6144, heads=48, ffn=18432, layers=1, tokens=4096 + 512,
                  out_channels=128)


class _Parallel(nn.Module):
    """What every TP module shares: its world size and the group its all-reduces use."""

    def __init__(self, world_size: int, group_name: str | None) -> None:
        super().__init__()
        if world_size > 1 and group_name is None:
            raise ValueError("a sharded module (world_size > 1) needs the process group's name")
        self.world_size = world_size
        self.group_name = group_name

    def local(self, n: int, what: str) -> int:
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) does not divide by the world size {self.world_size}")
        return n // self.world_size

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Complete a row-parallel product: the sum of every rank's partial."""
        if self.world_size == 1:
            return partial
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(partial, "sum", self.group_name)


class Attention(_Parallel):
    """Column-parallel q/k/v (this rank's heads), SDPA, row-parallel output projection."""

    def __init__(self, c: TPConfig, world_size: int, group_name: str | None) -> None:
        super().__init__(world_size, group_name)
        self.heads = self.local(c.heads, "heads")
        self.head_dim = c.head_dim
        width = self.heads * c.head_dim
        self.to_q = nn.Linear(c.hidden, width, bias=False)
        self.to_k = nn.Linear(c.hidden, width, bias=False)
        self.to_v = nn.Linear(c.hidden, width, bias=False)
        self.to_out = nn.Linear(width, c.hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.to_q(h)), heads(self.to_k(h)),
                                           heads(self.to_v(h)))
        return self.reduce(self.to_out(a.transpose(1, 2).reshape(b, t, -1)))


class DecoderBlock(_Parallel):
    def __init__(self, c: TPConfig, world_size: int, group_name: str | None) -> None:
        super().__init__(world_size, group_name)
        ffn = self.local(c.ffn, "ffn")
        self.input_norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.attn = Attention(c, world_size, group_name)
        self.post_norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.gate_proj = nn.Linear(c.hidden, ffn, bias=False)
        self.up_proj = nn.Linear(c.hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.reduce(self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)))


class Decoder(_Parallel):
    def __init__(self, c: TPConfig, world_size: int = 1, group_name: str | None = None) -> None:
        super().__init__(world_size, group_name)
        self.config = c
        self.layers = nn.ModuleList(DecoderBlock(c, world_size, group_name)
                                    for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=c.eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        for block in self.layers:
            x = block(x)
        return self.norm(x)


def _modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return (1 + scale[:, None]) * x + shift[:, None]


class DiTBlock(_Parallel):
    def __init__(self, c: TPConfig, world_size: int, group_name: str | None) -> None:
        super().__init__(world_size, group_name)
        ffn = self.local(c.ffn, "ffn")
        self.modulation = nn.Linear(c.hidden, 6 * c.hidden)  # replicated
        self.norm1 = nn.LayerNorm(c.hidden, eps=c.eps, elementwise_affine=False)
        self.attn = Attention(c, world_size, group_name)
        self.norm2 = nn.LayerNorm(c.hidden, eps=c.eps, elementwise_affine=False)
        self.mlp_up = nn.Linear(c.hidden, ffn, bias=False)
        self.mlp_down = nn.Linear(ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(temb).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(_modulate(self.norm1(x), scale1, shift1))
        h = _modulate(self.norm2(x), scale2, shift2)
        mlp = self.mlp_down(F.gelu(self.mlp_up(h), approximate="tanh"))
        return x + gate2[:, None] * self.reduce(mlp)


class TimestepMLP(_Parallel):
    """Sinusoidal features -> column-parallel linear -> SiLU -> row-parallel linear (+ bias once,
    after the all-reduce): a collective that depends on the timestep alone."""

    def __init__(self, c: TPConfig, world_size: int, group_name: str | None) -> None:
        super().__init__(world_size, group_name)
        self.linear_1 = nn.Linear(TIME_FREQS, self.local(c.hidden, "hidden"))
        self.linear_2 = nn.Linear(self.local(c.hidden, "hidden"), c.hidden, bias=False)
        self.bias_2 = nn.Parameter(torch.empty(c.hidden))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        half = TIME_FREQS // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=timestep.device,
                                                            dtype=torch.float32) / half)
        args = timestep.float()[:, None] * freqs[None]
        feats = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.bias_2.dtype)
        return self.reduce(self.linear_2(F.silu(self.linear_1(feats)))) + self.bias_2


class DiT(_Parallel):
    def __init__(self, c: TPConfig, world_size: int = 1, group_name: str | None = None) -> None:
        super().__init__(world_size, group_name)
        self.config = c
        self.time_embed = TimestepMLP(c, world_size, group_name)
        self.blocks = nn.ModuleList(DiTBlock(c, world_size, group_name) for _ in range(c.layers))
        self.norm_out = nn.LayerNorm(c.hidden, eps=c.eps, elementwise_affine=False)
        self.norm_out_modulation = nn.Linear(c.hidden, 2 * c.hidden)
        self.proj_out = nn.Linear(c.hidden, c.out_channels)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = F.silu(self.time_embed(timestep))
        x = hidden_states
        for block in self.blocks:
            x = block(x, temb)
        shift, scale = self.norm_out_modulation(temb).chunk(2, dim=-1)
        return self.proj_out(_modulate(self.norm_out(x), scale, shift))


_MODELS: dict[str, type[Decoder] | type[DiT]] = {"llm": Decoder, "dit": DiT}


def build_full(config: TPConfig, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Workload:
    """The unsharded model (no collective) with seeded weights, and its example inputs."""
    device = torch.device(device)
    model = _MODELS[config.kind](config)
    model = model.to(device=device, dtype=dtype)
    init_random_(model, generator(device, seed))
    model.requires_grad_(False).eval()
    return Workload(f"tp-{config.kind}", model, *_inputs(config, device, dtype, seed),
                    calls_per_step=1,
                    description=f"TP {config.kind}: {config.layers} blocks, hidden "
                                f"{config.hidden}, {config.tokens} tokens, unsharded")


def _inputs(c: TPConfig, device: torch.device, dtype: torch.dtype,
            seed: int) -> tuple[tuple, dict, tuple[str, ...]]:
    gen = generator(device, seed, inputs=True)
    x = torch.randn(c.batch, c.tokens, c.hidden, generator=gen, device=device, dtype=dtype)
    if c.kind == "llm":
        return (x,), {}, ()
    t = torch.rand(c.batch, generator=gen, device=device) * 1000
    return (x, t.to(dtype)), {}, ("timestep",)


def shard(full: nn.Module, rank: int, world_size: int, group_name: str) -> nn.Module:
    """``full``'s model for ``rank`` of ``world_size``: weights cut along the axis whose size
    differs (column-parallel: output features, row-parallel: input features), the rest copied."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    param = next(full.parameters())
    with torch.device("meta"):
        local = type(full)(full.config, world_size, group_name)
    local = local.to_empty(device=param.device).to(param.dtype)
    state = full.state_dict()
    with torch.no_grad():
        for name, t in local.state_dict().items():
            src = state[name]
            axes = [i for i, (a, b) in enumerate(zip(src.shape, t.shape, strict=True)) if a != b]
            if len(axes) > 1:
                raise ValueError(f"{name}: {list(src.shape)} -> {list(t.shape)} is not one cut")
            if axes:
                n = t.shape[axes[0]]
                src = src.narrow(axes[0], rank * n, n)
            t.copy_(src)
    return local.requires_grad_(False).eval()


def build_shard(config: TPConfig, rank: int, world_size: int, group_name: str, *,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> tuple[Workload, Workload]:
    """(this rank's sharded workload, the full one it was cut from); same inputs on every rank."""
    full = build_full(config, device=device, dtype=dtype, seed=seed)
    local = shard(full.model, rank, world_size, group_name)
    desc = (f"TP {config.kind}: {config.layers} blocks, hidden {config.hidden}, "
            f"{config.tokens} tokens, rank {rank} of {world_size}")
    return replace(full, model=local, description=desc), full
