"""Profiler attribution (kopt/profile.py, `kopt profile`): every op the optimized graph runs is
attributed to the node that ran it, FLOPs per node add up to the whole graph's, and the CLI
writes a trace Perfetto can open."""

from __future__ import annotations

import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import kopt
from kopt.capture import flatten_inputs
from kopt.cli import main
from kopt.models import build
from kopt.profile import Attribution, host_times, profile_graph


def test_every_op_is_attributed_to_a_node_and_flops_add_up() -> None:
    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs, verify=kopt.VerifyOptions(enabled=False))
    gm = opt.graph_module
    flat = flatten_inputs(w.args, w.kwargs)[0]
    a = profile_graph(gm, flat, iters=2)
    assert a.device == "cpu" and a.unattributed == {}
    computing = {n.name for n in gm.graph.nodes if n.op in ("call_function", "call_module")}
    assert set(a.nodes) == computing
    timed = [c for c in a.nodes.values() if c.ms > 0]
    assert len(timed) > 20 and 0 < a.attributed_ms <= a.total_ms
    # the fused ops and the GEMMs are where the time goes, and they are named as such
    ops = {c.op for c in a.top(10)}
    assert ops & {"rowwise.default", "linear.default", "scaled_dot_product_attention.default"}
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        gm(*flat)
    assert sum(c.flops for c in a.nodes.values()) == fc.get_total_flops() > 0
    assert all(c.bytes > 0 for c in timed)


def test_cli_profile_prints_the_top_nodes_and_writes_trace_and_json(tmp_path, capsys) -> None:  # noqa: ANN001
    trace, out = tmp_path / "trace.json", tmp_path / "attribution.json"
    rc = main(["profile", "-q", "--no-verify", "--top", "5", "--trace", str(trace),
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "profile (cpu, 3 calls)" in text and "attributed to" in text
    assert "traceEvents" in json.loads(trace.read_text())
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["nodes"] and data["unattributed"] == {}


def test_op_categories() -> None:
    from kopt.graph import op_category

    table = {
        "aten::mm": "gemm", "aten::addmm": "gemm", "aten::bmm": "gemm", "aten::linear": "gemm",
        "aten::_scaled_mm": "gemm", "kopt::fp8_gemm": "gemm", "kopt::fp8_blockwise_mm": "gemm",
        "kopt::bf16_gemm": "gemm",
        "aten::scaled_dot_product_attention": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "aten::_scaled_dot_product_cudnn_attention": "attention",
        "kopt::quant_fp8_rowwise": "quantization", "kopt::quant_fp8_group": "quantization",
        "kopt::act_quant_fp8_rowwise": "quantization",
        "kopt::rowwise": "elementwise", "kopt::qk_norm_rope": "elementwise",
        "aten::add": "elementwise", "aten::layer_norm": "elementwise",
        "aten::mm_like": "elementwise",
    }
    assert {name: op_category(name) for name in table} == table


def test_categories_split_the_call_and_add_up_to_the_wall_time() -> None:
    """With FP8 on, the LLM's time falls into all four categories plus launch gaps; every
    category's time is that of its nodes (a node's op decides), and the parts sum to the wall
    time per call."""
    from kopt.graph import CATEGORIES
    from kopt.profile import GAPS

    w = build("llm-tiny")
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))
    opt = kopt.optimize(w.model, w.args, w.kwargs, config,
                        verify=kopt.VerifyOptions(enabled=False))
    gm = opt.graph_module
    a = profile_graph(gm, flatten_inputs(w.args, w.kwargs)[0], iters=2)
    cats = {c.name: c for c in a.categories()}
    assert list(cats) == [*CATEGORIES, GAPS]
    assert all(cats[name].ms > 0 for name in CATEGORIES)
    for name in CATEGORIES:
        members = [c for c in a.nodes.values() if c.category == name]
        assert abs(cats[name].ms - sum(c.ms for c in members)) < 1e-9
        assert cats[name].flops == sum(c.flops for c in members)
    assert {c.op for c in a.nodes.values() if c.category == "gemm"} >= {"_scaled_mm.default"}
    assert {c.op for c in a.nodes.values() if c.category == "quantization"} >= {
        "act_quant_fp8_rowwise.default"}
    assert cats["attention"].flops == 0  # FlopCounterMode counts no CPU attention kernel
    assert abs(sum(c.ms for c in cats.values()) - a.total_ms) < 1e-6 * a.total_ms
    assert cats[GAPS].ms == a.total_ms - a.busy_ms > 0
    # each node's least call is at most its mean, and on the CPU its host time is its time
    timed = [c for c in a.nodes.values() if c.ms > 0]
    assert all(0 < c.min_ms <= c.ms + 1e-12 and c.host_ms == c.ms for c in timed)
    text = a.format(5)
    assert all(name in text for name in (*CATEGORIES, GAPS))


def _slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.003)  # 3 ms of host time, no device work
    return x + 1


torch.fx.wrap("_slow")


def test_host_times_per_node_without_the_profiler() -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _slow(x * 2).sum()

    gm = torch.fx.symbolic_trace(M())
    times = host_times(gm, [torch.randn(8)], iters=3)
    names = {n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert set(times) == names and all(t >= 0 for t in times.values())
    assert 3.0 <= times["_slow"] < 50.0
    assert all(t < 1.0 for name, t in times.items() if name != "_slow")
    # an attribution saved and read back is the same
    a = profile_graph(gm, [torch.randn(8)], iters=1)
    b = Attribution.from_json(a.to_json())
    assert b.nodes == a.nodes and b.total_ms == a.total_ms and b.category_ms == a.category_ms
