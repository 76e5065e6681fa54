"""The reference workload builders: tiny models run, are seeded, export; full configs have the sizes
the benchmarks quote (checked on meta, no weights allocated)."""

from __future__ import annotations

import pytest
import torch

from kopt.models import MODEL_NAMES, build
from kopt.models._common import generator

# (name, shape kwargs): the tiny workloads, decode and prefill both for the LLM.
TINY = [
    ("qwen-image-tiny", {}),
    ("qwen-image-tiny", {"text_padding": 3}),
    ("flux2-tiny", {}),
    ("llm-tiny", {"mode": "prefill"}),
    ("llm-tiny", {"mode": "decode"}),
]
TINY_IDS = ["qwen-image", "qwen-image-padded", "flux2", "llm-prefill", "llm-decode"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "shape"), TINY, ids=TINY_IDS)
def test_tiny_runs_and_is_seeded(name: str, shape: dict, dtype: torch.dtype) -> None:
    workload = build(name, dtype=dtype, seed=0, **shape)
    out = workload.run()
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert out.float().std() > 0.1  # not collapsed to a constant by a degenerate init
    # Same seed: bitwise the same; calling twice changes nothing (the decode cache is rewound).
    assert torch.equal(out, build(name, dtype=dtype, seed=0, **shape).run())
    assert torch.equal(out, workload.run())
    assert not torch.equal(out, build(name, dtype=dtype, seed=1, **shape).run())


@pytest.mark.parametrize(("name", "shape"), TINY, ids=TINY_IDS)
def test_tiny_weights_are_all_random(name: str, shape: dict) -> None:
    # Biases and norm scales too: a rewrite that drops one must change the output.
    model = build(name, **shape).model
    for pname, param in model.named_parameters():
        assert param.numel() == 1 or param.std() > 0, pname
        assert not param.requires_grad, pname
    assert not model.training


@pytest.mark.parametrize(("name", "shape"), TINY, ids=TINY_IDS)
def test_tiny_exports(name: str, shape: dict) -> None:
    workload = build(name, dtype=torch.bfloat16, **shape)
    exported = torch.export.export(workload.model, workload.args, workload.kwargs, strict=False)
    assert len(exported.graph.nodes) > 100


def test_decode_step_matches_uncached_forward() -> None:
    # The cache is filled by a real prefill: decoding token S over it equals position S of an
    # uncached pass over prompt + token. Prompt ids are the first draw of the input stream.
    seed, batch, seq_len = 3, 4, 16
    workload = build("llm-tiny", mode="decode", seed=seed, batch=batch, seq_len=seq_len)
    decoder = workload.model.model
    prompt = torch.randint(
        0,
        decoder.config.vocab_size,
        (batch, seq_len),
        generator=generator(torch.device("cpu"), seed, inputs=True),
    )
    tokens = torch.cat([prompt, workload.kwargs["input_ids"]], dim=1)
    with torch.no_grad():
        reference = decoder(input_ids=tokens, use_cache=False).last_hidden_state[:, -1:]
    torch.testing.assert_close(workload.run(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "params"),
    [("qwen-image", 20.4e9), ("flux2", 32.2e9), ("llm", 7.57e9)],
)
def test_full_parameter_counts_on_meta(name: str, params: float) -> None:
    workload = build(name, device="meta", dtype=torch.bfloat16)
    count = sum(p.numel() for p in workload.model.parameters())
    assert abs(count - params) / params < 0.02
    assert all(p.is_meta for p in workload.model.parameters())


def test_full_example_shapes() -> None:
    qwen = build("qwen-image", device="meta").kwargs
    assert qwen["hidden_states"].shape == (1, 4096, 64)
    assert qwen["encoder_hidden_states"].shape == (1, 128, 3584)
    assert qwen["img_shapes"] == [[(1, 64, 64)]]
    flux = build("flux2", device="meta").kwargs
    assert flux["hidden_states"].shape == (1, 4096, 128)
    assert flux["encoder_hidden_states"].shape == (1, 512, 15360)
    assert flux["img_ids"].shape == (1, 4096, 4)
    assert build("llm", device="meta").kwargs["input_ids"].shape == (1, 2048)
    assert build("llm", device="meta", mode="decode").kwargs["input_ids"].shape == (64, 1)


def test_names_and_unknown_name() -> None:
    assert MODEL_NAMES == (
        "qwen-image-tiny",
        "qwen-image",
        "flux2-tiny",
        "flux2",
        "llm-tiny",
        "llm",
    )
    with pytest.raises(ValueError, match="'sdxl'.*qwen-image-tiny.*llm"):
        build("sdxl")
