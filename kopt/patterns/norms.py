"""Recognising normalisations in a captured graph, whatever module wrote them.

Export keeps ``aten.layer_norm`` whole; an RMSNorm arrives either as ``aten.rms_norm`` or as the
decomposition a hand-written module produces (Llama/Qwen3, diffusers' ``RMSNorm``):

    xf = to_fp32(x); r = rsqrt(mean(xf ** 2, -1, keepdim) + eps); y = to_dtype(xf * r) [* w]

:func:`find_norm` returns a :class:`NormSite` for the node that produces the normalised value,
naming the input, the affine weight/bias, eps, and the nodes a fused kernel replaces. Matching is on
structure only: the reduced axis must be the last one, the same tensor must feed the square and
the scaling, and every internal node must have no user outside the norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

from kopt.graph import tensor_meta

aten = torch.ops.aten
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


@dataclass(frozen=True)
class NormSite:
    kind: Literal["layer", "rms"]
    x: fx.Node
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float
    out: fx.Node  # the node whose value is the normalised (and affine-transformed) result
    nodes: tuple[fx.Node, ...]  # every node of the norm, ``out`` included

    def internal_users_only(self) -> bool:
        inside = set(self.nodes)
        return all(u in inside for n in self.nodes if n is not self.out for u in n.users)


def _cast_dtype(n: fx.Node) -> torch.dtype | None:
    if n.target is aten._to_copy.default and set(n.kwargs) <= {"dtype"} and len(n.args) == 1:
        return n.kwargs.get("dtype")
    if n.target is torch.ops.prims.convert_element_type.default:
        return n.args[1]
    return None


def _last_dim(n: fx.Node, dims: object) -> bool:
    rank = tensor_meta(n).dim()
    return isinstance(dims, list | tuple) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def find_norm(node: fx.Node) -> NormSite | None:
    """The normalisation whose result ``node`` is, if it is one."""
    if node.op != "call_function":
        return None
    if node.target is aten.layer_norm.default:
        x, shape = node.args[0], node.args[1]
        w = node.args[2] if len(node.args) > 2 else None
        b = node.args[3] if len(node.args) > 3 else None
        eps = node.args[4] if len(node.args) > 4 else 1e-5
        if len(shape) != 1 or shape[0] != tensor_meta(x).shape[-1]:
            return None
        return NormSite("layer", x, w, b, float(eps), node, (node,))
    if node.target is aten.rms_norm.default:
        x, shape = node.args[0], node.args[1]
        w = node.args[2] if len(node.args) > 2 else None
        eps = node.args[3] if len(node.args) > 3 else None
        if len(shape) != 1 or eps is None:
            return None
        return NormSite("rms", x, w, None, float(eps), node, (node,))
    return _rms_decomposition(node)


def _strip_fp32_cast(n: object) -> tuple[object, list[fx.Node]]:
    if isinstance(n, fx.Node) and _cast_dtype(n) == torch.float32:
        return n.args[0], [n]
    return n, []


def _rms_core(scaled: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """``(x, eps, nodes)`` when ``scaled`` is ``x * rsqrt(mean(x ** 2, -1, keepdim) + eps)``, the
    square and the scaling reading ``x`` or its fp32 cast."""
    if scaled.op != "call_function" or scaled.target is not aten.mul.Tensor:
        return None
    for xs, r in ((scaled.args[0], scaled.args[1]), (scaled.args[1], scaled.args[0])):
        if not (isinstance(r, fx.Node) and r.target is aten.rsqrt.default):
            continue
        add = r.args[0]
        if not (isinstance(add, fx.Node) and add.target is aten.add.Tensor
                and isinstance(add.args[1], float)):
            continue
        mean = add.args[0]
        if not (isinstance(mean, fx.Node) and mean.target is aten.mean.dim
                and _last_dim(mean.args[0], mean.args[1]) and len(mean.args) > 2
                and mean.args[2]):
            continue
        sq = mean.args[0]
        if not (isinstance(sq, fx.Node) and sq.target is aten.pow.Tensor_Scalar
                and sq.args[1] == 2):
            continue
        x1, casts1 = _strip_fp32_cast(xs)
        x2, casts2 = _strip_fp32_cast(sq.args[0])
        if x1 is not x2 or not isinstance(x1, fx.Node):
            continue
        return x1, float(add.args[1]), [scaled, r, add, mean, sq, *casts1, *casts2]
    return None


def _rms_decomposition(node: fx.Node) -> NormSite | None:
    """``node`` = [w *] [cast](core) or [cast](core) [* w] (weight applied last)."""
    weight = None
    head: list[fx.Node] = []
    cur = node
    if cur.target is aten.mul.Tensor and _rms_core(cur) is None:
        a, b = cur.args
        for w, y in ((a, b), (b, a)):
            if isinstance(w, fx.Node) and isinstance(y, fx.Node) and w.op != "call_function" \
                    and tensor_meta(w).dim() == 1:
                weight, cur = w, y
                head.append(node)
                break
        else:
            return None
    if isinstance(cur, fx.Node) and _cast_dtype(cur) is not None:
        head.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node):
        return None
    core = _rms_core(cur)
    if core is None:
        return None
    x, eps, inner = core
    nodes = tuple(dict.fromkeys([node, *head, *inner]))
    return NormSite("rms", x, weight, None, eps, node, nodes)
