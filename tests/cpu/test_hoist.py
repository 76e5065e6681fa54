"""hoist: the timestep work of a CFG pair is done once; a new timestep, an in-place change of
the timestep or of a weight recomputes it; results are bitwise those of the unhoisted model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kopt
from kopt.models import build

aten = torch.ops.aten
GEMM_OPS = (aten.addmm.default, aten.mm.default, aten.bmm.default)


class GemmRows(TorchDispatchMode):
    """Records the row count M of every GEMM actually executed."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in GEMM_OPS:
            mat = args[1] if func is aten.addmm.default else args[0]
            self.rows.append(mat.shape[-2])
        return func(*args, **(kwargs or {}))


def _run(model, kwargs: dict) -> tuple[torch.Tensor, list[int]]:  # noqa: ANN001
    with GemmRows() as rec, torch.no_grad():
        out = model(**kwargs)[0]
    return out, rec.rows


@pytest.fixture(scope="module")
def qwen():  # noqa: ANN201
    w = build("qwen-image-tiny")
    hoisted = kopt.optimize(w.model, w.args, w.kwargs)
    plain = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(hoist=False))
    return w, hoisted, plain


def _uncond(w, tokens: int | None = None) -> dict:  # noqa: ANN001
    kw = dict(w.kwargs)
    cond = kw["encoder_hidden_states"]
    shape = (cond.shape[0], tokens or cond.shape[1], cond.shape[2])
    kw["encoder_hidden_states"] = torch.randn(shape)  # another prompt, same latents/timestep
    return kw


def test_second_call_of_a_cfg_pair_runs_no_timestep_gemm(qwen) -> None:  # noqa: ANN001
    w, hoisted, plain = qwen
    report = hoisted.report.result("hoist")
    assert report.matched == 1 and report.details[0].startswith("key {timestep}")
    assert "transformer_blocks.{0..1}.img_mod.1" in report.details[0]  # both blocks

    cond, uncond = dict(w.kwargs), _uncond(w)
    out1, rows1 = _run(hoisted, cond)
    out2, rows2 = _run(hoisted, uncond)
    # batch 1: the timestep MLP and the merged modulation GEMM are the only GEMMs with 1 row
    assert rows1.count(1) == 3
    assert rows2.count(1) == 0
    assert len(rows2) == len(rows1) - 3
    assert torch.equal(out1, _run(plain, cond)[0])
    assert torch.equal(out2, _run(plain, uncond)[0])

    new_t = dict(cond, timestep=cond["timestep"] * 0.5)  # next step: another timestep
    out3, rows3 = _run(hoisted, new_t)
    assert rows3.count(1) == 3
    assert torch.equal(out3, _run(plain, new_t)[0])


def test_cfg_pair_with_another_text_length_shares_the_timestep_cache(qwen) -> None:  # noqa: ANN001
    w, hoisted, plain = qwen
    uncond = _uncond(w, tokens=7)  # a negative prompt of another length: a new signature
    hoisted(**uncond)  # the first step specialises for it (captures and verifies)
    step_t = w.kwargs["timestep"] * 0.25  # the next step's timestep, one tensor for the pair
    cond = dict(w.kwargs, timestep=step_t)
    uncond["timestep"] = step_t
    _, rows1 = _run(hoisted, cond)
    out2, rows2 = _run(hoisted, uncond)
    assert rows1.count(1) == 3
    assert rows2.count(1) == 0
    assert torch.equal(out2, _run(plain, uncond)[0])
    assert len(hoisted.reports) == 2


def test_in_place_changes_of_timestep_or_weights_recompute(qwen) -> None:  # noqa: ANN001
    w, hoisted, plain = qwen
    kw = dict(w.kwargs, timestep=w.kwargs["timestep"].clone())
    _run(hoisted, kw)
    kw["timestep"].add_(0.25)  # same object, new value: the version counter moves
    out, rows = _run(hoisted, kw)
    assert rows.count(1) == 3
    assert torch.equal(out, _run(plain, kw)[0])
    lin = w.model.time_text_embed.timestep_embedder.linear_2
    saved = lin.weight.detach().clone()
    try:
        with torch.no_grad():
            lin.weight.mul_(1.5)
        out, rows = _run(hoisted, kw)
        assert rows.count(1) == 3
        torch.testing.assert_close(out, w.model(**kw)[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(out, _run(plain, kw)[0])
    finally:
        with torch.no_grad():
            lin.weight.copy_(saved)


class LatentReachesTimestep(nn.Module):
    """A "timestep" the latent reaches before the modulation GEMM: nothing to hoist."""

    def __init__(self) -> None:
        super().__init__()
        self.mod, self.proj = nn.Linear(8, 32), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = torch.sin(t[:, None] * torch.arange(8.0)) + x.mean((1, 2))[:, None]
        scale, shift = self.mod(nn.functional.silu(emb)).chunk(2, -1)
        return self.proj(x) * (1 + scale[:, None]) + shift[:, None]


def test_a_timestep_the_latent_reaches_is_not_hoisted() -> None:
    model = LatentReachesTimestep().eval()
    opt = kopt.optimize(model, (torch.randn(2, 64, 16), torch.rand(2)))
    result = opt.report.result("hoist")
    assert result.matched == 0
    assert "no GEMM or table depends only on the conditioning inputs (t)" in result.notes[0]


def test_llm_decoder_has_nothing_to_hoist() -> None:
    for mode in ("prefill", "decode"):
        w = build("llm-tiny", mode=mode)
        opt = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(merge_projections=False))
        result = opt.report.result("hoist")
        assert result.matched == 0 and result.notes[0].startswith("nothing to hoist")


class OpCount(TorchDispatchMode):
    def __init__(self, op) -> None:  # noqa: ANN001
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def test_flux2_hoists_timestep_guidance_and_the_rope_tables_of_its_ids() -> None:
    w = build("flux2-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    details = opt.report.result("hoist").details
    assert [d.split(":")[0] for d in details] == ["key {guidance, timestep}",
                                                  "key {img_ids, txt_ids}"]
    torch.testing.assert_close(w.run(opt), w.run(), rtol=1e-5, atol=1e-5)
    # next step: new latents, same ids/timestep objects -> neither sin/cos table is rebuilt
    kw = dict(w.kwargs, hidden_states=torch.randn_like(w.kwargs["hidden_states"]))
    with OpCount(aten.cos.default) as cos, torch.no_grad():
        out = opt(**kw)[0]
    assert cos.count == 0
    torch.testing.assert_close(out, w.model(**kw)[0], rtol=1e-5, atol=1e-5)


def test_two_alternating_keys_both_stay_cached(qwen) -> None:  # noqa: ANN001
    w, hoisted, plain = qwen
    t1, t2 = w.kwargs["timestep"] * 0.3, w.kwargs["timestep"] * 0.7
    _run(hoisted, dict(w.kwargs, timestep=t1))
    _run(hoisted, dict(w.kwargs, timestep=t2))
    out, rows = _run(hoisted, dict(w.kwargs, timestep=t1))
    assert rows.count(1) == 0
    assert torch.equal(out, _run(plain, dict(w.kwargs, timestep=t1))[0])


def test_declared_inputs_extend_the_keys_and_unknown_names_are_named() -> None:
    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(hoist=("hidden_states",)))
    keys = [d.split(":")[0] for d in opt.report.result("hoist").details]
    assert "key {hidden_states, timestep}" in keys and "key {timestep}" in keys
    with pytest.raises(ValueError, match="not tensor inputs"):
        kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(hoist=("latents",)))


def test_specialisations_share_packed_weights_and_caches(qwen) -> None:  # noqa: ANN001
    w, hoisted, _ = qwen
    hoisted(**_uncond(w, tokens=5))
    first, *others = hoisted.graph_modules
    assert others

    def packed(gm) -> dict[str, int]:  # noqa: ANN001
        return {n: t.data_ptr() for n, t in gm.named_buffers() if "_kopt_" in n}

    for gm in others:
        shared = set(packed(first).values()) & set(packed(gm).values())
        # the merged modulation and timestep-MLP weights exist once, not once per signature
        assert len(shared) >= 2
    regions = {id(m) for gm in hoisted.graph_modules for m in gm.children()
               if type(m).__name__ == "CachedRegion"}
    assert len(regions) == 1
    stats = hoisted.cache_stats()
    assert list(stats) == ["{timestep}"] and stats["{timestep}"][0] >= 1


FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
             aten.scalar_tensor.default, aten.lift_fresh_copy.default, aten.zeros.default,
             aten.ones.default, aten.empty.memory_format}


def test_per_call_graph_builds_no_table_from_python_data_and_new_resolutions_recompute() -> None:
    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    # the RoPE tables come from img_shapes (Python data): built in the captured graph ...
    assert any(n.target in FACTORIES for n in opt.captured_graph.graph.nodes)
    # ... and at load time, not per call: no factory, no host/device copy in the per-call graph
    for node in opt.graph_module.graph.nodes:
        assert node.target not in FACTORIES, node.format_node()
        assert not (node.target is aten._to_copy.default and "device" in node.kwargs)
    other = build("qwen-image-tiny", height=64, width=80)  # another resolution, same weights
    out = opt(*other.args, **other.kwargs)[0]
    torch.testing.assert_close(out, other.run(w.model), rtol=1e-5, atol=1e-5)
    assert len(opt.reports) == 2 and opt.reports[1].verified


def test_cuda_graph_split_runs_hoisted_regions_before_an_equal_body(qwen) -> None:  # noqa: ANN001
    """The split a CUDA graph is captured from: regions in the prelude, none in the body, and
    prelude + body computes what the whole graph does (a CPU check of kopt.cudagraphs)."""
    from kopt.capture import flatten_inputs
    from kopt.cudagraphs import replay_region, split_hoisted
    from kopt.graph.regions import CachedRegion

    w, hoisted, _ = qwen
    gm = hoisted.graph_module
    prelude, body = split_hoisted(gm)
    assert prelude is not None
    assert not any(isinstance(m, CachedRegion) for m in body.modules())
    (region,) = [m for m in prelude.modules() if isinstance(m, CachedRegion)]
    # the views that cut the merged modulation GEMM per block moved into the body: the
    # prelude's region returns that GEMM's output alone, not one tensor per block and stream
    (whole,) = [m for m in gm.modules() if isinstance(m, CachedRegion)]
    assert len(_outputs(whole)) == 22 and len(_outputs(region)) == 1
    assert region is not whole and not any(n.target is aten.split.Tensor
                                           for n in region.region.graph.nodes)
    assert sum(n.target is aten.split.Tensor for n in body.graph.nodes) == sum(
        n.target is aten.split.Tensor for n in whole.region.graph.nodes)
    # cut once per region: graphs that share the region (a CFG pair's two signatures) share
    # the prelude's form of it, and so its cache
    again, _ = split_hoisted(gm)
    assert [m for m in again.modules() if isinstance(m, CachedRegion)] == [region]
    assert replay_region(whole) is region
    flat = flatten_inputs(w.args, w.kwargs)[0]
    with torch.no_grad():
        want = gm(*flat)
        regions = prelude(*flat)
        with GemmRows() as rec:
            got = body(*flat, *regions)
    assert rec.rows.count(1) == 0  # the timestep GEMMs ran in the prelude, not in the body
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _outputs(region) -> tuple:  # noqa: ANN001
    return next(n for n in region.region.graph.nodes if n.op == "output").args[0]


def test_trailing_views_stop_at_a_computed_use_and_at_a_strided_base() -> None:
    """Only views whose values flow into the outputs alone move to the replay, and only over
    a contiguous base: the graph's copy of a strided base is laid out anew by its clone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kopt.graph.regions import trailing_views

    def region(t: torch.Tensor, w: torch.Tensor) -> tuple:
        m = torch.mm(t, w)  # [2, 12], contiguous
        a, b, c = torch.split(m, 4, dim=1)  # every piece an output: all trailing
        n = torch.mm(t, w) * 3
        d, e = torch.split(n, 6, dim=1)  # e is added to: the split is computed in the region
        tw = m.t()  # strided, read by a multiply
        return a.unsqueeze(1), b, c, d, e + 1, tw * 2, tw.unsqueeze(0)

    g = make_fx(region)(torch.randn(2, 3), torch.randn(3, 12)).graph
    by_target = [str(n.target) for n in trailing_views(g)]
    assert sorted(by_target) == sorted(["aten.split.Tensor"] + ["<built-in function getitem>"] * 3
                                       + ["aten.unsqueeze.default"])
    # d's getitem is not one: its base is the split's list, not a contiguous tensor; nor is
    # tw's unsqueeze (a strided base), nor tw itself (a multiply reads it)


def test_an_equal_timestep_in_a_new_tensor_hits(qwen) -> None:  # noqa: ANN001
    """Pipelines compute the timestep afresh for each call of a CFG pair (QwenImagePipeline:
    `timestep / 1000` per call): an equal value in another tensor must hit, a changed value,
    even by the sign of a zero, must not."""
    from kopt.graph.regions import VALUE_MISSES_IN_A_ROW, cached_regions

    w, hoisted, plain = qwen
    t = w.kwargs["timestep"] * 0.125
    _, rows1 = _run(hoisted, dict(w.kwargs, timestep=t))
    uncond = _uncond(w)
    uncond["timestep"] = t.clone()  # equal, not the same tensor
    out2, rows2 = _run(hoisted, uncond)
    assert rows1.count(1) == 3 and rows2.count(1) == 0
    assert torch.equal(out2, _run(plain, uncond)[0])

    zero = torch.zeros_like(t)
    _run(hoisted, dict(w.kwargs, timestep=zero))
    _, rows = _run(hoisted, dict(w.kwargs, timestep=-zero))  # -0.0: another bit pattern
    assert rows.count(1) == 3

    # a new timestep at every call (no CFG pair): after VALUE_MISSES_IN_A_ROW compares that
    # found nothing, the region stops comparing values (no more host syncs)
    region = next(r for g in hoisted.graph_modules for r in cached_regions(g))
    for i in range(VALUE_MISSES_IN_A_ROW + 1):
        _run(hoisted, dict(w.kwargs, timestep=t + i + 1))
    assert region.value_misses == VALUE_MISSES_IN_A_ROW
    last = t * 3
    _run(hoisted, dict(w.kwargs, timestep=last))
    _, rows = _run(hoisted, dict(w.kwargs, timestep=last.clone()))  # equal, not compared
    assert rows.count(1) == 3
    _, rows = _run(hoisted, dict(w.kwargs, timestep=last))  # identity still hits
    assert rows.count(1) == 0


def test_copy_all_copies_every_pair_in_multi_tensor_launches() -> None:
    """The CUDA-graph runner's copy-in (kopt.cudagraphs.copy_all): every destination gets its
    source, whatever its dtype, layout or a cast; pairs of one device and dtype go through one
    multi-tensor copy, not one copy each."""
    from unittest import mock

    from kopt.cudagraphs import copy_all

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(3, 4, generator=g) for _ in range(5)]
    src.append(torch.randn(4, 3, generator=g).t())  # a strided view
    src.append(torch.randn(6, generator=g, dtype=torch.float64))
    src.append(torch.randn(2, generator=g).to(torch.bfloat16))
    dst = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in src]
    dst.append(torch.empty(2))  # a cast: bf16 into fp32
    src.append(torch.randn(2, generator=g).to(torch.bfloat16))
    with mock.patch("torch._foreach_copy_", wraps=torch._foreach_copy_) as foreach:
        copy_all(dst, src)
    # the six fp32 pairs in one launch; the lone fp64 and bf16 pairs and the cast one by one
    assert [len(c.args[0]) for c in foreach.call_args_list] == [6]
    for d, s in zip(dst, src, strict=True):
        assert torch.equal(d, s.to(d.dtype))
