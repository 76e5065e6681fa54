"""Common-subexpression elimination on the functional graph.

    # f(a, b) ... f(a, b)  ->  one f(a, b)

Models recompute the same value in several places: every block of a DiT applies SiLU to the same
timestep embedding before its own modulation linear, so the modulation projections of all blocks
read *different* nodes. After CSE they read one node, and the merge pass can see them as parallel
projections of one activation.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from torch import fx

from kopt.graph.splice import eliminate_dead
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.collectives import NOT_DEDUPLICATED, is_collective
from kopt.patterns.core import exact


def _freeze(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return (type(x).__name__, tuple(_freeze(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in x.items())))
    hash(x)  # raises TypeError for values CSE cannot key on
    if isinstance(x, float):
        return ("float", x, repr(x))  # keeps 0.0 and -0.0 apart
    return (type(x).__name__, x)


def _pure(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or node.is_impure():
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return False
    return True


class EliminateCommonSubexpressions(Pass):
    name = "cse"
    numerics = exact("identical pure ops on identical inputs compute identical values")

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        seen: dict[Any, fx.Node] = {}
        removed: list[str] = []
        skipped: Counter[str] = Counter()
        for node in list(gm.graph.nodes):
            if not _pure(node):
                continue
            try:
                key = (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))
            except TypeError:
                skipped["argument not hashable"] += 1
                continue
            first = seen.get(key)
            if first is None:
                seen[key] = node
                continue
            if sites is not None and node.name not in sites:
                continue
            if is_collective(node):
                skipped[NOT_DEDUPLICATED] += 1
                continue
            node.replace_all_uses_with(first)
            removed.append(node.name)
        eliminate_dead(gm)
        return PassResult(self.name, len(removed), dict(skipped), before, count_nodes(gm),
                          time.perf_counter() - t0, sites=tuple(removed))
