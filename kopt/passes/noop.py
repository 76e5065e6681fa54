"""Remove copies that only exist because the graph is functional.

    # clone(x) -> x          (x dense: the copy has x's strides; nothing mutates either)
    # dropout(x, p, False) -> x

``torch.export`` traces ``F.dropout(x, p, training=False)`` -- every dropout of a model in eval
mode -- as ``aten.clone``: a full read and write of the activation that eager mode never does
(dropout returns its input). On Qwen-Image at 1024x1024 the copies after the attention and
feed-forward outputs cost 3.6 ms per forward on an H200 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import time

import torch
from torch import fx

from kopt.graph.splice import eliminate_dead
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.core import exact

aten = torch.ops.aten


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a preserve-format copy of it has the same strides."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def noop_input(node: fx.Node) -> fx.Node | str | None:
    """The node a no-op copy can be replaced by, or the reason it cannot (None: not a copy)."""
    if node.op != "call_function":
        return None
    if node.target is aten.dropout.default:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        return node.args[0] if train is False else "dropout in training mode"
    if node.target is aten.alias.default:
        return node.args[0]
    if node.target is not aten.clone.default:
        return None
    src = node.args[0]
    fmt = node.kwargs.get("memory_format")
    if fmt not in (None, torch.preserve_format):
        return "clone changes the memory format"
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return None
    if not _dense(src.meta["val"]):
        return "input is not dense: the copy changes strides"
    if src.op in ("placeholder", "get_attr") or any(u.op == "output" for u in node.users):
        return "copy separates a graph input/output from the caller's tensor"
    return src


class RemoveNoOps(Pass):
    name = "remove_noops"
    numerics = exact("a copy of a value is the value")

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        removed: list[str] = []
        rejected: dict[str, int] = {}
        for node in list(gm.graph.nodes):
            found = noop_input(node)
            if found is None or (sites is not None and node.name not in sites):
                continue
            if isinstance(found, str):
                rejected[found] = rejected.get(found, 0) + 1
                continue
            node.replace_all_uses_with(found)
            removed.append(node.name)
        eliminate_dead(gm)
        return PassResult(self.name, len(removed), rejected, before, count_nodes(gm),
                          time.perf_counter() - t0, sites=tuple(removed))
