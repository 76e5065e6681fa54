"""kopt.integrations.diffusers: tiny Qwen-Image and FLUX.2 pipelines (random weights, built from
configs) run end to end with kopt on and off.

Qwen-Image runs with its real text path: a Qwen2.5-VL text encoder and a byte-level Qwen2
tokenizer built in memory (no vocabulary files), true CFG with a negative prompt of another
length, so each step makes two transformer calls of two input signatures. FLUX.2 gets
``prompt_embeds`` (its Mistral-3 encoder and processor are left out).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from diffusers import (
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    QwenImagePipeline,
)
from diffusers.hooks import FirstBlockCacheConfig
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from kopt.integrations.diffusers import KoptTransformer, exact_tier, optimize_pipeline, restore
from kopt.models import build
from kopt.passes import PassConfig
from kopt.passes.pipeline import build_passes
from kopt.verify import RTOL_FLOOR

STEPS = 2
HEIGHT, WIDTH = 96, 128  # 6 x 8 latent patches, non-square
PROMPT, NEGATIVE = "a red cube on a table", "blurry"  # other lengths: two input signatures


def _byte_level_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE with no merges: one token per byte, plus the chat markers the
    pipeline's prompt template uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    tok = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


@pytest.fixture(scope="module")
def qwen_parts() -> dict:
    """Everything but the transformer (kopt never touches these)."""
    torch.manual_seed(0)
    tok = _byte_level_tokenizer()
    text_dim = build("qwen-image-tiny").model.config.joint_attention_dim
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=text_dim, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=text_dim, fullatt_block_indexes=[0]),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    # z_dim = the transformer's in_channels / 4 (2x2 patches); 3 temporal stages: 8x spatial.
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 2.0, 1.2, 0.8]).eval()
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tok)


def _qwen_pipe(parts: dict) -> QwenImagePipeline:
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                             transformer=build("qwen-image-tiny").model, **parts)


def _qwen_run(pipe: QwenImagePipeline, output_type: str = "pt",
              negative: str = NEGATIVE) -> torch.Tensor:
    out = pipe(prompt=PROMPT, negative_prompt=negative, true_cfg_scale=4.0, height=HEIGHT,
               width=WIDTH, num_inference_steps=STEPS, output_type=output_type,
               generator=torch.Generator().manual_seed(0))
    return out.images


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _forget(handle: KoptTransformer) -> None:
    """Empty the hoisted caches: the next run is a new denoising loop (equal timesteps of a
    repeated schedule would otherwise hit the previous run's entries, which is right too)."""
    handle.optimized.clear_caches()


def _delta(after: dict, before: dict) -> dict[str, tuple[int, int]]:
    return {k: (h - before.get(k, (0, 0))[0], m - before.get(k, (0, 0))[1])
            for k, (h, m) in after.items()}


def test_exact_tier_only_keeps_exact_passes() -> None:
    config = exact_tier()
    kept = build_passes(config)
    assert kept and all(p.numerics.tier == "exact" for p in kept)
    dropped = set(PassConfig().enabled()) - set(config.enabled())
    assert {"merge_projections", "rowwise_fusion"} <= dropped  # tolerance tier
    assert {"hoist", "fold_constants", "cse"} <= set(config.enabled())


def test_qwen_image_exact_tier_images_are_bitwise_equal(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    plain = _qwen_run(pipe)
    original = pipe.transformer

    handle = optimize_pipeline(pipe, config=exact_tier())
    assert isinstance(pipe.transformer, KoptTransformer) and handle.report is None
    optimized = _qwen_run(pipe)
    assert torch.equal(optimized, plain)

    # The cond and the uncond call have other text lengths: two signatures, one report each,
    # every pass that fired verified bitwise.
    assert len(handle.reports) == 2
    fired = {r.name for r in handle.report.passes if r.matched}
    assert {"cse", "fold_constants", "hoist"} <= fired
    for r in handle.report.passes:
        assert r.verdict is None or (r.verdict.passed and r.verdict.tier == "exact")
    text = str(handle)
    assert "kopt on QwenImageTransformer2DModel: 2 input signatures optimized" in text
    assert "hoist " in text and "passed (exact: bitwise equal" in text

    # Warm: each step's uncond call reuses the cond call's timestep work (the pipeline passes
    # a new, equal timestep tensor to each call).
    _forget(handle)
    before = handle.cache_stats()
    assert torch.equal(_qwen_run(pipe), plain)
    assert _delta(handle.cache_stats(), before) == {"{timestep}": (STEPS, STEPS)}
    # the same schedule again: its STEPS (<= 2 cache entries) timesteps all hit
    before = handle.cache_stats()
    assert torch.equal(_qwen_run(pipe), plain)
    assert _delta(handle.cache_stats(), before) == {"{timestep}": (2 * STEPS, 0)}

    # Packing the weights in place left the model computing what it did.
    assert restore(pipe) is original and pipe.transformer is original
    assert torch.equal(_qwen_run(pipe), plain)


def test_qwen_image_default_passes_within_tolerance(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    plain = _qwen_run(pipe, "latent")
    handle = optimize_pipeline(pipe)
    optimized = _qwen_run(pipe, "latent")
    fired = {r.name for r in handle.report.passes if r.matched}
    assert {"merge_projections", "fuse_qk_norm_rope", "rowwise_fusion", "hoist"} <= fired
    assert handle.report.verified
    # Each tolerance-tier pass may lose up to 2x the fp32 floor per call; 2 calls per step,
    # STEPS steps, each step's error scaled by its sigma step (< 1).
    bound = 2 * RTOL_FLOOR[torch.float32] * 2 * STEPS
    assert _relative_error(optimized, plain) <= bound
    _forget(handle)
    before = handle.cache_stats()
    _qwen_run(pipe, "latent")
    assert _delta(handle.cache_stats(), before) == {"{timestep}": (STEPS, STEPS)}


def test_capture_failure_runs_the_transformer_unmodified_and_says_where(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    block = pipe.transformer.transformer_blocks[1]
    block_forward = block.forward

    def branchy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = block_forward(*args, **kwargs)
        if out[1].abs().max() > 1e6:  # data-dependent: export cannot trace this
            raise AssertionError("unreachable on these inputs")
        return out

    block.forward = branchy
    plain = _qwen_run(pipe)
    handle = optimize_pipeline(pipe, verify=False)
    with pytest.warns(RuntimeWarning, match="runs unmodified: data-dependent control flow at "
                                            r".*test_integration_diffusers.py:\d+"):
        optimized = _qwen_run(pipe)
    assert torch.equal(optimized, plain)
    assert handle.optimized is None and len(handle.fallbacks) == 1
    assert "ran unmodified: data-dependent control flow" in str(handle)


def test_hooks_that_change_forward_run_the_transformer_unmodified(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    cache = FirstBlockCacheConfig(threshold=0.5)
    pipe.transformer.enable_cache(cache)
    cached = _qwen_run(pipe)
    pipe.transformer.disable_cache()

    handle = optimize_pipeline(pipe, config=exact_tier(), verify=False)
    _qwen_run(pipe)
    assert handle.optimized is not None
    handle.enable_cache(cache)  # a reconfiguring method: the graphs are dropped
    assert handle.optimized is None
    with pytest.warns(RuntimeWarning, match="diffusers hooks fbc_leader_block_hook on "
                                            "transformer_blocks.0"):
        out = _qwen_run(pipe)
    assert torch.equal(out, cached) and handle.optimized is None


def test_wrapper_reads_like_the_transformer_and_reoptimizes_when_changed(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    original = pipe.transformer
    handle = optimize_pipeline(pipe, config=PassConfig(hoist=False), verify=False)
    assert pipe.config["transformer"] == ("diffusers", "QwenImageTransformer2DModel")
    assert handle.config is original.config
    assert (handle.dtype, handle.device) == (original.dtype, original.device)
    assert handle.state_dict().keys() == original.state_dict().keys()
    assert "not optimized yet" in str(handle)

    _qwen_run(pipe, negative=PROMPT)
    first = handle.optimized
    assert first is not None and len(handle.reports) == 1
    pipe.to("cpu")  # nothing moves: the graphs stay
    assert handle.optimized is first
    handle.to(torch.float64)  # the transformer alone (the other parts are shared by tests)
    assert handle.optimized is None and original.dtype == torch.float64
    handle.float()
    _qwen_run(pipe, negative=PROMPT)
    assert handle.report.passes and handle.optimized is not first
    handle.set_attention_backend("native")
    assert handle.optimized is None

    with pytest.raises(Exception, match="already optimized"):
        optimize_pipeline(pipe)
    assert restore(pipe) is original


def test_torch_compile_with_kopt_backend_runs_the_pipeline(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    plain = _qwen_run(pipe, "latent", negative="a blue sphere on a rug")  # one text length
    reports: list = []
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, backend="kopt",
                                     options={"reports": reports})  # Inductor after kopt
    compiled = _qwen_run(pipe, "latent", negative="a blue sphere on a rug")
    assert len(reports) == 1 and reports[0].verified
    assert {"merge_projections", "fold_constants"} <= {r.name for r in reports[0].passes
                                                       if r.matched}
    bound = 2 * RTOL_FLOOR[torch.float32] * 2 * STEPS  # as above; Inductor reorders too
    assert _relative_error(compiled, plain) <= 2 * bound


def test_torch_compile_dynamic_graph_runs_unoptimized_with_the_reason(qwen_parts, caplog) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    plain = _qwen_run(pipe, "latent")
    original = pipe.transformer
    for dynamic, optimized_graphs in ((None, 1), (False, 2)):
        reports: list = []
        torch._dynamo.reset()
        pipe.transformer = torch.compile(original, backend="kopt", dynamic=dynamic,
                                         options={"inner": "eager", "reports": reports,
                                                  "verify": False})  # verified above
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kopt"):
            out = _qwen_run(pipe, "latent")
        # dynamic=None: the uncond call's other text length makes dynamo recompile with a
        # symbolic size, which kopt leaves to the inner compiler and says so.
        said = [r.message for r in caplog.records if "left unoptimized" in r.message]
        assert len(reports) == optimized_graphs
        assert bool(said) == (dynamic is None)
        assert all("dynamic shapes" in m and "dynamic=False" in m for m in said)
        assert _relative_error(out, plain) <= 2 * RTOL_FLOOR[torch.float32] * 2 * STEPS


def test_compiling_the_wrapper_compiles_the_transformer_as_is(qwen_parts) -> None:  # noqa: ANN001
    pipe = _qwen_pipe(qwen_parts)
    plain = _qwen_run(pipe, "latent")
    handle = optimize_pipeline(pipe)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match='torch.compile traces the transformer itself.*"kopt"'):
        handle.compile(backend="eager", fullgraph=True)  # fullgraph: no break around kopt
    assert torch.equal(_qwen_run(pipe, "latent"), plain)
    assert handle.optimized is None


def test_flux2_exact_tier_images_are_bitwise_equal() -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                             latent_channels=4, norm_num_groups=4).eval()
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                         text_encoder=None, tokenizer=None,
                         transformer=build("flux2-tiny").model)
    text_dim = pipe.transformer.config.joint_attention_dim
    embeds = torch.randn(1, 12, text_dim, generator=torch.Generator().manual_seed(1))

    def run() -> torch.Tensor:
        return pipe(prompt_embeds=embeds, height=HEIGHT, width=WIDTH,
                    num_inference_steps=STEPS, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    plain = run()
    handle = optimize_pipeline(pipe, config=exact_tier())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        assert torch.equal(run(), plain)
    assert len(handle.reports) == 1
    hoist = handle.report.result("hoist")
    assert hoist.matched == 2 and hoist.verdict.passed
    # One call per step (guidance-distilled): the timestep work is new every step, the RoPE
    # tables from the position ids are computed once.
    _forget(handle)
    before = handle.cache_stats()
    assert torch.equal(run(), plain)
    assert _delta(handle.cache_stats(), before) == {"{guidance, timestep}": (0, STEPS),
                                                    "{img_ids, txt_ids}": (STEPS - 1, 1)}


def test_weights_kopt_moved_to_host_come_back_for_what_reads_them(qwen_parts, monkeypatch) -> None:  # noqa: ANN001
    """With FP8 the BF16 weights the graphs no longer read leave the device (here the CPU's
    own tensors move, as CUDA's do by default); the pipeline's images stay the same, and what
    reads the weights (a fallback call, state_dict, a cast, restore) gets them back."""
    from kopt import offload
    from kopt.passes import FP8Config

    monkeypatch.setattr(offload, "OFFLOAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's weights move too
    pipe = _qwen_pipe(qwen_parts)
    original = pipe.transformer
    config = PassConfig(fp8=FP8Config(min_features=16))
    plain = _qwen_run(pipe, "latent")
    handle = optimize_pipeline(pipe, config=config, verify=False)
    first = _qwen_run(pipe, "latent")
    assert handle.optimized.memory().host > 0
    emptied = [n for n, p in original.named_parameters() if p.untyped_storage().nbytes() == 0]
    assert emptied
    _forget(handle)
    assert torch.equal(_qwen_run(pipe, "latent"), first)
    pipe.to("cpu")  # nothing moves: the weights stay in host memory
    assert handle.optimized.memory().host > 0
    with handle.optimized.original_weights() as model:
        assert model is original and all(p.untyped_storage().nbytes() for p in
                                          model.parameters())
    state = handle.state_dict()  # the caller keeps these tensors: back for good
    assert all(t.untyped_storage().nbytes() for t in state.values())
    assert handle.optimized.memory().host == 0
    assert restore(pipe) is original
    assert torch.equal(_qwen_run(pipe, "latent"), plain)
