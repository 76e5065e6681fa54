"""fp8: the rowwise quantizer's contract, the rewrite firing (exact counts, ops removed/added,
weights quantized at load), its near misses with reasons, and its bounded numerics."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import kopt
from kopt.capture import capture_module
from kopt.codegen.kernels.quant_fp8 import E4M3, E4M3_MAX, quant_fp8_rowwise
from kopt.graph import constant_nodes, copy_graph_module
from kopt.passes import FP8Config, RewritePass
from kopt.patterns.fp8 import FP8_BOUND, fp8_linear
from kopt.verify import VerifyOptions, compare
from tests.fixtures import QKV

aten = torch.ops.aten
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
SMALL = FP8Config(min_features=16)


@pytest.mark.parametrize("shape", [(1, 16), (7, 129), (3, 5, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_contract(shape: tuple, dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    torch.library.opcheck(quant_fp8_rowwise, (x,))
    q, scale = torch.ops.kopt.quant_fp8_rowwise(x)
    assert q.dtype == E4M3 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-1], 1)
    qf = q.float()
    assert torch.equal(qf.abs().amax(-1), torch.full(shape[:-1], E4M3_MAX))  # amax -> 448
    # round to nearest: within half an e4m3 step (2^-4 relative) where x/scale is normal
    x32, back = x.float(), qf * scale
    normal = (x32 / scale).abs() >= 2.0**-6
    assert ((back - x32).abs() <= 2.0**-4 * x32.abs() + 1e-30)[normal].all()


def test_quantizer_keeps_zero_rows_finite() -> None:
    q, scale = torch.ops.kopt.quant_fp8_rowwise(torch.zeros(2, 32))
    assert torch.isfinite(scale).all() and not q.float().any()


def _fp8(model: nn.Module, x: torch.Tensor, config: FP8Config = SMALL):  # noqa: ANN202
    # the fusions after the fp8 pass take quantizers into their kernels: off, to see its output
    passes = kopt.PassConfig(fp8=config, rowwise_fusion=False, fuse_act_quant=False)
    opt = kopt.optimize(model, (x,), config=passes)
    return opt, opt.report.result("fp8")


def _count(gm: fx.GraphModule, target) -> int:  # noqa: ANN001
    return sum(n.target is target for n in gm.graph.nodes)


def test_fires_after_the_merge_and_quantizes_weights_at_load() -> None:
    model = QKV(64, v_extra=0).eval()  # aligned: merged q/k/v is 64 -> 160
    x = torch.randn(2, 5, 64)
    opt, result = _fp8(model, x)
    assert result.matched == 2  # merged q/k/v, out projection
    gm = opt.graph_module
    assert _count(gm, aten.linear.default) == 0
    assert _count(gm, aten._scaled_mm.default) == 2
    consts = constant_nodes(gm.graph)
    quants = [n for n in gm.graph.nodes if n.target is QUANT]
    assert len(quants) == 2 and not any(n.args[0] in consts for n in quants)  # activations only
    fp8_weights = [t for n, t in gm.named_buffers() if t.dtype == E4M3]
    assert len(fp8_weights) == 2  # packed once: [Wq;Wk;Wv] and Wout
    assert result.verdict is not None and result.verdict.passed


@pytest.mark.parametrize("layout", ["rowwise", "blockwise"])
def test_linears_of_one_input_share_its_quantizer_when_not_merged(layout: str) -> None:
    """With merge_projections off, q/k/v stay three GEMMs of one activation: it is quantized
    once (the pass runs after CSE, which cannot share the quantizers it adds)."""
    dim = 128 if layout == "rowwise" else 512  # blockwise: K a multiple of 4 x 128
    model = QKV(dim, v_extra=0).eval()
    x = torch.randn(2, 5, dim)
    passes = kopt.PassConfig(fp8=FP8Config(min_features=16, layout=layout),
                             merge_projections=False, rowwise_fusion=False,
                             fuse_act_quant=False)
    opt = kopt.optimize(model, (x,), config=passes)
    gm = opt.graph_module
    target = QUANT if layout == "rowwise" else torch.ops.kopt.quant_fp8_group.default
    gemm = aten._scaled_mm.default if layout == "rowwise" else \
        torch.ops.kopt.fp8_blockwise_mm.default
    assert opt.report.result("fp8").matched == 4 and _count(gm, gemm) == 4
    assert _count(gm, target) == 2  # q/k/v's input, the out projection's
    assert opt.report.verified
    with torch.no_grad():
        assert torch.equal(opt(x), opt(x))


def test_near_misses_say_why() -> None:
    x = torch.randn(3, 64)
    _, result = _fp8(QKV(64).eval(), x, FP8Config())  # default threshold: 1024 features
    assert result.matched == 0
    assert any("below min_features 1024" in r for r in result.rejected)
    _, result = _fp8(QKV(40).eval(), torch.randn(3, 40))  # 40 -> 20, 40 -> 43: not aligned
    assert result.matched == 0
    assert any("not multiples of 16" in r for r in result.rejected)
    _, result = _fp8(QKV(64).double().eval(), x.double())
    assert any("torch.float64 is not bf16/fp16/fp32" in r for r in result.rejected)

    class PerCall(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, w)

    opt = kopt.optimize(PerCall().eval(), (x, torch.randn(32, 64)),
                        config=kopt.PassConfig(fp8=SMALL))
    assert opt.report.result("fp8").rejected == {
        "weight is computed per call, not a load-time constant": 1}


@pytest.mark.parametrize("rows", [1, 33])
def test_bounded_tier_on_awkward_shapes(rows: int) -> None:
    model = QKV(1024).eval()
    cap = capture_module(model, (torch.randn(rows, 1024),))
    after = copy_graph_module(cap.gm)
    rewrite = fp8_linear(SMALL)
    result = RewritePass("fp8", [rewrite]).run(after)
    assert result.matched == 2  # q and k; v (1024 -> 1027) and out (1027 -> 1024) are unaligned
    assert sum(result.rejected.values()) == 2
    verdict = compare(cap.gm, after, cap.example_inputs, rewrite.numerics, VerifyOptions())
    assert verdict.passed, verdict
    assert rewrite.numerics.bound == FP8_BOUND


def test_weights_changed_in_place_are_requantized() -> None:
    model = QKV(64, v_extra=0).eval()
    x = torch.randn(4, 64)
    opt, _ = _fp8(model, x)
    with torch.no_grad():
        model.v.weight.mul_(-2.0)
    fresh, _ = _fp8(model, x)
    assert torch.equal(opt(x), fresh(x))


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_reference_models_verify_within_the_bound(tiny, name: str) -> None:  # noqa: ANN001
    w = tiny[name]
    opt = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(fp8=SMALL))
    result = opt.report.result("fp8")
    assert result.matched >= 8 and result.verdict.passed
    out, ref = w.run(opt), w.run()
    assert ((out - ref).norm() / ref.norm()).item() < FP8_BOUND


def test_bounded_tier_is_checked_per_site_and_catches_a_wrong_scale() -> None:
    from kopt.verify import LOCAL_REFERENCE

    model = QKV(64, v_extra=0).eval()
    cap = capture_module(model, (torch.randn(6, 64),))
    after = copy_graph_module(cap.gm)
    rewrite = fp8_linear(SMALL)
    RewritePass("fp8", [rewrite]).run(after)
    verdict = compare(cap.gm, after, cap.example_inputs, rewrite.numerics, VerifyOptions())
    assert verdict.passed and "model output" in verdict.detail
    site = next(n for n in after.graph.nodes if LOCAL_REFERENCE in n.meta)
    with after.graph.inserting_after(site):
        wrong = after.graph.call_function(aten.mul.Tensor, (site, 1.25))  # a scale off by 25%
    site.replace_all_uses_with(wrong, delete_user_cb=lambda u: u is not wrong)
    wrong.meta[LOCAL_REFERENCE] = site.meta.pop(LOCAL_REFERENCE)
    wrong.meta["val"] = site.meta["val"]
    after.recompile()
    verdict = compare(cap.gm, after, cap.example_inputs, rewrite.numerics, VerifyOptions())
    assert not verdict.passed and f"site {wrong.name}" in verdict.detail


def test_the_per_site_check_keeps_a_site_input_only_until_its_last_reference() -> None:
    """The bounded tier's per-site check holds the inputs its references read, each only until
    the last site that reads it: a whole model's site inputs alive at once would not fit a
    GPU. The projections of one input keep it alive until the last of them has run."""
    from kopt.verify import LOCAL_REFERENCE, _LocalCheck

    cap = capture_module(QKV(64, v_extra=0).eval(), (torch.randn(6, 64),))
    after = copy_graph_module(cap.gm)
    RewritePass("fp8", [fp8_linear(SMALL)]).run(after)
    sites = [n for n in after.graph.nodes if LOCAL_REFERENCE in n.meta]
    held: list[set[str]] = []

    class Watching(_LocalCheck):
        def run_node(self, n):  # noqa: ANN001, ANN202
            out = super().run_node(n)
            if n in sites:
                held.append(set(self.by_name))
            return out

    check = Watching(after)
    with torch.no_grad():
        check.run(*cap.example_inputs)
    x = sites[0].meta[LOCAL_REFERENCE][1][0]  # the input q, k and v share
    readers = [i for i, s in enumerate(sites) if x in s.meta[LOCAL_REFERENCE][1]]
    assert len(readers) >= 3
    assert [x in h for h in held] == [i < readers[-1] for i in range(len(sites))]
    assert check.by_name == {} and check.worst[1] in {s.name for s in sites}


def test_the_per_site_reference_upcasts_the_weight_a_block_at_a_time(monkeypatch) -> None:  # noqa: ANN001
    """An FP8 linear's fp64 reference upcasts its weight a block of columns at a time, never
    whole (W1's merged modulation weight is 50.8 GiB in fp64), and finds the error the whole
    fp64 linear finds."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kopt import verify
    from kopt.verify import LOCAL_REFERENCE, _LocalCheck

    cap = capture_module(QKV(64, v_extra=0).eval(), (torch.randn(6, 64),))
    after = copy_graph_module(cap.gm)
    RewritePass("fp8", [fp8_linear(SMALL)]).run(after)
    weights = [a.meta["val"].numel() for n in after.graph.nodes if LOCAL_REFERENCE in n.meta
               for a in after.graph.nodes if a.name == n.meta[LOCAL_REFERENCE][1][1]]

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.float64:
                Largest.most = max(Largest.most, out.numel())
            return out

    monkeypatch.setattr(verify, "GEMM_CHUNK_BYTES", 8 * 64 * 16)  # 16 columns of 64 at a time
    blocked = _LocalCheck(after)
    with torch.no_grad(), Largest():
        blocked.run(*cap.example_inputs)
    assert 0 < Largest.most < min(weights)
    monkeypatch.setattr(verify, "_BLOCKED_REFERENCES", {})
    whole = _LocalCheck(after)
    with torch.no_grad():
        whole.run(*cap.example_inputs)
    assert whole.worst[1] == blocked.worst[1]
    assert blocked.worst[0] == pytest.approx(whole.worst[0], rel=1e-9)


def test_linears_with_large_weights_are_quantized_after_the_others_are_packed(monkeypatch) -> None:  # noqa: ANN001
    """``fp8`` leaves the linears with weights over ``LARGE_BYTES`` to ``fp8_large``, which runs
    after ``fold_weights``: no check quantizes such a weight per call while every BF16 weight
    is still there. Each check measures only its own sites (``fp8``'s site references name
    weights ``fold_weights`` folded away), and the optimized model is the one a single round
    gives, bit for bit."""
    from kopt.models import build
    from kopt.patterns import fp8

    config = kopt.PassConfig(fp8=FP8Config(min_features=16))
    outs, matched = [], []
    for large in (1 << 30, 4096):
        monkeypatch.setattr(fp8, "LARGE_BYTES", large)
        w = build("qwen-image-tiny")
        opt = kopt.optimize(w.model, w.args, w.kwargs, config, keep_original=True,
                            verify=VerifyOptions(seeds=(0,)))
        assert opt.report.verified and not any(r.reverted for r in opt.report.passes)
        outs.append(w.run(opt))
        first, second = opt.report.result("fp8"), opt.report.result("fp8_large")
        matched.append((first.matched, second.matched))
    (all_sites, none), (first, second) = matched
    assert none == 0 and 0 < first < all_sites and first + second == all_sites
    assert "quantized after fold_weights, by fp8_large" in str(opt.report.result("fp8").rejected)
    assert torch.equal(outs[0], outs[1])
