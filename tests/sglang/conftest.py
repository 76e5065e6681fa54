"""SGLang's own denoising stage and DiTs (FLUX.2, Qwen-Image), tiny, random weights, on the CPU.

Run by ``tests/sglang/run.sh`` in ``.venv-sglang`` (sglang pins its own torch). sglang is imported
at the top: where it cannot be imported the tests fail, they are never skipped.

What is SGLang's and what is the harness's:

* SGLang's: the DiT classes and their configs, ``ServerArgs``, the ``DenoisingStage`` (its
  scheduler loop, CFG branches, the kwargs it builds per call, the torch.compile registry) and
  ``FlowMatchEulerDiscreteScheduler``. ``Engine.run`` calls ``DenoisingStage.forward`` exactly as
  SGLang's pipeline executor does, after the residency manager's ``begin_request``.
* The harness's: the request fields the stages before denoising would fill in (latents, text
  embeddings, timesteps), and the few pieces of a loaded pipeline the stage reads (a residency
  manager built from a stand-in pipeline with just the attributes it reads).

Kernels: the PyPI ``sglang-kernel`` wheel is the CUDA build. ``sgl_kernel`` does not load without
``libcuda``, so SGLang's CPU kernels (``torch.ops.sgl_kernel.*_cpu``, which come with the CPU
build) are missing, and on the CPU platform SGLang's custom ops dispatch to them. The harness
selects the pure-PyTorch implementations SGLang ships for devices without kernels of their own:
every ``CustomOp``'s ``forward_native`` (what ``CustomOp.dispatch_forward`` returns on such a
platform) and, for ``fuse_scale_shift_kernel``, the torch fallback that ``select_impl`` binds on
MPS and MUSA (``fallback_torch.fuse_scale_shift_kernel_native``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# sglang is imported unconditionally: a missing or broken install fails every test here.
import pytest
import sglang.multimodal_gen.runtime.layers.elementwise as sgl_elementwise
import sglang.multimodal_gen.runtime.layers.layernorm as sgl_layernorm
import torch
from sglang.kernels.ops.diffusion.common.fallback_torch import fuse_scale_shift_kernel_native
from sglang.multimodal_gen.configs.models.dits.flux import FluxArchConfig, FluxConfig
from sglang.multimodal_gen.configs.models.dits.qwenimage import (
    QwenImageArchConfig,
    QwenImageDitConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.flux import (
    Flux2PipelineConfig,
    _prepare_latent_ids,
    flux2_pack_latents,
)
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import QwenImagePipelineConfig
from sglang.multimodal_gen.configs.sample.flux import Flux2SamplingParams
from sglang.multimodal_gen.configs.sample.qwenimage import QwenImageSamplingParams
from sglang.multimodal_gen.runtime.distributed.parallel_state import (
    maybe_init_distributed_environment_and_model_parallel,
    model_parallel_is_initialized,
)
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.managers.memory_managers.component_manager import (
    ComponentResidencyManager,
)
from sglang.multimodal_gen.runtime.models.dits.flux_2 import Flux2Transformer2DModel
from sglang.multimodal_gen.runtime.models.dits.qwen_image import QwenImageTransformer2DModel
from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
from sglang.multimodal_gen.runtime.pipelines_core.stages.denoising import DenoisingStage
from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args
from sglang.srt.utils.network import get_free_port_below_ephemeral

STEPS = 2
VAE_SCALE = 8  # both pipelines: latent pixel = 8x8 image pixels, a token = 2x2 latent pixels
WEIGHT_STD = 0.05  # random weights of this size keep the activations O(1) through the blocks


@pytest.fixture(scope="session", autouse=True)
def _sglang_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One process, one rank: SGLang's parallel groups (tp = sp = 1, gloo) and native kernels."""
    with pytest.MonkeyPatch.context() as patch:
        if not model_parallel_is_initialized():
            for key, value in dict(MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(get_free_port_below_ephemeral()),
                                   RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
                patch.setenv(key, value)
            maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)
        # The modules bound fuse_scale_shift_kernel at import: rebind where it is called.
        for module in (sgl_layernorm, sgl_elementwise):
            patch.setattr(module, "fuse_scale_shift_kernel", fuse_scale_shift_kernel_native)
        yield


@pytest.fixture(autouse=True)
def _fresh() -> None:
    """Seeded, and dynamo's caches empty (a DiT compiled by an earlier test is not reused)."""
    torch.manual_seed(0)
    torch._dynamo.reset()


def native_ops(dit: torch.nn.Module) -> int:
    """Route every SGLang custom op of ``dit`` to its PyTorch implementation; returns how many."""
    ops = [m for m in dit.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op._forward_method = op.forward_native
    return len(ops)


@dataclass
class Model:
    """A tiny SGLang DiT with the request fields its denoising stage needs."""

    name: str
    pipeline_config: Any
    dit: torch.nn.Module
    request: dict[str, Any]  # Req fields the stages before denoising would have set
    calls_per_step: int  # DiT calls per denoising step (2 with CFG)
    sampling_params: type  # the pipeline's SamplingParams class (its defaults decide CFG)

    def server_args(self, root: str, **kwargs: Any) -> ServerArgs:
        return server_args(self.pipeline_config, root, **kwargs)


def server_args(pipeline_config: Any, root: str, **kwargs: Any) -> ServerArgs:
    return ServerArgs(model_path=root, pipeline_config=pipeline_config, num_gpus=1,
                      log_level="warning", **kwargs)


class Engine:
    """SGLang's denoising stage around ``model.dit``, with SGLang's server args."""

    def __init__(self, model: Model, server_args: ServerArgs) -> None:
        self.model = model
        self.server_args = server_args
        set_global_server_args(server_args)  # what the stage (and its attention) read
        self.scheduler = FlowMatchEulerDiscreteScheduler()
        self.stage = DenoisingStage(transformer=model.dit, scheduler=self.scheduler)
        # What the residency manager reads of a loaded pipeline.
        pipeline = SimpleNamespace(component_residency_strategies={},
                                   _stage_name_mapping={"denoising_stage": self.stage},
                                   modules={"transformer": model.dit,
                                            "scheduler": self.scheduler})
        self.residency = ComponentResidencyManager(pipeline, server_args)
        self.stage.set_component_residency_manager(self.residency)

    def run(self) -> torch.Tensor:
        """One request: STEPS denoising steps; the final latents, unpacked by the pipeline."""
        set_global_server_args(self.server_args)
        self.scheduler.set_timesteps(STEPS)
        fields = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                  for k, v in self.model.request.items()}
        req = Req(sampling_params=self.model.sampling_params(), scheduler=self.scheduler,
                  timesteps=self.scheduler.timesteps, num_inference_steps=STEPS,
                  generator=torch.Generator().manual_seed(0), **fields)
        self.residency.begin_request([self.stage], req, self.server_args)
        return self.stage.forward(req, self.server_args).latents


def _randomize(dit: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, WEIGHT_STD)
    return dit.eval()


def qwen_image(root: str) -> Model:
    """Qwen-Image, true CFG: the cond (7 text tokens) and uncond (5) calls of a step are two
    calls of another shape. 64x96 pixels -> 4x6 = 24 image tokens."""
    arch = QwenImageArchConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2,
                               joint_attention_dim=48, in_channels=16, axes_dims_rope=(8, 12, 12))
    config = QwenImagePipelineConfig(dit_config=QwenImageDitConfig(arch_config=arch),
                                     dit_precision="fp32")
    config.vae_config.post_init()  # what loading the VAE sets (its scale factor)
    set_global_server_args(server_args(config, root))  # read when the attention is built
    dit = _randomize(QwenImageTransformer2DModel(config.dit_config, hf_config={}))
    assert native_ops(dit) > 0
    height, width = 64, 96
    tokens = (height // VAE_SCALE // 2) * (width // VAE_SCALE // 2)
    latents = torch.randn(1, tokens, arch.in_channels)
    request = dict(height=height, width=width, latents=latents, raw_latent_shape=latents.shape,
                   prompt_embeds=[torch.randn(1, 7, 48)],
                   negative_prompt_embeds=[torch.randn(1, 5, 48)])
    # QwenImageSamplingParams: negative prompt " " and guidance scale 4 by default, true CFG.
    return Model("qwen-image", config, dit, request, 2, QwenImageSamplingParams)


def flux2(root: str) -> Model:
    """FLUX.2-dev: guidance-distilled, one call per step. 96x128 pixels -> 6x8 = 48 image
    tokens, 12 text tokens; head_dim 32 = the four RoPE axes (t, h, w, l)."""
    arch = FluxArchConfig(num_layers=2, num_single_layers=2, attention_head_dim=32,
                          num_attention_heads=2, axes_dims_rope=(8, 8, 8, 8), in_channels=16,
                          joint_attention_dim=48)
    # Fields FLUX.2's config.json sets (the class defaults of diffusers' Flux2Transformer2DModel).
    arch.timestep_guidance_channels = 32
    arch.mlp_ratio = 3.0
    arch.rope_theta = 2000
    arch.eps = 1e-6
    config = Flux2PipelineConfig(dit_config=FluxConfig(arch_config=arch), dit_precision="fp32")
    config.vae_config.post_init()
    set_global_server_args(server_args(config, root))
    dit = _randomize(Flux2Transformer2DModel(config.dit_config, hf_config={}))
    assert native_ops(dit) > 0
    height, width = 96, 128
    grid = torch.randn(1, arch.in_channels, height // VAE_SCALE // 2, width // VAE_SCALE // 2)
    latents = flux2_pack_latents(grid)
    embeds = torch.randn(1, 12, 48)
    request = dict(height=height, width=width, latents=latents,
                   latent_ids=_prepare_latent_ids(grid), raw_latent_shape=latents.shape,
                   prompt_embeds=[embeds], prompt_seq_lens=[[embeds.shape[1]]])
    # Flux2SamplingParams: no negative prompt, so no CFG (guidance is embedded in the DiT).
    return Model("flux2", config, dit, request, 1, Flux2SamplingParams)


@pytest.fixture
def model_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """ServerArgs' model_path: a folder (nothing is loaded from it: the DiTs are built here)."""
    return os.fspath(tmp_path_factory.mktemp("model"))
