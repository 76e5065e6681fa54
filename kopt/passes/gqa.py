"""Grouped-query attention without the copies of K and V per query head.

Grouped-query attention (Llama, Qwen, Mistral: 8 K/V heads for 32 query heads) is written in
Hugging Face's models as ``repeat_kv``: K and V are expanded to one head per query head and
copied (``reshape`` of an ``expand`` is a ``clone``), then attention runs as plain multi-head
attention. In decode the copies move ``rep`` times the whole KV cache per layer per step: on
an H200, for Qwen3-8B's shapes at batch 64 over a 640-token cache, 26.4 of the step's 37.1 ms
of kernel time, profiled (RESULTS.md, 2026-11-30, H200).

The rewrite folds the query heads that share a K/V head into the query rows instead::

    # q: [B, Hkv*rep, 1, D]; k = view(clone(expand(unsqueeze(k_kv, 2), [B, Hkv, rep, S, D])))
    sdpa(q, repeat(k_kv), repeat(v_kv), mask)
      -> reshape(sdpa(q.reshape(B, Hkv, rep, D), k_kv, v_kv, mask'), [B, Hkv*rep, 1, Dv])

Query head ``h = kvh * rep + r`` (the repeat's order) becomes row ``r`` of K/V head ``kvh``;
every row still attends over the same keys with the same scale and mask row (a mask per head is
regrouped like the heads), so each output is the same softmax-weighted sum: the numerics differ
only in the attention kernel's blocking (tolerance tier). Any SDPA backend runs it (it is
ordinary attention with ``Hkv`` heads), unlike ``enable_gqa``, which not every backend takes
together with a mask. Decode only (one query row, ``L = 1``): with several rows the output of
the folded attention is laid out otherwise than the ops after attention view it (and prefill's
repeat is a smaller share of its time). Not rewritten: a causal flag, dropout, or a repeated
K/V that something else reads too (its copy would stay).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import fx

from kopt.graph.splice import infer_meta
from kopt.passes.base import NodeSitePass
from kopt.patterns.core import tolerance

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class _Site(NamedTuple):
    k: fx.Node  # [B, Hkv, S, D], before the repeat
    v: fx.Node
    rep: int
    mask: fx.Node | None


def _repeated(node: Any) -> tuple[fx.Node, int] | str | None:
    """(the K/V node before the repeat, rep) if ``node`` is ``repeat_kv``'s output
    ``view(clone(expand(unsqueeze(x, 2), [B, Hkv, rep, S, D])), [B, Hkv * rep, S, D])``."""
    if not isinstance(node, fx.Node) or node.target not in _VIEWS:
        return None
    src = node.args[0]
    chain = [node]
    if isinstance(src, fx.Node) and src.target is aten.clone.default:
        chain.append(src)
        src = src.args[0]
    if not isinstance(src, fx.Node) or src.target is not aten.expand.default:
        return None
    chain.append(src)
    unsq = src.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target is not aten.unsqueeze.default or \
            unsq.args[1] != 2:
        return None
    x = unsq.args[0]
    xv, ev, ov = (n.meta.get("val") for n in (x, src, node))
    if not all(isinstance(t, torch.Tensor) for t in (xv, ev, ov)) or xv.dim() != 4:
        return None
    b, hkv, s, d = xv.shape
    rep = ev.shape[2]
    if tuple(ev.shape) != (b, hkv, rep, s, d) or tuple(ov.shape) != (b, hkv * rep, s, d):
        return None
    if any(len(n.users) != 1 for n in chain):
        return "the repeated K/V is read elsewhere: its copy would stay"
    return x, rep


def gqa_site(node: fx.Node) -> _Site | str | None:
    """What :class:`FoldGroupedQueryHeads` rewrites at ``node``, why not, or None."""
    if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    if args.get("enable_gqa"):
        return None
    k, v = _repeated(args["key"]), _repeated(args["value"])
    if k is None or v is None:
        return None
    if isinstance(k, str) or isinstance(v, str):
        return k if isinstance(k, str) else v
    if k[1] != v[1] or k[1] < 2:
        return "K and V repeated differently"
    if args.get("dropout_p", 0.0):
        return "dropout"
    if args.get("is_causal", False):
        return "causal: the folded query rows would not line up with the keys"
    q, mask = args["query"], args.get("attn_mask")
    qv = q.meta.get("val") if isinstance(q, fx.Node) else None
    if not isinstance(qv, torch.Tensor) or qv.dim() != 4 or qv.shape[1] != \
            k[0].meta["val"].shape[1] * k[1]:
        return "query heads are not K/V heads x rep"
    if qv.shape[2] != 1:
        return ("several query rows (prefill): the folded output would not have the layout "
                "the ops after attention view it in")
    if mask is not None:
        mv = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if not isinstance(mv, torch.Tensor) or mv.dim() != 4 or mv.shape[1] not in (1,
                                                                                    qv.shape[1]):
            return "mask is not [B, 1 or heads, L, S]"
    return _Site(k[0], v[0], k[1], mask)


class FoldGroupedQueryHeads(NodeSitePass):
    name = "fold_gqa"
    numerics = tolerance("each query head attends over the same keys; only the attention "
                         "kernel's blocking changes")

    def find(self, node: fx.Node) -> _Site | str | None:
        return gqa_site(node)

    def apply(self, gm: fx.GraphModule, node: fx.Node, site: _Site) -> None:
        g = gm.graph
        q = node.args[0]
        b, hq, _, d = q.meta["val"].shape
        hkv, rep = hq // site.rep, site.rep
        dv = node.meta["val"].shape[-1]

        def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
            n = g.call_function(target, args, kwargs)
            infer_meta(gm, n)
            return n

        with g.inserting_before(node):
            q2 = call(aten.reshape.default, q, [b, hkv, rep, d])
            mask = site.mask
            if mask is not None and mask.meta["val"].shape[1] == hq:
                # one mask per query head: regrouped as the query heads are (one query row)
                mb, _, _, ms = mask.meta["val"].shape
                mask = call(aten.reshape.default, mask, [mb, hkv, rep, ms])
            kwargs = {k: v for k, v in node.kwargs.items() if k == "scale"}
            out = call(aten.scaled_dot_product_attention.default, q2, site.k, site.v, mask,
                       **kwargs)
            back = call(aten.reshape.default, out, [b, hq, 1, dv])
        back.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(back)
        g.erase_node(node)
