"""The cached region a hoisted graph calls: a graph module run only when its key changes.

:class:`CachedRegion` wraps a region of work that depends on only some of a graph's inputs
(:mod:`kopt.passes.hoist` builds them). Its cache key is safe without reading tensor values (no
device sync): the *identity* and version counter of each key input (diffusers and SGLang pass the
same timestep tensor to both calls of a step; an in-place change bumps the version) and the
version counters of the parameters the region reads (a weight changed in place invalidates it).
Each region holds :data:`CACHE_ENTRIES` entries (least recently used out), so memory is bounded.

It lives with the graph utilities because every later layer reads it: the hoisting pass makes
it, the cost model counts its nodes, the CUDA-graph runner splits it out of the captured body.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from kopt.graph.query import attr, is_view, structural_key

# Entries per region: the two calls of a CFG pair may alternate two keys (cond/uncond masks).
CACHE_ENTRIES = 2
# Key tensors of at most this many elements also match a held entry by value (bitwise) when
# they are other tensors: QwenImagePipeline computes `timestep / 1000` afresh for each call of
# a CFG pair. A compare costs a host sync; after this many compares in a row that found nothing
# (a new timestep every call: no CFG pair) a region matches by identity only.
MAX_VALUE_KEY_ELEMENTS = 1 << 16
VALUE_MISSES_IN_A_ROW = 8
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layout(values: Any) -> tuple:
    """Each tensor's strides, dtype and device (None for a non-tensor)."""
    return tuple((v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else None
                 for v in values)


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
        # the region's execution plan (kopt.runtime), for inputs of this layout; kept out of
        # the module tree (a runtime form, not a part of the graph to count, save or move)
        object.__setattr__(self, "planned", None)
        self.planned_for: tuple = ()

    def set_plan(self, planned: fx.GraphModule | None, for_layout: tuple) -> None:
        """Compute misses with ``planned`` (bitwise ``region``) when the inputs have
        ``for_layout`` (:func:`layout`): a plan is traced and recorded for its inputs' strides
        and dtypes (the verifier's fp64 run calls the region with others)."""
        object.__setattr__(self, "planned", planned)
        self.planned_for = for_layout

    def _compute(self, *args: Any) -> Any:
        planned = self.planned
        if planned is not None and layout(args) == self.planned_for:
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
                        and all(same_value(a, b) for a, b in zip(keys, held, strict=True))):
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


def same_value(a: Any, b: Any) -> bool:
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


def cached_regions(gm: fx.GraphModule) -> list[CachedRegion]:
    return [m for m in gm.modules() if isinstance(m, CachedRegion)]


def trailing_views(region: fx.Graph) -> set[fx.Node]:
    """The region's views that only cut its results into its outputs (W1: the 360 splits,
    718 unsqueezes and 1082 getitems that cut the one merged modulation GEMM per block), over
    bases that are contiguous tensors. A CUDA graph replays a view for free while the eager
    prelude pays each one's dispatch (4.9 ms of host time per miss on W1; RESULTS.md, 2026-12-02,
    H200), so the
    CUDA-graph runner computes these in the captured body from the region's bases
    (:func:`kopt.cudagraphs.split_hoisted`). A contiguous base keeps the views valid on the
    graph's own copy of it (a clone of a strided tensor may be laid out otherwise)."""
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
