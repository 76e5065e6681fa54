"""The cost model (kopt/cost): counts per node against torch's FLOP counter and the tensors a
real run moves; symbolic counts against a capture at a size not used to build them; the device
model's fit to a trace; the ranking, the gate that skips predicted losers, and `--rank`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import kopt
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.cli import main
from kopt.cost import (
    H200,
    Calibration,
    CostModel,
    DeviceModel,
    count_graph,
    fit,
    known_device,
    measure,
)
from kopt.cost.calibrate import fit_counted, nnls
from kopt.cost.counts import OpCount
from kopt.cost.symbolic import HP, S_IMG, S_TXT, WP, B, D, S, capture_stages, symbolic_pipeline
from kopt.graph.regions import cached_regions
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.profile import Attribution, NodeCost

OFF = kopt.VerifyOptions(enabled=False)
FP8 = PassConfig(fp8=FP8Config(min_features=16))


@pytest.fixture
def one_thread():  # noqa: ANN201
    """Timing on a shared 2-core machine: one intra-op thread keeps the samples comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Measure(fx.Interpreter):
    """Runs a graph; per computing node: FlopCounterMode's FLOPs, the bytes of the distinct
    tensors it read and wrote, whether its output aliases an input, and the tensors."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: dict[str, tuple[int, int, bool, list[Any], Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        with FlopCounterMode(display=False) as fc:
            out = super().run_node(n)
        ins = [self.env[a] for a in dict.fromkeys(n.all_input_nodes)]
        tensors = [t for v in ins for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors + outs)
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        aliases = bool(outs) and all(t.untyped_storage().data_ptr() in ptrs for t in outs)
        self.seen[n.name] = (fc.get_total_flops(), moved, aliases, tensors, out)
        return out


def _flops_reference(n: fx.Node, measured: tuple) -> int:
    """FlopCounterMode's count, or, for attention (no formula for its CPU kernel), torch's
    own attention formula on the real q, k, v."""
    flops, _, _, tensors, _ = measured
    if n.target is torch.ops.aten.scaled_dot_product_attention.default:
        q, k, v = (a.meta["val"].shape for a in n.args[:3])
        return flop_counter.sdpa_flop_count(q, k, v)
    return flops


def _check_counts(gm: fx.GraphModule, inputs: list) -> int:
    m = _Measure(gm)
    with torch.no_grad():
        m.run(*inputs)
    nodes = {n.name: n for n in gm.graph.nodes}
    counted = 0
    for c in count_graph(gm):
        if "/" in c.node:  # inside a hoisted region: runs in the region module, not here
            continue
        n = nodes[c.node]
        measured = m.seen[c.node]
        assert c.flops == _flops_reference(n, measured), c
        if c.kernel:
            assert c.bytes == measured[1], c
        else:  # a view: what it returns aliases what it read
            assert measured[2] and c.bytes == 0 and c.flops == 0, c
        counted += 1
    return counted


@pytest.fixture(scope="module")
def llm() -> tuple[Any, Any]:
    """llm-tiny (prefill 1 x 20) captured, and optimized with FP8."""
    w = build("llm-tiny")
    cap = capture_module(w.model, w.args, w.kwargs)
    return cap, optimize_captured(cap, FP8, OFF, None, "llm-tiny", 0.0)


def test_known_devices_by_the_names_cuda_reports() -> None:
    """The H100 SXM shares the H200's tensor-core peaks at less bandwidth; an H100 PCIe (other
    peaks) or an unknown GPU is no known device, never an H200's or an SXM's numbers."""
    h100 = known_device("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.peak_tflops == H200.peak_tflops
    assert h100.bandwidth_gbs < H200.bandwidth_gbs
    assert known_device("NVIDIA H200").name == H200.name
    assert known_device("NVIDIA H100 PCIe") is None
    assert known_device("NVIDIA A100-SXM4-80GB") is None


@pytest.mark.parametrize("name", ["qwen-image-tiny", "llm-tiny"])
def test_counts_match_the_flop_counter_and_the_tensors_moved(name: str, llm) -> None:  # noqa: ANN001
    """Every node of the captured and of the FP8-optimized graph: FLOPs equal what
    FlopCounterMode counts for it, bytes what the real run read and wrote, views alias."""
    if name == "llm-tiny":
        cap, spec = llm
    else:
        w = build(name)
        cap = capture_module(w.model, w.args, w.kwargs)
        spec = optimize_captured(cap, FP8, OFF, None, name, 0.0)
    assert _check_counts(cap.gm, cap.example_inputs) > 100
    assert _check_counts(spec.gm, cap.example_inputs) > 50
    ops = {c.op for c in count_graph(spec.gm)}
    assert {"aten::_scaled_mm", "kopt::rowwise"} <= ops
    gemm = [c for c in count_graph(spec.gm) if c.op == "aten::_scaled_mm"]
    assert all(c.category == "gemm" and c.dtype == "float8_e4m3fn" and c.flops > 0 for c in gemm)


@pytest.fixture(scope="module")
def llm_pipe():  # noqa: ANN201
    """Symbolic counts of llm-tiny prefill at batch 1 with FP8, fitted at two probes only."""
    return symbolic_pipeline("llm-tiny", FP8, batch=1, check=False)


def test_symbolic_counts_equal_the_counts_of_an_unseen_size(llm_pipe) -> None:  # noqa: ANN001
    """At a sequence length no probe used, every stage's symbolic counts evaluate to the
    counts of the graph captured and rewritten there, and its FLOPs to FlopCounterMode's."""
    values, stages = capture_stages("llm-tiny", FP8, device="cpu", mode="prefill", batch=1,
                                    seq_len=29)
    assert values[S] == 29 and values[B] == 1
    assert llm_pipe.check([g for _, _, g in stages], values) == []
    captured = stages[0][2]
    w = build("llm-tiny", batch=1, seq_len=29)
    inputs = capture_module(w.model, w.args, w.kwargs).example_inputs
    m = _Measure(captured)
    with torch.no_grad():
        m.run(*inputs)
    nodes = {n.name: n for n in captured.graph.nodes}
    symbolic = llm_pipe.stages[0].counts()
    for c in symbolic:
        want = _flops_reference(nodes[c.node], m.seen[c.node])
        assert c.at({**values, D: llm_pipe.hidden}).flops == want, c
    # the expressions are of the workload: linear in the tokens for the projections,
    # quadratic in them for attention
    total = sympy.expand(sum(c.flops for c in symbolic))
    assert total.free_symbols == {S, D} and sympy.Poly(total, S).degree() == 2
    attention = [c for c in symbolic if c.category == "attention"]
    assert attention and all(sympy.Poly(c.flops, S).degree() == 2 for c in attention)


def test_symbolic_dit_counts_use_tokens_grid_and_hidden_size() -> None:
    """Qwen-Image at batch 1: checked at a third probe (a capture no fit used); a projection of
    the image stream is 2 * S_img * D^2 FLOPs; the RoPE tables depend on the latent grid."""
    pipe = symbolic_pipeline("qwen-image-tiny", PassConfig(), batch=1, check=True)
    counts = {c.node: c for c in pipe.stages[0].counts()}
    linears = [c for c in counts.values() if c.op == "aten::linear"]
    assert 2 * S_IMG * D**2 in {sympy.expand(c.flops) for c in linears}
    assert 2 * S_TXT * D**2 in {sympy.expand(c.flops) for c in linears}
    assert any({HP, WP} & sympy.sympify(c.bytes).free_symbols for c in counts.values())
    # per pass: the fused kernels it inserted, symbolically
    fused = {c.name: c for c in pipe.candidates()}["fuse_qk_norm_rope"]
    assert [c.op for c in fused.inserted if c.kernel] == ["kopt::qk_norm_rope"] * fused.sites
    totals = fused.totals()
    assert totals["kernels_removed"] > totals["kernels_inserted"]
    saved = sympy.expand(totals["bytes_removed"] - totals["bytes_inserted"])
    assert saved.free_symbols == {S_IMG, S_TXT} and all(
        v > 0 for v in sympy.Poly(saved, S_IMG, S_TXT).coeffs())


def _synthetic(gm: fx.GraphModule, truth: DeviceModel, device: str) -> Attribution:
    """The attribution ``truth`` predicts for every node of ``gm`` (no noise)."""
    nodes = {}
    for c in count_graph(gm):
        if "/" in c.node or (not c.kernel and not c.dispatched):
            continue
        kernel = truth.kernel_ms(c)
        host = truth.op_host_ms(c)
        ms = kernel if device == "cuda" else kernel + host  # on a CPU, launch_us is 0
        calls = round(truth.launches(c)) if device == "cuda" else 1
        nodes[c.node] = NodeCost(c.node, c.op, ms=ms, calls=calls, flops=0, bytes=0,
                                 category=c.category, dtype=c.dtype, host_ms=host, min_ms=ms)
    return Attribution(device, 1, nodes, {}, 1.0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fit_recovers_the_parameters_that_made_the_trace(device: str, llm) -> None:  # noqa: ANN001
    """Times generated from known parameters (CPU: op times; CUDA: kernel and host times and
    kernels per op), one (fixed cost, efficiency) per group the trace can tell apart, are
    fitted back to those parameters."""
    import statistics

    from kopt.cost.calibrate import ANY_KERNEL, _groups, _samples, _varied

    cap, spec = llm
    cuda = device == "cuda"
    uniform = H200.with_(efficiency={}, fixed_us={}, kernels_per_op={})
    probe = [(count_graph(g), _synthetic(g, uniform, device)) for g in (cap.gm, spec.gm)]
    samples = _samples(probe)
    roof = [uniform.roofline_ms(x.count.flops, x.count.bytes, x.count.dtype) for x in samples]
    group = _groups(samples, roof, 3)
    keys = sorted(set(group.values()))
    assert ANY_KERNEL in keys and len(keys) >= 4, keys
    fixed = {k: 1.0 + 0.5 * i for i, k in enumerate(keys) if k != ANY_KERNEL}
    shared = [r for x, r in zip(samples, roof, strict=True)
              if x.count.kernel and group[x.count.op] == ANY_KERNEL]
    truth = uniform.with_(
        launch_us=5.5 if cuda else 0.0, view_us=1.7, fixed_us=fixed,
        kernel_us=2.5 if _varied(shared) else statistics.median(fixed.values()),
        efficiency={k: 0.3 + 0.05 * i for i, k in enumerate(keys)},
        kernels_per_op={"aten::linear": 2.0} if cuda else {},
        # kopt's row-wise op: a Python implementation and a Triton launcher on the host
        host_us={"kopt::rowwise": 40.0} if cuda else {})
    pairs = [(g, _synthetic(g, truth, device)) for g in (cap.gm, spec.gm)]
    got = fit(pairs, base=uniform)
    assert got.launch_us == pytest.approx(truth.launch_us, abs=1e-6)
    assert got.host_us == pytest.approx(truth.host_us)
    assert got.view_us == pytest.approx(1.7, rel=1e-6)
    assert got.kernels_per_op == truth.kernels_per_op
    kernels = [x.count for x in samples if x.count.kernel]
    assert {c.op for c in kernels} >= {"aten::linear", "aten::_scaled_mm", "kopt::rowwise",
                                       "aten::cat", "aten::mul"}
    for c in kernels:  # every op's fixed cost and efficiency, its own or its group's
        assert got.fixed_of(c) == pytest.approx(truth.fixed_of(c), rel=1e-6), c.op
        assert got.efficiency_of(c) == pytest.approx(truth.efficiency_of(c), rel=1e-6), c.op
    assert got.asynchronous == cuda
    assert "median relative error per node 0%" in got.source


def test_host_times_are_scaled_to_the_measured_wall_times(llm) -> None:  # noqa: ANN001
    """CUDA, host-bound: the profiler records every op's host time 1.6x too long; the wall
    times of two graphs (the ops' true host times plus a per-node cost) give the scale and the
    per-node cost back, and the fitted model predicts both walls."""
    from kopt.cost.calibrate import _fit_walls

    cap, spec = llm
    truth = H200.with_(launch_us=6.0, view_us=1.0, host_us={"kopt::rowwise": 30.0},
                       node_us=2.0, kernel_us=0.0, fixed_us={}, efficiency={})
    profiled = truth.with_(launch_us=9.6, view_us=1.6, host_us={"kopt::rowwise": 48.0},
                           node_us=0.0)
    graphs = [count_graph(cap.gm), count_graph(spec.gm)]
    walls = [truth.predict(g).host_ms for g in graphs]
    assert all(w > truth.predict(g).device_ms for g, w in zip(graphs, walls, strict=True))
    got, note = _fit_walls(profiled, graphs, walls)
    assert got.launch_us == pytest.approx(6.0, rel=1e-6)
    assert got.host_us["kopt::rowwise"] == pytest.approx(30.0, rel=1e-6)
    assert got.node_us == pytest.approx(2.0, rel=1e-6)
    assert "x 0.62 to 2 measured wall times" in note
    for g, w in zip(graphs, walls, strict=True):
        assert got.predict(g).total_ms == pytest.approx(w, rel=1e-6)
    # one host-bound graph: the per-node cost only, the profiled host times as they are
    one, note = _fit_walls(profiled, graphs[:1], walls[:1])
    assert one.launch_us == 9.6 and note == "" and one.node_us < 2.0


def test_a_node_that_dispatches_nothing_costs_no_host_time() -> None:
    """A getitem of a split's tuple is a tuple index: no ``node_us`` (charged it, W1's
    hoisted region of 1082 getitems was predicted 13 ms slower per miss); a view pays the
    graph's Python and its dispatch."""
    from kopt.cost.calibrate import _fit_walls

    model = H200.with_(launch_us=6.0, view_us=1.0, node_us=2.0, host_us={})
    getitem = OpCount("g", "getitem", "view", "bfloat16", 0, 0, False, dispatched=False)
    view = OpCount("u", "aten::unsqueeze", "view", "bfloat16", 0, 0, False)
    launch = OpCount("m", "aten::mul", "elementwise", "bfloat16", 10, 40, True)
    assert model.host_ms(getitem) == 0.0 and model.op_host_ms(getitem) == 0.0
    assert model.host_ms(view) == pytest.approx(3e-3)
    assert model.op_host_ms(view) == pytest.approx(1e-3)
    assert model.host_ms(launch) == pytest.approx(8e-3)
    # the per-node cost is fitted over the nodes it is of: a host-bound graph of many
    # getitems gives node_us back, not node_us diluted over the getitems
    graph = [launch] * 50 + [view] * 100 + [getitem] * 400
    wall = model.predict(graph).host_ms
    got, _ = _fit_walls(model.with_(node_us=0.0), [graph], [wall])
    assert got.node_us == pytest.approx(2.0, rel=1e-6)


def test_a_miss_of_the_hoisted_regions_is_one_more_wall_equation() -> None:
    """One host-bound graph whose hoisted region is mostly views: its wall with the caches
    hit gives only ``node_us``; with the wall of a call where the region misses too, both
    the scale on the profiled host times (1.6x too long here) and ``node_us`` come back,
    and the region's host time is predicted as measured."""
    from kopt.cost.calibrate import _fit_walls

    truth = H200.with_(launch_us=6.0, view_us=1.0, node_us=2.0, host_us={})
    profiled = truth.with_(launch_us=9.6, view_us=1.6, node_us=0.0)
    launch = OpCount("m", "aten::mul", "elementwise", "bfloat16", 10, 40, True)
    view = OpCount("u", "aten::unsqueeze", "view", "bfloat16", 0, 0, False)
    region = [dataclasses.replace(view, cached="step")] * 300 + [
        dataclasses.replace(launch, cached="step")] * 5
    graph = [launch] * 50 + [view] * 100 + region
    hit = truth.predict([c for c in graph if c.cached is None]).host_ms
    miss = truth.predict(graph).host_ms
    assert miss > hit > truth.predict(graph).device_ms
    got, note = _fit_walls(profiled, [graph], [hit], [miss])
    assert got.launch_us == pytest.approx(6.0, rel=1e-6)
    assert got.view_us == pytest.approx(1.0, rel=1e-6)
    assert got.node_us == pytest.approx(2.0, rel=1e-6)
    assert "to 2 measured wall times" in note
    assert got.predict(region).host_ms == pytest.approx(truth.predict(region).host_ms)
    without, _ = _fit_walls(profiled, [graph], [hit])
    assert without.view_us == 1.6  # one equation: the profiled times as they are


def test_the_hoisted_regions_node_cost_is_fitted_from_their_miss() -> None:
    """Two host-bound graphs fit the scale and ``node_us`` from their hit walls; a region of
    views whose generated code costs a quarter of the average node then gets its own cost per
    node from the miss wall, and its miss is predicted as measured (at ``node_us`` it would
    be 1.95x too slow here)."""
    from kopt.cost.calibrate import _fit_walls

    truth = H200.with_(launch_us=6.0, view_us=1.0, node_us=2.0, region_node_us=0.5,
                       host_us={})
    profiled = truth.with_(launch_us=9.6, view_us=1.6, node_us=0.0, region_node_us=None)
    launch = OpCount("m", "aten::mul", "elementwise", "bfloat16", 10, 40, True)
    view = OpCount("u", "aten::unsqueeze", "view", "bfloat16", 0, 0, False)
    region = [dataclasses.replace(view, cached="step")] * 300 + [
        dataclasses.replace(launch, cached="step")] * 5
    plain = [launch] * 80 + [view] * 40
    graph = [launch] * 50 + [view] * 100 + region
    walls = [truth.predict(plain).host_ms, truth.predict(graph[:150]).host_ms]
    miss = truth.predict(graph).host_ms
    got, note = _fit_walls(profiled, [plain, graph], walls, [None, miss])
    assert got.node_us == pytest.approx(2.0, rel=1e-6)
    assert got.region_node_us == pytest.approx(0.5, rel=1e-6)
    assert "hoisted regions' nodes 0.50 us" in note
    assert got.predict(region).host_ms == pytest.approx(truth.predict(region).host_ms)
    at_average = got.with_(region_node_us=None).predict(region).host_ms
    assert at_average == pytest.approx(1.95 * truth.predict(region).host_ms, rel=0.01)
    without, _ = _fit_walls(profiled, [plain, graph], walls)
    assert without.region_node_us is None and without.node_us == pytest.approx(2.0, rel=1e-6)


def test_calibration_times_a_call_whose_hoisted_regions_miss(one_thread) -> None:  # noqa: ANN001
    """``measure`` times each graph with hoisted regions once more with their caches emptied
    before every call (None for a graph without regions); saved and read back."""
    w = build("qwen-image-tiny")
    cap = capture_module(w.model, w.args, w.kwargs)
    spec = optimize_captured(cap, PassConfig(), OFF, None, w.name, 0.0)
    regions = cached_regions(spec.gm)
    assert regions, "qwen-image-tiny has its timestep work hoisted"
    cal = measure([(cap.gm, cap.example_inputs), (spec.gm, cap.example_inputs)], iters=2)
    assert cal.miss_ms[0] is None and cal.miss_ms[1] > 0
    assert Calibration.from_json(cal.to_json()).miss_ms == cal.miss_ms
    assert all(r._entries for r in regions)  # the caches serve the next call again


def test_fit_groups_ops_only_where_sizes_tell_a_fixed_cost_from_a_rate() -> None:
    from kopt.cost.calibrate import ANY_KERNEL, _groups, _Sample
    from kopt.cost.counts import OpCount

    def sample(op: str, category: str) -> _Sample:
        return _Sample(OpCount("n", op, category, "float32", 0, 0, True),
                       NodeCost("n", op, ms=1.0))

    rows = [("aten::cat", "elementwise", r) for r in (1.0, 2.0, 8.0)]  # spread: its own
    rows += [("aten::add", "elementwise", r) for r in (1.0, 1.0)]  # with the category's rest:
    rows += [("aten::mul", "elementwise", r) for r in (4.0, 4.0)]  # spread
    rows += [("aten::linear", "gemm", r) for r in (3.0, 3.0, 3.0)]  # one size: shared
    rows += [("aten::mm", "gemm", 3.0)]
    got = _groups([sample(op, cat) for op, cat, _ in rows], [r for *_, r in rows], 3)
    assert got == {"aten::cat": "aten::cat", "aten::add": "elementwise",
                   "aten::mul": "elementwise", "aten::linear": ANY_KERNEL, "aten::mm": ANY_KERNEL}


def test_nnls_keeps_parameters_non_negative() -> None:
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)  # unconstrained slope: -1
    x = nnls(a, b)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)
    exact = nnls(a, a @ torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert torch.allclose(exact, torch.tensor([0.5, 2.0], dtype=torch.float64))


def test_calibrate_fits_a_cpu_trace(one_thread, llm) -> None:  # noqa: ANN001
    """A real CPU trace of the captured and the optimized graph: the ceilings are the best
    rates measured, every parameter is positive, and the fitted model costs a graph at four
    times the tokens higher than at one (its counts, not its fit, say so)."""
    cap, spec = llm
    cal = measure([(cap.gm, cap.example_inputs), (spec.gm, cap.example_inputs)], iters=3)
    model = cal.fit()
    # what the fit is made of, saved and fitted again elsewhere: the same model
    assert Calibration.from_json(cal.to_json()).fit() == model
    assert not model.asynchronous and model.graph_launch_us is None
    assert model.peak_tflops["float32"] > 0 and model.bandwidth_gbs > 0
    assert model.fixed_us and all(v >= 0 for v in model.fixed_us.values())
    assert model.kernel_us > 0 and model.node_us >= 0
    assert all(0 < e < math.inf for e in model.efficiency.values())
    assert all(0 < model.efficiency_of(c) < math.inf and model.fixed_of(c) >= 0
               for c in count_graph(spec.gm))
    assert "2 cpu trace(s)" in model.source
    small = CostModel(model).graph(cap.gm)
    w4 = build("llm-tiny", seq_len=80)
    big = CostModel(model).graph(capture_module(w4.model, w4.args, w4.kwargs).gm)
    assert big.total_ms > small.total_ms and big.bytes > small.bytes


def test_device_model_json_round_trip(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "h200.json"
    H200.save(path)
    assert DeviceModel.load(path) == H200


def test_h200_model_predicts_the_gemm_epilogue_losing_in_eager_as_measured() -> None:
    """W1's ablation of the GEMM epilogue (RESULTS.md, 2026-11-30, H200): replacing _scaled_mm + add
    by kopt's Triton GEMM at 238 sites cost 55.5 ms per call eager, the Triton launcher's host
    time. The shipped model has that host cost per launch, so it predicts the eager loss."""
    m, n = 4096, 3072
    before, after = [], []
    for i in range(238):
        k = 3072 if i % 2 else 12288
        flops, gemm_bytes, add_bytes = 2 * m * n * k, m * k + n * k + 2 * m * n, 3 * 2 * m * n
        before += [OpCount(f"mm{i}", "aten::_scaled_mm", "gemm", "float8_e4m3fn", flops,
                           gemm_bytes, True),
                   OpCount(f"add{i}", "aten::add", "elementwise", "bfloat16", m * n, add_bytes,
                           True)]
        after.append(OpCount(f"fused{i}", "kopt::fp8_gemm", "gemm", "float8_e4m3fn", flops,
                             gemm_bytes + 2 * m * n, True))
    # W1's eager kopt-fp8 call is host-bound (125.1 ms eager, 103.4 replayed): what the
    # rewrite adds to the host's time per call is what it adds to the call
    host = H200.predict(after).host_ms - H200.predict(before).host_ms
    assert 45 < host < 65  # measured: 55.5 ms per call slower
    assert H200.predict(after).total_ms > H200.predict(before).total_ms
    assert H200.predict(after).host_ms > H200.predict(after).device_ms  # host-bound
    assert "kopt::fp8_gemm 240" in H200.describe()


# A device where FP32 GEMMs are slow and FP8 ones fast, with costly launches: FP8 (one more
# quantization kernel per GEMM, a faster GEMM) loses at a few tokens and wins at many.
SLOW_FP32 = DeviceModel("slow-fp32", {"float32": 0.1, "float8_e4m3fn": 100.0}, 1000.0,
                        launch_us=10.0, graph_launch_us=None, asynchronous=False)


def test_gate_skips_fp8_where_it_loses_and_keeps_it_where_it_wins() -> None:
    cost = CostModel(SLOW_FP32)
    decisions = {}
    for seq in (4, 256):
        w = build("llm-tiny", seq_len=seq)
        opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, verify=OFF, cost=cost)
        p = opt.report.ranking.get("fp8")
        result = opt.report.result("fp8")
        fp8_nodes = sum(n.target is torch.ops.aten._scaled_mm.default
                        for n in opt.graph_module.graph.nodes)
        assert p.applied == (p.saved_ms > 0)
        if p.applied:
            assert result.matched == p.sites > 0 and fp8_nodes > 0
        else:
            assert result.matched == 0 and fp8_nodes == 0
            assert any(n.startswith("skipped: predicted to lose") for n in result.notes)
        decisions[seq] = p.applied
    assert decisions == {4: False, 256: True}


def test_symbolic_ranking_agrees_with_the_captured_one_and_moves_with_tokens(llm_pipe) -> None:  # noqa: ANN001
    """The fp8 pass's saving from symbolic counts equals the one the pass manager predicted on
    a real capture of that size, and crosses zero between a few and many tokens."""
    cost = dataclasses.replace(CostModel(SLOW_FP32), min_saving_ms=-math.inf)  # skip none
    w = build("llm-tiny", seq_len=8)
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, verify=OFF, cost=cost)
    assert opt.report.ranking.get("fp8").saved_ms < 0 < opt.report.result("fp8").matched
    at = {p.name: p for p in llm_pipe.predictions(cost, llm_pipe.values(seq_len=8))}
    for p in opt.report.ranking.passes:
        assert at[p.name].saved_ms == pytest.approx(p.saved_ms, rel=1e-9, abs=1e-12), p.name
    saved = {seq: {p.name: p.saved_ms for p in llm_pipe.predictions(
        cost, llm_pipe.values(seq_len=seq))}["fp8"] for seq in (4, 64, 4096)}
    assert saved[4] < 0 < saved[64] < saved[4096]


def test_cli_rank_prints_the_ranking_and_uses_a_device_model_file(tmp_path, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "device.json"
    SLOW_FP32.save(path)
    rc = main(["optimize", "-q", "--no-verify", "--model", "llm-tiny", "--shape", "seq_len=4",
               "--fp8", "--fp8-min-features", "16", "--rank", "--device-model", str(path),
               "--rank-at", "seq_len=256"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ranking (slow-fp32, eager)" in text and "seq_len=256" in text
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln[:4].strip().isdigit()}
    assert set(PassConfig().enabled()) | {"fp8"} <= set(lines)
    assert "skipped: predicted to lose" in lines["fp8"]
    # the column at 256 tokens: fp8 predicted to win there
    assert float(lines["fp8"].split()[5]) > 0 > float(lines["fp8"].split()[3])
    assert "skipped: predicted to lose" in text.split("ranking (")[0]  # in the report too


def test_cli_rank_with_the_shipped_h200_model(capsys) -> None:  # noqa: ANN001
    rc = main(["optimize", "-q", "--no-verify", "--model", "llm-tiny", "--rank",
               "--device-model", "h200", "--cuda-graphs"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ranking (NVIDIA H200, CUDA graph)" in text
    assert "device model: NVIDIA H200" in text


def test_an_inplace_cache_write_moves_the_written_bytes_not_the_cache() -> None:
    """index_copy_ into a KV cache reads and writes the new tokens; the functional index_copy
    writes a whole new cache, and copy_ moves all of it back."""
    from torch import fx

    from kopt.cost.counts import count_node

    g = fx.Graph()
    cache, pos, new = (g.placeholder(n) for n in ("cache", "pos", "new"))
    vals = {cache: torch.empty(64, 8, 640, 128, dtype=torch.bfloat16, device="meta"),
            pos: torch.empty(1, dtype=torch.long, device="meta"),
            new: torch.empty(64, 8, 1, 128, dtype=torch.bfloat16, device="meta")}
    for n, v in vals.items():
        n.meta["val"] = v
    aten = torch.ops.aten
    inplace = g.call_function(aten.index_copy_.default, (cache, 2, pos, new))
    functional = g.call_function(aten.index_copy.default, (cache, 2, pos, new))
    back = g.call_function(aten.copy_.default, (cache, functional))
    for n in (inplace, functional, back):
        n.meta["val"] = vals[cache]
    full, token = vals[cache].nbytes, vals[new].nbytes
    assert count_node(inplace).bytes == 2 * (token + 8)
    assert count_node(functional).bytes == 2 * full + token + 8
    assert count_node(back).bytes == 2 * full


def _count(node: str, op: str, nbytes: float, *, kernel: bool = True, cached: str | None = None,
           category: str = "elementwise") -> OpCount:
    return OpCount(node, op, category, "bfloat16", 0, nbytes, kernel, cached)


def test_a_cuda_graph_replay_pays_the_hoisted_regions_eagerly_on_a_miss() -> None:
    """The hoisted regions run before the replay, eagerly (a graph would replay one timestep's
    values): on a miss their host launches are paid in series with the graph's kernels; the
    rest of the call is the graph's kernels and in-graph launch gaps, no host time."""
    device = H200.with_(launch_us=20.0, view_us=5.0, node_us=0.0, kernel_us=2.0, fixed_us={},
                        efficiency={}, graph_launch_us=1.0)
    body = [_count(f"b{i}", "aten::mul", 4.247e6) for i in range(10)]  # 1 us roofline each
    region = [_count(f"r{i}", "aten::mul", 4.247e6, cached="step") for i in range(10)]
    views = [_count(f"v{i}", "aten::view", 0, kernel=False, cached="step") for i in range(4)]
    graph = CostModel(device, cuda_graphs=True, calls_per_step=2)
    got = graph.predict(body + region + views)
    # body: 10 x (2 fixed + 1 roofline + 1 gap) us; prelude on a miss (every 2nd call): host
    # 10 x 20 + 4 x 5 us, longer than its kernels
    assert got.total_ms == pytest.approx((10 * 4 + (10 * 20 + 4 * 5) / 2) / 1e3)
    assert got.host_ms == pytest.approx((10 * 20 + 4 * 5) / 2 / 1e3)
    # eager: one timeline, host-bound
    eager = dataclasses.replace(graph, cuda_graphs=False).predict(body + region + views)
    assert eager.total_ms == pytest.approx((10 * 20 + (10 * 20 + 4 * 5) / 2) / 1e3)
    # without hoisting the same work runs inside the graph every call
    inline = [dataclasses.replace(c, cached=None) for c in region + views]
    assert graph.predict(body + inline).total_ms == pytest.approx(20 * 4 / 1e3)
    # the region's trailing views run in the replay (kopt.cudagraphs.split_hoisted): free
    replayed = [dataclasses.replace(v, replayed=True) for v in views]
    assert graph.predict(body + region + replayed).total_ms == pytest.approx(
        (10 * 4 + 10 * 20 / 2) / 1e3)
    assert eager.total_ms == pytest.approx(dataclasses.replace(graph, cuda_graphs=False)
                                           .predict(body + region + replayed).total_ms)


def test_host_costs_are_medians_that_near_zero_timings_do_not_decide() -> None:
    """Timed without the profiler, a view's cost less the timer's own is near zero for some
    nodes: the fitted cost per view and per launch are the medians, not pulled to zero."""
    from kopt.cost.calibrate import _fit_host, _Sample

    def sample(i: int, op: str, host_us: float, kernel: bool) -> _Sample:
        return _Sample(_count(f"n{i}", op, 1e6 if kernel else 0, kernel=kernel),
                       NodeCost(f"n{i}", op, ms=0.01 if kernel else 0.0, calls=1,
                                host_ms=host_us / 1e3))

    views = [5.0, 6.0, 7.0, 0.001, 0.002, 5.5, 6.5]
    launches = [15.0, 16.0, 17.0, 0.01, 18.0]
    custom = [200.0, 210.0, 190.0]
    samples = ([sample(i, "aten::view", h, False) for i, h in enumerate(views)]
               + [sample(10 + i, "aten::mul", h, True) for i, h in enumerate(launches)]
               + [sample(20 + i, "kopt::rowwise", h, True) for i, h in enumerate(custom)])
    launch_us, view_us, host_us = _fit_host(samples, [1.0 if s.count.kernel else 0.0
                                                      for s in samples], 3)
    assert view_us == pytest.approx(5.5)
    assert launch_us == pytest.approx(16.0)
    assert host_us == {"kopt::rowwise": pytest.approx(200.0)}


def test_a_device_bound_graph_says_nothing_about_the_host() -> None:
    """A device-bound graph whose wall time the device model under-predicts: the difference
    is the device model's error, not host time per node."""
    from kopt.cost.calibrate import _fit_walls

    model = H200.with_(launch_us=10.0, view_us=0.0, node_us=0.0, kernel_us=5.0, fixed_us={},
                       efficiency={})
    graph = [_count(f"n{i}", "aten::mul", 4.247e8) for i in range(10)]  # 100 us each
    p = model.predict(graph)
    assert p.device_ms > p.host_ms
    got, note = _fit_walls(model, [graph], [1.3 * p.device_ms])
    assert got.node_us == 0.0 and note == ""


def test_an_op_whose_large_kernels_run_slower_gets_the_rate_its_totals_say() -> None:
    """The group fit weighs nodes alike, so many small kernels of a group set its rate; an
    op with a few large kernels at half that rate gets its own efficiency from its totals,
    and the large kernels' modelled time adds up to their measured time."""
    truth = H200.with_(kernel_us=2.0, fixed_us={}, efficiency={"*": 0.8}, kernels_per_op={})
    slow = truth.with_(efficiency={"*": 0.4})
    counts = [_count(f"m{i}", "aten::mul", 4.247e6 * (1 + i % 5)) for i in range(40)]
    counts += [_count(f"c{i}", "aten::clone", 4.247e8) for i in range(4)]  # 100 us roofline
    nodes = {}
    for c in counts:
        ms = (slow if c.op == "aten::clone" else truth).kernel_ms(c)
        nodes[c.node] = NodeCost(c.node, c.op, ms=ms, calls=1, host_ms=0.01, min_ms=ms)
    got = fit_counted([(counts, Attribution("cuda", 1, nodes, {}, 1.0))], base=truth)
    clones = [c for c in counts if c.op == "aten::clone"]
    assert got.efficiency["aten::clone"] == pytest.approx(0.4, rel=1e-6)
    assert sum(got.kernel_ms(c) for c in clones) == pytest.approx(
        sum(nodes[c.node].ms for c in clones), rel=1e-6)
    assert got.efficiency_of(counts[0]) == pytest.approx(0.8, rel=1e-3)


def test_a_group_of_small_kernels_takes_the_base_rate_it_cannot_measure() -> None:
    """Kernels whose time is their fixed cost measure no rate (decode's quantizers, all on
    64-row inputs): the group gets the base model's efficiency, so a large kernel of the same
    op elsewhere (the quantizer on a weight) is not costed at whatever the solver left."""
    base = H200.with_(kernel_us=2.0, fixed_us={}, kernels_per_op={},
                      efficiency={"quantization": 0.6, "elementwise": 0.75})
    truth = base.with_(fixed_us={"kopt::quant_fp8_rowwise": 4.0},
                       efficiency={"kopt::quant_fp8_rowwise": 0.05, "elementwise": 0.7})
    counts = [_count(f"q{i}", "kopt::quant_fp8_rowwise", 4.247e3 * (1 + i % 5),
                     category="quantization") for i in range(12)]  # ~1-5 ns of roofline
    # the largest mul 10 us of roofline against a 2 us fixed cost: a rate sample (at 8 us it
    # sat on the SPREAD boundary, where the fit's last bit decided)
    counts += [_count(f"m{i}", "aten::mul", 4.247e6 * (1 + i % 10)) for i in range(12)]
    nodes = {c.node: NodeCost(c.node, c.op, ms=truth.kernel_ms(c), calls=1, host_ms=0.01,
                              min_ms=truth.kernel_ms(c)) for c in counts}
    got = fit_counted([(counts, Attribution("cuda", 1, nodes, {}, 1.0))], base=base)
    weight = _count("w", "kopt::quant_fp8_rowwise", 1e9, category="quantization")
    assert got.efficiency_of(weight) == pytest.approx(0.6)
    assert got.fixed_of(weight) == pytest.approx(4.0, rel=1e-3)  # the fixed cost is measured
    assert got.efficiency_of(counts[-1]) == pytest.approx(0.7, rel=1e-3)  # a measured rate


def test_operand_layout_is_counted_and_sets_its_own_rate() -> None:
    """A bias add (an operand broadcast over the output) and a cat of slices (strided
    operands) are told from a plain add and a cat of whole tensors; the fit gives the slow
    layout its own rate from its large kernels, and an op seen only contiguous costs a
    broadcast of itself at the op's rate."""
    from kopt.cost.counts import count_node

    aten = torch.ops.aten
    g = fx.Graph()
    x, y, b, qkv = (g.placeholder(n) for n in ("x", "y", "b", "qkv"))
    vals = {x: torch.empty(64, 128, device="meta"), y: torch.empty(64, 128, device="meta"),
            b: torch.empty(128, device="meta"), qkv: torch.empty(64, 384, device="meta")}
    plain = g.call_function(aten.add.Tensor, (x, y))
    bias = g.call_function(aten.add.Tensor, (x, b))
    q = g.call_function(aten.slice.Tensor, (qkv, 1, 0, 128))
    k = g.call_function(aten.slice.Tensor, (qkv, 1, 128, 256))
    cat_views = g.call_function(aten.cat.default, ([q, k], 1))
    cat_whole = g.call_function(aten.cat.default, ([x, y], 1))
    for n, v in vals.items():
        n.meta["val"] = v
    for n in (plain, bias):
        n.meta["val"] = torch.empty(64, 128, device="meta")
    q.meta["val"] = vals[qkv][:, :128]
    k.meta["val"] = vals[qkv][:, 128:256]
    for n in (cat_views, cat_whole):
        n.meta["val"] = torch.empty(64, 256, device="meta")
    got = [count_node(n).rate_key for n in (plain, bias, cat_views, cat_whole, q)]
    assert got == ["aten::add", "aten::add[broadcast]", "aten::cat[strided]", "aten::cat",
                   "aten::slice"]

    truth = H200.with_(kernel_us=2.0, fixed_us={}, kernels_per_op={},
                       efficiency={"aten::add": 0.8, "aten::add[broadcast]": 0.4})
    counts = [dataclasses.replace(_count(f"a{i}", "aten::add", 4.247e8 * (1 + i % 3)),
                                  layout="broadcast" if i % 2 else "") for i in range(12)]
    nodes = {c.node: NodeCost(c.node, c.op, ms=truth.kernel_ms(c), calls=1, host_ms=0.01,
                              min_ms=truth.kernel_ms(c)) for c in counts}
    fitted = fit_counted([(counts, Attribution("cuda", 1, nodes, {}, 1.0))], base=truth)
    assert fitted.efficiency_of(counts[0]) == pytest.approx(0.8, rel=1e-3)
    assert fitted.efficiency_of(counts[1]) == pytest.approx(0.4, rel=1e-3)
    mul = dataclasses.replace(_count("m", "aten::mul", 1e6), layout="broadcast")
    assert H200.with_(efficiency={"aten::mul": 0.7}).efficiency_of(mul) == 0.7


def test_an_aten_elementwise_op_in_two_element_types_gets_a_rate_for_each() -> None:
    """ATen's unvectorized kernels are bound by elements per second, so a bf16 broadcast
    multiply moves fewer bytes per second than an fp32 one (W2 on the H200: 1.4 against 2.2
    TB/s): with both in the trace each type keeps its own rate; an op seen in one type keeps
    one rate, and a type the trace lacks takes the op's."""
    truth = H200.with_(kernel_us=2.0, fixed_us={}, kernels_per_op={},
                       efficiency={"aten::mul[broadcast]@bfloat16": 0.33,
                                   "aten::mul[broadcast]@float32": 0.53, "aten::add": 0.9})

    def mul(i: int, dtype: str) -> OpCount:
        return OpCount(f"m{dtype}{i}", "aten::mul", "elementwise", dtype, 0,
                       4.247e8 * (1 + i % 3), True, layout="broadcast")

    counts = ([mul(i, "bfloat16") for i in range(6)] + [mul(i, "float32") for i in range(6)]
              + [_count(f"a{i}", "aten::add", 4.247e8 * (1 + i % 3)) for i in range(6)])
    nodes = {c.node: NodeCost(c.node, c.op, ms=truth.kernel_ms(c), calls=1, host_ms=0.01,
                              min_ms=truth.kernel_ms(c)) for c in counts}
    fitted = fit_counted([(counts, Attribution("cuda", 1, nodes, {}, 1.0))], base=truth)
    assert fitted.efficiency_of(counts[0]) == pytest.approx(0.33, rel=1e-3)
    assert fitted.efficiency_of(counts[6]) == pytest.approx(0.53, rel=1e-3)
    assert not any("@" in k for k in fitted.efficiency if k.startswith("aten::add"))
    half = dataclasses.replace(counts[0], dtype="float16")
    assert fitted.efficiency_of(half) == fitted.efficiency["aten::mul[broadcast]"]


def test_a_layout_the_trace_lacks_keeps_the_base_models_rate() -> None:
    """A trace of kopt's graph has no strided cat (cat_rows replaced it), only whole-tensor
    cats at a high rate: a strided cat elsewhere (the graph without cat_rows) is costed at the
    base's strided-cat rate, not at the plain cats' fitted one; a layout the trace measures
    keeps its fitted rate."""
    truth = H200.with_(kernel_us=2.0, fixed_us={}, kernels_per_op={},
                       efficiency={"aten::cat": 0.9, "aten::add[broadcast]": 0.4})
    counts = [_count(f"c{i}", "aten::cat", 4.247e8 * (1 + i % 3)) for i in range(6)]
    counts += [dataclasses.replace(_count(f"a{i}", "aten::add", 4.247e8 * (1 + i % 3)),
                                   layout="broadcast") for i in range(6)]
    nodes = {c.node: NodeCost(c.node, c.op, ms=truth.kernel_ms(c), calls=1, host_ms=0.01,
                              min_ms=truth.kernel_ms(c)) for c in counts}
    base = H200.with_(efficiency={**H200.efficiency, "aten::add[broadcast]": 0.9})
    fitted = fit_counted([(counts, Attribution("cuda", 1, nodes, {}, 1.0))], base=base)
    strided = dataclasses.replace(_count("s", "aten::cat", 5e7), layout="strided")
    assert fitted.efficiency_of(counts[0]) == pytest.approx(0.9, rel=1e-2)  # fitted
    assert fitted.efficiency_of(strided) == H200.efficiency["aten::cat[strided]"] < 0.5
    assert fitted.efficiency_of(counts[-1]) == pytest.approx(0.4, rel=1e-3)  # measured, kept


def _fp8_gemm_operands() -> tuple[fx.Graph, tuple[fx.Node, ...]]:
    """A graph with the placeholders of a [64, 128] x [128, 256] rowwise FP8 GEMM and its bf16
    bias, their values on the meta device."""
    g = fx.Graph()
    a, w, sa, sw, b = (g.placeholder(n) for n in ("a", "w", "sa", "sw", "b"))
    a.meta["val"] = torch.empty(64, 128, device="meta", dtype=torch.float8_e4m3fn)
    w.meta["val"] = torch.empty(128, 256, device="meta", dtype=torch.float8_e4m3fn)
    sa.meta["val"], sw.meta["val"] = (torch.empty(64, 1, device="meta"),
                                      torch.empty(1, 256, device="meta"))
    b.meta["val"] = torch.empty(256, device="meta", dtype=torch.bfloat16)
    return g, (a, w, sa, sw, b)


def test_a_gemm_with_a_bias_epilogue_is_costed_slower_than_without() -> None:
    """What absorb_bias saves is the bias add less the epilogue it adds to the GEMM: a biased
    FP8 GEMM is counted as such, costed EPILOGUE_SLOWDOWN slower than the op's rate where it
    has none of its own, and a trace of biased GEMMs only (W1) gives the plain GEMM its rate
    back through the same factor."""
    from kopt.cost.calibrate import _epilogue_rates
    from kopt.cost.counts import count_node
    from kopt.cost.device import EPILOGUE_SLOWDOWN

    aten = torch.ops.aten
    g, (a, w, sa, sw, b) = _fp8_gemm_operands()
    kw = {"out_dtype": torch.bfloat16}
    plain = g.call_function(aten._scaled_mm.default, (a, w, sa, sw), kw)
    biased = g.call_function(aten._scaled_mm.default, (a, w, sa, sw, b), kw)
    for n in (plain, biased):
        n.meta["val"] = torch.empty(64, 256, device="meta", dtype=torch.bfloat16)
    cp, cb = count_node(plain), count_node(biased)
    assert (cp.rate_key, cb.rate_key) == ("aten::_scaled_mm", "aten::_scaled_mm[bias]")
    slowdown = EPILOGUE_SLOWDOWN["aten::_scaled_mm"]
    assert slowdown > 1
    model = H200.with_(efficiency={"aten::_scaled_mm": 0.7}, fixed_us={}, kernel_us=0.0)
    assert model.efficiency_of(cb) == pytest.approx(0.7 / slowdown)
    # (the biased GEMM also reads its bias: 512 bytes, 0.7% more)
    assert slowdown < model.kernel_ms(cb) / model.kernel_ms(cp) < slowdown * 1.01
    own = model.with_(efficiency={"aten::_scaled_mm": 0.7, "aten::_scaled_mm[bias]": 0.5})
    assert own.efficiency_of(cb) == 0.5  # a measured rate is kept
    assert _epilogue_rates({"aten::_scaled_mm[bias]": 0.6}) == {
        "aten::_scaled_mm": pytest.approx(0.6 * slowdown)}
    assert _epilogue_rates({"aten::_scaled_mm[bias]": 0.6, "aten::_scaled_mm": 0.7}) == {}


def test_a_reshape_that_can_view_its_input_is_a_view_whatever_its_traced_storage() -> None:
    """A pass traces its new nodes' values one by one (another storage than the input's): the
    reshape of a contiguous activation to 2-D is still a view; flattening a transposed one is
    a copy."""
    from kopt.cost.counts import count_node
    from kopt.graph import is_view

    aten = torch.ops.aten
    g = fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("t")
    x.meta["val"] = torch.empty(1, 48, 64, device="meta")
    t.meta["val"] = torch.empty(1, 64, 48, device="meta").transpose(1, 2)
    flat = g.call_function(aten.reshape.default, (x, [-1, 64]))
    copy = g.call_function(aten.reshape.default, (t, [-1]))
    flat.meta["val"] = torch.empty(48, 64, device="meta")
    copy.meta["val"] = torch.empty(48 * 64, device="meta")
    assert is_view(flat) and count_node(flat).bytes == 0
    assert not is_view(copy) and count_node(copy).bytes == 2 * 48 * 64 * 4



def test_a_fit_says_when_a_profile_ran_slower_than_the_timed_calls() -> None:
    """A CUDA graph whose profiled kernels add up to more than its timed call (one stream
    cannot) is named in the fitted model's source; one within its wall time is not."""
    counts = [_count(f"m{i}", "aten::mul", 4.247e8 * (1 + i % 4)) for i in range(8)]
    nodes = {c.node: NodeCost(c.node, c.op, ms=H200.kernel_ms(c), calls=1, host_ms=0.01,
                              min_ms=H200.kernel_ms(c)) for c in counts}
    kernels = sum(n.ms for n in nodes.values())
    trace = Attribution("cuda", 1, nodes, {}, 1.0)
    slow = fit_counted([(counts, trace)], base=H200, wall_ms=[kernels / 1.25])
    assert "graph 1 1.25x" in slow.source and "its rates are pessimistic" in slow.source
    fine = fit_counted([(counts, trace)], base=H200, wall_ms=[kernels * 1.1])
    assert "pessimistic" not in fine.source


def test_replayed_kernels_are_matched_to_their_nodes_in_launch_order() -> None:
    """A replay holds the eager call's kernels in the same order, plus copies that ran
    outside the graph and less a kernel the capture skipped: each node gets its matched
    kernels' replayed times, an unmatched kernel keeps its eager time, and the coverage is
    the matched share of the eager kernel time."""
    from kopt.profile import align_replay

    order = [("mm", "gemm", 4.0), ("mm", "bias", 1.0), ("norm", "rms", 2.0),
             ("act", "silu", 1.0), (None, "memset", 0.5), ("act", "mul", 1.5)]
    replay = [("foreach_copy", 0.2), ("gemm", 3.0), ("bias", 0.5), ("rms", 1.0),
              ("silu", 0.8), ("memset", 0.4), ("mul", 1.0)]
    fewer = [r for r in replay if r[0] != "rms"]  # the norm's kernel not matched
    (same, partial), coverage = align_replay(order, [replay, fewer])
    assert same == {"mm": 3.5, "norm": 1.0, "act": 1.8}
    assert partial == {"mm": 3.5, "norm": 2.0, "act": 1.8}  # the eager time kept
    assert coverage == pytest.approx(8.0 / 10.0)
    _, none = align_replay(order, [[("other", 1.0)]])
    assert none == 0.0


def test_a_calibration_fits_replayed_kernel_times_where_every_graph_has_them() -> None:
    """The rates come from the CUDA graph replays where each graph was replayed (a kernel
    1.25x faster replayed fits a 1.25x higher efficiency), from the eager profile with
    ``source="eager"`` or where one graph has no replay; the replays survive JSON."""
    counts = tuple(_count(f"m{i}", "aten::mul", 4.247e8 * (1 + i % 4)) for i in range(8))

    def trace(scale: float) -> Attribution:
        return Attribution("cuda", 1, {c.node: NodeCost(
            c.node, c.op, ms=scale * H200.kernel_ms(c), calls=1, host_ms=0.01,
            min_ms=scale * H200.kernel_ms(c)) for c in counts}, {}, 1.0)

    cal = Calibration(((counts, trace(1.25), 10.0),), (trace(1.0),), ("matched",))
    replayed, eager = cal.fit(H200), cal.fit(H200, source="eager")
    ratio = replayed.efficiency_of(counts[0]) / eager.efficiency_of(counts[0])
    assert ratio == pytest.approx(1.25, rel=0.02)
    assert "CUDA graph replays" in replayed.source and "replays" not in eager.source
    again = Calibration.from_json(cal.to_json())
    assert again.replayed and again.notes == ("matched",) and again.fit(H200) == replayed
    clocked = dataclasses.replace(cal, clocks=((1500.0, 690.5),))
    assert Calibration.from_json(clocked.to_json()).clocks == ((1500.0, 690.5),)
    assert again.clocks == (None,)
    unreplayed = Calibration(((counts, trace(1.25), 10.0),), (None,), ("no kernels",))
    assert unreplayed.fit(H200) == eager
    with pytest.raises(ValueError, match="source"):
        cal.fit(H200, source="graph")


def test_replay_launches_reads_kernels_by_the_range_their_launch_started_in() -> None:
    """A trace as the H200's profiler records it (benchmarks/probes/replay_trace.py): eager
    kernels tied to cudaLaunchKernel / cuLaunchKernel calls inside node ranges, replayed
    kernels all tied to one cudaGraphLaunch, the ranges' own device-side copies, and an op
    whose correlation id collides with a launch's."""
    from kopt.profile import ORDER, PREFIX, REPLAY, RawEvent, replay_launches

    ev = [RawEvent(ORDER, False, 100, 100, 1), RawEvent(ORDER, True, 150, 300, 1),
          RawEvent(PREFIX + "mm", False, 110, 20, 2), RawEvent("aten::mm", False, 111, 10, 3),
          RawEvent("cudaLaunchKernel", False, 112, 2, 50),
          RawEvent(PREFIX + "act", False, 140, 20, 4),
          RawEvent("cuLaunchKernel", False, 141, 2, 51), RawEvent("aten::relu", False, 142, 5, 50),
          RawEvent("gemm", True, 150, 40_000, 50), RawEvent("silu", True, 40_200, 3_000, 51),
          RawEvent(REPLAY + "0", False, 500, 50, 5), RawEvent("cudaGraphLaunch", False, 510, 5, 60),
          RawEvent(REPLAY + "0", True, 520, 30_000, 5),
          RawEvent("silu", True, 30_600, 2_000, 60), RawEvent("gemm", True, 520, 30_000, 60)]
    order, replays = replay_launches(ev, 1)
    assert order == [("mm", "gemm", 0.04), ("act", "silu", 0.003)]
    assert replays == [[("gemm", 0.03), ("silu", 0.002)]]
    assert replay_launches(ev, 2)[1][1] == []  # no second replay range: nothing in it


# -- the power model ---------------------------------------------------------------------------
POWERED = H200.with_(power_cap_w=700.0, memory_power_w=350.0, max_boost=1.3, fixed_us={},
                     kernel_us=0.0, efficiency={"aten::_scaled_mm": 0.6, "aten::mul": 0.8})


def _gemm(node: str, tflop: float) -> OpCount:
    return OpCount(node, "aten::_scaled_mm", "gemm", "float8_e4m3fn", tflop * 1e12, 1e6, True)


def test_the_clock_factor_rises_with_the_memory_bound_share_up_to_the_highest_clock() -> None:
    """m(s) = ((1 - rho s) / (1 - s)) ** (-1/3): 1 at s = 0, falling as memory-bound time
    leaves power to the compute-bound kernels, never under 1 / max_boost; 1 without a cap."""
    assert POWERED.clock_factor(0.0) == 1.0
    rho = 350.0 / 700.0
    assert POWERED.clock_factor(0.3) == pytest.approx(((1 - rho * 0.3) / 0.7) ** (-1 / 3))
    shares = [0.0, 0.1, 0.3, 0.5]
    factors = [POWERED.clock_factor(s) for s in shares]
    assert factors == sorted(factors, reverse=True) and factors[-1] < 0.9
    assert POWERED.clock_factor(0.98) == pytest.approx(1 / 1.3)
    assert H200.clock_factor(0.5) == 1.0 and not H200.power_limited


def test_a_graph_with_more_memory_bound_time_runs_its_gemms_faster() -> None:
    """The same GEMMs, alone and with memory-bound kernels beside them: only the GEMMs' time
    changes, by the factor of the graph's memory-bound share (the fixed point of it)."""
    gemms = [_gemm(f"g{i}", 1.0) for i in range(4)]
    muls = [_count(f"m{i}", "aten::mul", 4.247e9) for i in range(4)]  # 1.25 ms each
    assert all(POWERED.compute_bound(g) for g in gemms)
    assert not any(POWERED.compute_bound(m) for m in muls)
    alone = POWERED.kernel_times(gemms)
    mixed = POWERED.kernel_times(gemms + muls)
    assert mixed[4:] == [POWERED.kernel_ms(m) for m in muls]
    ratio = mixed[0] / alone[0]
    share = sum(mixed[4:]) / sum(mixed)
    assert ratio == pytest.approx(POWERED.clock_factor(share), rel=1e-3)
    assert ratio < 0.97
    plain = H200.with_(efficiency=POWERED.efficiency, fixed_us={}, kernel_us=0.0)
    assert plain.kernel_times(gemms + muls) == [plain.kernel_ms(c) for c in gemms + muls]
    p = POWERED.predict(gemms + muls, cuda_graphs=True)
    assert p.device_ms == pytest.approx(sum(mixed))


def test_the_fit_takes_each_graphs_clock_out_of_its_gemm_rates() -> None:
    """Two graphs whose GEMMs ran at the clocks their memory-bound shares left them: fitted
    with the power limit, one GEMM rate explains both graphs; fitted without it the rate is
    the two clocks' compromise and misses each graph's GEMM time."""
    from kopt.cost.calibrate import Calibration, PowerLimit

    def graph(tag: str, muls: int) -> tuple[tuple[OpCount, ...], Attribution]:
        counts = tuple([_gemm(f"{tag}g{i}", 0.5 * (1 + i % 4)) for i in range(8)]
                       + [_count(f"{tag}m{i}", "aten::mul", 4.247e9 * (1 + i % 4))
                          for i in range(muls)])
        times = POWERED.kernel_times(counts)
        return counts, Attribution("cuda", 1, {c.node: NodeCost(
            c.node, c.op, ms=t, calls=1, host_ms=0.01, min_ms=t)
            for c, t in zip(counts, times, strict=True)}, {}, 1.0)

    dense, mixed = graph("a", 1), graph("b", 16)
    limit = PowerLimit(700.0, 350.0, 1980.0, 1980.0 / 1.3)
    assert limit.throttled and not PowerLimit(700.0, 350.0, 1980.0, 1975.0).throttled
    cal = Calibration(((*dense, 10.0), (*mixed, 10.0)), (dense[1], mixed[1]), ("", ""),
                      ((1980.0 / 1.3, 690.0), (1700.0, 650.0)), (700.0, 350.0, 1980.0))
    assert cal.power_limit == limit
    again = Calibration.from_json(cal.to_json())
    assert again.power == (700.0, 350.0, 1980.0) and again.power_limit == cal.power_limit
    powered, plain = cal.fit(H200), cal.fit(H200, power=False)
    assert powered.power_limited and not plain.power_limited
    assert powered.efficiency_of(dense[0][0]) == pytest.approx(0.6, rel=1e-3)
    for counts, attribution in (dense, mixed):
        gemm_ms = sum(attribution.nodes[c.node].ms for c in counts if c.category == "gemm")

        def modelled(model: DeviceModel, counts: tuple[OpCount, ...] = counts) -> float:
            return sum(t for c, t in zip(counts, model.kernel_times(counts), strict=True)
                       if c.category == "gemm")

        assert modelled(powered) == pytest.approx(gemm_ms, rel=2e-3)
        assert abs(modelled(plain) / gemm_ms - 1) > 0.01


def test_kernels_per_op_is_the_mean_over_the_ops_nodes() -> None:
    """An op whose nodes launch one kernel or two (W1's ``_scaled_mm``: 358 and 360) counts the
    mean per node, so that a graph's predicted launches are the profiled ones; the median (2)
    counted 2218 launches per call against 1860 replayed (RESULTS.md, 2026-12-03, H200)."""
    from kopt.cost.calibrate import _kernels_per_op, _Sample
    from kopt.profile import NodeCost

    def sample(i: int, op: str, kernels: int) -> _Sample:
        count = OpCount(f"n{i}", op, "gemm", "float8_e4m3fn", 1e9, 1e7, True)
        return _Sample(count, NodeCost(f"n{i}", op, ms=0.01, calls=kernels))

    nodes = ([sample(i, "aten::_scaled_mm", 1) for i in range(3)]
             + [sample(3 + i, "aten::_scaled_mm", 2) for i in range(5)]
             + [sample(8 + i, "aten::mul", 1) for i in range(4)]
             + [sample(12 + i, "kopt::qk_norm_rope", 2) for i in range(2)])
    per_op = _kernels_per_op(nodes)
    assert per_op == {"aten::_scaled_mm": pytest.approx(13 / 8), "kopt::qk_norm_rope": 2.0}
    model = H200.with_(kernels_per_op=per_op)
    assert sum(model.launches(s.count) for s in nodes) == pytest.approx(
        sum(s.cost.calls for s in nodes))


def test_a_gemm_accumulating_fast_is_costed_faster_and_both_levers_combine() -> None:
    """FP8Config(accumulate=...) is a lever the cost model sees: a GEMM with use_fast_accum
    has its own rate key, runs FAST_ACCUM_SPEEDUP faster than the op's rate where it has no
    rate of its own, with a bias epilogue both factors apply, and a trace of fast GEMMs only
    gives the exact GEMM its rate back."""
    from kopt.cost.calibrate import _epilogue_rates
    from kopt.cost.counts import count_node
    from kopt.cost.device import EPILOGUE_SLOWDOWN, FAST_ACCUM_SPEEDUP

    aten = torch.ops.aten
    g, (a, w, sa, sw, b) = _fp8_gemm_operands()
    exact = g.call_function(aten._scaled_mm.default, (a, w, sa, sw), {"out_dtype": torch.bfloat16})
    fast = g.call_function(aten._scaled_mm.default, (a, w, sa, sw),
                           {"out_dtype": torch.bfloat16, "use_fast_accum": True})
    both = g.call_function(aten._scaled_mm.default, (a, w, sa, sw, b, None, torch.bfloat16, True))
    for n in (exact, fast, both):
        n.meta["val"] = torch.empty(64, 256, device="meta", dtype=torch.bfloat16)
    ce, cf, cb = count_node(exact), count_node(fast), count_node(both)
    assert (ce.rate_key, cf.rate_key, cb.rate_key) == (
        "aten::_scaled_mm", "aten::_scaled_mm[fast]", "aten::_scaled_mm[bias,fast]")
    speedup = FAST_ACCUM_SPEEDUP["aten::_scaled_mm"]
    slowdown = EPILOGUE_SLOWDOWN["aten::_scaled_mm"]
    assert speedup > 1
    model = H200.with_(efficiency={"aten::_scaled_mm": 0.7}, fixed_us={}, kernel_us=0.0)
    assert model.efficiency_of(cf) == pytest.approx(0.7 * speedup)
    assert model.efficiency_of(cb) == pytest.approx(0.7 * speedup / slowdown)
    assert model.kernel_ms(ce) / model.kernel_ms(cf) == pytest.approx(speedup)
    own = model.with_(efficiency={"aten::_scaled_mm": 0.7, "aten::_scaled_mm[fast]": 0.75})
    assert own.efficiency_of(cf) == 0.75  # a measured rate is kept
    assert _epilogue_rates({"aten::_scaled_mm[fast]": 0.8}) == {
        "aten::_scaled_mm": pytest.approx(0.8 / speedup)}
    assert _epilogue_rates({"aten::_scaled_mm[bias,fast]": 0.8}) == {
        "aten::_scaled_mm": pytest.approx(0.8 * slowdown / speedup)}


def test_the_ranking_prices_fast_accumulation_as_a_lever() -> None:
    """The optimized graph's FP8 GEMMs accumulate fast by default: the ranking says what that
    is predicted to save against exact accumulation; with accumulate='exact' there is no such
    lever to price (a device where FP8 wins at 256 tokens: the gate keeps the fp8 pass)."""
    cost = CostModel(SLOW_FP32.with_(efficiency={"aten::_scaled_mm": 0.7}))
    w = build("llm-tiny", seq_len=256)
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8, verify=OFF, cost=cost)
    fast = opt.report.ranking
    (lever,) = fast.levers
    gemms = sum("fast" in c.layout.split(",") for c in count_graph(opt.graph_module))
    assert lever.name == "accumulate=fast" and lever.sites == gemms > 0
    assert lever.saved_ms > 0 and "lever: predicted to save" in fast.format()
    exact = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16, accumulate="exact"))
    assert kopt.optimize(w.model, w.args, w.kwargs, exact, verify=OFF,
                         cost=cost).report.ranking.levers == ()
