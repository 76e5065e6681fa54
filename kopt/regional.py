"""Inductor compiles each kind of repeated block once: the optimized graph's blocks outlined.

Inductor's time grows with the graph's nodes: W1's optimized graph (7.4k nodes, 60 blocks)
takes it 30-55 s on an H100, the same lowering and code made 60 times over.
:func:`outline_blocks` finds the blocks, makes one graph of each kind of block (its operands:
every weight and activation the block reads) and hands it to a compiler once; each site then
calls that kind's compiled code through ``kopt::block``, an op whose outputs' shapes are known
without running it, so that what compiles the outer graph (Inductor again) traces a block site
as one opaque call. Torch's own ``invoke_subgraph`` would share the lowering too, but its
tracing runs every site's graph again on fake tensors where the graph holds custom ops
(FakeTensor's cache takes only ``aten`` ops): on a 60-block tiny Qwen-Image it halved
Inductor's time where this cuts it 3.4-fold (RESULTS.md, 2026-12-07, CPU). The graph computes
what it computed (with ``compile=None`` each kind runs its graph as is: bitwise the same);
Inductor's fusions across a block's boundary are lost, and a block's outputs that share memory
with an operand or with each other, or that come back in other strides than the graph had, are
copied (an op's outputs are its own, in the layout its fake kernel declared).

A block is found by structure: the capture records on each node the module list child it was
traced in (``nn_module_stack``); the nodes the passes made carry no module and are placed by
what they read and what reads them (:func:`_blocks`; an op fused across two blocks' boundary
goes to the later). A block is outlined only where its nodes form a convex region (no outside
node both reads from and feeds into it), compute without writing in place, and read from
outside only tensors and plain values; blocks outlined together have the same code node for
node and the same operand shapes, strides and dtypes.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.tools_common import legalize_graph

from kopt.graph.query import attr
from kopt.repeated import _list_child

# fewer sites of one block than this are left inline: sharing saves nothing
MIN_SITES = 2


@dataclass(eq=False)
class Kind:
    """One kind of block: its graph, the code each site runs, and its outputs' layouts."""

    graph: fx.GraphModule
    run: Callable[..., Any]
    outputs: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]]
    sites: int
    id: int = -1


# kind id -> Kind, while something (the outlined graph's compiled code) holds it
_KINDS: weakref.WeakValueDictionary[int, Kind] = weakref.WeakValueDictionary()
_IDS = itertools.count()


@torch.library.custom_op("kopt::block", mutates_args=())
def _block(xs: list[torch.Tensor], kind: int) -> list[torch.Tensor]:
    k = _KINDS[kind]
    outs = list(k.run(*xs))
    seen = {x.untyped_storage().data_ptr() for x in xs}
    for i, (o, (shape, stride, dtype, _)) in enumerate(zip(outs, k.outputs, strict=True)):
        # an op's outputs are its own (no operand's memory, none shared), in the layouts the
        # graph had there (a compiler may return a view's values contiguous)
        if o.untyped_storage().data_ptr() in seen or tuple(o.stride()) != stride:
            out = torch.empty_strided(shape, stride, dtype=dtype, device=o.device)
            outs[i] = out.copy_(o)
        seen.add(outs[i].untyped_storage().data_ptr())
    return outs


@_block.register_fake
def _(xs: list[torch.Tensor], kind: int) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in _KINDS[kind].outputs]


def outline_blocks(gm: fx.GraphModule,
                   compile: Callable[[fx.GraphModule, list[torch.Tensor]], Callable] | None = None
                   ) -> list[Kind]:
    """Outline ``gm``'s repeated blocks (module docstring) in place: each kind's graph given
    to ``compile`` once with example operands (None: the graph runs as is). Returns the kinds,
    which whoever runs ``gm`` must hold (the sites find them by id while they live)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple, list[tuple[list[fx.Node], list[fx.Node], list[fx.Node]]]] = {}
    for members in _blocks(nodes).values():
        site = _site(gm, members, order)
        if site is not None:
            groups.setdefault(_signature(gm, *site), []).append(site)
    kinds = []
    moved: dict[fx.Node, fx.Node] = {}  # an outlined block's output -> the getitem reading it
    for sites in (g for g in groups.values() if len(g) >= MIN_SITES):
        members, operands, outputs = sites[0]
        graph = _subgraph(gm, members, operands, outputs)
        run = graph if compile is None else compile(graph, _examples(gm, operands))
        layouts = []
        for o in outputs:
            v = o.meta["val"]
            layouts.append((tuple(v.shape), tuple(v.stride()), v.dtype, v.device))
        kind = Kind(graph, run, layouts, len(sites), next(_IDS))
        _KINDS[kind.id] = kind
        kinds.append(kind)
        for inside, operands, outputs in sites:
            _replace(gm, kind.id, inside, [moved.get(a, a) for a in operands], outputs, moved)
    if kinds:
        legalize_graph(gm)
        gm.graph.lint()
        gm.recompile()
    return kinds


def _examples(gm: fx.GraphModule, operands: list[fx.Node]) -> list[torch.Tensor]:
    """Operands to compile a kind with: the first site's weights, and activations of their
    layouts (a compiler reads their metadata, not their values)."""
    out = []
    for a in operands:
        v = _value(gm, a)
        if a.op == "get_attr":
            out.append(v)
        else:  # at the first site's storage offset: the compiler specialises on alignment
            size = v.storage_offset() + (1 + sum((d - 1) * st for d, st in zip(
                v.shape, v.stride(), strict=True)) if v.numel() else 0)
            base = torch.empty(size, dtype=v.dtype, device=v.device)
            out.append(base.as_strided(tuple(v.shape), tuple(v.stride()), v.storage_offset()))
    return out


def _blocks(nodes: list[fx.Node]) -> dict[tuple[str, int], list[fx.Node]]:
    """The nodes of each block (module docstring), in graph order."""
    key: dict[fx.Node, tuple[str, int] | None] = {n: _list_child(n) for n in nodes}
    _place([n for n in nodes if not n.meta.get("nn_module_stack")], key)
    blocks: dict[tuple[str, int], list[fx.Node]] = {}
    for n in nodes:
        if key[n] is not None:
            blocks.setdefault(key[n], []).append(n)
    return blocks


def _place(unplaced: list[fx.Node], key: dict[fx.Node, Any]) -> None:
    """Each node the passes made (carrying no module) takes the block it computes from; one
    that computes from two blocks of a list (an op fused across their boundary: a residual add
    with the next block's norm) takes the later, so every block but the first holds the same
    fused op at its start. A node that computes from none takes the one block that reads it,
    if one does."""
    for n in unplaced:
        near = {key.get(m) for m in n.all_input_nodes} - {None}
        if len({path for path, _ in near}) == 1:
            key[n] = max(near, key=lambda k: k[1])
    for n in reversed(unplaced):
        if key[n] is None:
            near = {key.get(u) for u in n.users} - {None}
            if len(near) == 1:
                key[n] = near.pop()


def _site(gm: fx.GraphModule, members: list[fx.Node], order: dict[fx.Node, int]
          ) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]] | None:
    """(the block's nodes, its operands, its outputs), or None where it cannot be outlined."""
    inside = set(members)
    size = -1
    while size != len(inside):
        size = len(inside)
        # a node reading a non-tensor made outside (a getitem of another node's list) stays out
        for n in members:
            if n in inside and any(a not in inside and _value(gm, a) is None
                                   for a in n.all_input_nodes):
                inside.discard(n)
        _convexify(inside)
    members = [n for n in members if n in inside]
    if not members or any(_writes(n) for n in members):
        return None
    if not _convex(members, inside, order):
        return None
    operands: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in seen:
                seen.add(a)
                operands.append(a)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs or not all(_value(gm, o) is not None for o in outputs):
        return None
    return members, operands, outputs


def _value(gm: fx.GraphModule, n: fx.Node) -> torch.Tensor | None:
    """The tensor ``n`` stands for (its traced value, or a weight), or None if not a tensor."""
    v = attr(gm, n.target) if n.op == "get_attr" else n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _writes(n: fx.Node) -> bool:
    target = n.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _convexify(inside: set[fx.Node]) -> None:
    """Leave out of ``inside`` each node from which a path through outside nodes comes back
    in (a fused op between two blocks reading this block's modulation), with the inside nodes
    it reads: what is left is convex."""
    comes_back: dict[fx.Node, bool] = {}

    def back(o: fx.Node) -> bool:  # whether outside node o reaches an inside node
        stack = [o]
        while stack:
            n = stack.pop()
            if n in comes_back:
                continue
            pending = [u for u in n.users if u not in inside and u not in comes_back]
            if pending:
                stack.append(n)
                stack.extend(pending)
                continue
            comes_back[n] = any(u in inside or comes_back[u] for u in n.users)
        return comes_back[o]

    out = [n for n in inside if any(u not in inside and back(u) for u in n.users)]
    while out:
        n = out.pop()
        if n in inside:
            inside.discard(n)
            out.extend(a for a in n.all_input_nodes if a in inside)


def _convex(members: list[fx.Node], inside: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether no node outside ``inside`` lies on a path between two of its nodes."""
    first, last = order[members[0]], order[members[-1]]
    tainted: set[fx.Node] = set()  # outside nodes that depend on an inside node
    for n in members[0].graph.nodes:
        i = order[n]
        if i <= first or i > last:
            continue
        if n in inside:
            if any(a in tainted for a in n.all_input_nodes):
                return False
        elif any(a in inside or a in tainted for a in n.all_input_nodes):
            tainted.add(n)
    return True


def _signature(gm: fx.GraphModule, members: list[fx.Node], operands: list[fx.Node],
               outputs: list[fx.Node]) -> tuple:
    """The block's code node for node, with its operands' shapes, strides and dtypes: equal
    signatures compute the same function of their operands."""
    index = {n: ("op", i) for i, n in enumerate(operands)}
    index.update({n: ("n", i) for i, n in enumerate(members)})
    code = []
    for n in members:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])
        code.append((str(n.target), repr(args), repr(sorted(kwargs.items()))))
    layout = []
    for a in operands:
        v = _value(gm, a)
        layout.append((tuple(v.shape), v.stride(), v.dtype, str(v.device)))
    return tuple(code), tuple(layout), tuple(index[o] for o in outputs)


def _subgraph(gm: fx.GraphModule, members: list[fx.Node], operands: list[fx.Node],
              outputs: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(operands):
        env[a] = graph.placeholder(f"x{i}")
        env[a].meta["val"] = _value(gm, a)
    for k, n in enumerate(members):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        env[n] = graph.create_node(n.op, n.target, args, kwargs, name=f"n{k}")
        env[n].meta.update({k: v for k, v in n.meta.items() if k == "val"})
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _replace(gm: fx.GraphModule, kind: int, members: Sequence[fx.Node],
             operands: Sequence[Any], outputs: Sequence[fx.Node],
             moved: dict[fx.Node, fx.Node]) -> None:
    graph = gm.graph
    inside = set(members)
    with graph.inserting_after(members[-1]):
        call = graph.call_function(torch.ops.kopt.block.default, (list(operands), kind))
    after = call
    for j, out in enumerate(outputs):
        with graph.inserting_after(after):
            item = graph.call_function(operator.getitem, (call, j))
        item.meta["val"] = out.meta["val"]
        out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        moved[out] = item
        after = item
    for n in reversed(members):
        graph.erase_node(n)
