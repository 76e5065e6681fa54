"""Graph surgery: copying, inlining a traced subgraph, adding constants, dead-code removal."""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from kopt.graph.query import fake_mode_of

try:  # FX's graph module that generates its code when first needed (torch >= 2.2)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _LAZY
except ImportError:  # pragma: no cover -- a torch without it: the eager code generation
    _LAZY = fx.GraphModule

# Attributes kopt adds to a graph module (packed weights, folded constants) carry this prefix.
KOPT_PREFIX = "_kopt_"


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copied graph that shares the attributes (weights) of ``gm``.

    Cheap enough to snapshot a graph before every pass: no tensor is copied, and its Python
    code is generated when it is first called or read (FX's lazy graph module, as Inductor
    uses), not at every edit: W1's 11650-node graph took 1.2 s per code generation, 31 of them
    in one optimization (on the meta device, 2 CPU cores: 70.7 s against 39.7 s lazily,
    ``benchmarks/probes/optimize_time.py``; RESULTS.md, 2026-12-03).
    """
    graph = fx.Graph(owning_module=None, tracer_cls=gm.graph._tracer_cls)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    new = _LAZY(gm, graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    for name in _program_attributes(gm):  # read by a load program only: kept too
        if not hasattr(new, name) and hasattr(gm, name):
            new.register_buffer(name, getattr(gm, name), persistent=False)
    return new


def _program_attributes(gm: fx.GraphModule) -> set[str]:
    """kopt-made attributes the load programs (``kopt.passes.fold``) write or read: one
    folded after another reads its constants, and re-packing writes them again."""
    return {s for p in gm.meta.get("kopt_load_programs", ()) for s in (*p.sources, *p.targets)
            if s.startswith(KOPT_PREFIX)}


def eliminate_dead(gm: fx.GraphModule) -> None:
    remove_dead_code(gm.graph)
    prune_unused_attributes(gm)
    gm.recompile()


def remove_dead_code(graph: fx.Graph) -> bool:
    """What ``graph.eliminate_dead_code()`` does, with each op's purity looked up once per op
    and without its lint.

    FX lints the whole graph first and asks every node, dead or not, whether it is impure; for
    an aten op the answer is a schema walk and an effects-table lookup each time, and the passes
    remove dead code about 20 times on a graph of W1's 11650 nodes. An ``OpOverload``'s purity
    depends on the op alone (its schema, its tags, the effects table), so it is remembered per
    op, and only nodes nothing reads are asked. The lint (are the nodes in order) is the
    pipeline's, after every pass. Subgraphs that ``get_attr`` nodes read (a higher-order op's
    branches) are cleaned too, as FX does."""
    impure_random = True  # as FX decides it: random ops may go where Inductor's config says
    if TracingContext.try_get():
        from torch._inductor import config as inductor_config
        impure_random = inductor_config.fallback_random
    changed = False
    for node in reversed(graph.nodes):
        if node.users or node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            key = (node.target, impure_random)
            impure = _IMPURE.get(key)
            if impure is None:
                impure = _IMPURE[key] = node.is_impure(impure_random)
        else:
            impure = node.is_impure(impure_random)
        if not impure:
            graph.erase_node(node)
            changed = True
    owner = graph.owning_module
    if owner is not None:
        read = {n.target for n in graph.find_nodes(op="get_attr")}
        for name, child in owner.named_children():
            if name in read and isinstance(child, fx.GraphModule):
                changed |= remove_dead_code(child.graph)
                child.recompile()
    return changed


_IMPURE: dict[tuple[torch._ops.OpOverload, bool], bool] = {}


def prune_unused_attributes(gm: fx.GraphModule) -> None:
    """Drop kopt-made attributes that no ``get_attr`` node reads any more (nodes of submodule
    graphs such as hoisted regions count: they share the attribute's tensor and name), nor a
    load program (``kopt.passes.fold``: one folded after another reads its constants, and
    re-packing runs it again)."""
    used = {n.target for m in gm.modules() if isinstance(m, fx.GraphModule)
            for n in m.graph.nodes if n.op == "get_attr"}
    used.update(s for p in gm.meta.get("kopt_load_programs", ()) for s in p.sources)
    # (a program's target no program reads and no node reads is dropped: re-packing skips it)
    for name in [name for name, _ in gm.named_buffers(recurse=False)]:
        if name.startswith(KOPT_PREFIX) and name not in used:
            delattr(gm, name)


def add_constant(gm: fx.GraphModule, value: torch.Tensor, hint: str) -> fx.Node:
    """Store ``value`` on ``gm`` under a fresh name and return a ``get_attr`` node reading it.

    The node is placed before the first non-placeholder node, so every user can see it.
    """
    base = KOPT_PREFIX + "".join(c if c.isalnum() else "_" for c in hint)
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.register_buffer(name, value, persistent=False)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(name)
    node.meta["val"] = fake_mode_of(gm).from_tensor(value, static_shapes=True)
    return node


def infer_meta(gm: fx.GraphModule, node: fx.Node) -> None:
    """Compute ``node.meta["val"]`` by running its target on the fake values of its inputs."""
    mode = fake_mode_of(gm)

    def to_fake(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = pytree.tree_map(to_fake, node.args)
    kwargs = pytree.tree_map(to_fake, node.kwargs)
    node.meta["val"] = fake_call(mode, node.target, args, kwargs)


# (target, inputs' metadata) -> the outputs' metadata, per fake mode: see :func:`fake_call`
_OUTPUTS_BY_MODE: weakref.WeakKeyDictionary[FakeTensorMode, dict[tuple, Any]] = \
    weakref.WeakKeyDictionary()
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


def fake_call(mode: FakeTensorMode, target: Any, args: Sequence[Any] = (),
              kwargs: Mapping[str, Any] | None = None) -> Any:
    """``target(*args, **kwargs)`` on fake tensors in ``mode``, remembered by the inputs'
    metadata for functional ops (no input written, no output aliasing an input).

    The passes build the same call for every instance of a repeated block (W1: 60 blocks, each
    with 8 FP8 linears), and the fake mode's own cache hashes each call's arguments anew. For an
    op whose outputs are fresh tensors, equal shapes, strides, dtypes and devices in (and equal
    Python arguments) give equal metadata out, so a remembered call makes new fake tensors of
    that metadata instead of running the op's fake implementation again. The inputs' storage
    offsets count only modulo 16 elements (their alignment): each block's slice of a merged
    projection's output starts elsewhere, and a functional op's outputs do not depend on where
    its inputs start. (Views are not remembered: remaking one with ``as_strided`` costs the
    fake mode as much as the view op itself.)"""
    kwargs = dict(kwargs or {})
    key = _call_key(target, args, kwargs)
    memo = _OUTPUTS_BY_MODE.setdefault(mode, {}) if key is not None else None
    if memo is not None and key in memo:
        spec, leaves = memo[key]
        made = [fresh_fake(mode, *leaf[1:5]) if isinstance(leaf, tuple) and leaf[:1] == ("T",)
                else leaf for leaf in leaves]
        return pytree.tree_unflatten(made, spec)
    with mode:
        out = target(*args, **kwargs)
    if memo is not None:
        leaves, spec = pytree.tree_flatten(out)
        described = [_describe(leaf) for leaf in leaves]
        if all(leaf is None or (d is not None and (not isinstance(leaf, torch.Tensor)
                                                   or d[5] == 0))  # fresh outputs only
               for d, leaf in zip(described, leaves, strict=True)):
            memo[key] = (spec, described)
    return out


def fresh_fake(mode: FakeTensorMode, shape: Sequence[int], stride: Sequence[int],
               dtype: torch.dtype, device: torch.device) -> FakeTensor:
    """A new fake tensor of ``mode`` with its own storage, as ``torch.empty_strided`` under the
    mode makes one, but made directly from a meta tensor: dispatching through the mode costs
    several times as much, and the passes make one per output of every remembered call."""
    return FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"),
                      device)


def _describe(x: Any, align: bool = False) -> Any:
    """A fake tensor's (``"T"``, shape, stride, dtype, device, storage offset; with ``align``,
    the offset modulo 16); a plain value as it is; None for anything else (symbolic sizes,
    other objects: not remembered)."""
    if isinstance(x, torch.Tensor):
        if not isinstance(x, FakeTensor) or any(
                not isinstance(d, int) for d in (*x.shape, *x.stride(), x.storage_offset())):
            return None
        offset = x.storage_offset() % 16 if align else x.storage_offset()
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, offset)
    return x if isinstance(x, _PLAIN) else None


def _call_key(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple | None:
    """The memo key of a functional op's call, None where the call is not remembered."""
    if not isinstance(target, torch._ops.OpOverload) or not _functional(target):
        return None
    leaves, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    described = []
    for leaf in leaves:
        d = _describe(leaf, align=True)
        if d is None and leaf is not None:
            return None
        described.append(d)
    return (target, str(spec), tuple(described))


_FUNCTIONAL: dict[torch._ops.OpOverload, bool] = {}


def _functional(op: torch._ops.OpOverload) -> bool:
    """No argument written or aliased by an output, and no nondeterministic or random op."""
    known = _FUNCTIONAL.get(op)
    if known is None:
        schema = op._schema
        known = (not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
                 and torch.Tag.nondeterministic_seeded not in op.tags)
        _FUNCTIONAL[op] = known
    return known


def inline_graph(
    gm: fx.GraphModule,
    sub: fx.Graph,
    inputs: Mapping[str, Any],
    before: fx.Node,
) -> list[Any]:
    """Copy the nodes of ``sub`` into ``gm.graph`` before ``before``.

    ``inputs`` maps each placeholder name of ``sub`` to a node (or Python value) of ``gm``.
    Returns the copied values of ``sub``'s outputs, flattened. Metadata (``val``) is copied.
    """
    env: dict[fx.Node, Any] = {}
    outputs: Sequence[Any] = ()
    with gm.graph.inserting_before(before):
        for node in sub.nodes:
            if node.op == "placeholder":
                env[node] = inputs[node.name]
            elif node.op == "output":
                outputs = pytree.tree_leaves(node.args[0])
            elif node.op == "get_attr":
                raise ValueError(f"replacement graphs may not read attributes ({node.target})")
            else:
                new = gm.graph.node_copy(node, lambda n: env[n])
                new.meta = dict(node.meta)
                env[node] = new
    return [env[o] if isinstance(o, fx.Node) else o for o in outputs]


def stable_topo_sort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the existing order otherwise.

    Rewrites insert replacements at their anchor; a replacement output whose users sit earlier
    in the graph (a multi-output pattern) or an input defined later (a weight transposed next to
    its use) is put right by this.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    if all(order[i] < order[n] for n in graph.nodes for i in n.all_input_nodes):
        return
    indegree = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    ready = [(order[n], n.name) for n in graph.nodes if indegree[n] == 0]
    by_name = {n.name: n for n in graph.nodes}
    heapq.heapify(ready)
    sorted_nodes: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        node = by_name[name]
        sorted_nodes.append(node)
        for user in node.users:
            indegree[user] -= 1
            if indegree[user] == 0:
                heapq.heappush(ready, (order[user], user.name))
    if len(sorted_nodes) != len(order):
        raise RuntimeError("graph has a cycle after rewriting")
    cursor = sorted_nodes[0]
    first = next(iter(graph.nodes))
    if first is not cursor:
        first.prepend(cursor)
    for node in sorted_nodes[1:]:
        cursor.append(node)
        cursor = node
