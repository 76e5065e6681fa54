"""Dependency analysis: which graph inputs each node's value depends on.

A node that depends on no placeholder depends only on parameters and buffers: it is a load-time
constant. A node that depends only on step-invariant inputs (timestep, guidance) can be hoisted
out of the per-call work. Both questions are answered from the same dependency sets.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import fx


def dependency_sets(graph: fx.Graph) -> dict[fx.Node, frozenset[str]]:
    """For every node, the names of the placeholders its value depends on (transitively).

    One pass in topological order; a node's set is the union of its inputs' sets.
    """
    deps: dict[fx.Node, frozenset[str]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            deps[node] = frozenset((node.name,))
            continue
        acc: frozenset[str] = frozenset()
        for inp in node.all_input_nodes:
            acc = acc | deps[inp]
        deps[node] = acc
    return deps


def constant_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computable at load time: they read parameters/buffers and no placeholder.

    Nodes with side effects (``is_impure``) and the output node are never constants.
    """
    deps = dependency_sets(graph)
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            out.add(node)
        elif node.op == "call_function" and not deps[node] and not is_effectful(node):
            if all(inp in out for inp in node.all_input_nodes):
                out.add(node)
    return out


def is_effectful(node: fx.Node) -> bool:
    # A random op with constant inputs is not a constant: folding it would freeze one draw.
    tags = getattr(node.target, "tags", ())
    return node.is_impure() or torch.Tag.nondeterministic_seeded in tags


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The data-flow graph as a networkx DiGraph (edges producer -> consumer), keyed by node."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for inp in node.all_input_nodes:
            g.add_edge(inp, node)
    return g
