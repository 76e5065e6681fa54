"""kopt on SGLang's own FLUX.2 and Qwen-Image DiTs, through SGLang's denoising stage and its
torch.compile path (``kopt.integrations.sglang``), against SGLang's own output.

Run with ``tests/sglang/run.sh`` (its own environment: sglang pins torch 2.14.1).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kopt.integrations.diffusers import exact_tier
from kopt.integrations.sglang import KoptDiT, apply, optimize_dit, restore
from kopt.verify import RTOL_FLOOR

from .conftest import STEPS, Engine, Model, flux2, qwen_image

BREAK = (r"graph break: Data pointer comparison at "
         r"sglang/multimodal_gen/runtime/models/dits/flux_2\.py:\d+ "
         r"`if result\.data_ptr\(\) != out\.data_ptr\(\):`")


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _bound(model: Model) -> float:
    """Each tolerance-tier pass may lose up to 2x the fp32 floor per DiT call; every call of
    the request adds its error (each scaled by its sigma step, < 1)."""
    return 2 * RTOL_FLOOR[torch.float32] * model.calls_per_step * STEPS


def _sound(handle: KoptDiT) -> None:
    """Every rewrite kopt made verified, none was reverted (merged projections' outputs are
    column slices: the views SGLang's attention takes of them become reshapes)."""
    assert handle.reports
    for report in handle.reports:
        assert report.verified, str(report)
        for r in report.passes:
            assert not r.reverted, str(report)


def test_qwen_image_through_sglangs_torch_compile_hook(model_root: str) -> None:
    model = qwen_image(model_root)
    plain = Engine(model, model.server_args(model_root)).run()

    # --enable-torch-compile: SGLang's stage compiles the DiT itself when it is created.
    engine = Engine(model, model.server_args(model_root, enable_torch_compile=True))
    registry = engine.stage._torch_compile_registry
    assert registry.is_compiled(model.dit)
    handle, = apply(engine.stage, inner="eager")
    assert handle.compiled and handle.dit is model.dit and engine.stage.transformer is model.dit
    assert "optimized on the first request" in str(handle)

    optimized = engine.run()
    assert _relative_error(optimized, plain) <= _bound(model)
    # SGLang's own compile call did not take the DiT back for Inductor: kopt's backend compiled
    # one graph per CFG branch (7 and 5 text tokens), no graph break, nothing left unoptimized.
    assert len(handle.reports) == 2
    assert not handle.graph_breaks and not handle.fallbacks
    assert {"merge_projections", "rowwise_fusion", "fold_constants", "hoist"} \
        <= handle.passes_fired()
    _sound(handle)
    text = str(handle)
    assert text.startswith("kopt on QwenImageTransformer2DModel: 2 graphs optimized")
    assert "5 projections of silu_1" in text  # every block's modulation GEMM, merged

    # The next request reuses the graphs (no recompilation) and computes the same.
    assert torch.equal(engine.run(), optimized) and len(handle.reports) == 2

    restore(engine.stage)
    assert not registry.is_compiled(model.dit) and model.dit._compiled_call_impl is None
    assert torch.equal(Engine(model, model.server_args(model_root)).run(), plain)


def test_qwen_image_exact_tier_is_bitwise_sglangs_compiled_graphs(model_root: str) -> None:
    model = qwen_image(model_root)
    engine = Engine(model, model.server_args(model_root))
    # SGLang's torch.compile path with a backend that runs dynamo's graphs as they are: the
    # reference for kopt's graphs (SGLang's eager forward runs its own nested torch.compile
    # regions through Inductor, which reorders float math).
    model.dit.compile(backend="eager", dynamic=False)
    traced = engine.run()
    restore(model.dit)
    torch._dynamo.reset()

    handle = optimize_dit(model.dit, config=exact_tier(), inner="eager")
    assert torch.equal(engine.run(), traced)
    assert {"cse", "fold_constants", "hoist"} <= handle.passes_fired()
    for report in handle.reports:
        assert report.verified
        for r in report.passes:
            assert r.verdict is None or r.verdict.tier == "exact"


def test_flux2_graph_break_is_reported_and_the_graphs_around_it_optimized(
        model_root: str) -> None:
    model = flux2(model_root)
    engine = Engine(model, model.server_args(model_root))
    plain = engine.run()

    handle, = apply(engine.stage, inner="eager")
    with pytest.warns(RuntimeWarning, match=BREAK):
        optimized = engine.run()
    assert _relative_error(optimized, plain) <= _bound(model)
    # One break location (each single-stream block's SwiGLU writes into a slice of the output
    # GEMM's input and compares data pointers), reported once.
    assert len(handle.graph_breaks) == 1 and "flux_2.py" in handle.graph_breaks[0]
    assert {"rowwise_fusion", "cse", "fold_constants"} <= handle.passes_fired()
    _sound(handle)
    # Dynamo compiles a block's forward once for all the blocks past the break (the weights
    # are inputs of its graph); kopt optimized such graphs once per block's weights.
    per_graph = Counter(r.model for r in handle.reports)
    assert max(per_graph.values()) == 2 == len(model.dit.single_transformer_blocks)
    assert f"graph break: {handle.graph_breaks[0]}" in str(handle)

    assert torch.equal(engine.run(), optimized)


def test_flux2_graph_kopt_cannot_capture_runs_as_traced_and_says_why(model_root: str) -> None:
    model = flux2(model_root)
    engine = Engine(model, model.server_args(model_root))
    plain = engine.run()

    handle, = apply(engine.stage, config=exact_tier(), inner="eager")
    with pytest.warns(RuntimeWarning, match=r"runs as dynamo traced it: input mutation: the "
                                            r"model writes into its input l_out_ in place"):
        optimized = engine.run()
    # The graph after the break copies the attention output into the GEMM input it was handed
    # (an in-place write to a graph input), which kopt's capture does not take: it runs as
    # dynamo traced it. Every other graph is kopt's, at the exact tier: bitwise SGLang's.
    assert len(handle.fallbacks) == 1 and "graph " in handle.fallbacks[0]
    assert torch.equal(optimized, plain)
    assert {"cse", "fold_constants"} <= handle.passes_fired()
    assert all(report.verified for report in handle.reports)
    assert f"ran unmodified: {handle.fallbacks[0]}" in str(handle)


def test_engine_setup_kopt_must_not_take_leaves_the_dit_unmodified(model_root: str) -> None:
    model = qwen_image(model_root)
    engine = Engine(model, model.server_args(model_root))
    plain = engine.run()
    # SGLang's breakable CUDA graph captures the eager DiT itself (it cannot run on the CPU:
    # the flag is set after the stage is built, as only apply() reads it here).
    engine.server_args.enable_breakable_cuda_graph = True
    with pytest.warns(RuntimeWarning, match="runs unmodified: SGLang's breakable CUDA graph"):
        handle, = apply(engine.stage)
    assert not handle.compiled and model.dit._compiled_call_impl is None
    assert not engine.stage._torch_compile_registry.is_compiled(model.dit)
    assert "kopt on QwenImageTransformer2DModel: not applied" in str(handle)
    engine.server_args.enable_breakable_cuda_graph = False
    assert torch.equal(engine.run(), plain) and not handle.reports


def test_apply_says_what_it_needs() -> None:
    with pytest.raises(Exception, match="no denoising stage with a DiT"):
        apply(torch.nn.Linear(2, 2))


def test_qwen_image_default_inner_compiler_is_inductor(model_root: str) -> None:
    model = qwen_image(model_root)
    engine = Engine(model, model.server_args(model_root))
    plain = engine.run()
    handle, = apply(engine.stage)  # kopt's passes, then Inductor, as SGLang's own compile
    optimized = engine.run()
    assert _relative_error(optimized, plain) <= 2 * _bound(model)  # Inductor reorders too
    assert len(handle.reports) == 2
    fired = handle.passes_fired()
    assert {"merge_projections", "rowwise_fusion", "fold_constants"} <= fired
    # hoisting keeps state in kopt's runner, which Inductor would trace through: left off
    assert "hoist" not in fired
    _sound(handle)
