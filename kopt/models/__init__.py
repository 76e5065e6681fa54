"""Reference workloads: each builder returns a model with seeded random weights and the inputs its
real caller passes to `forward` (a diffusers pipeline's denoising loop, an LLM serving step).

`build("qwen-image-tiny")` and friends run anywhere; the full configs (20-32B parameters) are built
without host copies of the weights, straight on `device`. `device="meta"` gives shapes only: weights
and inputs are meta tensors, which is enough for parameter counts and fake-tensor capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kopt.models import flux2, llm, qwen_image
from kopt.models._common import Workload, main_output

__all__ = ["MODEL_NAMES", "Workload", "build", "main_output"]

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
            return builder(variant, device=device, dtype=dtype, seed=seed, **shape)
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
