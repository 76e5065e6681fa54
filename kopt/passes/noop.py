"""Remove copies that only exist because the graph is functional, and casts that name a tensor
they do not read.

    # clone(x) -> x          (x dense: the copy has x's strides; nothing mutates either)
    # dropout(x, p, False) -> x
    # type_as(x, y) -> x                     (x already has y's dtype)
    # type_as(x, y) -> _to_copy(x, dtype=d)  (d: y's dtype; the form x.to(d) exports as)

``torch.export`` traces ``F.dropout(x, p, training=False)`` -- every dropout of a model in eval
mode -- as ``aten.clone``: a full read and write of the activation that eager mode never does
(dropout returns its input). On Qwen-Image at 1024x1024 the copies after the attention and
feed-forward outputs cost 3.6 ms per forward on an H200 (benchmarks/RESULTS.md).

``type_as(x, y)`` reads ``y`` for its dtype alone, but in the graph it is an edge from ``y``:
Gemma's RMSNorm ends ``out.type_as(x)`` with ``x`` the norm's own input, so a fusion of
residual + norm saw its output read its intermediate and gave up (the zoo's Gemma 2 and 3;
RESULTS.md, 2026-12-03, CPU). As a cast of ``x`` alone, it is what ``x.to(d)`` (Llama's,
Qwen3's norms) is.
"""

from __future__ import annotations

import torch
from torch import fx

from kopt.passes.base import NodeSitePass
from kopt.patterns.core import exact

aten = torch.ops.aten


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a preserve-format copy of it has the same strides."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in order:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def noop_input(node: fx.Node) -> fx.Node | torch.dtype | str | None:
    """The node a no-op copy can be replaced by, the dtype a ``type_as`` casts to, or the
    reason it cannot be replaced (None: neither a copy nor a ``type_as``)."""
    if node.op != "call_function":
        return None
    if node.target is aten.dropout.default:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        return node.args[0] if train is False else "dropout in training mode"
    if node.target is aten.alias.default:
        return node.args[0]
    if node.target is aten.type_as.default:
        return _cast(node)
    if node.target is not aten.clone.default:
        return None
    src = node.args[0]
    fmt = node.kwargs.get("memory_format")
    if fmt not in (None, torch.preserve_format):
        return "clone changes the memory format"
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return None
    if not _dense(src.meta["val"]):
        return "input is not dense: the copy changes strides"
    if src.op in ("placeholder", "get_attr") or any(u.op == "output" for u in node.users):
        return "copy separates a graph input/output from the caller's tensor"
    return src


def _cast(node: fx.Node) -> fx.Node | torch.dtype | str | None:
    """``type_as(x, y)``: x (y's dtype already), y's dtype (a cast), or why neither."""
    x, y = node.args[:2]
    vals = [getattr(a, "meta", {}).get("val") for a in (x, y)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    if vals[0].device != vals[1].device:
        return "type_as moves the tensor to another device"
    if vals[0].dtype == vals[1].dtype:
        if x.op in ("placeholder", "get_attr") and any(u.op == "output" for u in node.users):
            return "type_as of a graph input returned: the output would be the caller's tensor"
        return x  # eager returns x itself
    return vals[1].dtype


class RemoveNoOps(NodeSitePass):
    name = "remove_noops"
    numerics = exact("a copy of a value is the value; a cast is the same cast")

    def find(self, node: fx.Node) -> fx.Node | torch.dtype | str | None:
        return noop_input(node)

    def apply(self, gm: fx.GraphModule, node: fx.Node, found: fx.Node | torch.dtype) -> None:
        if isinstance(found, torch.dtype):  # type_as(x, y) -> x.to(y's dtype)
            with gm.graph.inserting_before(node):
                found_node = gm.graph.call_function(aten._to_copy.default, (node.args[0],),
                                                    {"dtype": found})
            found_node.meta = dict(node.meta)
            found = found_node
        node.replace_all_uses_with(found)

def reinplace_site(node: fx.Node) -> tuple[fx.Node, fx.Node] | str | None:
    """(buffer, the copy back into it) when ``node`` is a functional cache update that can run
    in place, the reason it cannot, or None (not one)."""
    if node.op != "call_function" or node.target is not aten.index_copy.default:
        return None
    buf = node.args[0]
    if not isinstance(buf, fx.Node) or buf.op not in ("placeholder", "get_attr"):
        return "not an update of a graph input or buffer"
    back = [u for u in buf.users if u.op == "call_function" and u.target is aten.copy_.default
            and u.args[0] is buf and u.args[1] is node]
    if len(back) != 1:
        return "the result is not copied back into the buffer"
    if set(buf.users) != {node, back[0]}:
        return "the buffer is read elsewhere: writing it in place would change what that reads"
    if any(u.op == "output" for u in node.users):
        return "the updated cache is a graph output: in place it would alias the buffer"
    return buf, back[0]


class ReinplaceCacheUpdates(NodeSitePass):
    """Write a cache update into its buffer instead of into a new tensor copied back::

        # copy_(cache, index_copy(cache, d, i, v)) -> index_copy_(cache, d, i, v)

    ``torch.export`` makes the KV cache's in-place ``index_copy_`` functional: the update writes
    a whole new cache, and the graph's last nodes copy it back into the buffer, two full copies
    of the cache per layer per step where eager mode writes the new tokens only (a decode step
    of Qwen3-8B's shapes at batch 64 over 640 cached: about 10 ms of the cost model's 35 on an
    H200, benchmarks/RESULTS.md). Only where nothing else reads the buffer, so every reader sees
    what it saw before."""

    name = "reinplace"
    numerics = exact("the same values written into the same buffer")

    def find(self, node: fx.Node) -> tuple[fx.Node, fx.Node] | str | None:
        return reinplace_site(node)

    def apply(self, gm: fx.GraphModule, node: fx.Node, found: tuple[fx.Node, fx.Node]) -> None:
        _, back = found
        with gm.graph.inserting_before(node):
            inplace = gm.graph.call_function(aten.index_copy_.default, node.args,
                                             dict(node.kwargs))
        inplace.meta = dict(node.meta)
        gm.graph.erase_node(back)
        node.replace_all_uses_with(inplace)
        gm.graph.erase_node(node)
