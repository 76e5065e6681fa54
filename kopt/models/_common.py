"""Shared pieces of the workload builders: the `Workload` record and seeded weight materialisation.

Every builder, tiny or full, goes through the same path: construct under `torch.device("meta")`,
cast on meta, `to_empty` on the target device, then fill every parameter from a seeded generator on
that device. Running the tiny models through the exact path the 20-30B models take means the CPU
tests check the full-size construction logic too; only the sizes differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

# Inputs come from their own generator stream so that adding a parameter to a model never shifts
# the example inputs (and the other way round).
_INPUT_STREAM = 1 << 32

# Deviation of norm scales around 1.0 and std of biases. Large enough that a rewrite that drops a
# norm weight or a bias fails verification even at bf16 tolerance; small enough to stay realistic.
_NORM_STD = 0.1
_BIAS_STD = 0.1


@dataclass(frozen=True, eq=False)
class Workload:
    """A reference model plus the exact inputs its real caller passes to `forward`.

    `eq=False`: comparing two workloads field by field would compare tensors, which has no single
    boolean answer; identity is the useful equality here.
    """

    name: str
    model: nn.Module
    args: tuple
    kwargs: dict
    # kwargs that carry the step's conditioning and positions: identical in every call of one
    # denoise step (both halves of a true-CFG pair), whatever the prompt. Empty for the LLM.
    step_invariant: tuple[str, ...]
    calls_per_step: int
    description: str

    def run(self, model: Callable | None = None) -> torch.Tensor:
        """The main output of ``model`` (default: the workload's own) on the example inputs."""
        with torch.no_grad():
            out = (self.model if model is None else model)(*self.args, **self.kwargs)
        return main_output(out)


def main_output(out: object) -> torch.Tensor:
    """The main output tensor, whatever container a model returns it in."""
    if isinstance(out, tuple | list):
        return out[0]
    for field in ("last_hidden_state", "sample"):
        value = getattr(out, field, None)
        if isinstance(value, torch.Tensor):
            return value
    return out


def is_meta(device: torch.device) -> bool:
    return device.type == "meta"


def generator(device: torch.device, seed: int, *, inputs: bool = False) -> torch.Generator:
    """A generator on `device` (weights and inputs are drawn where they live, never on the host)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed + (_INPUT_STREAM if inputs else 0))
    return g


def materialize(
    build_on_meta: Callable[[], nn.Module],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    recompute: Callable[[nn.Module], None] = lambda model: None,
    recomputed_buffers: Iterable[str] = (),
) -> nn.Module:
    """Build a model without ever holding its weights on the host, and fill them from `seed`.

    `recompute` restores state the model derives itself (rotary tables) that `to_empty` leaves as
    garbage or that construction under meta left on meta; `recomputed_buffers` names the buffers it
    covers. Any other buffer is an error: a new library version that adds one must be looked at,
    not silently left uninitialised.
    """
    with torch.device("meta"):
        model = build_on_meta()
    # from_pretrained would keep these in fp32; none of the reference models has any, and a model
    # that does needs a deliberate choice, not a blanket cast.
    if getattr(model, "_keep_in_fp32_modules", None):
        raise NotImplementedError(f"{type(model).__name__} keeps modules in fp32")
    # Cast on meta first so that a bf16 model never exists in fp32 on the device (FLUX.2 in fp32 is
    # 129 GB, more than an H200 holds). nn.Module.to: diffusers' override only adds a warning
    # about the fp32 modules ruled out above.
    model = nn.Module.to(model, dtype=dtype).to_empty(device=device)
    unexpected = {name for name, _ in model.named_buffers()} - set(recomputed_buffers)
    if unexpected:
        raise RuntimeError(f"buffers with no known initialisation: {sorted(unexpected)}")
    if not is_meta(device):
        init_random_(model, generator(device, seed))
    recompute(model)
    if not is_meta(device):
        check_materialized(model)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def init_random_(model: nn.Module, gen: torch.Generator) -> None:
    """Fill every parameter with seeded random values; no zeros, no ones, no identity norms.

    Matrices get std 1/sqrt(fan_in), which keeps every Linear at unit gain at any width: the tiny
    models then carry activations of the same scale as the full ones, and at width 3072-4096 it is
    the usual 0.016-0.018 (the conventional 0.02).
    """
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
        elif name.endswith("bias"):
            param.normal_(0.0, _BIAS_STD, generator=gen)
        else:  # 1-d scales: RMSNorm / LayerNorm weights
            param.normal_(1.0, _NORM_STD, generator=gen)


def check_materialized(model: nn.Module) -> None:
    """Fail if any tensor the forward can reach still lives on meta.

    Plain tensor attributes (not parameters, not buffers) are invisible to `to_empty`; Qwen-Image's
    RoPE tables are such attributes, and construction under meta leaves them without data.
    """
    for mod_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        tensors += list(module.named_buffers(recurse=False))
        tensors += [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
        for attr, tensor in tensors:
            if tensor.is_meta:
                raise RuntimeError(f"{mod_name or '<root>'}.{attr} is still on the meta device")


def check_sizes(**sizes: int) -> None:
    """Raise ValueError naming the first size below 1: no token count or batch may be empty."""
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"{key} must be at least 1, got {value}")


def as_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # A generator and the tensors it fills must agree on the index.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
