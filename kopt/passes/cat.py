"""Concatenations of strided views as whole-row copies.

    cat([v_txt, v_img], 1) -> kopt::cat_rows([v_txt, v_img], 1)

where each input is a view whose values after the cat dim are contiguous per row (a slice of a
merged projection's output: ``[B, S, H, D]`` out of ``[B, S, 3 H D]``). ATen copies such inputs
element by element; ``kopt::cat_rows`` copies whole rows as vectors (see
:mod:`kopt.codegen.kernels.cat_rows`). This is the V half of a joint-attention block's
[text; image] concatenation that ``fuse_qk_norm_rope`` leaves (Q and K are written joint by the
fused kernel), and any other cat of such slices. A copy: exact.

Runs after the passes that fuse a cat into a kernel of their own (``fuse_act_quant``,
``fuse_act``) and after ``fold_constants`` (a cat of weights is done once at load anyway).
Not rewritten: a cat of contiguous tensors (ATen's kernel vectorizes those), of inputs that
cannot be viewed as rows, of rows shorter than ``MIN_ROW_BYTES`` (a cat along the last dim,
such as RoPE's rotate-half), or of mixed dtypes.

An input that is ``view(p + b)`` (``b`` one vector of a row's values, the add read only there:
the V slice of a merged projection whose bias its GEMM left standing, the blockwise FP8 GEMM's,
split per slice by :mod:`kopt.patterns.bias`) is read as ``view(p)`` with ``b`` added in the
copy: one pass over V instead of two.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import fx

from kopt.codegen.kernels.cat_rows import cat_rows, row_view
from kopt.graph import bias_add_operands
from kopt.graph.splice import infer_meta
from kopt.passes.base import NodeSitePass
from kopt.patterns.core import exact

aten = torch.ops.aten


# The kernel runs a program per row (and per 4096-element chunk of it): rows shorter than this
# would make it a launch of near-empty programs (a cat along the last dim has rows of one
# element). The joint V rows it is for are 6 KiB (W1) and 12 KiB (W2); a guard, not a measured
# crossover.
MIN_ROW_BYTES = 128


class _Site(NamedTuple):
    tensors: list[fx.Node]
    dim: int
    # per input: (p, bias) when the input is view(p + bias) and the copy adds the bias
    biased: list[tuple[fx.Node, fx.Node] | None]


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _biased(t: fx.Node, dim: int) -> tuple[fx.Node, fx.Node] | None:
    """``(p, b)`` if ``t`` is ``view(p + b)``, ``b`` one vector of the row's values after
    ``dim``, and ``view(p)`` is a view (no copy)."""
    if t.op != "call_function" or t.target not in _VIEWS or len(t.users) != 1:
        return None
    add = t.args[0]
    found = bias_add_operands(add)
    tv = t.meta["val"]
    if found is None or len(add.users) != 1 \
            or add.meta["val"].shape[-1] != math.prod(tv.shape[dim + 1:]):
        return None  # (the bias must be one vector of a row's values after the cat dim)
    try:
        view = found[0].meta["val"].view(tv.shape)  # a fake tensor: strides only
    except (RuntimeError, ValueError):
        return None
    return found if not isinstance(row_view(view, dim), str) else None


def cat_site(node: fx.Node) -> _Site | str | None:
    """What :class:`CatRows` rewrites at ``node``, why not, or None (not a cat)."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 \
            or not all(isinstance(t, fx.Node) for t in tensors):
        return None
    vals = [t.meta.get("val") for t in tensors]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    if len({v.dtype for v in vals}) != 1 or len({v.dim() for v in vals}) != 1:
        return "inputs of mixed dtypes or ranks"
    dim = dim % vals[0].dim()
    biased = [_biased(t, dim) for t in tensors]
    if any(biased):
        vals = [v if bp is None else bp[0].meta["val"].view(v.shape)
                for v, bp in zip(vals, biased, strict=True)]
    elif all(v.is_contiguous() for v in vals):
        return "inputs contiguous: ATen's cat already copies them as vectors"
    for v in vals:
        why = row_view(v, dim)
        if isinstance(why, str):
            return why
    row_bytes = math.prod(vals[0].shape[dim + 1:]) * vals[0].element_size()
    if row_bytes < MIN_ROW_BYTES:
        return (f"rows of {row_bytes} bytes: too short for row copies (a program per row; "
                f"ATen's cat, e.g. RoPE's rotate-half)")
    return _Site(list(tensors), dim, biased)


class CatRows(NodeSitePass):
    name = "cat_rows"
    numerics = exact("a copy: every value lands where torch.cat puts it")

    def find(self, node: fx.Node) -> _Site | str | None:
        return cat_site(node)

    def apply(self, gm: fx.GraphModule, node: fx.Node, site: _Site) -> None:
        g = gm.graph
        tensors, biases = list(site.tensors), None
        with g.inserting_before(node):
            if any(site.biased):
                biases = []
                for i, (t, bp) in enumerate(zip(site.tensors, site.biased, strict=True)):
                    biases.append(None if bp is None else bp[1])
                    if bp is not None:
                        tensors[i] = g.call_function(aten.view.default,
                                                     (bp[0], list(t.meta["val"].shape)))
                        infer_meta(gm, tensors[i])
            new = g.call_function(cat_rows, (tensors, site.dim) + ((biases,) if biases else ()))
        infer_meta(gm, new)
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(new)
        g.erase_node(node)
        for t, bp in zip(site.tensors, site.biased, strict=True):
            if bp is not None:  # the view of the add, then the add
                add = t.args[0]
                g.erase_node(t)
                g.erase_node(add)
