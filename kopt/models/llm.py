"""LLM decoder (W3): a transformers Qwen3 decoder stack (`Qwen3Model`, no LM head), random weights.

Two modes, each one forward of a serving loop:
- `prefill`: `Qwen3Model(input_ids=(B, S), use_cache=False)`, returns a `BaseModelOutputWithPast`.
  Eager runs SDPA with `is_causal=True` and no mask; under `torch.export` transformers refuses to
  bake `is_causal` in and materialises a (B, 1, S, S) boolean causal mask instead, so the exported
  graph attends through a mask the eager model never builds.
- `decode`: one new token per sequence over a KV cache already holding `seq_len` tokens. The model
  is `Qwen3DecodeStep`, which owns a transformers `StaticCache` as buffers and takes
  `(input_ids (B, 1), cache_position (1,))`; it returns the last hidden state (B, 1, hidden).

Why a wrapper and a StaticCache for decode: a cache passed as a kwarg is mutated by every forward
(a DynamicCache grows, a StaticCache advances its length counter), so the same example inputs would
describe a different step on every call; and neither cache class is a pytree node, so
`torch.export` rejects both as inputs ("Unsupported input type ... StaticCache"; transformers can
register DynamicCache globally, which is process-wide state we do not want to switch on).
Held as buffers (transformers' own ExecuTorch recipe), the cache is state that the exported
program mutates in place (`index_copy_` into slot `seq_len`, `copy_`/`add_` on the
`cumulative_length` counters), and the wrapper rewinds the counters to `cache_position` first, so
repeated calls are idempotent. The cache is filled by a real prefill of random prompt ids, so the
decode output equals what the uncached model computes for the same tokens.

Quirks that matter to a graph capture: the attention mask over the whole static cache (capacity
`max_cache_len`, slots past the current position masked) is built inside the forward from the
position counters; RoPE cos/sin are computed from `inv_freq` (an fp32 buffer even in a bf16 model)
on every call; q/k go through per-head RMSNorm (QK-norm) before RoPE; GQA with 8 kv heads for 32
query heads (full).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3Model, StaticCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

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
Mode = Literal["prefill", "decode"]

# Qwen3-8B's decoder (7.57B parameters without the LM head).
FULL_CONFIG: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# seq_len: prompt length (prefill) or tokens already in the cache (decode). max_cache_len: the
# static cache's capacity, larger than the context so that its masked tail is part of the workload.
_DEFAULTS: dict[tuple[Variant, Mode], dict[str, int]] = {
    ("full", "prefill"): dict(batch=1, seq_len=2048),
    ("full", "decode"): dict(batch=64, seq_len=512, max_cache_len=640),
    ("tiny", "prefill"): dict(batch=1, seq_len=20),
    ("tiny", "decode"): dict(batch=64, seq_len=16, max_cache_len=24),
}


class Qwen3DecodeStep(nn.Module):
    """One decode step of `model` over a static KV cache that this module owns as buffers.

    The cache's layers hold references to the buffers, re-bound at every call: `.to()`, a deepcopy
    or export's parameter swapping replace the buffer objects, and the cache must follow them.
    """

    def __init__(self, model: Qwen3Model, cache: StaticCache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        for i, layer in enumerate(cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(
                f"cumulative_length_{i}", layer.cumulative_length, persistent=False
            )

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = getattr(self, f"cumulative_length_{i}")
            # Rewind: the step writes slot cache_position whatever ran before.
            layer.cumulative_length.copy_(cache_position[0])
        out = self.model(input_ids=input_ids, use_cache=True, **cache_kwarg(self.model, self.cache))
        return out.last_hidden_state


def build(
    variant: Variant,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    mode: Mode = "prefill",
    batch: int | None = None,
    seq_len: int | None = None,
    max_cache_len: int | None = None,
) -> Workload:
    """Qwen3 decoder + the inputs of one prefill or one decode step."""
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if mode == "prefill" and max_cache_len is not None:
        raise ValueError("max_cache_len applies to mode='decode' only")
    device = as_device(device)
    defaults = _DEFAULTS[variant, mode]
    batch = defaults["batch"] if batch is None else batch
    seq_len = defaults["seq_len"] if seq_len is None else seq_len
    check_sizes(batch=batch, seq_len=seq_len)
    config = Qwen3Config(
        **(FULL_CONFIG if variant == "full" else TINY_CONFIG), attn_implementation="sdpa"
    )

    model = materialize(
        lambda: Qwen3Model(config),
        device=device,
        dtype=dtype,
        seed=seed,
        recompute=_rebuild_rotary,
        recomputed_buffers=("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"),
    )
    gen = None if is_meta(device) else generator(device, seed, inputs=True)
    tokens = (batch, seq_len)
    if mode == "prefill":
        workload_model: nn.Module = model
        kwargs: dict[str, Any] = dict(
            input_ids=_random_ids(config, tokens, gen, device), use_cache=False
        )
        shape = f"prefill {batch}x{seq_len}"
    else:
        max_cache_len = defaults["max_cache_len"] if max_cache_len is None else max_cache_len
        if max_cache_len <= seq_len:
            raise ValueError(f"max_cache_len ({max_cache_len}) must exceed seq_len ({seq_len})")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
        # Allocated up front, on the device: export cannot trace the lazy first-update allocation.
        cache.early_initialization(
            batch, config.num_key_value_heads, config.head_dim, dtype, device
        )
        prompt = _random_ids(config, tokens, gen, device)
        if not is_meta(device):
            with torch.no_grad():
                model(input_ids=prompt, use_cache=True, **cache_kwarg(model, cache))
        workload_model = Qwen3DecodeStep(model, cache).eval()
        kwargs = dict(
            input_ids=_random_ids(config, (batch, 1), gen, device),
            cache_position=torch.tensor([seq_len], dtype=torch.long, device=device),
        )
        shape = (
            f"decode batch {batch}, 1 new token over {seq_len} cached (capacity {max_cache_len})"
        )
    description = (
        f"Qwen3 {variant} decoder: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} q / {config.num_key_value_heads} kv heads x "
        f"{config.head_dim}, intermediate {config.intermediate_size}, {shape}, {dtype_name(dtype)}"
    )
    suffix = "" if variant == "full" else "-tiny"
    return Workload(
        name=f"llm{suffix}",
        model=workload_model,
        args=(),
        kwargs=kwargs,
        step_invariant=(),
        calls_per_step=1,
        description=description,
    )


def cache_kwarg(model: nn.Module, cache: StaticCache) -> dict[str, StaticCache]:
    """The keyword that hands `model.forward` its KV cache: `cache` from transformers 5.25,
    `past_key_values` before. The forward takes `**kwargs`, so the wrong name is not an error:
    the model would silently run without the cache."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return {name: cache}
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def _rebuild_rotary(model: Qwen3Model) -> None:
    """Replace the rotary module: `to_empty` left its `inv_freq` buffers uninitialised.

    Rebuilt by the class's own constructor on the CPU (a few hundred floats), then moved; it stays
    fp32 in a bf16 model, as in a model loaded with `from_pretrained(dtype=torch.bfloat16)`.
    """
    device = model.embed_tokens.weight.device
    with torch.device("cpu"):
        rotary = Qwen3RotaryEmbedding(config=model.config)
    model.rotary_emb = rotary.to(device)


def _random_ids(
    config: Qwen3Config,
    shape: tuple[int, int],
    gen: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, shape, generator=gen, device=device)
