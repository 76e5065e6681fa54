"""Verification: a wrong rewrite is caught, reverted site by site, and reported; the module the
user gets computes what the model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.passes import PassConfig, PassManager, RewritePass
from kopt.patterns import PatternRewrite, exact, tolerance
from kopt.verify import RTOL_FLOOR, VerifyOptions, compare, random_inputs, run_fp64

# x * y -> x * |y|: wrong exactly where y has negative entries. Declared exact on purpose.
WRONG_ABS = PatternRewrite(
    "wrong_abs", lambda x, y: x * y, lambda x, y: x * torch.abs(y),
    lambda: [torch.randn(4), torch.randn(4)], exact("(deliberately false)"),
)


class TwoScales(nn.Module):
    """x * pos + x * neg: the rewrite is right at the first site, wrong at the second."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.rand(6) + 0.5)
        self.register_buffer("neg", -(torch.rand(6) + 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.pos + x * self.neg


class _Manager(PassManager):
    def __init__(self, rewrite: PatternRewrite, verify: VerifyOptions = VerifyOptions()) -> None:
        super().__init__(PassConfig(cse=False, merge_projections=False, fold_constants=False),
                         verify)
        self.passes = [RewritePass("under_test", [rewrite])]


def test_failing_sites_are_reverted_and_reported_good_ones_kept() -> None:
    model = TwoScales().eval()
    x = torch.randn(3, 6)
    cap = capture_module(model, (x,))
    gm, (result,) = _Manager(WRONG_ABS).run(cap.gm, cap.example_inputs)
    assert result.matched == 1 and len(result.reverted) == 1
    assert result.verdict is not None and result.verdict.passed
    assert "1 failing sites reverted" in result.verdict.detail
    abs_ops = [n for n in gm.graph.nodes if n.target is torch.ops.aten.abs.default]
    assert len(abs_ops) == 1  # the positive-scale site keeps the (there harmless) rewrite
    assert torch.equal(gm(x)[0], model(x))


def test_pass_failing_everywhere_is_fully_reverted() -> None:
    class Neg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("neg", -(torch.rand(6) + 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.neg

    model = Neg().eval()
    x = torch.randn(3, 6)
    cap = capture_module(model, (x,))
    gm, (result,) = _Manager(WRONG_ABS).run(cap.gm, cap.example_inputs)
    assert result.matched == 0 and len(result.reverted) == 1
    assert result.verdict is not None and not result.verdict.passed
    assert "reverted" in result.verdict.detail
    assert not any(n.target is torch.ops.aten.abs.default for n in gm.graph.nodes)
    assert torch.equal(gm(x)[0], model(x))


def _with_output_changed(x: torch.Tensor, change) -> tuple:  # noqa: ANN001
    """(graph of TwoScales, a copy whose output goes through ``change(graph, out_node)``)."""
    cap = capture_module(TwoScales().eval(), (x,))
    after = copy_graph_module(cap.gm)
    out = next(n for n in after.graph.nodes if n.op == "output")
    with after.graph.inserting_before(out):
        changed = change(after.graph, out.args[0][0])
    out.args = ((changed,),)
    after.recompile()
    return cap.gm, after


def test_exact_tier_detects_a_change_of_one_ulp() -> None:
    x = torch.randn(3, 6)
    before, after = _with_output_changed(
        x, lambda g, o: g.call_function(torch.ops.aten.mul.Tensor, (o, 1.0 + 2.0**-23)))
    verdict = compare(before, after, [x], exact("test"))
    assert not verdict.passed and "not bitwise equal" in verdict.detail
    # ... which the tolerance tier accepts: one ulp is far inside the fp32 floor
    assert compare(before, after, [x], tolerance("test")).passed


def test_tolerance_tier_rejects_a_real_loss_of_precision() -> None:
    def through_bf16(g, o):  # noqa: ANN001, ANN202
        cast = torch.ops.aten._to_copy.default
        low = g.call_function(cast, (o,), {"dtype": torch.bfloat16})
        return g.call_function(cast, (low,), {"dtype": torch.float32})

    x = torch.randn(64, 6)
    before, after = _with_output_changed(x, through_bf16)
    verdict = compare(before, after, [x], tolerance("test"))
    assert not verdict.passed and "relative error" in verdict.detail


def test_fp64_reference_really_runs_in_fp64() -> None:
    class Lossy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + 1e8) - 1e8  # loses x entirely in fp32, not in fp64

    x = torch.full((4,), 0.25)
    cap = capture_module(Lossy(), (x,))
    (ref,) = run_fp64(cap.gm, [x])
    assert ref.dtype == torch.float64 and torch.equal(ref, x.double())
    assert RTOL_FLOOR[torch.float32] < 1e-5


def test_random_inputs_are_fresh_and_keep_ids_and_python_values() -> None:
    floats, ids = torch.randn(5, 3) * 4 + 10, torch.arange(5)
    a = random_inputs([floats, ids, 7], seed=0)
    b = random_inputs([floats, ids, 7], seed=1)
    assert not torch.equal(a[0], floats) and not torch.equal(a[0], b[0])
    assert abs(a[0].mean().item() - 10) < 3  # drawn like the example, not from N(0, 1)
    assert torch.equal(a[1], ids) and a[2] == 7


class _CatLinear(nn.Module):
    """Two weights concatenated in the graph (as the merge pass leaves them before folding),
    then one GEMM with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(24, 16))
        self.w2 = nn.Parameter(torch.randn(40, 16))
        self.b = nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, torch.cat([self.w1, self.w2]), self.b)


def test_fp64_reference_moves_weights_in_their_dtype_and_chunks_gemms(monkeypatch) -> None:  # noqa: ANN001
    """A full-size model's fp64 reference must fit: concatenating weights runs in their own
    dtype (exact: values are only moved), and a GEMM upcasts its weight a block of columns at
    a time. The result is the plain fp64 product either way."""
    import kopt.verify as verify

    model = _CatLinear().eval()
    x = torch.randn(5, 16)
    cap = capture_module(model, (x,))
    seen: dict[str, torch.dtype] = {}

    class Spy(verify._Upcast):
        def run_node(self, n):  # noqa: ANN001, ANN202
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[str(n.target)] = out.dtype
            return out

    upcast: list[int] = []  # elements of every tensor the fp64 run copied to fp64
    monkeypatch.setattr(torch.Tensor, "to", _spy_fp64_copies(torch.Tensor.to, upcast))
    monkeypatch.setattr(verify, "GEMM_CHUNK_BYTES", 8 * 16 * 7)  # 7 columns per block
    with torch.no_grad():
        (ref,) = pytree_leaves(Spy(cap.gm).run(x))
    assert seen["aten.cat.default"] == torch.float32  # not upcast
    assert ref.dtype == torch.float64
    w = torch.cat([model.w1, model.w2]).double()
    want = x.double() @ w.t() + model.b.double()
    assert torch.allclose(ref, want, rtol=1e-14, atol=1e-14)
    # the 64 x 16 weight was never upcast whole: at most 7 of its columns (16 x 7) at a time,
    # besides the input (5 x 16) and the bias (64)
    assert 16 * 7 in upcast and max(upcast) <= 16 * 7 < w.numel()


def _spy_fp64_copies(to, sizes: list[int]):  # noqa: ANN001, ANN202
    """``Tensor.to`` that records the size of every copy to fp64 it makes."""
    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = to(self, *args, **kwargs)
        if out.dtype == torch.float64 and self.dtype != torch.float64:
            sizes.append(self.numel())
        return out
    return spy


def test_fp64_reference_of_an_fp8_gemm_upcasts_its_weight_in_blocks(monkeypatch) -> None:  # noqa: ANN001
    """The fp64 value of ``_scaled_mm`` (the FP8 linears) upcasts its fp8 weight a block of
    columns at a time, scaled per column: W1's merged modulation GEMM in FP8 would otherwise
    need a 55 GB fp64 copy. The result is the exact product of the dequantized operands."""
    import kopt.verify as verify

    a = torch.randn(5, 16).to(torch.float8_e4m3fn)
    b = torch.randn(16, 40).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(5, 1) + 0.5, torch.rand(1, 40) + 0.5
    bias = torch.randn(40)
    want = (a.double() * sa.double()) @ (b.double() * sb.double()) + bias.double()
    upcast: list[int] = []
    monkeypatch.setattr(torch.Tensor, "to", _spy_fp64_copies(torch.Tensor.to, upcast))
    monkeypatch.setattr(verify, "GEMM_CHUNK_BYTES", 8 * 16 * 7)  # 7 columns per block
    got = verify._scaled_mm64(a, b, sa, sb, bias)
    assert torch.allclose(got, want, rtol=1e-14, atol=1e-12)
    assert upcast.count(16 * 7) == 5 and max(upcast) <= 16 * 7 < b.numel()  # 40 = 5 x 7 + 5


@pytest.mark.parametrize("case", ["plain", "causal", "mask", "row-mask", "gqa"])
def test_fp64_attention_runs_a_block_of_query_rows_at_a_time(monkeypatch, case) -> None:  # noqa: ANN001
    """The fp64 run's attention holds the scores of a block of query rows at a time (the math
    path holds them whole: 3.2 GiB a tensor at W1), with the same values as the whole run:
    causal, masked, and grouped-query attention included."""
    import kopt.verify as verify

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=g, dtype=torch.float64)
    kv_heads = 2 if case == "gqa" else 4
    k = torch.randn(2, kv_heads, 11, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 11, 8, generator=g, dtype=torch.float64)
    kwargs: dict = {"scale": 0.3}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "mask":
        kwargs["attn_mask"] = torch.randn(2, 1, 13, 11, generator=g, dtype=torch.float64)
    elif case == "row-mask":  # broadcast over the query rows
        kwargs["attn_mask"] = torch.rand(1, 1, 1, 11, generator=g) > 0.3
    elif case == "gqa":
        kwargs["enable_gqa"] = True
    want = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kwargs)
    scores: list[int] = []
    sdpa = torch.ops.aten.scaled_dot_product_attention.default

    class Spy:  # records the query rows of each call
        def __call__(self, query, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN204
            scores.append(query.shape[-2])
            return sdpa(query, *args, **kw)

    monkeypatch.setattr(verify, "SDPA_CHUNK_BYTES", 8 * 11 * 2 * 4 * 3)  # 3 query rows a block
    monkeypatch.setattr(torch.ops.aten.scaled_dot_product_attention, "default", Spy())
    got = verify._sdpa64(q, k, v, **kwargs)
    assert scores == [3, 3, 3, 3, 1]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_fp64_run_takes_the_blocked_attention(monkeypatch) -> None:  # noqa: ANN001
    """The fp64 run of a captured graph computes its SDPA with the blocked function."""
    import kopt.verify as verify

    class Attention(nn.Module):
        def forward(self, q, k, v):  # noqa: ANN001, ANN201
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    cap = capture_module(Attention(), (q, k, v))
    calls: list[int] = []
    real = verify._sdpa64

    def spy(query, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(query.shape[-2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(verify, "_sdpa64", spy)
    (got,) = run_fp64(cap.gm, [q, k, v])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True)
    assert calls == [10] and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def pytree_leaves(tree):  # noqa: ANN001, ANN201
    return torch.utils._pytree.tree_leaves(tree)


def test_a_reference_that_cannot_run_reverts_without_bisecting(monkeypatch) -> None:  # noqa: ANN001
    """When the fp64 reference itself fails (out of memory on a full-size model), no site can
    be judged: all sites are reverted at once, the report says why, nothing is bisected. (A
    rewrite whose outputs are the graph before's needs no fp64 run: ``fp64=True`` runs it.)"""
    import kopt.verify as verify

    calls = []

    def broken(gm, inputs):  # noqa: ANN001, ANN202
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 50.77 GiB.\nmore")

    monkeypatch.setattr(verify, "run_fp64", broken)
    # a tolerance-tier rewrite that is right: only the reference can fail
    same = PatternRewrite("same", lambda x, y: x * y, lambda x, y: y * x,
                          lambda: [torch.randn(4), torch.randn(4)], tolerance("commutes"))
    model = TwoScales().eval()
    x = torch.randn(3, 6)
    cap = capture_module(model, (x,))
    gm, (result,) = _Manager(same, VerifyOptions(fp64=True)).run(cap.gm, cap.example_inputs)
    assert len(calls) == 1  # one attempt, no bisection
    assert result.matched == 0 and len(result.reverted) == 2
    assert result.verdict is not None and not result.verdict.passed
    assert result.verdict.unverifiable and "could not be computed" in result.verdict.detail
    assert "OutOfMemoryError" in result.verdict.detail and "more" not in result.verdict.detail
    assert torch.equal(gm(x)[0], model(x))
    # by default the check sees the outputs unchanged and runs no fp64 graph
    calls.clear()
    gm, (result,) = _Manager(same).run(cap.gm, cap.example_inputs)
    assert not calls and result.matched == 2 and result.verdict.passed
    assert "outputs equal to the graph before's" in result.verdict.detail
    assert "no fp64 run" in result.verdict.detail


def test_fp64_reference_quantizes_weights_the_models_way() -> None:
    """A quantizer whose input the fp64 run never upcast (a weight: load-time work) runs in the
    weight's dtype, as the optimized model runs it; one of an activation gets fp64 input."""
    import kopt.codegen.kernels.quant_fp8  # noqa: F401 -- registers the op
    import kopt.verify as verify

    class Quantizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            qw, sw = torch.ops.kopt.quant_fp8_rowwise(self.w)
            qx, sx = torch.ops.kopt.quant_fp8_rowwise(x)
            return (qx.float() * sx) @ (qw.float() * sw).t()

    x = torch.randn(4, 16)
    gm = capture_module(Quantizes(), (x,)).gm
    inputs: dict[str, torch.dtype] = {}

    class Spy(verify._Upcast):
        def call_function(self, target, args, kwargs):  # noqa: ANN001, ANN202
            if target is torch.ops.kopt.quant_fp8_rowwise.default:
                inputs[str(len(inputs))] = args[0].dtype
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        (ref,) = pytree_leaves(Spy(gm).run(x))
    assert inputs == {"0": torch.float32, "1": torch.float64}
    assert ref.dtype == torch.float64


def _verified_pipeline(monkeypatch, keep: bool, every_fp64: bool = True  # noqa: ANN001
                       ) -> tuple[list, list, dict[str, int]]:
    """The FP8 pipeline on FLUX.2 tiny, verified on two seeds, counting the graphs run."""
    import kopt.verify as verify
    from kopt.models import build
    from kopt.passes import FP8Config

    w = build("flux2-tiny", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    runs = {"graph": 0, "fp64": 0}
    run_flat, fp64 = verify.run_flat, verify.run_fp64

    def counted(fn, key):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            runs[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(verify, "run_flat", counted(run_flat, "graph"))
    monkeypatch.setattr(verify, "run_fp64", counted(fp64, "fp64"))
    monkeypatch.setattr(verify, "BASELINE_BYTES", verify.BASELINE_BYTES if keep else 0)
    kept: list[tuple[int, bool]] = []
    accept = verify.Baseline.accept

    def checked_accept(self, gm, numerics) -> None:  # noqa: ANN001
        accept(self, gm, numerics)
        for seed, out in self.want.items():  # what the next pass is checked against
            again = run_flat(gm, random_inputs(self.example, seed))
            kept.append((seed, all(torch.equal(a, b) for a, b in zip(out, again, strict=True))))

    monkeypatch.setattr(verify.Baseline, "accept", checked_accept)
    config = PassConfig(fuse_allreduce_norm=False, fp8=FP8Config(min_features=16))
    gm, results = PassManager(config, VerifyOptions(seeds=(0, 1), fp64=every_fp64)).run(
        cap.gm, cap.example_inputs)
    verdicts = [(r.name, r.matched, r.verdict.passed if r.verdict else None,
                 r.verdict.tier if r.verdict else None) for r in results]
    outputs = run_flat(gm, random_inputs(cap.example_inputs, 3))
    assert all(same for _, same in kept)
    return verdicts, outputs, runs | {"kept": len(kept)}


def test_checks_reuse_the_accepted_graphs_outputs_and_fp64_runs(monkeypatch) -> None:  # noqa: ANN001
    """A pass is checked against the outputs its predecessor was checked with (bit for bit what
    the accepted graph computes), and against an fp64 run kept across passes that compute the
    same function: the same verdicts and graph as running everything again, with fewer runs."""
    reused, out, runs = _verified_pipeline(monkeypatch, keep=True)
    monkeypatch.undo()
    again, out_again, runs_again = _verified_pipeline(monkeypatch, keep=False)
    assert reused == again
    assert sum(1 for _, matched, passed, _ in reused if matched and passed) >= 4
    assert all(torch.equal(a, b) for a, b in zip(out, out_again, strict=True))
    assert runs["kept"] > 0 and runs_again["kept"] == 0
    # the captured graph's fp64 run, and the FP8 graph's: two per seed
    assert runs["fp64"] == 4 < runs_again["fp64"]
    assert runs["graph"] < runs_again["graph"]


def test_tolerance_checks_near_the_graph_before_run_no_fp64_graph(monkeypatch) -> None:  # noqa: ANN001
    """By default a tolerance check whose outputs lie close enough to the graph before's to
    pass at any fp64 error runs no fp64 graph: the same verdicts and optimized graph as with
    every fp64 run (``fp64=True``), with fewer of them."""
    every, out, runs = _verified_pipeline(monkeypatch, keep=True, every_fp64=True)
    monkeypatch.undo()
    fewer, out_fewer, runs_fewer = _verified_pipeline(monkeypatch, keep=True, every_fp64=False)
    assert [v[:3] for v in every] == [v[:3] for v in fewer]
    assert all(torch.equal(a, b) for a, b in zip(out, out_fewer, strict=True))
    assert runs_fewer["fp64"] < runs["fp64"]


def test_kept_outputs_are_copies_where_the_graph_writes_state() -> None:
    """A graph that returns the buffer it writes: the check restores the buffer afterwards, so
    the outputs kept for the next pass must be copies, or the next check would compare against
    the restored state."""
    from torch import fx

    from kopt.verify import Baseline

    class Store(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("acc", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.ops.aten.copy_.default(self.acc, x)
            return self.acc

    gm = fx.symbolic_trace(Store())
    example, options = [torch.randn(4)], VerifyOptions(seeds=(0,))
    base = Baseline(gm, example)
    first = copy_graph_module(gm)
    assert compare(gm, first, example, exact("a copy"), options, base).passed
    base.accept(first, exact("a copy"))
    assert torch.equal(base.want[0][0], random_inputs(example, 0)[0])
    assert not gm.acc.any()  # restored after the check
    assert compare(first, copy_graph_module(gm), example, exact("a copy"), options, base).passed


@pytest.mark.parametrize("fp64", [True, False])
def test_a_bounded_check_after_another_runs_no_fp64_graph(monkeypatch, fp64) -> None:  # noqa: ANN001
    """Two FP8 rounds in a row (``fp8``, then ``fp8_large``): with ``fp64``, the second reports
    the model's output error against the fp64 run of the captured graph's function, kept from
    the first, instead of an fp64 run of the graph the first left; by default neither runs an
    fp64 graph and both report how far the captured graph's outputs moved. Each site is still
    checked on its own fp64 computation."""
    import kopt.verify as verify
    from kopt.passes import FP8Config
    from kopt.patterns.fp8 import fp8_linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(torch.bfloat16)
    cap = capture_module(model, (torch.randn(8, 64, dtype=torch.bfloat16),))
    fp64_runs = []
    real = verify.run_fp64
    monkeypatch.setattr(verify, "run_fp64",
                        lambda gm, inputs: fp64_runs.append(gm) or real(gm, inputs))
    rewrite = RewritePass("fp8", [fp8_linear(FP8Config(min_features=16), large=False)])
    options = VerifyOptions(seeds=(0, 1), fp64=fp64)
    baseline = verify.Baseline(cap.gm, cap.example_inputs)
    graphs, verdicts = [cap.gm], []
    sites = [n.name for n in cap.gm.graph.nodes if "linear" in str(n.target)]
    assert len(sites) == 2
    for site in sites:  # one linear per round
        cand = copy_graph_module(graphs[-1])
        assert rewrite.run(cand, {site}).matched == 1
        verdicts.append(compare(graphs[-1], cand, cap.example_inputs, rewrite.numerics,
                                options, baseline))
        verify.forget_sites(cand)
        baseline.accept(cand, rewrite.numerics)
        graphs.append(cand)
    assert all(v.passed and v.tier == "bounded" for v in verdicts), verdicts
    assert all("site error" in v.detail for v in verdicts)
    if fp64:
        assert fp64_runs == [cap.gm, cap.gm]  # one per seed, in the first round only
        # both rounds: the error against the captured graph's fp64 run, and that graph's own
        original = [v.detail.split("(original ")[1].split(")")[0] for v in verdicts]
        assert original[0] == original[1]
    else:
        assert fp64_runs == []
        assert all("from the captured graph's" in v.detail for v in verdicts)
    first, second = (float(v.detail.split("model output ")[1].split(" ")[0]) for v in verdicts)
    assert second > first  # two linears in FP8 move the output further than one


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_near_enough_never_passes_what_the_fp64_check_fails(dtype) -> None:
    """Wherever :func:`near_enough` passes a check without the fp64 run, the full criterion
    holds: outputs moved by just under its distance, in the direction that hurts most (away
    from the fp64 values) and at random, from originals of every accuracy."""
    from kopt.verify import near_enough, relative_error

    gen = torch.Generator().manual_seed(0)
    floor, factor = RTOL_FLOOR[dtype], 2.0
    limit = (factor - 1) * floor / (1 + floor)
    passed = 0
    for e_b in (0.0, floor / 10, floor, 3 * floor, 0.3):
        ref = torch.randn(4096, generator=gen, dtype=torch.float64)
        noise = torch.randn(4096, generator=gen, dtype=torch.float64)
        before = (ref + e_b * ref.norm() * noise / noise.norm()).to(dtype)
        away = before.double() - ref
        for direction in (away if away.norm() > 0 else noise,
                          torch.randn(4096, generator=gen, dtype=torch.float64)):
            for t in (0.5, 0.97, 1.5):
                after = (before.double() + t * limit * before.double().norm()
                         * direction / direction.norm()).to(dtype)
                d = near_enough([after], [before], factor)
                if d is None:
                    continue
                passed += 1
                err_before = max(relative_error(before, ref), floor)
                assert relative_error(after, ref) <= factor * err_before
                assert d <= limit
    assert passed >= 10  # the path was taken, not skipped everywhere
    assert near_enough([before * 2], [before], factor) is None
    assert near_enough([torch.full_like(before, float("nan"))], [before], factor) is None


def test_the_report_gives_each_checks_time_apart_from_its_pass() -> None:
    """A verified pass's line gives its check's seconds beside its own; the summary adds them
    up; a pass with nothing to check and an unverified run have none."""
    import kopt

    class Projections(nn.Module):  # three projections of one input: merged, then packed
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x) * self.v(x)

    w = Projections().eval()
    x = torch.randn(4, 16)
    report = kopt.optimize(w, (x,)).report
    checked = [r for r in report.passes if r.verdict is not None]
    assert checked and all(r.check_seconds > 0 for r in checked)
    assert all(r.check_seconds == 0 for r in report.passes if r.verdict is None)
    text = str(report)
    for r in checked:
        assert f"+ check {r.check_seconds:.2f} s" in text
    assert f"{sum(r.check_seconds for r in checked):.1f} s of checks" in text
    quiet = kopt.optimize(w, (x,), verify=False).report
    assert all(r.check_seconds == 0 for r in quiet.passes) and "s of checks" not in str(quiet)
    assert "verification off" in str(quiet)
    with pytest.raises(TypeError, match="verify must be a bool or a kopt.verify.VerifyOptions"):
        kopt.optimize(w, (x,), verify=3)
