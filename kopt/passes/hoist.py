"""Hoisting: work that depends on only some of the inputs is done once per distinct value of
those inputs, and reused across calls.

    # F(x_t, t, c) and F(x_t, t, u): modulation(t) computed once for the CFG pair

Classifier-free guidance runs the denoiser twice per step with the same latents and timestep and
different text. A node whose value depends (:mod:`kopt.graph.deps`) only on *conditioning*
inputs and parameters -- the timestep embedding and every block's modulation GEMM depend on
``{timestep}`` (FLUX.2: ``{timestep, guidance}``) -- is the same in both calls. Each group of
such nodes with one dependency set ``S`` becomes one :class:`~kopt.graph.regions.CachedRegion`
call in the per-call graph, which recomputes only when the key changes.

Conditioning inputs are found automatically: floating-point tensor inputs at least
:data:`CONDITIONING_RATIO` times smaller than the largest one (timestep and guidance are
``[batch]``, pooled embeddings ``[batch, 768]``), as opposed to the latent and text
activations, which change between the two calls or every step and would make a cache miss while
holding activation-sized memory. More can be declared by name
(``PassConfig(hoist=("hidden_states",))``: the CFG pair also shares the latents, so everything
before block 0's joint attention on the image side is then cached too).

The cache key is safe without reading tensor values (:mod:`kopt.graph.regions`); each region
holds a bounded number of entries, whose memory is reported at build time. A region is
cached if it has a GEMM or a table's worth of ops (:data:`MIN_OPS_WITHOUT_GEMM`); a few
element-wise ops save less than the key check costs.
"""

from __future__ import annotations

import operator
import time
from collections import defaultdict

import torch
from torch import fx

import kopt.codegen.gemm  # noqa: F401 -- registers kopt::fp8_gemm
from kopt.graph import describe_node, stable_topo_sort
from kopt.graph.deps import dependency_sets, is_effectful
from kopt.graph.regions import CACHE_ENTRIES, CachedRegion
from kopt.graph.splice import eliminate_dead
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.collectives import KEEP_PER_CALL, is_collective
from kopt.patterns.core import Rejection, exact

aten = torch.ops.aten

# A floating-point input this many times smaller than the largest is a conditioning input.
CONDITIONING_RATIO = 64

# A region without a GEMM is cached only if it has at least this many compute ops (a RoPE table
# built from position ids); the cost model (kopt.cost) will rank regions by predicted time.
MIN_OPS_WITHOUT_GEMM = 8

# Uses that make an integer input a token id or a cache index rather than a position/mask.
_INDEXING = {
    "embedding", "index", "index_select", "index_copy", "index_put", "scatter", "gather",
    "slice_scatter", "select_scatter", "index_add", "take",
}

# Ops that make a region worth caching.
GEMMS = {
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten.matmul.default, aten.baddbmm.default, aten.convolution.default,
    aten.scaled_dot_product_attention.default, aten._scaled_mm.default,
    torch.ops.kopt.fp8_gemm.default,
}


_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.expand.default, aten.permute.default, aten.slice.Tensor, aten.select.int,
    aten.t.default, aten.transpose.int, aten._unsafe_view.default, operator.getitem,
}


class HoistInvariants(Pass):
    name = "hoist"
    numerics = exact("the same ops on the same values, computed at the first call with a key")

    def __init__(self, declared: tuple[str, ...] = ()) -> None:
        self.declared = tuple(declared)

    def config_key(self) -> str:
        return repr(self.declared)

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        regions, reason = plan_regions(gm.graph, self.declared)
        kept = kept_collectives(gm.graph, self.declared)
        details, applied, notes = [], [], []
        held = 0
        for key, nodes in regions:
            anchor = nodes[0].name
            if sites is not None and anchor not in sites:
                continue
            module = _extract_region(gm, key, nodes)
            applied.append(anchor)
            held += module.cached_bytes()
            gemms = [n for n in nodes if n.target in GEMMS]
            paths = sorted({describe_node(n) for n in gemms})
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4
                                             else "")
            what = f"{len(gemms)} GEMMs ({shown})" if gemms else "no GEMM (a table)"
            details.append(f"key {{{', '.join(k.name for k in key)}}}: {len(nodes)} nodes, "
                           f"{what}; caches {module.cached_bytes() / 2**20:.2f} MiB")
        if applied:
            stable_topo_sort(gm.graph)
            eliminate_dead(gm)
            notes.append(f"memory: {held / 2**20:.2f} MiB held by {len(applied)} caches "
                         f"({CACHE_ENTRIES} entries each)")
        elif reason:
            notes.append(f"nothing to hoist: {reason}")
        return PassResult(self.name, len(applied), {KEEP_PER_CALL: len(kept)} if kept else {},
                          before, count_nodes(gm), time.perf_counter() - t0,
                          sites=tuple(applied), details=tuple(details), notes=tuple(notes),
                          rejections=tuple(Rejection(self.name, n.name, KEEP_PER_CALL)
                                           for n in kept))


def conditioning_inputs(graph: fx.Graph, declared: tuple[str, ...] = ()) -> list[fx.Node]:
    """The inputs hoisted work may be keyed on.

    * conditioning: floating-point inputs far smaller than the largest one (timestep, guidance);
    * positions and masks: integer or bool inputs used in arithmetic only (FLUX.2's image and
      text ids, from which every call rebuilds the RoPE tables), not token ids or cache indices
      (an embedding lookup or an index/scatter reads them);
    * whatever is declared by name.
    """
    tensors = [n for n in graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    floats = [n.meta["val"].numel() for n in tensors if n.meta["val"].is_floating_point()]
    largest = max(floats, default=0)
    deps = dependency_sets(graph)
    out = []
    for n in tensors:
        v = n.meta["val"]
        if n.name in declared:
            out.append(n)
        elif v.is_floating_point():
            if v.numel() * CONDITIONING_RATIO <= largest:
                out.append(n)
        elif not v.is_complex() and not _indexes(n, deps):
            out.append(n)
    return out


def _indexes(node: fx.Node, deps: dict[fx.Node, frozenset[str]]) -> bool:
    """Whether values computed from ``node`` alone (and parameters) are used to look up or
    write at positions: token ids feed an embedding, a cache position an index_copy."""
    region = {node}
    for n in node.graph.nodes:
        if n.op == "call_function" and deps[n] == {node.name} and any(
                i in region for i in n.all_input_nodes):
            region.add(n)
    for n in region:
        for user in n.users:
            name = getattr(user.target, "_opname", getattr(user.target, "__name__", ""))
            if user.op == "call_function" and name.rstrip("_") in _INDEXING:
                return True
    return False


def plan_regions(
    graph: fx.Graph, declared: tuple[str, ...] = ()
) -> tuple[list[tuple[tuple[fx.Node, ...], list[fx.Node]]], str]:
    """The regions to cache, as (key placeholders, nodes in graph order), or a reason for none."""
    tensor_inputs = [n for n in graph.nodes if n.op == "placeholder"
                     and isinstance(n.meta.get("val"), torch.Tensor)]
    names = {n.name for n in tensor_inputs}
    unknown = [d for d in declared if d not in names]
    if unknown:
        raise ValueError(f"hoist: declared inputs {unknown} are not tensor inputs of the graph "
                         f"({sorted(names)})")
    keys_allowed = frozenset(n.name for n in conditioning_inputs(graph, declared))
    # Python-value inputs are specialised constants: only tensor inputs key a region.
    deps = {n: s & names for n, s in dependency_sets(graph).items()}
    output = next(n for n in graph.nodes if n.op == "output")
    full = deps[output]
    if len(full) < 2:
        return [], "the output depends on fewer than two inputs, so no work depends on a part"

    if not keys_allowed:
        return [], ("no conditioning input (a small floating-point input such as a timestep, "
                    "or position ids)")

    def hoistable(n: fx.Node) -> bool:
        return (n.op == "call_function" and bool(deps[n]) and deps[n] < full
                and deps[n] <= keys_allowed and not is_effectful(n) and output not in n.users
                and not is_collective(n))

    # Each hoistable node joins the region of its users when they all share one key set that
    # contains its own (so a cheap prefix of a GEMM's input is cached with it); else its own.
    key_of: dict[fx.Node, frozenset[str]] = {}
    for node in reversed(list(graph.nodes)):
        if not hoistable(node):
            continue
        user_keys = {key_of.get(u) for u in node.users}
        if len(user_keys) == 1 and None not in user_keys:
            (key,) = user_keys
            if deps[node] <= key:
                key_of[node] = key
                continue
        key_of[node] = deps[node]
    groups: dict[frozenset[str], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node in key_of:
            groups[key_of[node]].append(node)
    regions = []
    for key, group in groups.items():
        nodes = _without_cycles(graph, group)
        compute = [n for n in nodes if n.target not in _VIEW_OPS]
        if any(n.target in GEMMS for n in nodes) or len(compute) >= MIN_OPS_WITHOUT_GEMM:
            order = [n for n in tensor_inputs if n.name in key]
            regions.append((tuple(order), nodes))
    if not regions:
        return [], ("no GEMM or table depends only on the conditioning inputs "
                    f"({', '.join(sorted(keys_allowed))})")
    return regions, ""


def kept_collectives(graph: fx.Graph, declared: tuple[str, ...] = ()) -> list[fx.Node]:
    """Collectives (waits aside) that depend only on conditioning inputs: hoistable but for
    being collectives. A cache hit would skip one on this rank only, and ranks that disagree on
    hit or miss (another timestep tensor object, a bumped version) wait on each other forever."""
    names = {n.name for n in graph.nodes if n.op == "placeholder"
             and isinstance(n.meta.get("val"), torch.Tensor)}
    deps = {n: s & names for n, s in dependency_sets(graph).items()}
    output = next(n for n in graph.nodes if n.op == "output")
    keys = frozenset(n.name for n in conditioning_inputs(graph, declared))
    return [n for n in graph.nodes if is_collective(n) and n.target is not _WAIT
            and deps[n] and deps[n] < deps[output] and deps[n] <= keys]


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _without_cycles(graph: fx.Graph, nodes: list[fx.Node]) -> list[fx.Node]:
    """Drop region nodes that read a value computed outside the region from inside it: one
    call cannot both produce and consume it."""
    region, tainted = set(nodes), set()
    for node in graph.nodes:
        reads_outside_result = any(i in tainted for i in node.all_input_nodes)
        if node in region:
            if reads_outside_result:
                region.discard(node)
                tainted.add(node)
        elif reads_outside_result or any(i in region for i in node.all_input_nodes):
            tainted.add(node)
    return [n for n in nodes if n in region]


def _extract_region(gm: fx.GraphModule, key: tuple[fx.Node, ...],
                    nodes: list[fx.Node]) -> CachedRegion:
    """Move ``nodes`` into a CachedRegion submodule called from ``gm``'s graph."""
    inside = set(nodes)
    inputs: list[fx.Node] = list(key)
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in inside and inp not in inputs and inp.op != "get_attr":
                inputs.append(inp)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]

    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        env[inp] = sub.placeholder(inp.name)
        env[inp].meta = dict(inp.meta)
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp.op == "get_attr" and inp not in env:
                env[inp] = sub.get_attr(inp.target)
                env[inp].meta = dict(inp.meta)
        env[node] = sub.node_copy(node, lambda a: env[a])
    out_node = sub.output(tuple(env[o] for o in outputs))
    out_node.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    region = fx.GraphModule(gm, sub)
    module = CachedRegion(region, tuple(range(len(key))), tuple(k.name for k in key))

    name, i = "_kopt_hoist", 0
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    gm.add_submodule(f"{name}_{i}", module)
    with gm.graph.inserting_before(outputs[0]):
        call = gm.graph.call_module(f"{name}_{i}", tuple(inputs))
    call.meta["val"] = out_node.meta["val"]
    for j, o in enumerate(outputs):
        with gm.graph.inserting_after(call):
            piece = gm.graph.call_function(operator.getitem, (call, j))
        piece.meta = dict(o.meta)
        o.replace_all_uses_with(piece, delete_user_cb=lambda u: u not in inside)
    for node in reversed(nodes):
        if not node.users:
            gm.graph.erase_node(node)
    return module


