"""Load-time constant folding: every parameter-only subgraph is evaluated once, not per call.

The merge pass's weight concatenations, transposes of weights, and (with the FP8 mode) weight
quantization and scale packing depend only on parameters and buffers. This pass evaluates the
frontier of that constant region -- constant nodes with a per-call user -- and replaces each by a
stored tensor. The computation is kept as a *load program* (a small GraphModule reading the
original parameters) so that :class:`kopt.api.OptimizedModule` can re-run it when a parameter is
changed in place or replaced, instead of serving stale packed weights.

The values are computed one node at a time, each intermediate dropped after its last use, and
each weight handed to :func:`kopt.offload.release` once the last value computed from it is
stored. A row-wise op on a row-concatenation of weights (FP8 quantizing W1's 121 modulation
weights merged into one 13.6 GB matrix) runs on one weight at a time into its output's rows,
so the concatenation itself is never made.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt import offload
from kopt.capture import MODEL_SOURCES, SOURCE_KEY
from kopt.graph import add_constant, attr, constant_nodes
from kopt.graph.splice import prune_unused_attributes, remove_dead_code
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.collectives import KEEP_PER_CALL, is_collective
from kopt.patterns.core import exact

# A folded tensor larger than this, and larger than what it is computed from, is left per call:
# storing e.g. an expanded all-ones mask would trade a cheap kernel for a lot of memory.
MAX_GROWTH_BYTES = 64 << 20
# A row-concatenation of weights larger than this, packed in place while the weights may move
# (:func:`kopt.offload.releasing`), is assembled through host memory: each weight is copied out
# and its device memory freed before the buffer is allocated, so the device never holds the
# weights and their concatenation at once (W1's 121 modulation weights merged: 12.7 GiB).
HOST_PACK_BYTES = 1 << 30
# False inside :func:`copies_only`: nothing re-points the model's parameters
_IN_PLACE = [True]


@contextlib.contextmanager
def copies_only() -> Iterator[None]:
    """Within the block, folded row-concatenations stay copies of their own: no parameter of
    the model is re-pointed (:func:`pack_in_place`). For a graph that is thrown away after
    (verification's shallow model): the optimization of the whole model packs the same
    parameters after it, and parameters packed into another graph's buffer would leave the
    whole model's concatenation a copy of its own."""
    _IN_PLACE.append(False)
    try:
        yield
    finally:
        _IN_PLACE.pop()


@dataclass
class LoadProgram:
    """Recomputes the folded constants of a graph module from its original attributes."""

    graph_module: fx.GraphModule  # no inputs; returns the folded values in ``targets`` order
    targets: tuple[str, ...]  # attribute names on the optimized graph module
    sources: tuple[str, ...]  # attribute names it reads (the model's parameters and buffers)
    # outputs (by index) whose source parameters were re-pointed into them (:func:`pack_in_place`)
    packed_in_place: tuple[int, ...] = ()

    def run(self, keep: frozenset[int] | None = None, pack: bool = False
            ) -> list[torch.Tensor]:
        """The folded values. ``keep``: storages the optimized graph reads itself; every other
        weight is handed to :func:`kopt.offload.release` once read for the last time (None:
        none is). ``pack``: the outputs in ``packed_in_place`` packed in place as they are
        made, as ``fold_constants`` did (:func:`pack_in_place`)."""
        gm = self.graph_module
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        in_place = {out[i] for i in self.packed_in_place}
        with torch.no_grad():
            return _Streaming(gm, keep, pack, in_place).values()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FoldConstants(Pass):
    numerics = exact("the same ops on the same parameters, evaluated once at load instead of "
                     "at every call")

    def __init__(self, name: str = "fold_constants", in_place_only: bool = False) -> None:
        self.name = name  # "fold_weights": the same pass, right after the fp8 pass
        # only the row-concatenations of weights that become the buffer their parameters
        # view (:class:`PackedAfter`, in the merge pass: no copy, nothing concatenated per call)
        self.in_place_only = in_place_only

    def config_key(self) -> str:
        return f"{self.name} in_place_only={self.in_place_only}"

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
            and (not self.in_place_only or (_packs_in_place(n) and _sources(gm, n) is not None
                                            and gm.meta.get(SOURCE_KEY) in MODEL_SOURCES))
        ]
        if not frontier:
            return PassResult(self.name, 0, {KEEP_PER_CALL: len(kept)} if kept else {}, before,
                              before, time.perf_counter() - t0)

        load_gm, needed = _extract(gm, frontier, consts)
        source_bytes = {
            n.target: _nbytes(attr(gm, n.target)) for n in load_gm.graph.nodes
            if n.op == "get_attr"
        }
        storages = {attr(gm, t).untyped_storage()._cdata for t in source_bytes}
        # storages read per call whatever is folded, or by a concatenation about to become
        # the buffer its parameters view (pack_in_place): never released
        models = gm.meta.get(SOURCE_KEY) in MODEL_SOURCES  # its attributes: the parameters
        keep = {attr(gm, n.target) for n in gm.graph.nodes
                if n.op == "get_attr" and any(u not in needed for u in n.users)}
        keep.update(attr(gm, a.target) for n in frontier if models and _packs_in_place(n)
                    for a in n.args[0])
        released = offload.released()
        with torch.no_grad():
            streaming = _Streaming(load_gm, frozenset(t.untyped_storage()._cdata for t in keep),
                                   pack=models)
            values = streaming.values()
        packed_early = {n.name for n in streaming.packed}
        rejected: dict[str, int] = {KEEP_PER_CALL: len(kept)} if kept else {}
        targets, kept_values, folded, in_place = [], [], [], []
        added = aliased = 0
        for node, value in zip(frontier, values, strict=True):
            inputs = sum(source_bytes.get(a.target, 0) for a in _attr_inputs(node))
            if _nbytes(value) > MAX_GROWTH_BYTES and _nbytes(value) > inputs:
                reason = "folded value would be larger than its inputs and > 64 MiB"
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            # packed as it was made: its weights view it already (and a storage id taken
            # before the run may since name a new storage: it is no view for that)
            early = node.name in packed_early
            views = not early and value.untyped_storage()._cdata in storages
            packed = value if early else (
                pack_in_place(gm, node, value) if not views and models else None)
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
        remove_dead_code(gm.graph)

        still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        # released on the expectation that every value computed from it would be folded: a
        # value left per call, or one stored as a view of it, reads it still
        reading = {attr(gm, t).untyped_storage()._cdata for t in still_read}
        reading.update(v.untyped_storage()._cdata for v in kept_values)
        offload.give_back((offload.released() - released) & reading)
        unread = sum(b for t, b in source_bytes.items() if t not in still_read)
        keep = [i for i, n in enumerate(frontier) if n.name in folded]
        program = LoadProgram(_select_outputs(load_gm, keep), tuple(targets), tuple(source_bytes),
                              tuple(in_place))
        # a new list: the graph copies a pass starts from share their meta's values, and a
        # pass reverted must not leave its program in the graph kept
        gm.meta["kopt_load_programs"] = [*gm.meta.get("kopt_load_programs", []), program]
        prune_unused_attributes(gm)  # after the program joins: it may read earlier constants
        gm.recompile()
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


# Ops computing each row of their outputs from the same row of their one input alone:
# ``op(cat(xs))`` is ``cat(op(x) for x in xs)`` bit for bit (an FP8 row's scale is its own
# amax, a max whatever the order).
ROW_LOCAL: set = set()


def _row_local() -> set:
    if not ROW_LOCAL:
        import kopt.codegen.kernels.quant_fp8  # noqa: F401 -- registers the op

        ROW_LOCAL.add(torch.ops.kopt.quant_fp8_rowwise.default)
    return ROW_LOCAL


class _Streaming(fx.Interpreter):
    """Runs a load program node by node, each value dropped after its last use (the
    Interpreter's own bookkeeping), and hands each weight's storage to
    :func:`kopt.offload.release` once every value computed from it is computed and none of
    them views it. ``per_call``: storages the graph still reads per call, never released
    (None: nothing is released). A row-local op on a row-concatenation of attributes runs one
    attribute at a time into its outputs' rows; an attribute read only there goes as soon as
    its rows are written (all that is computed from it goes through that op's fresh
    outputs)."""

    def __init__(self, gm: fx.GraphModule, per_call: frozenset[int] | None = None,
                 pack: bool = False, pack_only: set[fx.Node] | None = None) -> None:
        _defer_rows(gm)
        # ``pack``: each output row-concatenation of weights (those in ``pack_only``, if given)
        # packed in place as soon as it is made (:func:`pack_in_place`): the weights it copies
        # go before the next one is made
        self.pack = pack
        self.pack_only = pack_only
        self.packed: list[fx.Node] = []  # the outputs ``pack`` packed
        super().__init__(gm)
        nodes = list(gm.graph.nodes)
        self.outputs = set(nodes[-1].all_input_nodes)
        # attribute -> the outputs computed from it not computed yet
        self.pending: dict[fx.Node, set[fx.Node]] = {}
        reach: dict[fx.Node, set[fx.Node]] = {}
        for n in nodes:
            if n.op == "get_attr":
                reach[n] = {n}
                self.pending[n] = set()
            else:
                reach[n] = set().union(*(reach[a] for a in n.all_input_nodes))
            if n in self.outputs:
                for a in reach[n]:
                    self.pending[a].add(n)
        self.key = {a: self.fetch_attr(a.target).untyped_storage()._cdata for a in self.pending}
        self.sharing: dict[int, list[fx.Node]] = {}
        for a, key in self.key.items():
            self.sharing.setdefault(key, []).append(a)
        self.done: set[fx.Node] = set()
        self.kept: set[int] = set()  # storages of the outputs computed (views stay)
        self.per_call = per_call
        # cat nodes whose rows a row-local op takes attribute by attribute (never made whole)
        self.rows: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            if _row_concatenated(n):
                self.rows[n.args[0]] = n

    def values(self) -> list[torch.Tensor]:
        return list(self.run())

    def run_node(self, n: fx.Node) -> object:
        if n in self.rows:
            return None  # made row by row by its one user
        cat = n.args[0] if n.args and self.rows.get(n.args[0]) is n else None
        packs = (n in self.outputs and self.pack and _packs_in_place(n)
                 and (self.pack_only is None or n in self.pack_only))
        value = self._by_rows(n, cat) if cat is not None else None
        if value is None and packs:
            value = _cat_through_host(self.module, n)
        if value is None:
            value = super().run_node(n)
        if packs:
            packed = pack_in_place(self.module, n, value)  # its weights view it now
            if packed is not None:
                value = packed
                self.packed.append(n)
        if n in self.outputs:
            self.kept.update(t.untyped_storage()._cdata for t in pytree.tree_leaves(value)
                             if isinstance(t, torch.Tensor))
            finished = [a for a, outs in self.pending.items() if n in outs]
            for a in finished:
                self.pending[a].discard(n)
            self._finish([a for a in finished if not self.pending[a]])
        return value

    def _by_rows(self, n: fx.Node, cat: fx.Node) -> object:
        """``n``'s row-local op on ``cat``'s attributes one at a time, into its outputs' rows."""
        sources = [self.fetch_attr(a.target) for a in cat.args[0]]
        total = sum(t.shape[0] for t in sources)
        outs: list[torch.Tensor] = []
        row = 0
        for node, t in zip(cat.args[0], sources, strict=True):
            part = n.target(t)
            parts = tuple(part) if isinstance(part, tuple | list) else (part,)
            if not outs:
                outs = [torch.empty((total, *p.shape[1:]), dtype=p.dtype, device=p.device)
                        for p in parts]
            for o, p in zip(outs, parts, strict=True):
                o[row:row + p.shape[0]].copy_(p)
            row += t.shape[0]
            del part, parts
            if len(node.users) == 1:  # all computed from it goes through n's fresh outputs
                self._finish([node])
        del sources
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _finish(self, attrs: list[fx.Node]) -> None:
        """``attrs`` are read no more: release each storage none of whose attributes is."""
        self.done.update(attrs)
        if self.per_call is None:
            return
        for key in {self.key[a] for a in attrs}:
            if (key not in self.sharing or key in self.per_call or key in self.kept
                    or not all(a in self.done for a in self.sharing.get(key, ()))):
                continue
            first = self.sharing.pop(key)[0]
            offload.release([self.fetch_attr(first.target)])


def _row_concatenated(node: fx.Node) -> bool:
    """Whether ``node`` runs a row-local op on a row-concatenation of attributes."""
    cat = node.args[0] if node.op == "call_function" and node.args else None
    return (_row_local_call(node) and isinstance(cat, fx.Node)
            and cat.target is torch.ops.aten.cat.default and len(cat.users) == 1
            and _dim(cat) == 0
            and all(isinstance(a, fx.Node) and a.op == "get_attr" for a in cat.args[0]))


def _row_local_call(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _row_local() and len(node.args) == 1
            and not node.kwargs and isinstance(node.args[0], fx.Node))


def _defer_rows(gm: fx.GraphModule) -> None:
    """Move the row-local ops on weights (an attribute, or a row-concatenation of them), and
    all computed from them, to the end, smallest input first (in place; the graph stays in
    topological order). Such an op allocates its whole output before its input goes, so the
    largest (W1's 121 modulation weights merged: 6.3 GiB of FP8) comes once the rest has been
    packed and its weights released, not while every BF16 weight is still there."""
    graph = gm.graph
    roots = []
    for n in graph.nodes:
        if _row_local_call(n) and (_row_concatenated(n) or n.args[0].op == "get_attr"):
            srcs = n.args[0].args[0] if _row_concatenated(n) else [n.args[0]]
            roots.append((sum(_nbytes(attr(gm, a.target)) for a in srcs), len(roots), n))
    rank = {n: i for i, (_, _, n) in enumerate(sorted(roots, key=lambda r: r[:2]))}
    order: list[tuple[int, int, fx.Node]] = []
    reached: dict[fx.Node, int] = {}
    for i, n in enumerate(graph.nodes):
        ranks = [reached[a] for a in n.all_input_nodes if a in reached]
        if n in rank:
            ranks.append(rank[n])
        if ranks and n.op != "output":
            reached[n] = max(ranks)
            order.append((reached[n], i, n))
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for _, _, n in sorted(order, key=lambda r: r[:2]):
        out.prepend(n)


def _dim(node: fx.Node) -> int:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


class PackedAfter(Pass):
    """``inner``, then the row-concatenations of weights it made packed in place (captures
    whose attributes are the model's parameters: :func:`pack_in_place`), before the pass is
    checked. The concatenation is what ``fold_constants`` would pack later anyway; packed
    now, the checks of this pass and of those after it read one buffer instead of
    concatenating the weights per call. The graph after ``fold_constants`` is the same."""

    def __init__(self, inner: Pass) -> None:
        self.inner = inner
        self.name = inner.name
        self.numerics = inner.numerics
        self.rewrites = getattr(inner, "rewrites", ())
        self._pack = FoldConstants(inner.name, in_place_only=True)

    def config_key(self) -> str:
        return f"{self.inner.uuid()} packed after"

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        result = self.inner.run(gm, sites)
        if not result.matched:
            return result
        packed = self._pack.run(gm)
        if not packed.matched:
            return result
        return replace(result, nodes_after=packed.nodes_after,
                       seconds=result.seconds + packed.seconds,
                       notes=(*result.notes, f"{packed.matched} concatenations of weights packed "
                              "at load, the parameters viewing them"))


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
    if not _IN_PLACE[-1] or not _packs_in_place(node) or not value.is_contiguous():
        return None
    tensors = _sources(gm, node)
    if tensors is None or tensors[0].dtype != value.dtype or tensors[0].device != value.device:
        return None
    if any(t.untyped_storage().nbytes() != _nbytes(t) for t in tensors):  # views of a buffer
        return _adjacent_rows(tensors, value)
    _repoint(tensors, value)
    return value


def _cat_through_host(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The row-concatenation ``node`` of weights, made through host memory with its weights
    re-pointed at its rows (:data:`HOST_PACK_BYTES`); None where it is made on the device."""
    tensors = _sources(gm, node) if _IN_PLACE[-1] else None
    if (tensors is None or sum(_nbytes(t) for t in tensors) <= HOST_PACK_BYTES
            or len({t.untyped_storage()._cdata for t in tensors}) != len(tensors)):
        return None
    hosts = offload.copied_out(tensors)
    if hosts is None:
        return None
    first = tensors[0]
    try:
        value = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]),
                            dtype=first.dtype, device=first.device)
    except BaseException:
        offload.put_back(tensors, hosts)
        raise
    _repoint(tensors, value, hosts)
    return value


def _repoint(tensors: list[torch.Tensor], value: torch.Tensor,
             hosts: list[torch.Tensor] | None = None) -> None:
    """Re-point ``tensors`` at their rows of ``value``, one after another (``hosts``: their
    bytes, written into those rows first)."""
    offload.repointed(tensors, value)
    offset = 0
    with torch.no_grad():
        for i, t in enumerate(tensors):
            rows = value[offset:offset + t.shape[0]]
            if hosts is not None:
                rows.view(-1).view(torch.uint8).copy_(hosts[i])
            t.data = rows
            offset += t.shape[0]


def _packs_in_place(node: fx.Node) -> bool:
    """Whether ``node`` is a row-concatenation of attributes (what :func:`pack_in_place`
    may make its sources view)."""
    return (node.target is torch.ops.aten.cat.default and _dim(node) == 0
            and all(isinstance(s, fx.Node) and s.op == "get_attr" for s in node.args[0]))


def _sources(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor] | None:
    """The weights the row-concatenation ``node`` reads, where :func:`pack_in_place` can make
    them views of one buffer: distinct tensors, contiguous, of one dtype and device."""
    tensors = [attr(gm, s.target) for s in node.args[0]]
    if (len({id(t) for t in tensors}) != len(tensors)
            or len({(t.dtype, t.device) for t in tensors}) != 1
            or not all(t.is_contiguous() for t in tensors)):
        return None
    return tensors


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


def _extract(gm: fx.GraphModule, frontier: list[fx.Node], consts: set[fx.Node]
             ) -> tuple[fx.GraphModule, set[fx.Node]]:
    """A GraphModule (sharing ``gm``'s attributes) computing the frontier nodes from constants,
    and the nodes of ``gm`` it copies."""
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
    return fx.GraphModule(gm, graph), needed


def _select_outputs(load: fx.GraphModule, keep: list[int]) -> fx.GraphModule:
    out = next(n for n in load.graph.nodes if n.op == "output")
    values = out.args[0]
    out.args = (tuple(values[i] for i in keep),)
    remove_dead_code(load.graph)
    load.recompile()
    return load


# A load program before it runs: (its graph, targets, sources, outputs packed in place).
ProgramParts = tuple[fx.Graph, tuple[str, ...], tuple[str, ...], tuple[int, ...]]


def skip_packed_rows(programs: list[ProgramParts], reads: set[str]) -> list[ProgramParts]:
    """``programs`` without the packed row-concatenations of weights that only later programs'
    row-local ops read: each such op reads the concatenated weights themselves instead, which
    :class:`_Streaming` runs one weight at a time into its output's rows -- the same rows, bit
    for bit, since the op is row-local -- so the concatenation is never made. With FP8 that is
    the merge's (W1: 12.7 GiB of BF16 made through host memory) quantized by ``fold_weights``,
    whose BF16 the optimized graph never reads. ``reads``: the attributes the optimized graph
    and its hoisted regions read (a concatenation they read is made as before). A weight read
    anywhere else than by that one concatenation keeps it too: :class:`_Streaming` releases a
    weight as soon as its rows are written."""
    named: dict[str, list[tuple[int, fx.Node]]] = {}  # attribute -> (program, its get_attr)
    for k, (graph, *_) in enumerate(programs):
        for n in graph.find_nodes(op="get_attr"):
            named.setdefault(n.target, []).append((k, n))
    composed: dict[int, set[int]] = {}  # program -> outputs taken out
    changed: set[int] = set()  # programs reading a concatenation's weights now
    for i, (graph, targets, _, in_place) in enumerate(programs):
        out = _output(graph)
        for j in in_place:
            cat, target = out[j], targets[j]
            readers = [(k, n) for k, n in named.get(target, ()) if k > i]
            if (target in reads or not readers or not _packs_in_place(cat)
                    or len(cat.users) != 1  # the output node alone
                    or any(len(named.get(a.target, ())) != 1 for a in cat.args[0])
                    or not all(_row_local_call(u) for _, r in readers for u in r.users)):
                continue
            for k, r in readers:
                changed.add(k)
                for user in list(r.users):
                    with r.graph.inserting_before(user):
                        parts = [r.graph.get_attr(a.target) for a in cat.args[0]]
                        rows = r.graph.call_function(cat.target, (parts, *cat.args[1:]),
                                                     dict(cat.kwargs))
                    user.replace_input_with(r, rows)
                r.graph.erase_node(r)
            composed.setdefault(i, set()).add(j)
    if not composed:
        return programs
    result = []
    for i, (graph, targets, sources, in_place) in enumerate(programs):
        gone = composed.get(i, set())
        if gone:
            out = _output(graph)
            keep = [j for j in range(len(out)) if j not in gone]
            if not keep:
                continue
            output = next(n for n in graph.nodes if n.op == "output")
            output.args = (type(out)(out[j] for j in keep),)
            remove_dead_code(graph)
            targets = tuple(targets[j] for j in keep)
            in_place = tuple(keep.index(j) for j in in_place if j not in gone)
        if gone or i in changed:
            sources = tuple(dict.fromkeys(n.target for n in graph.nodes if n.op == "get_attr"))
        result.append((graph, targets, sources, in_place))
    return result


def _output(graph: fx.Graph) -> tuple | list:
    return next(n for n in graph.nodes if n.op == "output").args[0]
