"""Models nobody tuned kopt for: tiny seeded random-weight configs of other diffusers DiTs and
transformers LLMs, with the inputs their callers pass (fp32, CPU).

kopt's passes match graph structure, never module names or model classes; these are how that
claim is checked (``benchmarks/generality.py``, ``tests/cpu/test_zoo.py``). Each function
returns a :class:`kopt.models.Workload`, so the CLI takes them as they are::

    kopt optimize --model kopt.models.zoo:wan --fp8 --fp8-min-features 16

The LLMs run a prefill without a cache (batch 2, 12 tokens); the DiTs one conditional call.
Every weight, bias and norm scale is random (:func:`kopt.models._common.init_random_`), so a
rewrite that drops one changes the output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from kopt.models._common import Workload, init_random_

__all__ = ["ZOO", "build"]


def _finish(model: nn.Module, seed: int) -> nn.Module:
    init_random_(model, torch.Generator().manual_seed(seed))
    model.requires_grad_(False)
    return model.eval()


def _inputs(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1)


def _dit(name: str, model: nn.Module, kwargs: dict, description: str) -> Workload:
    step = tuple(k for k in ("timestep", "guidance") if k in kwargs)
    return Workload(name, model, (), dict(kwargs, return_dict=False), step, 1, description)


# -- diffusers DiTs ---------------------------------------------------------------------------

def flux1(seed: int = 0) -> Workload:
    """FLUX.1: double- and single-stream blocks, QK-norm + interleaved RoPE, guidance."""
    from diffusers import FluxTransformer2DModel
    m = _finish(FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)), seed)
    g, img, txt = _inputs(seed), 16, 8
    ids = torch.zeros(img, 3)
    ids[:, 1], ids[:, 2] = torch.arange(img) // 4, torch.arange(img) % 4
    return _dit("flux1", m, dict(
        hidden_states=torch.randn(1, img, 16, generator=g),
        encoder_hidden_states=torch.randn(1, txt, 32, generator=g),
        pooled_projections=torch.randn(1, 24, generator=g), timestep=torch.tensor([0.7]),
        guidance=torch.tensor([3.5]), img_ids=ids, txt_ids=torch.zeros(txt, 3)),
        "FLUX.1 tiny: 2 double + 2 single-stream blocks, hidden 32")


def sd3(seed: int = 0) -> Workload:
    """SD3.5: joint attention with QK RMSNorm (no RoPE), a dual-attention (MMDiT-X) block."""
    from diffusers import SD3Transformer2DModel
    m = _finish(SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=24, out_channels=4, pos_embed_max_size=16, qk_norm="rms_norm",
        dual_attention_layers=(0,)), seed)
    g = _inputs(seed)
    return _dit("sd3.5", m, dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 24, generator=g), timestep=torch.tensor([500.0])),
        "SD3.5 tiny: 2 joint blocks (the first dual-attention), hidden 32")


def pixart(seed: int = 0) -> Workload:
    """PixArt-Sigma: adaLN-single, self + cross attention, GELU(tanh) MLP."""
    from diffusers import PixArtTransformer2DModel
    m = _finish(PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=24,
        norm_num_groups=4), seed)
    g = _inputs(seed)
    return _dit("pixart-sigma", m, dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 24, generator=g),
        timestep=torch.tensor([500]),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None}),
        "PixArt-Sigma tiny: 2 blocks, hidden 32")


def sana(seed: int = 0) -> Workload:
    """Sana: linear attention, a GLU conv MLP (Mix-FFN)."""
    from diffusers import SanaTransformer2DModel
    m = _finish(SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=32, caption_channels=24, sample_size=8, patch_size=1), seed)
    g = _inputs(seed)
    return _dit("sana", m, dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 24, generator=g),
        timestep=torch.tensor([500.0])),
        "Sana tiny: 2 blocks, hidden 32")


def wan(seed: int = 0) -> Workload:
    """Wan 2.1 (video): QK RMSNorm across heads + RoPE, cross attention to the text, whose
    embedding's second linear feeds every block's K/V projections directly."""
    from diffusers import WanTransformer3DModel
    m = _finish(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2,
        rope_max_seq_len=32), seed)
    g = _inputs(seed)
    return _dit("wan2.1", m, dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 24, generator=g)),
        "Wan 2.1 tiny: 2 blocks, hidden 32, 2 frames of 8x8")


# -- transformers LLMs ------------------------------------------------------------------------

def _llm(name: str, config_cls: str, model_cls: str, attention: str = "sdpa",
         **kw: object) -> Callable[[int], Workload]:
    def build(seed: int = 0) -> Workload:
        import transformers
        config = getattr(transformers, config_cls)(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **kw)
        config._attn_implementation = attention
        m = _finish(getattr(transformers, model_cls)(config), seed)
        ids = torch.randint(0, 128, (2, 12), generator=_inputs(seed))
        return Workload(name, m, (ids,), {"use_cache": False}, (), 1,
                        f"{model_cls} tiny: 2 layers, hidden 64, prefill of 2 x 12 tokens")
    build.__name__ = name.replace("-", "_").replace(".", "_")
    build.__doc__ = f"transformers' {model_cls}, tiny, prefill without a cache."
    return build


llama = _llm("llama", "LlamaConfig", "LlamaModel", num_key_value_heads=2)
mistral = _llm("mistral", "MistralConfig", "MistralModel", num_key_value_heads=2)
qwen2 = _llm("qwen2", "Qwen2Config", "Qwen2Model", num_key_value_heads=2)
# transformers runs Gemma 2's soft-capped attention eagerly only
gemma2 = _llm("gemma2", "Gemma2Config", "Gemma2Model", "eager", num_key_value_heads=2,
              head_dim=16)
gemma3 = _llm("gemma3", "Gemma3TextConfig", "Gemma3TextModel", num_key_value_heads=2,
              head_dim=16)
phi3 = _llm("phi3", "Phi3Config", "Phi3Model", num_key_value_heads=4)
qwen3_moe = _llm("qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeModel", num_key_value_heads=2,
                 moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
gpt_neox = _llm("gpt-neox", "GPTNeoXConfig", "GPTNeoXModel")

ZOO: dict[str, Callable[[int], Workload]] = {
    "flux1": flux1, "sd3.5": sd3, "pixart-sigma": pixart, "sana": sana, "wan2.1": wan,
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma2": gemma2, "gemma3": gemma3,
    "phi3": phi3, "qwen3-moe": qwen3_moe, "gpt-neox": gpt_neox,
}


def build(name: str, seed: int = 0, *, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32) -> Workload:
    """The zoo's model ``name`` (one of :data:`ZOO`), weights and inputs drawn from ``seed`` (on
    the CPU in fp32, then moved to ``device`` and floating-point tensors cast to ``dtype``)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}")
    w = ZOO[name](seed)

    def move(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        return x.to(device, dtype) if x.is_floating_point() else x.to(device)

    # as from_pretrained loads them: the modules a model keeps in fp32 (Wan's norms, time
    # embedder, RoPE and modulation table) stay there. nn.Module.to: diffusers' own warns.
    nn.Module.to(w.model, device, dtype)
    keep = getattr(w.model, "_keep_in_fp32_modules", None) or ()
    for prefix, module in w.model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                name = f"{prefix}.{key}" if prefix else key
                if t is not None and t.is_floating_point() and \
                        any(k in name.split(".") for k in keep):
                    table[key] = nn.Parameter(t.detach().float(), requires_grad=False) \
                        if isinstance(t, nn.Parameter) else t.float()
    return dataclasses.replace(w, args=tuple(pytree.tree_map(move, list(w.args))),
                               kwargs=pytree.tree_map(move, w.kwargs))
