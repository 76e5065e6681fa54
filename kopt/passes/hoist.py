"""Hoisting: work that depends on only some of the inputs is done once per distinct value of
those inputs, and reused across calls.

    # F(x_t, t, c) and F(x_t, t, u): modulation(t) computed once for the CFG pair

Classifier-free guidance runs the denoiser twice per step with the same latents and timestep and
different text. A node whose value depends (:mod:`kopt.graph.deps`) only on *conditioning*
inputs and parameters -- the timestep embedding and every block's modulation GEMM depend on
``{timestep}`` (FLUX.2: ``{timestep, guidance}``) -- is the same in both calls. Each group of
such nodes with one dependency set ``S`` becomes one :class:`CachedRegion` call in the per-call
graph, which recomputes only when the key changes.

Conditioning inputs are found automatically: floating-point tensor inputs at least
:data:`CONDITIONING_RATIO` times smaller than the largest one (timestep and guidance are
``[batch]``, pooled embeddings ``[batch, 768]``), as opposed to the latent and text
activations, which change between the two calls or every step and would make a cache miss while
holding activation-sized memory. More can be declared by name
(``PassConfig(hoist=("hidden_states",))``: the CFG pair also shares the latents, so everything
before block 0's joint attention on the image side is then cached too).

The cache key is safe without reading tensor values (no device sync): the *identity* and version
counter of each key input (diffusers and SGLang pass the same timestep tensor to both calls of a
step; an in-place change bumps the version) and the version counters of the parameters the region
reads (a weight changed in place invalidates it). Each region holds :data:`CACHE_ENTRIES`
entries (least recently used out), so memory is bounded and reported at build time. A region is
cached if it has a GEMM or a table's worth of ops (:data:`MIN_OPS_WITHOUT_GEMM`); a few
element-wise ops save less than the key check costs.
"""

from __future__ import annotations

import operator
import time
from collections import defaultdict
from typing import Any

import torch
from torch import fx

import kopt.codegen.gemm  # noqa: F401 -- registers kopt::fp8_gemm
from kopt.graph import attr, describe_node, stable_topo_sort, structural_key
from kopt.graph.deps import dependency_sets, is_effectful
from kopt.graph.splice import eliminate_dead
from kopt.passes.base import Pass, PassResult, count_nodes
from kopt.patterns.collectives import KEEP_PER_CALL, is_collective
from kopt.patterns.core import Rejection, exact

aten = torch.ops.aten

# A floating-point input this many times smaller than the largest is a conditioning input.
CONDITIONING_RATIO = 64

# Entries per region: the two calls of a CFG pair may alternate two keys (cond/uncond masks).
CACHE_ENTRIES = 2
# Key tensors of at most this many elements also match a held entry by value (bitwise) when
# they are other tensors: QwenImagePipeline computes `timestep / 1000` afresh for each call of
# a CFG pair. A compare costs a host sync; after this many compares in a row that found nothing
# (a new timestep every call: no CFG pair) a region matches by identity only.
MAX_VALUE_KEY_ELEMENTS = 1 << 16
VALUE_MISSES_IN_A_ROW = 8
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

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


class CachedRegion(torch.nn.Module):
    """Runs ``region`` unless its key inputs and parameters are the ones of the last call."""

    def __init__(self, region: fx.GraphModule, key_positions: tuple[int, ...],
                 key_names: tuple[str, ...]) -> None:
        super().__init__()
        self.region = region
        self.key_positions = key_positions
        self.key_names = key_names
        self.bind_params()
        self._entries: list[tuple[tuple[Any, ...], tuple[int, ...], Any]] = []
        self.hits = 0
        self.misses = 0
        self.value_misses = 0  # value compares in a row that found no entry
        # the region's execution plan (kopt.runtime), for inputs of these strides
        self.planned: fx.GraphModule | None = None
        self.planned_strides: tuple = ()

    def set_plan(self, planned: fx.GraphModule, strides: tuple) -> None:
        """Compute misses with ``planned`` (bitwise ``region``) when the inputs have
        ``strides``."""
        self.planned, self.planned_strides = planned, strides

    def _compute(self, *args: Any) -> Any:
        planned = self.planned
        if planned is not None and tuple(
                a.stride() if isinstance(a, torch.Tensor) else None
                for a in args) == self.planned_strides:
            return planned(*args)
        return self.region(*args)

    def bind_params(self) -> None:
        """(Re)read the tensors the region's graph reads; call after swapping an attribute."""
        self.params = [attr(self.region, n.target) for n in self.region.graph.nodes
                       if n.op == "get_attr"]
        self.clear()

    def _versions_now(self, keys: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(k._version for k in keys if isinstance(k, torch.Tensor)) + tuple(
            p._version for p in self.params)

    def forward(self, *args: Any) -> Any:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # A CUDA graph replays whatever this call does, without re-running the key check:
            # a hit captured now would replay stale outputs for every later key. Compute.
            return self._compute(*args)
        keys = tuple(args[i] for i in self.key_positions)
        versions = self._versions_now(keys)
        for i, (held, held_versions, _) in enumerate(self._entries):
            if versions == held_versions and all(a is b for a, b in zip(keys, held, strict=True)):
                return self._hit(i, keys, versions)
        if self._entries and self.value_misses < VALUE_MISSES_IN_A_ROW and _small(keys):
            # Another tensor with the same value (a pipeline that computes the timestep afresh
            # for each call of a CFG pair): compare values, one host sync.
            for i, (held, held_versions, _) in enumerate(self._entries):
                # the held keys and the parameters unchanged since the entry was made
                if (self._versions_now(held) == held_versions
                        and all(_same_value(a, b) for a, b in zip(keys, held, strict=True))):
                    self.value_misses = 0
                    return self._hit(i, keys, versions)
            self.value_misses += 1
        self.misses += 1
        out = self._compute(*args)
        # The entry keeps the key tensors alive: their ids cannot be reused by other tensors.
        self._entries.append((keys, versions, out))
        del self._entries[:-CACHE_ENTRIES]
        return out

    def _hit(self, i: int, keys: tuple[Any, ...], versions: tuple[int, ...]) -> Any:
        self.hits += 1
        outputs = self._entries.pop(i)[2]
        self._entries.append((keys, versions, outputs))  # most recently used last, new keys
        return outputs

    @property
    def shareable(self) -> bool:
        """True when the key inputs are all the region reads (besides parameters): then two
        graphs with this same region code compute the same values from the same key."""
        n_inputs = sum(1 for n in self.region.graph.nodes if n.op == "placeholder")
        return n_inputs == len(self.key_positions)

    def share_key(self) -> tuple:
        out = next(n for n in self.region.graph.nodes if n.op == "output")
        return (structural_key(self.region, list(out.all_input_nodes)), self.key_names)

    def cached_bytes(self) -> int:
        vals = [n.meta.get("val") for n in self.region.graph.nodes if n.op == "output"]
        leaves = torch.utils._pytree.tree_leaves(vals)
        one = sum(v.numel() * v.element_size() for v in leaves if isinstance(v, torch.Tensor))
        return one * CACHE_ENTRIES

    def clear(self) -> None:
        self._entries = []
        self.value_misses = 0


def _small(keys: tuple[Any, ...]) -> bool:
    return all(not isinstance(k, torch.Tensor) or k.numel() <= MAX_VALUE_KEY_ELEMENTS
               for k in keys)


def _same_value(a: Any, b: Any) -> bool:
    """Bitwise equal tensors (0.0 and -0.0 differ, a NaN equals itself), or equal non-tensors."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)
                          and type(a) is type(b) and a == b)
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        a, b = a.view(_SAME_SIZE_INT[a.element_size()]), b.view(_SAME_SIZE_INT[b.element_size()])
    return torch.equal(a, b)


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


def cached_regions(gm: fx.GraphModule) -> list[CachedRegion]:
    return [m for m in gm.modules() if isinstance(m, CachedRegion)]


def trailing_views(region: fx.Graph) -> set[fx.Node]:
    """The region's views that only cut its results into its outputs (W1: the 360 splits,
    718 unsqueezes and 1082 getitems that cut the one merged modulation GEMM per block), over
    bases that are contiguous tensors. A CUDA graph replays a view for free while the eager
    prelude pays each one's dispatch (4.9 ms of host time per miss on W1, session 23), so the
    CUDA-graph runner computes these in the captured body from the region's bases
    (:func:`kopt.cudagraphs.split_hoisted`). A contiguous base keeps the views valid on the
    graph's own copy of it (a clone of a strided tensor may be laid out otherwise)."""
    from kopt.cost.counts import is_view  # counts imports this module

    nodes = list(region.nodes)
    sunk = {n for n in nodes if n.op == "call_function" and is_view(n)}

    def base_ok(i: fx.Node) -> bool:
        v = i.meta.get("val")
        return isinstance(v, torch.Tensor) and v.is_contiguous()

    changed = True
    while changed:
        changed = False
        for n in reversed(nodes):  # every user an output or another trailing view
            if n in sunk and any(u.op != "output" and u not in sunk for u in n.users):
                sunk.discard(n)
                changed = True
        for n in nodes:  # every input another trailing view or a contiguous base
            if n in sunk and any(i not in sunk and not base_ok(i) for i in n.all_input_nodes):
                sunk.discard(n)
                changed = True
    return sunk
