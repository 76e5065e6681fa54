"""FLUX.2-dev (W2): `diffusers.Flux2Transformer2DModel` with random weights.

The example inputs are what `Flux2Pipeline.__call__` (diffusers 0.42.1, text-to-image, no reference
images) passes to the transformer, with the same latent arithmetic: VAE factor 8, 2x2 patches folded
into channels, so a HxW image is (H/16)*(W/16) tokens of `in_channels` features.

Quirks of this forward that matter to a graph capture:
- Positions come as integer tensors, `img_ids` (B, H/16*W/16, 4) and `txt_ids` (B, L, 4), (t, h,
  w, l) coordinates made on the CPU and copied to the device by the pipeline. The forward uses only
  batch row 0 and computes RoPE cos/sin from them in float64 on every call (float64 on the GPU).
  `img_ids` is an expanded view (batch stride 0), as `_prepare_latent_ids` makes it.
- The timestep is t / 1000 in the model dtype and the forward multiplies it by 1000 again, so in
  bf16 it goes through a lossy round trip. `guidance` is a float32 tensor `full([1], 4.0)
  .expand(B)` (stride 0 for B > 1), cast to the model dtype and scaled by 1000 inside.
- Timestep and guidance embeddings are summed into one `temb`, from which three shared modulation
  Linears (double-stream img, double-stream txt, single-stream) are computed once per forward and
  reused by every block; `norm_out` uses `temb` too. All of that depends on timestep and guidance
  only.
- `hidden_states` is a non-contiguous view: `_pack_latents` is `reshape(B, C, h*w).permute(0, 2, 1)`
  and nothing copies it before the first step's call.
- No attention mask: text is padded to a fixed length (512) by the pipeline, with no mask.
- One call per step: FLUX.2-dev is guidance-distilled, no true CFG.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from diffusers import Flux2Transformer2DModel

from kopt.models._common import (
    Workload,
    as_device,
    check_sizes,
    dtype_name,
    generator,
    is_meta,
    materialize,
)

Variant = Literal["tiny", "full"]

VAE_SCALE_FACTOR = 8
PATCH = 2
GUIDANCE_SCALE = 4.0  # Flux2Pipeline.__call__ default

# Full = the class defaults (8 double + 48 single blocks, 48 x 128 = 6144 hidden, 32.2B params).
FULL_CONFIG: dict[str, Any] = {}

# Same structure, small widths. head_dim 32 = sum of the four RoPE axes (t, h, w, l).
TINY_CONFIG: dict[str, Any] = dict(
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    axes_dims_rope=(8, 8, 8, 8),
    in_channels=16,
    joint_attention_dim=48,
    timestep_guidance_channels=32,
)

# Tiny default: 96x128 pixels -> 6x8 = 48 image tokens (non-square), 12 text tokens.
_DEFAULTS: dict[Variant, dict[str, int]] = {
    "full": dict(height=1024, width=1024, text_tokens=512),
    "tiny": dict(height=96, width=128, text_tokens=12),
}


def build(
    variant: Variant,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
    text_tokens: int | None = None,
    batch: int = 1,
) -> Workload:
    """FLUX.2 transformer + the kwargs of one call of the denoising loop."""
    device = as_device(device)
    defaults = _DEFAULTS[variant]
    height = defaults["height"] if height is None else height
    width = defaults["width"] if width is None else width
    text_tokens = defaults["text_tokens"] if text_tokens is None else text_tokens
    check_sizes(height=height, width=width, text_tokens=text_tokens, batch=batch)
    multiple = VAE_SCALE_FACTOR * PATCH
    if height % multiple or width % multiple:
        raise ValueError(f"height and width must be multiples of {multiple}, got {height}x{width}")

    config = FULL_CONFIG if variant == "full" else TINY_CONFIG
    model = materialize(
        lambda: Flux2Transformer2DModel(**config), device=device, dtype=dtype, seed=seed
    )
    kwargs = _example_kwargs(model, device, dtype, seed, height, width, text_tokens, batch)
    cfg = model.config
    tokens = (height // multiple) * (width // multiple)
    description = (
        f"FLUX.2 {variant}: {cfg.num_layers} double + {cfg.num_single_layers} single-stream "
        f"blocks, hidden {cfg.num_attention_heads * cfg.attention_head_dim} "
        f"({cfg.num_attention_heads} heads x {cfg.attention_head_dim}), {height}x{width} px = "
        f"{tokens} image + {text_tokens} text tokens, batch {batch}, {dtype_name(dtype)}"
    )
    return Workload(
        name="flux2" if variant == "full" else "flux2-tiny",
        model=model,
        args=(),
        kwargs=kwargs,
        step_invariant=("timestep", "guidance", "img_ids", "txt_ids"),
        calls_per_step=1,
        description=description,
    )


def _example_kwargs(
    model: Flux2Transformer2DModel,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    height: int,
    width: int,
    text_tokens: int,
    batch: int,
) -> dict[str, Any]:
    cfg = model.config
    gen = None if is_meta(device) else generator(device, seed, inputs=True)
    # prepare_latents: noise of shape (B, 4C, H/16, W/16) -> ids from that grid -> (B, h*w, 4C).
    lat_h, lat_w = height // (VAE_SCALE_FACTOR * 2), width // (VAE_SCALE_FACTOR * 2)
    latents = torch.randn(
        (batch, cfg.in_channels, lat_h, lat_w), generator=gen, device=device, dtype=dtype
    )
    latent_ids = _prepare_latent_ids(batch, lat_h, lat_w).to(device)
    latents = latents.reshape(batch, cfg.in_channels, lat_h * lat_w).permute(0, 2, 1)

    prompt_embeds = torch.randn(
        (batch, text_tokens, cfg.joint_attention_dim), generator=gen, device=device, dtype=dtype
    )
    text_ids = _prepare_text_ids(batch, text_tokens).to(device)

    sigma = torch.rand((1,), generator=gen, device=device) * 0.95 + 0.05
    t = sigma * 1000
    timestep = t.expand(batch).to(latents.dtype)
    guidance = torch.full([1], GUIDANCE_SCALE, device=device, dtype=torch.float32).expand(batch)
    return dict(
        hidden_states=latents.to(dtype),
        timestep=timestep / 1000,
        guidance=guidance,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=latent_ids,
        joint_attention_kwargs=None,
        return_dict=False,
    )


def _prepare_latent_ids(batch: int, height: int, width: int) -> torch.Tensor:
    """Flux2Pipeline._prepare_latent_ids: (t=0, h, w, l=0) per latent pixel, batch-expanded."""
    ids = torch.cartesian_prod(
        torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1)
    )
    return ids.unsqueeze(0).expand(batch, -1, -1)


def _prepare_text_ids(batch: int, length: int) -> torch.Tensor:
    """Flux2Pipeline._prepare_text_ids: (0, 0, 0, l) per text token."""
    one = torch.arange(1)
    return torch.stack(
        [torch.cartesian_prod(one, one, one, torch.arange(length)) for _ in range(batch)]
    )
