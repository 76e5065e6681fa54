"""Parallel projections: N >= 2 GEMMs reading the same activation become one GEMM.

    # x@Wq.T+bq, x@Wk.T+bk, x@Wv.T+bv  ->  split(x@[Wq;Wk;Wv].T + [bq;bk;bv])

Q/K/V of an attention stream, gate/up of an MLP, the per-block modulation linears reading the
same embedding: wherever several ``aten.linear`` (weight [out, in]) or ``aten.matmul`` / ``aten.mm``
(weight [in, out]) nodes take the same activation and a load-time-constant weight. The weight
and bias concatenations depend only on parameters, so the constant-folding pass evaluates them
once at load time; per call there is one GEMM and a split into views.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

from kopt.graph import compact_paths, constant_nodes, infer_meta, module_path, tensor_meta
from kopt.patterns.collectives import partial_sum_nodes
from kopt.patterns.core import Match, Rejection, StructuralRewrite, tolerance

aten = torch.ops.aten

_LINEAR = aten.linear.default
_MATMULS = (aten.matmul.default, aten.mm.default)


@dataclass(frozen=True)
class _Projection:
    node: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    kind: str  # "linear": weight is [out, in]; "matmul": weight is [in, out]

    @property
    def out_features(self) -> int:
        w = tensor_meta(self.weight)
        return int(w.shape[0] if self.kind == "linear" else w.shape[1])


def _as_projection(node: fx.Node) -> _Projection | None:
    if node.op != "call_function":
        return None
    if node.target is _LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return _Projection(node, node.args[1], bias, "linear")
    if node.target in _MATMULS and isinstance(node.args[1], fx.Node):
        if tensor_meta(node.args[1]).dim() == 2:
            return _Projection(node, node.args[1], None, "matmul")
    return None


def find_parallel_projections(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    """Group projections by the activation they read; yield a Match per mergeable group."""
    consts = constant_nodes(gm.graph)
    # tensor parallelism: row-parallel projections (partial sums) merge only with each other
    partial = partial_sum_nodes(gm.graph)
    by_input: dict[fx.Node, list[_Projection]] = defaultdict(list)
    for node in gm.graph.nodes:
        proj = _as_projection(node)
        if proj is not None and isinstance(node.args[0], fx.Node):
            by_input[node.args[0]].append(proj)
    for x, projs in by_input.items():
        if len(projs) < 2:
            for p in projs:
                yield Rejection(NAME, p.node.name,
                                f"no other projection reads its input {x.name}", near_miss=True)
            continue
        groups: dict[tuple, list[_Projection]] = defaultdict(list)
        for p in projs:
            if p.weight not in consts:
                yield Rejection(NAME, p.node.name,
                                "weight is computed per call, not a load-time constant")
                continue
            if p.bias is not None and p.bias not in consts:
                yield Rejection(NAME, p.node.name,
                                "bias is computed per call, not a load-time constant")
                continue
            w = tensor_meta(p.weight)
            b = tensor_meta(p.bias) if p.bias is not None else None
            key = (p.kind, w.dtype, w.device, b is not None, b.dtype if b is not None else None,
                   p.node in partial)
            groups[key].append(p)
        for key, members in groups.items():
            if len(members) >= 2:
                first = members[0].node
                yield Match(NAME, first, tuple(m.node for m in members),
                            {"input": x, "kind": key[0], "projections": members})
                continue
            others = [k for k in groups if k != key]
            if others:
                yield Rejection(NAME, members[0].node.name, _mismatch_reason(key, others[0]))


def _mismatch_reason(key: tuple, other: tuple) -> str:
    kind, dtype, device, has_bias, _, partial = key
    okind, odtype, odevice, ohas_bias, _, opartial = other
    if partial != opartial:
        return ("sharded differently: a row-parallel projection (its output is a partial sum, "
                "all-reduced later) next to projections whose outputs are complete on this rank"
                if partial else "sharded differently: the other projections of this input are "
                "row-parallel (their outputs are partial sums, all-reduced later)")
    if kind != okind:
        return f"{kind} projection next to {okind} projections of the same input"
    if dtype != odtype:
        return f"weight dtype {dtype} differs from the other projections' {odtype}"
    if device != odevice:
        return f"weight on {device}, the other projections' on {odevice}"
    if has_bias != ohas_bias:
        return "bias/no-bias mismatch with the other projections of the same input"
    return "bias dtype differs from the other projections'"


def merge_parallel_projections(gm: fx.GraphModule, match: Match) -> None:
    projs: list[_Projection] = match.bindings["projections"]
    x: fx.Node = match.bindings["input"]
    kind: str = match.bindings["kind"]
    g = gm.graph
    sizes = [p.out_features for p in projs]
    with g.inserting_before(projs[0].node):
        w_cat = g.call_function(aten.cat.default, ([p.weight for p in projs], 0 if
                                                   kind == "linear" else 1))
        infer_meta(gm, w_cat)
        if kind == "linear":
            b_cat = None
            if projs[0].bias is not None:
                b_cat = g.call_function(aten.cat.default, ([p.bias for p in projs], 0))
                infer_meta(gm, b_cat)
            merged = g.call_function(_LINEAR, (x, w_cat, b_cat))
        else:
            merged = g.call_function(projs[0].node.target, (x, w_cat))
        infer_meta(gm, merged)
        merged.meta["kopt_from"] = describe_merge(match).split(": ", 1)[-1]
        parts = g.call_function(aten.split_with_sizes.default, (merged, sizes, -1))
        infer_meta(gm, parts)
        for i, p in enumerate(projs):
            piece = g.call_function(operator.getitem, (parts, i))
            piece.meta["val"] = parts.meta["val"][i]
            p.node.replace_all_uses_with(piece)
            _views_to_reshapes(gm, piece)
    for p in projs:
        g.erase_node(p.node)


# ops whose output is their input's values rearranged, as a view where the strides allow
_MOVEMENTS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.unflatten.int, aten.split.Tensor, aten.split_with_sizes.default, aten.alias.default,
    operator.getitem,
})
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _views_to_reshapes(gm: fx.GraphModule, piece: fx.Node) -> None:
    """A projection's output was contiguous; its piece of the merged output is a column slice.
    A ``view`` after it (directly or through other rearrangements) that merged dimensions across
    the rows would now fail: it becomes ``reshape``, the same values, a view wherever one is
    possible and a copy where not."""
    todo = [piece]
    while todo:
        node = todo.pop()
        for user in list(node.users):
            if user.op != "call_function" or user.target not in _MOVEMENTS:
                continue
            if user.target in _VIEWS:
                user.target = aten.reshape.default
            infer_meta(gm, user)
            todo.append(user)


def describe_merge(match: Match) -> str:
    """``blocks.0.attn.{to_q,to_k,to_v}`` -- the merged modules in a few words
    (:func:`kopt.graph.query.compact_paths`)."""
    paths = [module_path(p.node) or p.node.name for p in match.bindings["projections"]]
    return f"{len(paths)} projections of {match.bindings['input'].name}: {compact_paths(paths)}"


NAME = "merge_projections"

MERGE_PROJECTIONS = StructuralRewrite(
    name=NAME,
    matcher=find_parallel_projections,
    applier=merge_parallel_projections,
    numerics=tolerance(
        "one wider GEMM may be run by a different kernel or blocking than the N narrow ones, so "
        "the order of the K-reduction can change; each output element is still one dot product "
        "of the same operands (bitwise equal where the backend keeps the blocking)"
    ),
    benefit=10,
    description="x@Wq, x@Wk, x@Wv -> split(x@[Wq;Wk;Wv])",
    describer=describe_merge,
)
