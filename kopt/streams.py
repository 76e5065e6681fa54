"""Concurrent branches of a graph on two CUDA streams.

A double-stream DiT block (Qwen-Image, FLUX's double blocks) runs two chains between its joint
attentions: the image tokens' projections, norms and MLP, and the text tokens' own. The text
chain's GEMMs have 128-512 rows: too few tiles to fill the GPU, and bound by the time to stream
their weights, so on one stream they leave most SMs idle while the image chain waits behind
them. On a second stream the text chain runs beside the image chain's kernels.

Which nodes go to the side stream is read from the graph's structure alone:

1. The heavy nodes (GEMMs, attention) are split into two chains, in graph order, by ancestry: a
   node continues a chain whose last node is one of its ancestors, else starts the empty one.
   Where both chains' last nodes are (after a joint attention), it continues the one whose last
   node has as many rows (tokens) as its own, else the one with more work. A node concurrent
   with both chains' ends (a third branch) stays on the main chain. The lighter chain (fewer
   FLOPs) is the side chain.
2. Every other node goes to the side stream when all of its users are there (so a norm or a
   quantizer feeding a side GEMM runs beside it), or when only the side stream's values feed
   it (an activation after a side GEMM, up to where the branches meet); it stays on the main
   stream otherwise, and so do the hoisted regions' calls.

No chain of at least ``MIN_SIDE_FRACTION`` of the graph's heavy FLOPs, no streams: a
single-stream model (an LLM decoder with merged projections) is left as it is.

Synchronization, inserted in graph order: before a node on stream ``c`` reads a value the
other stream ``p`` computed, ``c`` waits for everything enqueued on ``p`` so far (one event
per wait, fewer where an earlier wait already covers the value). The side stream first waits
for the main stream (the graph's inputs), and the main stream waits for the side stream before
the graph returns. A value computed on ``p`` and read on ``c`` is held until ``p`` next waits
for ``c``, or to the end of the graph where ``p`` does not wait again: the caching allocator
hands a freed block to the next allocation on the stream that allocated it, so the block must
not be freed before that stream is ordered after the read (a side stream that runs on without
waiting would otherwise write its next values over what the main stream is still reading).
The values are unchanged bit for bit (the same kernels on the same inputs), and the execution
plan checks so before it is used (:mod:`kopt.runtime`).

Off, and not offered to users (``kopt.runtime.build_plan(branch_streams=True)`` turns it on).
On the GPU a first version computed bitwise what one stream does when run eagerly, but other
values, NaN on some models, replayed from a CUDA graph. A storage-level race check on the CPU
then found why: a value the main stream read from the side stream was freed while the side
stream ran on without waiting again, so its next allocations could take the block before the
read ran. Such values are now held to the end; the GPU has not run this version yet. The
overlap it can buy is also small: W1's GEMMs and same-size copies per layer ran 1.026x faster
with the text branch on a second stream inside a CUDA graph (RESULTS.md, 2026-12-08, H100).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt.graph.query import is_view, op_category, qualified_name

aten = torch.ops.aten
# ops whose schema says they may return their input, and which copy otherwise
_CAST_OR_ALIAS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other})

MAIN, SIDE = 0, 1
ALIAS_META = "kopt_alias"
# The side chain's least share of the heavy FLOPs (W1's text chain has 2.4% of them)
MIN_SIDE_FRACTION = 0.005


@dataclass
class Assignment:
    """Which nodes run on the side stream, or why none does."""

    side: set[fx.Node] = field(default_factory=set)
    side_flop: float = 0.0
    total_flop: float = 0.0
    side_heavy: int = 0
    why_not: str | None = None

    def line(self, syncs: int) -> str:
        if self.why_not is not None:
            return f"one stream ({self.why_not})"
        return (f"two streams: {len(self.side)} nodes ({self.side_heavy} GEMM/attention, "
                f"{100 * self.side_flop / self.total_flop:.1f}% of their FLOPs) on a side "
                f"stream, {syncs} waits")


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    """The node's op: its target, or the op an execution plan's DirectOp launches."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        target = getattr(target, "op", None)  # kopt.codegen.launch.DirectOp
    return target if isinstance(target, torch._ops.OpOverload) else None


def _target_name(node: fx.Node) -> str | None:
    op = _overload(node)
    return None if op is None else qualified_name(op)


def _val(node: Any) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    leaves = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return leaves[0] if leaves else None


def heavy_flop(node: fx.Node) -> float:
    """The FLOPs of a GEMM or an attention node (0 for anything else): 2 M N K from its first
    operand's last dim and its output; 4 Lq Lk D per batch and head."""
    name = _target_name(node)
    if node.op != "call_function" or name is None:
        return 0.0
    category = op_category(name)
    out = _val(node)
    if out is None:
        return 0.0
    if category == "gemm":
        a = _val(node.args[1] if name in ("aten::addmm", "aten::baddbmm") else node.args[0])
        return 2.0 * out.numel() * a.shape[-1] if a is not None and a.dim() else 0.0
    if category == "attention":
        q, k = _val(node.args[0]), _val(node.args[1])
        if q is None or k is None or q.dim() < 2 or k.dim() < 2:
            return 0.0
        return 4.0 * q.numel() * k.shape[-2]
    return 0.0


def is_alias(node: fx.Node) -> bool:
    """Whether the node only names part of another value (no GPU work): ``getitem`` or a view;
    as :func:`mark_aliases` found it, where it ran (an execution plan's Python bindings no
    longer say which op they call)."""
    marked = node.meta.get(ALIAS_META)
    if marked is not None:
        return marked
    if node.op != "call_function":
        return False
    if node.target in _CAST_OR_ALIAS:  # ``x.to(dtype)`` is ``x`` only when nothing changes
        out, src = _val(node), _val(node.args[0])
        return out is not None and src is not None and (out.dtype, out.device) == (
            src.dtype, src.device)
    if node.target is aten.flatten.using_ints:  # a reshape: a copy where strides forbid a view
        out, src = _val(node), _val(node.args[0])
        return out is not None and src is not None and src.is_contiguous()
    return is_view(node)  # views, and reshape / contiguous by their strides


def mark_aliases(graph: fx.Graph) -> None:
    """Record :func:`is_alias` in each node's meta, while the targets are still the ops."""
    for n in graph.nodes:
        n.meta[ALIAS_META] = None
        n.meta[ALIAS_META] = is_alias(n)


def _work_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def assign(graph: fx.Graph, heavy: Callable[[fx.Node], float] = heavy_flop) -> Assignment:
    """The nodes of ``graph`` to run on a side stream (module docstring)."""
    nodes = _work_nodes(graph)
    writes = next((n for n in nodes if (op := _overload(n)) is not None
                   and op._schema.is_mutable), None)
    if writes is not None:
        return Assignment(why_not=f"{writes.format_node()[:60]} writes a tensor in place")
    flop = {n: heavy(n) for n in nodes}
    heavy_nodes = [n for n in nodes if flop[n] > 0]
    total = sum(flop.values())
    if len(heavy_nodes) < 2:
        return Assignment(why_not="fewer than two GEMM or attention nodes")
    bit = {n: 1 << i for i, n in enumerate(heavy_nodes)}
    ancestors: dict[fx.Node, int] = {}
    for n in graph.nodes:
        acc = 0
        for i in n.all_input_nodes:
            acc |= ancestors.get(i, 0) | bit.get(i, 0)
        ancestors[n] = acc
    tails: list[fx.Node | None] = [None, None]
    work = [0.0, 0.0]
    chain: dict[fx.Node, int] = {}
    for h in heavy_nodes:
        fits = [c for c in (0, 1) if tails[c] is not None and ancestors[h] & bit[tails[c]]]
        if fits:  # after a join both do: the chain of the same tokens, else the heavier one
            c = max(fits, key=lambda c: (_rows(tails[c]) == _rows(h), work[c]))
        elif tails[1] is None and tails[0] is not None:
            c = 1
        else:
            c = 0  # the first node, or a third branch: the main chain
        chain[h] = c
        tails[c] = h
        work[c] += flop[h]
    side_chain = 1 if work[1] < work[0] else 0
    side_flop = work[side_chain]
    if side_flop < MIN_SIDE_FRACTION * total:
        return Assignment(why_not=f"no concurrent branch: the second chain has "
                                  f"{100 * side_flop / total:.1f}% of the GEMM/attention FLOPs")
    side = {h for h in heavy_nodes if chain[h] == side_chain}
    free = [n for n in nodes if n not in chain and n.op != "call_module"]  # regions: main
    _by_users(free, side)
    for n in free:  # what only the side chain's values feed, up to where the branches meet
        computed = [i for i in n.all_input_nodes if i.op not in ("placeholder", "get_attr")]
        if computed and all(i in side for i in computed):
            side.add(n)
    _by_users(free, side)
    return Assignment(side=side, side_flop=side_flop, total_flop=total,
                      side_heavy=sum(1 for h in heavy_nodes if h in side))


def _rows(node: fx.Node) -> int | None:
    """The rows (tokens) of a node's output: its elements over its last dim."""
    out = _val(node)
    return out.numel() // out.shape[-1] if out is not None and out.dim() and out.shape[-1] \
        else None


def _by_users(nodes: list[fx.Node], side: set[fx.Node]) -> None:
    """Add to ``side`` each node all of whose users are there (last to first)."""
    for n in reversed(nodes):
        if n.users and all(u in side for u in n.users):
            side.add(n)


def graph_device(graph: fx.Graph) -> torch.device | None:
    """The one device of the graph's tensors, or None (none, or several)."""
    devices = {v.device for n in graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
               if isinstance(v, torch.Tensor)}
    return devices.pop() if len(devices) == 1 else None


class BranchStreams:
    """The side stream of one device, and the calls a planned graph makes to it. The main
    stream is whatever stream is current when the graph runs (a CUDA graph's capture stream
    while capturing)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def main_waits(self, *held: Any) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def side_waits(self, *held: Any) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        main = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(self.side)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_stream(main)


class _Sync:
    """A wait in a planned graph: ``streams.main_waits`` or ``side_waits``; its arguments are
    the values it holds until then (module docstring)."""

    def __init__(self, fn: Callable[..., None], name: str) -> None:
        self.fn = fn
        self.__name__ = self.__qualname__ = name
        self.__module__ = "kopt.streams"

    def __call__(self, *held: Any) -> None:
        self.fn(*held)


class OnSide:
    """A node's target, called with the side stream current."""

    def __init__(self, fn: Callable[..., Any], streams: BranchStreams) -> None:
        self.fn = fn
        self.streams = streams
        name = getattr(fn, "__name__", "op")
        self.__name__ = self.__qualname__ = f"side_{name}"
        self.__module__ = "kopt.streams"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.streams.on_side(self.fn, args, kwargs)


def apply(gm: fx.GraphModule, side: Iterable[fx.Node], streams: Any) -> int:
    """Run the ``side`` nodes of ``gm`` on ``streams.side`` (a :class:`BranchStreams`, or a
    stand-in with its three methods): wraps their targets in :class:`OnSide` and inserts the waits
    (module docstring); returns the number of waits. Only ``call_function`` nodes move."""
    side = {n for n in side if n.op == "call_function"}
    graph = gm.graph
    waits = {MAIN: _Sync(streams.main_waits, "main_waits"),
             SIDE: _Sync(streams.side_waits, "side_waits")}
    stream_of = {n: SIDE if n in side else MAIN for n in graph.nodes}
    last_reader: dict[tuple[fx.Node, int], fx.Node] = {}
    for n in graph.nodes:
        if n.op != "output":
            for i in n.all_input_nodes:
                last_reader[i, stream_of[n]] = n
    enqueued = [0, 0]  # work nodes enqueued on each stream so far
    waited = [-1, -1]  # how many of the other stream's each has waited for (-1: none yet)
    origin: dict[fx.Node, tuple[int, int]] = {}  # value -> its producer's (stream, position)
    held: list[list[fx.Node]] = [[], []]  # values held until stream s next waits
    syncs = 0

    def wait(c: int, before: fx.Node) -> None:
        nonlocal syncs
        with graph.inserting_before(before):
            graph.call_function(waits[c], tuple(held[c]))
        held[c] = []
        waited[c] = enqueued[1 - c]
        syncs += 1

    for n in list(graph.nodes):
        if n.op in ("placeholder", "get_attr"):
            origin[n] = (MAIN, 0)
            continue
        if n.op == "output":
            # the side stream's values the main stream read since the side stream last waited
            # for it stay held to the end: nothing orders the side stream's later allocations
            # after those reads otherwise
            held[MAIN] += held[SIDE]
            if waited[MAIN] < enqueued[SIDE] or held[MAIN]:
                wait(MAIN, n)
            break
        c = stream_of[n]
        if is_alias(n) and n.all_input_nodes:
            origin[n] = origin[n.all_input_nodes[0]]
        else:
            need = max((origin[i][1] for i in n.all_input_nodes if origin[i][0] != c),
                       default=None)
            if c == SIDE and waited[SIDE] < 0:
                need = 0  # the side stream starts after what the caller enqueued
            if need is not None and waited[c] < need:
                wait(c, n)
            enqueued[c] += 1
            origin[n] = (c, enqueued[c])
            if c == SIDE:
                n.target = OnSide(n.target, streams)
        for i in n.all_input_nodes:
            p = origin[i][0]
            if p != c and last_reader.get((i, c)) is n and i.op not in ("placeholder",
                                                                        "get_attr"):
                held[p].append(i)
    gm.recompile()
    return syncs
