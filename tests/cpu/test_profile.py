"""Profiler attribution (kopt/profile.py, `kopt profile`): every op the optimized graph runs is
attributed to the node that ran it, FLOPs per node add up to the whole graph's, and the CLI
writes a trace Perfetto can open."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

import kopt
from kopt.capture import flatten_inputs
from kopt.cli import main
from kopt.models import build
from kopt.profile import profile_graph


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
