"""Load-time constant folding: every parameter-only subgraph is evaluated once, not per call.

The merge pass's weight concatenations, transposes of weights, and (with the FP8 mode) weight
quantization and scale packing depend only on parameters and buffers. This pass evaluates the
frontier of that constant region -- constant nodes with a per-call user -- and replaces each by a
stored tensor. The computation is kept as a *load program* (a small GraphModule reading the
original parameters) so that :class:`kopt.api.OptimizedModule` can re-run it when a parameter is
changed in place or replaced, instead of serving stale packed weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import fx

from kopt.capture import SOURCE_KEY
from kopt.graph import add_constant, attr, constant_nodes
from kopt.graph.splice import eliminate_dead
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.collectives import KEEP_PER_CALL, is_collective
from kopt.patterns.core import exact

# A folded tensor larger than this, and larger than what it is computed from, is left per call:
# storing e.g. an expanded all-ones mask would trade a cheap kernel for a lot of memory.
MAX_GROWTH_BYTES = 64 << 20


@dataclass
class LoadProgram:
    """Recomputes the folded constants of a graph module from its original attributes."""

    graph_module: fx.GraphModule  # no inputs; returns the folded values in ``targets`` order
    targets: tuple[str, ...]  # attribute names on the optimized graph module
    sources: tuple[str, ...]  # attribute names it reads (the model's parameters and buffers)
    # outputs (by index) whose source parameters were re-pointed into them (:func:`pack_in_place`)
    packed_in_place: tuple[int, ...] = ()

    def run(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.graph_module())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FoldConstants(Pass):
    name = "fold_constants"
    numerics = exact("the same ops on the same parameters, evaluated once at load instead of "
                     "at every call")

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        consts = constant_nodes(gm.graph)
        kept = _drop_collectives(gm.graph, consts)
        frontier = [
            n for n in gm.graph.nodes
            if n in consts and n.op == "call_function"
            and any(u not in consts for u in n.users)
            and (sites is None or n.name in sites)
        ]
        if not frontier:
            return PassResult(self.name, 0, {KEEP_PER_CALL: len(kept)} if kept else {}, before,
                              before, time.perf_counter() - t0)

        load_gm = _extract(gm, frontier, consts)
        values = LoadProgram(load_gm, (), ()).run()
        source_bytes = {
            n.target: _nbytes(attr(gm, n.target)) for n in load_gm.graph.nodes
            if n.op == "get_attr"
        }
        storages = {attr(gm, t).untyped_storage().data_ptr() for t in source_bytes}
        rejected: dict[str, int] = {KEEP_PER_CALL: len(kept)} if kept else {}
        targets, kept_values, folded, in_place = [], [], [], []
        added = aliased = 0
        for node, value in zip(frontier, values, strict=True):
            inputs = sum(source_bytes.get(a.target, 0) for a in _attr_inputs(node))
            if _nbytes(value) > MAX_GROWTH_BYTES and _nbytes(value) > inputs:
                reason = "folded value would be larger than its inputs and > 64 MiB"
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            views = value.untyped_storage().data_ptr() in storages  # of a parameter already
            packed = pack_in_place(gm, node, value) if (
                not views and gm.meta.get(SOURCE_KEY) == "export") else None
            value = value if packed is None else packed
            const = add_constant(gm, value, hint=node.name)
            node.replace_all_uses_with(const)
            targets.append(const.target)
            kept_values.append(value)
            folded.append(node.name)
            if views:
                continue
            if packed is not None:
                aliased += _nbytes(value)
                in_place.append(len(targets) - 1)
            else:
                added += _nbytes(value)
        eliminate_dead(gm)

        still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        unread = sum(b for t, b in source_bytes.items() if t not in still_read)
        keep = [i for i, n in enumerate(frontier) if n.name in folded]
        program = LoadProgram(_select_outputs(load_gm, keep), tuple(targets), tuple(source_bytes),
                              tuple(in_place))
        programs: list[LoadProgram] = gm.meta.setdefault("kopt_load_programs", [])
        programs.append(program)
        notes = (
            f"memory: +{_mib(added)} of packed constants, {_mib(aliased)} packed in place (the "
            f"model's parameters now view the packed buffers); {_mib(unread)} of parameters no "
            "longer read per call",
        )
        return PassResult(
            name=self.name,
            matched=len(folded),
            rejected=rejected,
            nodes_before=before,
            nodes_after=count_nodes(gm),
            seconds=time.perf_counter() - t0,
            sites=tuple(folded),
            notes=notes,
        )


def _drop_collectives(graph: fx.Graph, consts: set[fx.Node]) -> list[fx.Node]:
    """Take collectives on parameters, and what they compute, out of ``consts`` (in place): at
    load they would run once, and again on whichever rank re-packs after an in-place weight
    change while its peers are not in the collective. Returns the collectives kept per call."""
    kept = []
    for node in graph.nodes:
        if node in consts and (is_collective(node) or any(
                a not in consts for a in node.all_input_nodes)):
            consts.discard(node)
            if is_collective(node):
                kept.append(node)
    return kept


def pack_in_place(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor
                  ) -> torch.Tensor | None:
    """Make the parameters a folded row-concatenation was built from views of it; returns the
    tensor the graph holds for it (None: the concatenation stays a copy of its own).

    The merge pass's ``cat([Wq; Wk; Wv])`` would otherwise hold every merged weight twice (W1:
    19.5 GB). Re-pointing each source parameter's ``.data`` at its rows of the packed buffer
    keeps the values, the parameter objects and the model working, and frees the old storage.
    Parameters already viewing one buffer, row after row (packed by another specialisation,
    or an earlier optimization of the model), give that buffer's rows: the concatenation is
    held once however often the model is optimized.
    """
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target is not torch.ops.aten.cat.default or dim != 0 or not value.is_contiguous():
        return None
    sources = node.args[0]
    if not all(isinstance(s, fx.Node) and s.op == "get_attr" for s in sources):
        return None
    tensors = [attr(gm, s.target) for s in sources]
    if len({id(t) for t in tensors}) != len(tensors) or not all(
            t.is_contiguous() and t.dtype == value.dtype and t.device == value.device
            for t in tensors):
        return None
    if any(t.untyped_storage().nbytes() != _nbytes(t) for t in tensors):  # views of a buffer
        return _adjacent_rows(tensors, value)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            rows = t.shape[0]
            t.data = value[offset:offset + rows]
            offset += rows
    return value


def _adjacent_rows(tensors: list[torch.Tensor], value: torch.Tensor) -> torch.Tensor | None:
    """The rows ``value`` holds, as a view of the one buffer ``tensors`` view row after row
    (None where they do not)."""
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.detach().as_strided(value.shape, value.stride(), first.storage_offset())


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _attr_inputs(node: fx.Node) -> list[fx.Node]:
    seen, stack, out = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            out.append(n)
        stack.extend(n.all_input_nodes)
    return out


def _extract(gm: fx.GraphModule, frontier: list[fx.Node], consts: set[fx.Node]) -> fx.GraphModule:
    """A GraphModule (sharing ``gm``'s attributes) computing the frontier nodes from constants."""
    needed: set[fx.Node] = set()
    stack = list(frontier)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in frontier))
    return fx.GraphModule(gm, graph)


def _select_outputs(load: fx.GraphModule, keep: list[int]) -> fx.GraphModule:
    out = next(n for n in load.graph.nodes if n.op == "output")
    values = out.args[0]
    out.args = (tuple(values[i] for i in keep),)
    load.graph.eliminate_dead_code()
    load.recompile()
    return load
