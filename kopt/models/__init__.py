"""Reference workloads: each builder returns a model with seeded random weights and the inputs its
real caller passes to `forward` (a diffusers pipeline's denoising loop, an LLM serving step).

`build("qwen-image-tiny")` and friends run anywhere; the full configs (20-32B parameters) are built
without host copies of the weights, straight on `device`. `device="meta"` gives shapes only: weights
and inputs are meta tensors, which is enough for parameter counts and fake-tensor capture.
"""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Callable

import torch

from kopt.models import flux2, llm, qwen_image
from kopt.models._common import Workload, main_output

__all__ = ["MODEL_NAMES", "Workload", "build", "main_output", "shape_keys"]

_BUILDERS: tuple[tuple[str, Callable[..., Workload], str], ...] = (
    ("qwen-image-tiny", qwen_image.build, "tiny"),
    ("qwen-image", qwen_image.build, "full"),
    ("flux2-tiny", flux2.build, "tiny"),
    ("flux2", flux2.build, "full"),
    ("llm-tiny", llm.build, "tiny"),
    ("llm", llm.build, "full"),
)

MODEL_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _BUILDERS)


def build(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **shape: int | str,
) -> Workload:
    """Build workload `name` on `device` in `dtype`, every weight and input drawn from `seed`.

    `shape` holds the family's own keywords: Qwen-Image and FLUX.2 take `height`, `width` (pixels),
    `text_tokens`, `batch` (Qwen-Image also `text_padding`); the LLM takes `mode` ("prefill" or
    "decode"), `batch`, `seq_len` (prompt length, or tokens already cached in decode) and, for
    decode, `max_cache_len`.
    """
    for known, builder, variant in _BUILDERS:
        if name == known:
            if torch.device(device).type != "meta":
                _check_fits(name, builder(variant, device="meta", dtype=dtype, seed=seed,
                                          **shape).model, dtype, torch.device(device))
            return builder(variant, device=device, dtype=dtype, seed=seed, **shape)
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")


def shape_keys(name: str) -> dict[str, type | tuple[str, ...]]:
    """The shape keywords `build(name, ...)` takes, from its builder's signature, each with what it
    accepts: `int`, or the allowed strings of a `Literal` (the LLM's `mode`)."""
    for known, builder, _ in _BUILDERS:
        if name == known:
            hints = typing.get_type_hints(builder)
            keys = [k for k in inspect.signature(builder).parameters
                    if k not in ("variant", "device", "dtype", "seed")]
            return {k: _accepts(hints[k]) for k in keys}
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")


def _accepts(hint: object) -> type | tuple[str, ...]:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    kinds = [a for a in typing.get_args(hint) or (hint,) if a is not type(None)]
    if kinds != [int]:  # a builder grew a keyword the command line cannot spell
        raise TypeError(f"shape keyword of type {hint} is neither an int nor a Literal")
    return int


def _check_fits(name: str, meta_model: torch.nn.Module, dtype: torch.dtype,
                device: torch.device) -> None:
    """Refuse, with the numbers, a model whose weights alone exceed the device's free memory
    (a full-size DiT on a CPU machine), instead of letting the process be killed."""
    need = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > free:
        raise ValueError(
            f"{name} needs {need / 2**30:.1f} GiB for its weights in {dtype} but {device} has "
            f"{free / 2**30:.1f} GiB free; use a -tiny model, or --device cuda on a GPU machine"
        )
