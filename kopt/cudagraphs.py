"""Whole-forward CUDA graphs for an optimized graph, with the hoisted regions outside the graph.

A CUDA graph replays a fixed sequence of kernels on fixed addresses. The optimized per-call graph
has static shapes, reads its packed weights from fixed buffers and copies nothing from the host
(shape-only work is folded at load), so all of it can be captured, except the hoisted regions: a
graph replays whatever a region did when it was captured, which would serve one timestep's
modulation for every later timestep. So the graph is split:

    prelude(inputs)              -> region outputs   (eager: a cache hit launches nothing)
    body(inputs, region outputs) -> outputs          (captured once, replayed)

A region's trailing views (W1: the 1078 that cut one merged modulation GEMM per block) run in
the body, where a replay does them for free: the prelude returns their bases only.

Each call copies the inputs into the captured input buffers (skipped for a tensor that already is
one) and the region outputs when the region returned different tensors than last time (a miss:
a new timestep), all in a few multi-tensor launches (:func:`copy_all`); then it replays, and
returns clones of the outputs (so a caller that keeps the cond output while running the uncond
call, as a CFG loop does, is not handed a buffer the next replay overwrites;
``clone_outputs=False`` skips that copy for callers that consume at once).
"""

from __future__ import annotations

import logging
import operator
import weakref
from typing import Any

import torch
from torch import fx

from kopt.graph.regions import CachedRegion, trailing_views
from kopt.runtime import is_dense, plan_region

log = logging.getLogger("kopt")


def split_hoisted(gm: fx.GraphModule) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    """``(prelude, body)``: the prelude runs the hoisted regions from the graph's inputs, the
    body takes the inputs plus one extra input per region (its output tuple). ``(None, gm)``
    when there is no region, or a region reads something other than graph inputs.

    A region's trailing views (:func:`kopt.graph.regions.trailing_views`) move into the body:
    the prelude's region returns their bases, which the runner copies into the graph's
    buffers, and the replay cuts them for free. The prelude's regions are then new
    :class:`CachedRegion` modules of their own (their cache apart from ``gm``'s, whose eager
    calls keep the views cached)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module"
             and isinstance(gm.get_submodule(n.target), CachedRegion)]
    if not calls:
        return None, gm
    if any(a.op != "placeholder" for c in calls for a in c.all_input_nodes):
        log.info("kopt: a hoisted region reads computed values; it is captured with the graph")
        return None, gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cuts = {c: _cut(gm.get_submodule(c.target), c) for c in calls}

    root = torch.nn.Module()
    pre = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = pre.node_copy(p)
    outs = []
    for i, c in enumerate(calls):
        region = cuts[c][0] if cuts[c] is not None else gm.get_submodule(c.target)
        root.add_module(f"region_{i}", region)
        outs.append(pre.call_module(f"region_{i}", tuple(env[a] for a in c.args)))
    pre.output(tuple(outs))
    prelude = fx.GraphModule(root, pre)

    body = fx.Graph()
    env = {}
    for p in placeholders:
        env[p] = body.node_copy(p)
    for c in calls:
        env[c] = body.placeholder(f"{c.name}_outputs")
        env[c].meta = dict(c.meta)
        if cuts[c] is not None:
            region, views = cuts[c]
            env[c].meta["val"] = next(n for n in region.region.graph.nodes
                                      if n.op == "output").meta.get("val")
            pieces = _replay_views(body, env[c], views)
            for u in c.users:  # getitem(call, j): the body's cut of output j
                env[u] = pieces[u.args[1]]
    for n in gm.graph.nodes:
        if n.op != "placeholder" and n not in env:
            env[n] = body.node_copy(n, lambda a: env[a])
    body_gm = fx.GraphModule(gm, body)
    return prelude, body_gm


# region -> its cut (:func:`_cut`), made once per region: graphs that share a region (the
# specialisations of a CFG pair whose prompts differ in length) share its replay form, and
# so its cache
_CUTS: weakref.WeakKeyDictionary[CachedRegion, tuple[CachedRegion, tuple] | None] = \
    weakref.WeakKeyDictionary()


def replay_region(module: CachedRegion) -> CachedRegion | None:
    """The region a runner's prelude calls in place of ``module``, where one was cut."""
    cut = _CUTS.get(module)
    return cut[0] if cut is not None else None


def _cut(module: CachedRegion, call: fx.Node) -> tuple[CachedRegion, tuple] | None:
    """``(region, cut)``: the region without its trailing views, a new module that returns
    their bases, and what the body needs to compute the views from them, ``(the region's
    graph, its trailing views, the bases)``; None when there is nothing to move, or
    ``call``'s value is used other than by index."""
    if any(u.target is not operator.getitem or not isinstance(u.args[1], int)
           for u in call.users):
        return None
    if module not in _CUTS:
        _CUTS[module] = _cut_views(module)
    return _CUTS[module]


def _cut_views(module: CachedRegion) -> tuple[CachedRegion, tuple] | None:
    graph = module.region.graph
    views = trailing_views(graph)
    if not views:
        return None
    kept = [n for n in graph.nodes if n not in views and n.op != "output"]
    bases = list(dict.fromkeys(i for v in views for i in v.all_input_nodes if i not in views))
    output = next(n for n in graph.nodes if n.op == "output")
    bases += [o for o in output.args[0] if o not in views and o not in bases]
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in kept:
        env[n] = new.node_copy(n, lambda a: env[a])
    out = new.output(tuple(env[b] for b in bases))
    out.meta["val"] = tuple(b.meta.get("val") for b in bases)
    region = CachedRegion(fx.GraphModule(module.region, new), module.key_positions,
                          module.key_names)
    if module.planned is not None:  # the prelude runs the region's misses as planned too
        plan_region(region, module.planned_for)
    return region, (graph, views, bases)


def _replay_views(body: fx.Graph, bases_tuple: fx.Node, cut: tuple) -> dict[int, fx.Node]:
    """The region's outputs as nodes of ``body``, cut from the tuple of bases by the trailing
    views; by output index."""
    graph, views, bases = cut
    env: dict[fx.Node, fx.Node] = {}
    for j, b in enumerate(bases):
        env[b] = body.call_function(operator.getitem, (bases_tuple, j))
        env[b].meta = dict(b.meta)
    for n in graph.nodes:
        if n in views:
            env[n] = body.node_copy(n, lambda a: env[a])
    output = next(n for n in graph.nodes if n.op == "output")
    return {j: env[o] for j, o in enumerate(output.args[0])}


# Ops that make a graph uncapturable: they read a device value on the host (a sync), or size
# an output by data.
_SYNCING = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive",
    "aten::unique_dim", "aten::equal", "aten::is_nonzero", "aten::allclose",
    "aten::repeat_interleave", "aten::bincount", "aten::histc", "aten::argwhere",
})


def not_capturable(gm: fx.GraphModule) -> str | None:
    """Why ``gm`` (the body a runner would capture) cannot be captured in a CUDA graph, from
    its structure: an op that syncs with the host or sizes its output by data, or a value on
    the CPU that a CUDA op reads (a host tensor copied to the device at every call). None when
    nothing stands in the way."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        name = schema.name if schema is not None else getattr(node.target, "__name__", "")
        if name in _SYNCING:
            return f"{node.name} ({name}) syncs with the host"
        val = node.meta.get("val")
        outs = val if isinstance(val, list | tuple) else (val,)
        if any(isinstance(o, torch.Tensor) and o.device.type == "cuda" for o in outs):
            for a in node.all_input_nodes:
                v = a.meta.get("val")
                if (isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0):
                    return (f"{node.name} ({name}) reads {a.name}, a CPU tensor: a host copy "
                            "at every call")
    return None


def _static_copy(a: Any) -> Any:
    """A buffer laid out as ``a`` (strides and all) holding its values: what the captured graph
    reads its input from. A tensor whose elements overlap (an expanded one) has no such buffer
    a copy could fill: it is not captured."""
    if isinstance(a, tuple):
        return tuple(_static_copy(x) for x in a)
    if not isinstance(a, torch.Tensor):
        return a
    if not is_dense(a):
        raise NotCapturable(f"an input of shape {list(a.shape)} has overlapping elements "
                            f"(strides {a.stride()})")
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)


def memory_pool(device: int | None = None) -> Any:
    """A CUDA-graph memory pool of ``device`` (the current one by default) that lives as long as
    the object returned (pass its ``id`` to the captures). A bare
    ``torch.cuda.graph_pool_handle()`` counts only the graphs captured into it: once they are
    freed while a tensor they made is still held, a new capture into that handle can meet the
    caching allocator's internal assert (``use_count > 0``; seen in the full GPU suite, this
    cause not yet reproduced alone). The object holds a count of its own."""
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        return torch.cuda.MemPool()


def pool_bytes(pool: Any) -> int | None:
    """Bytes the caching allocator holds in the CUDA-graph memory pool ``pool`` (the ``id`` of
    a :func:`memory_pool`), from its segments; None where the allocator's snapshot
    does not name segments' pools."""
    total, named = 0, False
    for segment in torch.cuda.memory_snapshot():
        owner = segment.get("segment_pool_id")
        if owner is None:
            continue
        named = True
        if tuple(owner) == tuple(pool):
            total += segment["total_size"]
    return total if named else None


class NotCapturable(RuntimeError):
    """The forward cannot be captured in a CUDA graph; the message says why."""


def capture_graph(fn: Any, pool: Any = None, warmup: int = 1) -> tuple[Any, Any]:
    """``(graph, fn's result)``: ``fn`` captured in a CUDA graph (after ``warmup`` runs on a
    side stream: the allocator and library handles), into memory pool ``pool``."""
    from kopt.offload import stop_copies_ahead

    stop_copies_ahead()  # a capture forbids other threads' synchronizing calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class CudaGraphRunner:
    """Runs ``gm`` eagerly for ``warmup`` calls, then from a CUDA graph captured on the next.
    ``gm`` is an optimized graph (its hoisted regions run outside the graph) or any callable
    (the inner compiler's code for one, under ``torch.compile``).

    ``pool``: the memory pool the graph allocates from (``torch.cuda.graph_pool_handle()``;
    graphs replayed one at a time may share one). ``capture(fn, pool) -> (graph, result)``
    captures ``fn`` (the default, in a CUDA graph; anything with a ``replay()`` method that
    re-runs ``fn`` on the same buffers will do, as the CPU tests do)."""

    def __init__(self, gm: Any, warmup: int = 2, clone_outputs: bool = True,
                 pool: Any = None, capture: Any = None) -> None:
        if isinstance(gm, fx.GraphModule):
            self.prelude, self.body = split_hoisted(gm)
        else:  # compiled code (an inner compiler's): no hoisted region to keep outside
            self.prelude, self.body = None, gm
        self.warmup = warmup
        self.clone_outputs = clone_outputs
        self.pool = pool
        self.capture = capture if capture is not None else capture_graph
        self.calls = 0
        self.graph: Any = None
        self._static: list[Any] = []
        self._last_regions: tuple[Any, ...] = ()
        self._out: Any = None

    @property
    def hoisted_outside(self) -> bool:
        return self.prelude is not None

    def __call__(self, *flat: Any) -> Any:
        regions = tuple(self.prelude(*flat)) if self.prelude is not None else ()
        args = (*flat, *regions)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            return self.body(*args)
        if self.graph is None:
            self._capture(args)
        else:
            self._copy_in(flat, regions)
        self.graph.replay()
        if not self.clone_outputs:
            return self._out
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._out)

    def _capture(self, args: tuple[Any, ...]) -> None:
        self._static = [_static_copy(a) for a in args]
        self._last_regions = args[len(args) - self._n_regions():]
        self.graph, self._out = self.capture(lambda: self.body(*self._static), self.pool)
        log.info("kopt: forward captured in a CUDA graph (%s)",
                 "hoisted regions outside" if self.prelude is not None else "no hoisted regions")

    def _n_regions(self) -> int:
        if self.prelude is None:
            return 0
        return sum(1 for n in self.body.graph.nodes if n.op == "placeholder") - sum(
            1 for n in self.prelude.graph.nodes if n.op == "placeholder")

    def _copy_in(self, flat: tuple[Any, ...], regions: tuple[Any, ...]) -> None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, a in enumerate(flat):
            held = self._static[i]
            if isinstance(a, torch.Tensor) and a is not held:
                dst.append(held)
                src.append(a)
        n = len(flat)
        for j, (new, last) in enumerate(zip(regions, self._last_regions, strict=True)):
            if new is last:  # a hit returns the very tensors of the last call: nothing to copy
                continue
            for d, t in zip(self._static[n + j], new, strict=True):
                if isinstance(t, torch.Tensor):
                    dst.append(d)
                    src.append(t)
        copy_all(dst, src)
        self._last_regions = regions


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair, in a few multi-tensor launches: a miss of a hoisted
    region hands the graph hundreds of modulation vectors (W1: 6 per stream per block), whose
    copies one launch each would cost the host more than the region saves. Pairs of one device
    and dtype go through ``torch._foreach_copy_``; others (a CPU scalar, a cast) one by one."""
    groups: dict[tuple[torch.device, torch.dtype],
                 tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        if d.device == s.device and d.dtype == s.dtype:
            ds, ss = groups.setdefault((d.device, d.dtype), ([], []))
            ds.append(d)
            ss.append(s)
        else:
            d.copy_(s)
    for ds, ss in groups.values():
        if len(ds) == 1:
            ds[0].copy_(ss[0])
        else:
            torch._foreach_copy_(ds, ss)
