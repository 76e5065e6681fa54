"""Qwen-Image (W1): `diffusers.QwenImageTransformer2DModel` with random weights.

The example inputs are what `QwenImagePipeline.__call__` (diffusers 0.42.1) passes to the
transformer in its denoising loop, built with the same latent arithmetic: VAE factor 8, 2x2 patches,
so a HxW image is (H/16)*(W/16) tokens of `in_channels` (= 4 x latent channels) features.

Quirks of this forward that matter to a graph capture:
- `img_shapes` is Python data (`[[(1, H/16, W/16)]] * batch`): RoPE tables are sliced with it in
  Python, so a captured graph is specialised to one resolution.
- The RoPE tables (`pos_embed.pos_freqs`/`neg_freqs`) are complex64 plain attributes, not buffers,
  and stay on the CPU whatever the model's device; every forward copies them to the device
  (cached by an lru_cache in eager mode, a constant plus `.to(device)` in an exported graph).
  They stay complex64 in a bf16 model, and RoPE runs in complex arithmetic.
- `encoder_hidden_states_mask` is None: the pipeline drops an all-ones mask, which is the case for
  any unpadded prompt. `text_padding > 0` gives the padded case (mask of ones with trailing zeros,
  zero embeddings there), which turns into a boolean SDPA mask over [text, image] tokens.
- The timestep is the scheduler's t / 1000, in the model dtype; `Timesteps(scale=1000)` multiplies
  it back inside. It flows to one (B, D) embedding `temb`, the input of every block's
  `img_mod`/`txt_mod` Linear (adaLN) and of `norm_out`: all of that depends on the timestep only.
- `guidance` is None: the default config is not guidance-distilled (`guidance_embeds=False`).
- Two calls per denoising step (true CFG): same latents, timestep and shapes, different prompt
  embeddings (the negative prompt may even have a different length).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from diffusers import QwenImageTransformer2DModel

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

# Pipeline constants (pipeline_qwenimage.py): 8x spatial VAE compression, 2x2 latent patches.
VAE_SCALE_FACTOR = 8
PATCH = 2

# Full = the class defaults (60 layers, 24 x 128 = 3072 hidden, 20.4B parameters).
FULL_CONFIG: dict[str, Any] = {}

# Same structure, small widths. head_dim 32 = sum of the three RoPE axes (frame, height, width);
# joint_attention_dim differs from the hidden size so that a swapped projection cannot go unnoticed.
TINY_CONFIG: dict[str, Any] = dict(
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    axes_dims_rope=(8, 12, 12),
    in_channels=16,
    out_channels=4,
    joint_attention_dim=48,
)

# Tiny default: 96x128 pixels -> 6x8 = 48 image tokens; non-square so that height/width mix-ups in
# RoPE or packing show; 10 text tokens, not a power of two.
_DEFAULTS: dict[Variant, dict[str, int]] = {
    "full": dict(height=1024, width=1024, text_tokens=128),
    "tiny": dict(height=96, width=128, text_tokens=10),
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
    text_padding: int = 0,
) -> Workload:
    """Qwen-Image transformer + the kwargs of one (conditional) call of the denoising loop."""
    device = as_device(device)
    defaults = _DEFAULTS[variant]
    height = defaults["height"] if height is None else height
    width = defaults["width"] if width is None else width
    text_tokens = defaults["text_tokens"] if text_tokens is None else text_tokens
    check_sizes(height=height, width=width, text_tokens=text_tokens, batch=batch)
    multiple = VAE_SCALE_FACTOR * PATCH
    if height % multiple or width % multiple:
        raise ValueError(f"height and width must be multiples of {multiple}, got {height}x{width}")
    if not 0 <= text_padding < text_tokens:
        raise ValueError(f"text_padding must be in [0, {text_tokens}), got {text_padding}")

    config = FULL_CONFIG if variant == "full" else TINY_CONFIG
    model = materialize(
        lambda: QwenImageTransformer2DModel(**config),
        device=device,
        dtype=dtype,
        seed=seed,
        recompute=_rebuild_rope_tables,
    )
    kwargs = _example_kwargs(
        model, device, dtype, seed, height, width, text_tokens, batch, text_padding
    )
    cfg = model.config
    tokens = (height // multiple) * (width // multiple)
    description = (
        f"Qwen-Image {variant}: {cfg.num_layers} double-stream layers, hidden "
        f"{cfg.num_attention_heads * cfg.attention_head_dim} ({cfg.num_attention_heads} heads x "
        f"{cfg.attention_head_dim}), {height}x{width} px = {tokens} image + {text_tokens} text "
        f"tokens, batch {batch}, {dtype_name(dtype)}"
    )
    return Workload(
        name="qwen-image" if variant == "full" else "qwen-image-tiny",
        model=model,
        args=(),
        kwargs=kwargs,
        step_invariant=("timestep", "guidance", "img_shapes"),
        calls_per_step=2,
        description=description,
    )


def _rebuild_rope_tables(model: QwenImageTransformer2DModel) -> None:
    """Re-create `pos_embed` off the meta device.

    Its RoPE tables are plain tensor attributes computed in `__init__`, so building the model under
    meta left them without data and `to_empty` does not see them. Rebuilt with the class's own
    constructor, on the CPU, which is where a normally loaded model keeps them too.
    """
    old = model.pos_embed
    with torch.device("cpu"):
        model.pos_embed = type(old)(
            theta=old.theta, axes_dim=old.axes_dim, scale_rope=old.scale_rope
        )


def _example_kwargs(
    model: QwenImageTransformer2DModel,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    height: int,
    width: int,
    text_tokens: int,
    batch: int,
    text_padding: int,
) -> dict[str, Any]:
    cfg = model.config
    gen = None if is_meta(device) else generator(device, seed, inputs=True)
    # prepare_latents: (B, 1, C, 2h, 2w) noise packed to (B, h*w, 4C) with h, w = H/16, W/16.
    latent_channels = cfg.in_channels // 4
    lat_h, lat_w = 2 * (height // (VAE_SCALE_FACTOR * 2)), 2 * (width // (VAE_SCALE_FACTOR * 2))
    latents = torch.randn(
        (batch, 1, latent_channels, lat_h, lat_w), generator=gen, device=device, dtype=dtype
    )
    latents = _pack_latents(latents, batch, latent_channels, lat_h, lat_w)

    prompt_embeds = torch.randn(
        (batch, text_tokens, cfg.joint_attention_dim), generator=gen, device=device, dtype=dtype
    )
    prompt_embeds_mask = None
    if text_padding:
        # _get_qwen_prompt_embeds pads shorter prompts with zero embeddings and zero mask entries.
        prompt_embeds[:, text_tokens - text_padding :] = 0
        prompt_embeds_mask = torch.ones((batch, text_tokens), dtype=torch.long, device=device)
        prompt_embeds_mask[:, text_tokens - text_padding :] = 0

    # The scheduler's t (sigma * 1000, fp32) expanded to the batch, cast to the latents' dtype,
    # divided by 1000 at the call site.
    sigma = torch.rand((1,), generator=gen, device=device) * 0.95 + 0.05
    t = sigma * 1000
    timestep = t.expand(batch).to(latents.dtype) / 1000

    img_shapes = [[(1, height // VAE_SCALE_FACTOR // 2, width // VAE_SCALE_FACTOR // 2)]] * batch
    return dict(
        hidden_states=latents,
        timestep=timestep,
        guidance=None,
        encoder_hidden_states_mask=prompt_embeds_mask,
        encoder_hidden_states=prompt_embeds,
        img_shapes=img_shapes,
        attention_kwargs={},
        return_dict=False,
    )


def _pack_latents(
    latents: torch.Tensor, batch: int, channels: int, height: int, width: int
) -> torch.Tensor:
    """QwenImagePipeline._pack_latents: 2x2 patches, channel-last, one token per patch."""
    latents = latents.view(batch, channels, height // 2, 2, width // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(batch, (height // 2) * (width // 2), channels * 4)
