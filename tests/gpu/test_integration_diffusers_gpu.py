"""The diffusers integration on CUDA: a tiny Qwen-Image pipeline (random weights, built from
configs as in tests/cpu/test_integration_diffusers.py) with kopt's transformer replayed from
CUDA graphs, and compiled with ``backend="kopt"``: the engine's CUDA-graph and compile paths
keep working with kopt in them."""

from __future__ import annotations

import torch

from kopt.integrations.diffusers import exact_tier, optimize_pipeline, restore
from tests.cpu.test_integration_diffusers import (
    _delta,
    _forget,
    _qwen_pipe,
    _qwen_run,
    _relative_error,
    qwen_parts,  # noqa: F401 -- the fixture
)


def _on_cuda(pipe):  # noqa: ANN001, ANN202
    return pipe.to("cuda")


def test_cuda_graphs_through_the_pipeline_are_bitwise_the_plain_pipeline(qwen_parts) -> None:  # noqa: ANN001, F811
    """Exact-tier passes, the transformer replayed from CUDA graphs (one per input signature:
    the cond and the uncond prompt have other lengths), the hoisted timestep work outside the
    graphs: the images are bitwise those of the plain pipeline, and each step's uncond call
    reuses the cond call's timestep work."""
    pipe = _on_cuda(_qwen_pipe(qwen_parts))
    plain = _qwen_run(pipe)
    handle = optimize_pipeline(pipe, config=exact_tier(), cuda_graphs=True)
    first = _qwen_run(pipe)
    assert torch.equal(first, plain)
    assert len(handle.reports) == 2 and handle.report.verified
    assert {"hoist", "fold_constants"} <= {r.name for r in handle.report.passes if r.matched}
    _forget(handle)
    before = handle.cache_stats()
    assert torch.equal(_qwen_run(pipe), plain)  # replayed, caches refilled
    assert _delta(handle.cache_stats(), before) == {"{timestep}": (2, 2)}
    restore(pipe)
    assert torch.equal(_qwen_run(pipe), plain)


def test_default_passes_replayed_from_cuda_graphs_within_tolerance(qwen_parts) -> None:  # noqa: ANN001, F811
    pipe = _on_cuda(_qwen_pipe(qwen_parts))
    plain = _qwen_run(pipe, "latent")
    handle = optimize_pipeline(pipe, cuda_graphs=True)
    graphed = _qwen_run(pipe, "latent")
    assert handle.report.verified
    assert {"merge_projections", "rowwise_fusion", "hoist"} <= {
        r.name for r in handle.report.passes if r.matched}
    assert _relative_error(graphed, plain) <= 1e-5  # fp32, tolerance-tier fusions, 2 steps


def test_torch_compile_of_the_transformer_with_the_kopt_backend(qwen_parts) -> None:  # noqa: ANN001, F811
    pipe = _on_cuda(_qwen_pipe(qwen_parts))
    negative = "a blue sphere on a rug"  # the prompt's length: one graph
    plain = _qwen_run(pipe, "latent", negative=negative)
    reports: list = []
    pipe.transformer = torch.compile(pipe.transformer, backend="kopt",
                                     options={"reports": reports})
    compiled = _qwen_run(pipe, "latent", negative=negative)
    assert len(reports) == 1 and reports[0].verified
    assert _relative_error(compiled, plain) <= 1e-4  # Inductor's kernels after kopt's, fp32
