"""Profiler attribution: which FX node of an optimized graph spent the time.

:func:`profile_graph` runs a graph module under ``torch.profiler`` with every node's execution
wrapped in a ``record_function`` range named after the node; each aten/kopt op event (CPU) and
each device kernel (CUDA: the kernels the profiler links to their launching CPU event) is then
attributed to the innermost node range around it. Whatever ran outside any node (the graph's
own Python, a hoisted region's cache check) is reported as unattributed, never dropped.

Each node also gets its FLOPs (``torch.utils.flop_counter``, per op) and the bytes it reads and
writes (its tensors' sizes), so a report can say how close a node came to the device's peak
rate or bandwidth.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

PREFIX = "kopt::node::"
# op events the attribution counts: what the graph's nodes dispatch to (aten and kopt's ops)
_OP_PREFIXES = ("aten::", "kopt::", "prims::")


@dataclass
class NodeCost:
    name: str
    op: str
    ms: float = 0.0  # per call: device kernel time on CUDA, op self time on the CPU
    calls: int = 0  # op events (CPU) or kernels (CUDA) per call
    flops: int = 0
    bytes: int = 0

    def rates(self) -> tuple[float, float]:
        """(TFLOP/s, GB/s) achieved, 0 where no time was measured."""
        if self.ms <= 0:
            return 0.0, 0.0
        return self.flops / self.ms / 1e9, self.bytes / self.ms / 1e6


@dataclass
class Attribution:
    device: str
    iters: int
    nodes: dict[str, NodeCost] = field(default_factory=dict)
    unattributed: dict[str, float] = field(default_factory=dict)  # event name -> ms per call
    total_ms: float = 0.0  # wall time per call

    @property
    def attributed_ms(self) -> float:
        return sum(n.ms for n in self.nodes.values())

    def top(self, n: int = 20) -> list[NodeCost]:
        return sorted(self.nodes.values(), key=lambda c: -c.ms)[:n]

    def format(self, n: int = 20) -> str:
        busy = self.attributed_ms + sum(self.unattributed.values())
        lines = [f"profile ({self.device}, {self.iters} calls): {self.total_ms:.3f} ms per call, "
                 f"{busy:.3f} ms in ops/kernels ({self.attributed_ms:.3f} attributed to "
                 f"{sum(1 for c in self.nodes.values() if c.ms > 0)} nodes)",
                 f"  {'node':40s} {'op':28s} {'ms':>9s} {'share':>6s} {'TFLOP/s':>8s} "
                 f"{'GB/s':>8s}"]
        for c in self.top(n):
            tf, gbs = c.rates()
            lines.append(f"  {c.name[:40]:40s} {c.op[:28]:28s} {c.ms:9.4f} "
                         f"{c.ms / busy if busy else 0:6.1%} {tf:8.2f} {gbs:8.1f}")
        if self.unattributed:
            worst = sorted(self.unattributed.items(), key=lambda kv: -kv[1])[:5]
            lines.append("  unattributed: " + ", ".join(f"{k} {v:.4f} ms" for k, v in worst))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "iters": self.iters, "total_ms": self.total_ms,
                           "nodes": {k: vars(v) for k, v in self.nodes.items()},
                           "unattributed": self.unattributed}, indent=1)


class _Annotated(fx.Interpreter):
    """Runs the graph with a profiler range around every node that computes something."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module"):
            with record_function(PREFIX + n.name):
                return super().run_node(n)
        return super().run_node(n)


def _op_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module:{n.target}"
    return getattr(n.target, "__name__", str(n.target))


def _static_costs(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[str, NodeCost]:
    """FLOPs and bytes of every computing node, from one run with a FLOP counter per node."""
    costs: dict[str, NodeCost] = {}

    class Count(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(n)
            with FlopCounterMode(display=False) as fc:
                out = super().run_node(n)
            args = [a for a in tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)]
            moved = sum(_nbytes(self.env[a]) for a in args if a in self.env) + _nbytes(out)
            costs[n.name] = NodeCost(n.name, _op_name(n), flops=fc.get_total_flops(),
                                     bytes=moved)
            return out

    with torch.no_grad():
        Count(gm).run(*inputs)
    return costs


def _nbytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(v) if isinstance(t, torch.Tensor))


def _enclosing_node(e: Any) -> str | None:
    p = e
    while p is not None:
        if p.name.startswith(PREFIX):
            return p.name[len(PREFIX):]
        p = p.cpu_parent
    return None


def profile_graph(gm: fx.GraphModule, inputs: Sequence[Any], iters: int = 3,
                  trace: str | Path | None = None) -> Attribution:
    """Attribute the time of ``iters`` calls of ``gm(*inputs)`` to its nodes (after one warm-up
    call). ``trace``: also write the profiler's Chrome/Perfetto trace there."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs)
    runner = _Annotated(gm)
    with torch.no_grad():
        runner.run(*inputs)  # warm-up: autotuning, allocator, caches
    # counted after the warm-up, like the profiled calls: a hoisted region that hits its cache
    # does no work in either
    costs = _static_costs(gm, inputs)
    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            t0 = time.perf_counter()
            if start is not None:
                start.record()
            for _ in range(iters):
                runner.run(*inputs)
            if end is not None:
                end.record()
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        total = start.elapsed_time(end) if start is not None else wall
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    result = Attribution("cuda" if cuda else "cpu", iters, costs, {}, total / iters)
    unattributed: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.name.startswith(PREFIX):
            continue
        if cuda:
            ms = sum(k.duration for k in e.kernels) / 1e3 / iters
            if not e.kernels:
                continue
        else:
            if not e.name.startswith(_OP_PREFIXES):
                continue
            ms = e.self_cpu_time_total / 1e3 / iters
        node = _enclosing_node(e)
        if node is None or node not in result.nodes:
            unattributed[e.name] += ms
            continue
        cost = result.nodes[node]
        cost.ms += ms
        cost.calls += len(e.kernels) if cuda else 1
    for c in result.nodes.values():
        c.calls = round(c.calls / iters)
    result.unattributed = dict(unattributed)
    return result
