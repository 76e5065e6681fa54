"""QK-norm + RoPE: the per-head RMSNorm of q and k, the rotary embedding after it and the
concatenation of text and image tokens around them become one ``kopt::qk_norm_rope``.

    # rope(norm(q_txt) ++ norm(q_img)), rope(norm(k_txt) ++ norm(k_img))
    #     -> qk_norm_rope([q_txt, q_img], [k_txt, k_img], weights, tables)   (FLUX.2 double)
    # rope(norm(q_txt)) ++ rope(norm(q_img)), same for k -> qk_norm_rope(...)  (Qwen-Image)
    # rope(norm(q)), rope(norm(k)) -> qk_norm_rope([q], [k], ...)              (FLUX.2 single)
    # rope(norm(q)^T), rope(norm(k)^T) -> qk_norm_rope([q], [k], ...)^T          (Qwen3)

Found by structure alone, starting from each ``scaled_dot_product_attention``: its query and key
are followed back through layout ops (permute, transpose, GQA's expand) to a *unit*, which is a
RoPE (interleaved pairs written in real arithmetic, the same as a complex product, or
rotate-half) of an RMSNorm over the head dim (``aten.rms_norm`` or the hand-written
pow-mean-rsqrt form), possibly transposed [B, S, H, D] -> [B, H, S, D] in between, with
concatenations along the sequence axis before or after the RoPE. The fused op reads each
segment's q/k through its strides (views of the merged QKV output) and writes the concatenated
result in the layout the replaced node had.

Numerics: tolerance. On the CPU the op runs the models' own op sequence (bitwise equal); the
Triton kernel on the GPU sums the squares in another order (see
:mod:`kopt.codegen.kernels.qk_norm_rope`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from kopt.codegen.kernels import qk_norm_rope as kernel
from kopt.graph import (
    bias_add_operands,
    describe_node,
    fake_mode_of,
    infer_meta,
    op_name,
    tensor_meta,
)
from kopt.patterns.core import Match, Rejection, StructuralRewrite, tolerance

aten = torch.ops.aten
FUSED = torch.ops.kopt.qk_norm_rope.default
NAME = "fuse_qk_norm_rope"
SDPA = (aten.scaled_dot_product_attention.default,)
# What may stand between a unit's output and the attention that reads it.
_LAYOUT = (aten.permute.default, aten.transpose.int, aten.view.default, aten.reshape.default,
           aten._unsafe_view.default, aten.clone.default, aten.expand.default,
           aten.unsqueeze.default)
# A KV cache write: the new keys reach attention through the cache (LLM decode).
_CACHE_WRITES = {aten.index_copy.default: 3, aten.index_copy_.default: 3,
                 aten.slice_scatter.default: 1}
_CASTS = (aten._to_copy.default, aten.type_as.default)
_VIEWS = (aten.view.default, aten.reshape.default)


class _Miss(Exception):
    """The structure is not there; the message says what was found instead."""


@dataclass
class _Segment:
    x: fx.Node  # [B, S_i, H, D], read through its strides
    weight: fx.Node
    cos: fx.Node  # the table as the model multiplies by it ("complex": the complex frequencies)
    sin: fx.Node | None
    offset: int | None = None  # start of this segment in a table shared by several segments
    # x = view(pre + bias) with bias one vector of H D: the op reads view(pre) and adds the bias
    pre: fx.Node | None = None
    bias: fx.Node | None = None


@dataclass
class _Unit:
    out: fx.Node  # the node whose value the op's output replaces
    segments: list[_Segment]
    eps: float
    norm: str
    rope: str
    transposed: bool  # RoPE ran on [B, H, S, D]: the op's output is transposed back
    nodes: list[fx.Node] = field(default_factory=list)  # everything the op replaces
    # For the guard's dtype checks: what each norm returns and computes in, and the upcasts of
    # the RoPE's operands.
    norm_outs: list[fx.Node] = field(default_factory=list)
    norm_computes: list[fx.Node] = field(default_factory=list)
    rope_upcasts: list[fx.Node] = field(default_factory=list)


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: fx.Node) -> torch.Tensor:
    return tensor_meta(node)


def _dim(node: fx.Node, d: int) -> int:
    return d % _val(node).dim()


def _found(node: Any) -> str:
    return f"{op_name(node)} {node.name}" if isinstance(node, fx.Node) else repr(node)


def _strip_cast(node: Any, nodes: list[fx.Node], casts: list[fx.Node] | None = None) -> Any:
    if _is(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        nodes.append(node)
        if casts is not None:
            casts.append(node)
        return node.args[0]
    return node


# -- RMSNorm -----------------------------------------------------------------------------------
@dataclass
class _Norm:
    out: fx.Node
    x: fx.Node
    weight: fx.Node
    eps: float
    mode: str
    compute: fx.Node | None  # the value whose RMS is taken, x or x upcast (None: aten.rms_norm)
    nodes: list[fx.Node]


def _norm(y: Any) -> _Norm:
    """``aten.rms_norm(x, [D], w, eps)``, or ``w * cast(x * rsqrt(mean(x^2, -1) + eps))``."""
    if _is(y, aten.rms_norm.default):
        x, shape, w = y.args[:3]
        eps = y.args[3] if len(y.args) > 3 else y.kwargs.get("eps")
        if list(shape) != [_val(x).shape[-1]]:
            raise _Miss(f"{y.name} normalises over {list(shape)}, not the head dim alone")
        if w is None:
            raise _Miss(f"{y.name} has no weight")
        if eps is None:  # aten.rms_norm's default: the epsilon of its compute dtype
            dt = _val(x).dtype
            eps = torch.finfo(torch.float32 if dt in (torch.bfloat16, torch.float16) else dt).eps
        return _Norm(y, x, w, float(eps), "rms_norm", None, [y])
    if not _is(y, aten.mul.Tensor):
        raise _Miss(f"expected an RMSNorm, found {_found(y)}")
    for normed, w in (y.args, y.args[::-1]):
        if not isinstance(w, fx.Node) or _val(w).dim() != 1:
            continue
        nodes = [y]
        m = _strip_cast(normed, nodes)
        if not _is(m, aten.mul.Tensor):
            continue
        for src, r in (m.args, m.args[::-1]):
            if not _is(r, aten.rsqrt.default):
                continue
            add = r.args[0]
            mean = add.args[0] if _is(add, aten.add.Tensor) else None
            if not (_is(mean, aten.mean.dim) and isinstance(add.args[1], float | int)
                    and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))):
                raise _Miss(f"{r.name}: expected rsqrt(mean(x^2, keepdim=True) + eps)")
            dims = [_dim(mean, d) for d in mean.args[1]]
            if dims != [_val(mean).dim() - 1]:
                raise _Miss(f"{mean.name} takes the RMS over dim {mean.args[1]}, not the last "
                            "(head) dim")
            square = mean.args[0]
            if not _is(square, aten.pow.Tensor_Scalar) or square.args[1] != 2:
                raise _Miss(f"{mean.name}: expected the mean of x^2, found {_found(square)}")
            xf = square.args[0]
            x = _strip_cast(xf, nodes)
            if src is not xf and src is not x:
                raise _Miss(f"{m.name} scales {_found(src)}, not the tensor whose RMS is taken")
            nodes += [m, r, add, mean, square]
            return _Norm(y, x, w, float(add.args[1]), "cast", xf, nodes)
    raise _Miss(f"{y.name}: expected weight * (x * rsqrt(mean(x^2) + eps))")


# -- RoPE --------------------------------------------------------------------------------------
@dataclass
class _Rope:
    x: fx.Node
    cos: fx.Node
    sin: fx.Node | None
    style: str
    nodes: list[fx.Node]
    upcasts: list[fx.Node]  # casts of the operands before the products (not the final cast)


def _rotated(r: Any, nodes: list[fx.Node]) -> tuple[fx.Node, str]:
    """The tensor ``r`` is the rotation of, and how: ``stack(-x_odd, x_even)`` (pairs) or
    ``cat(-x[D/2:], x[:D/2])`` (half)."""
    if _is(r, *_VIEWS) and _is(r.args[0], aten.stack.default):
        stack = r.args[0]
        parts = stack.args[0]
        if len(parts) == 2 and _dim(stack, stack.args[1] if len(stack.args) > 1 else 0) \
                == _val(stack).dim() - 1 and _is(parts[0], aten.neg.default):
            odd, even = parts[0].args[0], parts[1]
            if _is(odd, operator.getitem) and _is(even, operator.getitem) \
                    and odd.args[0] is even.args[0] and (odd.args[1], even.args[1]) == (1, 0):
                unbind = odd.args[0]
                if _is(unbind, aten.unbind.int) and _is(unbind.args[0], *_VIEWS):
                    pairs = unbind.args[0]
                    if _val(pairs).shape[-1] == 2 and _dim(pairs, unbind.args[1]) == \
                            _val(pairs).dim() - 1:
                        nodes += [r, stack, parts[0], odd, even, unbind, pairs]
                        return pairs.args[0], "pairs"
    if _is(r, aten.cat.default) and len(r.args[0]) == 2 and \
            _dim(r, r.args[1] if len(r.args) > 1 else 0) == _val(r).dim() - 1:
        neg, first = r.args[0]
        if _is(neg, aten.neg.default):
            second, x1, x2 = neg.args[0], _half(first), _half(neg.args[0])
            if x1 is not None and x2 is not None and x1 == (x2[0], 0) and x2[1] == 1:
                # the halves' split, when x.chunk(2, -1) made them
                nodes += [r, neg, first, second] + [p.args[0] for p in (first, second)
                                                    if _is(p, operator.getitem)]
                return x1[0], "half"
    raise _Miss(f"expected a rotation of x (stack(-x_odd, x_even) or cat(-x2, x1)), found "
                f"{_found(r)}")


def _half(node: Any) -> tuple[fx.Node, int] | None:
    """``(x, 0)`` if ``node`` is the first half of x's last dim, ``(x, 1)`` the second: a slice,
    or a piece of ``x.chunk(2, -1)`` (a split)."""
    if _is(node, aten.slice.Tensor):
        x = node.args[0]
        last, d = _val(x).dim() - 1, _val(x).shape[-1]
        dim = _dim(x, node.args[1] if len(node.args) > 1 else 0)
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else d
        span = (dim, start or 0, min(end if end is not None else d, d))
        return (x, 0) if span == (last, 0, d // 2) else (x, 1) if span == (last, d // 2, d) \
            else None
    if _is(node, operator.getitem) and _is(node.args[0], aten.split.Tensor,
                                           aten.split_with_sizes.default):
        split = node.args[0]
        x = split.args[0]
        d = _val(x).shape[-1]
        sizes = split.args[1]
        halves = sizes == d // 2 if isinstance(sizes, int) else list(sizes) == [d // 2] * 2
        dim = _dim(x, split.args[2] if len(split.args) > 2 else 0)
        if halves and dim == _val(x).dim() - 1 and d % 2 == 0:
            return x, node.args[1]
    return None


def _rope(o: Any) -> _Rope:
    """``cast(x * cos + rot(x) * sin)`` or ``type_as(view_as_real(view_as_complex(x) * f))``."""
    nodes: list[fx.Node] = []
    casts: list[fx.Node] = []
    core = o
    if _is(o, *_CASTS):
        nodes.append(o)  # the cast back: the guard checks the unit's output dtype
        core = o.args[0]
    if _is(core, *_VIEWS) and _is(core.args[0], aten.view_as_real.default):
        mul = core.args[0].args[0]
        if not _is(mul, aten.mul.Tensor):
            raise _Miss(f"expected a complex product, found {_found(mul)}")
        for c, freqs in (mul.args, mul.args[::-1]):
            if _is(c, aten.view_as_complex.default) and _is(c.args[0], *_VIEWS) \
                    and isinstance(freqs, fx.Node) and _val(freqs).is_complex():
                nodes += [core, core.args[0], mul, c, c.args[0]]
                x = _strip_cast(c.args[0].args[0], nodes, casts)
                return _Rope(x, freqs, None, "complex", nodes, casts)
        raise _Miss(f"{mul.name}: expected view_as_complex(x) * frequencies")
    if not _is(core, aten.add.Tensor):
        raise _Miss(f"expected RoPE (x * cos + rot(x) * sin), found {_found(core)}")
    miss = None
    for m_x, m_rot in (core.args, core.args[::-1]):
        if not (_is(m_x, aten.mul.Tensor) and _is(m_rot, aten.mul.Tensor)):
            continue
        for r, sin in (m_rot.args, m_rot.args[::-1]):
            inner = list(nodes)
            inner_casts = list(casts)
            try:
                x, style = _rotated(_strip_cast(r, inner, inner_casts), inner)
            except _Miss as exc:
                miss = miss or exc
                continue
            for xc, cos in (m_x.args, m_x.args[::-1]):
                if xc is x or (_is(xc, aten._to_copy.default) and xc.args[0] is x):
                    if xc is not x:
                        inner.append(xc)
                        inner_casts.append(xc)
                    return _Rope(x, cos, sin, style, inner + [core, m_x, m_rot], inner_casts)
    raise miss or _Miss(f"{core.name}: expected x * cos + rot(x) * sin")


# -- units: segments of norm + RoPE ------------------------------------------------------------
def _seq_cat(node: Any) -> list[fx.Node] | None:
    """The parts of a concatenation along the sequence axis (dim 1 of [B, S, H, D])."""
    if _is(node, aten.cat.default) and _val(node).dim() == 4 and \
            _dim(node, node.args[1] if len(node.args) > 1 else 0) == 1 and len(node.args[0]) > 1:
        return list(node.args[0])
    return None


def _unit(out: fx.Node) -> _Unit:
    parts = _seq_cat(out)
    if parts is not None:  # per-segment RoPE, then the concatenation (Qwen-Image)
        unit = None
        for part in parts:
            rope = _rope(part)
            norm = _norm(rope.x)
            seg = _Segment(norm.x, norm.weight, rope.cos, rope.sin)
            if unit is None:
                unit = _Unit(out, [], norm.eps, norm.mode, rope.style, False, [out])
            elif (norm.eps, norm.mode, rope.style) != (unit.eps, unit.norm, unit.rope):
                raise _Miss(f"segments of {out.name} differ in norm or RoPE")
            unit.segments.append(seg)
            unit.nodes += rope.nodes + norm.nodes
            _note(unit, rope, norm)
        return _bind_biases(unit)
    rope = _rope(out)
    x, transposed, extra = rope.x, False, []
    if _is(x, aten.transpose.int) and sorted(_dim(x, d) for d in x.args[1:]) == [1, 2]:
        x, transposed, extra = x.args[0], True, [x]
    unit = _Unit(out, [], 0.0, "", rope.style, transposed, rope.nodes + extra,
                 rope_upcasts=list(rope.upcasts))
    parts = None if transposed else _seq_cat(x)
    offset = 0
    for part in parts or [x]:
        norm = _norm(part)
        unit.segments.append(_Segment(norm.x, norm.weight, rope.cos, rope.sin,
                                      offset if parts else None))
        offset += _val(part).shape[1]
        if unit.norm and (norm.eps, norm.mode) != (unit.eps, unit.norm):
            raise _Miss(f"segments of {x.name} differ in their norm")
        unit.eps, unit.norm = norm.eps, norm.mode
        unit.nodes += norm.nodes
        _note(unit, None, norm)
    if parts:
        unit.nodes.append(x)
    return _bind_biases(unit)


def _bind_biases(unit: _Unit) -> _Unit:
    """Take ``x = view(pre + bias)`` apart in every segment (the projection's bias, split per
    q / k / v slice by the bias pass), if every segment has one and nothing else reads the
    add or the view; otherwise leave the adds to run before the op."""
    found = []
    for seg in unit.segments:
        x = seg.x
        add = x.args[0] if _is(x, *_VIEWS, aten._unsafe_view.default) else None
        operands = bias_add_operands(add)
        if operands is None or len(add.users) != 1 \
                or _val(add).shape[-1] != _val(x).shape[2] * _val(x).shape[3]:
            return unit  # (the view must split the features into the heads)
        found.append((*operands, [x, add]))
    for seg, (pre, bias, nodes) in zip(unit.segments, found, strict=True):
        seg.pre, seg.bias = pre, bias
        unit.nodes += nodes
    return unit


def _note(unit: _Unit, rope: _Rope | None, norm: _Norm) -> None:
    unit.norm_outs.append(norm.out)
    if norm.compute is not None:
        unit.norm_computes.append(norm.compute)
    if rope is not None:
        unit.rope_upcasts += rope.upcasts


def _unit_reaching(node: Any, role: str) -> _Unit:
    """The unit whose output reaches an attention input through layout ops (or a KV cache
    write) only."""
    while True:
        try:
            return _unit(node)
        except _Miss as miss:
            if _is(node, *_CACHE_WRITES):
                node = node.args[_CACHE_WRITES[node.target]]
            elif _is(node, *_LAYOUT):
                node = node.args[0]
            else:
                raise _Miss(f"{role}: {miss}") from None


# -- matching and guarding ---------------------------------------------------------------------
def find_qk_norm_rope(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    for sdpa in gm.graph.nodes:
        if not _is(sdpa, *SDPA):
            continue
        try:
            uq = _unit_reaching(sdpa.args[0], "q")
            uk = _unit_reaching(sdpa.args[1], "k")
            if uk.out is uq.out:
                raise _Miss("q and k are one tensor")
            if (uq.norm, uq.rope, uq.eps, uq.transposed, len(uq.segments)) != \
                    (uk.norm, uk.rope, uk.eps, uk.transposed, len(uk.segments)):
                raise _Miss("q and k differ in norm, RoPE style, eps, layout or segments")
        except _Miss as miss:
            yield Rejection(NAME, sdpa.name, str(miss), near_miss=True)
            continue
        nodes = tuple(dict.fromkeys(uq.nodes + uk.nodes))
        yield Match(NAME, uq.out, nodes, {"q": uq, "k": uk, "attention": sdpa},
                    outputs=(uq.out, uk.out))


def why_not(gm: fx.GraphModule, match: Match) -> str | None:
    uq: _Unit = match.bindings["q"]
    uk: _Unit = match.bindings["k"]
    inside = set(match.nodes)
    for node in match.nodes:
        if node in (uq.out, uk.out):
            continue
        outside = [u.name for u in node.users if u not in inside]
        if outside:
            return (f"intermediate {node.name} ({op_name(node)}) is also used by "
                    f"{', '.join(outside)} outside the norm + RoPE")
    dtype = _val(uq.segments[0].x).dtype
    if dtype not in kernel.KERNEL_DTYPES:
        return f"q dtype {dtype} is not bf16/fp16/fp32"
    for unit, role in ((uq, "q"), (uk, "k")):
        reason = _dtype_problem(unit, role, dtype)
        if reason:
            return reason
    if [(s.cos, s.sin, s.offset) for s in uq.segments] != \
            [(s.cos, s.sin, s.offset) for s in uk.segments]:
        return "q and k use different rotary tables"
    with fake_mode_of(gm):
        try:
            tables = [_tables(uq, i, _run) for i in range(len(uq.segments))]
            kernel.check_args([_val(s.x) for s in uq.segments],
                              [_val(s.x) for s in uk.segments],
                              [_val(s.weight) for s in uq.segments],
                              [_val(s.weight) for s in uk.segments],
                              [_as_val(c) for c, _ in tables], [_as_val(s) for _, s in tables],
                              uq.norm, uq.rope)
        except (ValueError, RuntimeError, IndexError) as exc:
            return f"operands do not fit the fused op: {exc}"
    return None


def _dtype_problem(unit: _Unit, role: str, dtype: torch.dtype) -> str | None:
    """Where the unit rounds must be where the op rounds: the norm computes in fp32 and returns
    the activation's dtype; the RoPE computes in the promoted dtype of that and its tables (fp32
    for complex tables) and casts back to the activation's dtype."""
    for seg in unit.segments:
        if _val(seg.x).dtype != dtype:
            return f"{role} is {_val(seg.x).dtype}, q is {dtype}"
        if unit.norm == "cast" and _val(seg.weight).dtype != dtype:
            return f"{role}'s norm weight is {_val(seg.weight).dtype}, not {dtype}"
    for node in unit.norm_computes:
        if _val(node).dtype != torch.float32:
            return f"{role}'s RMS is computed in {_val(node).dtype}, not fp32"
    for node in unit.norm_outs:
        if _val(node).dtype != dtype:
            return f"{role}'s norm returns {_val(node).dtype}, not the input's {dtype}"
    table = unit.segments[0].cos
    compute = torch.float32 if unit.rope == "complex" else \
        torch.promote_types(dtype, _val(table).dtype)
    for node in unit.rope_upcasts:
        if _val(node).dtype != compute:
            return (f"{role}'s RoPE upcasts to {_val(node).dtype}, the op computes in {compute} "
                    f"({dtype} activations, {_val(table).dtype} tables)")
    if _val(unit.out).dtype != dtype:
        return f"{role}'s RoPE result is {_val(unit.out).dtype}, not {dtype} (no cast back)"
    return None


def _run(target: Callable, *args: Any) -> Any:
    return target(*[_val(a) if isinstance(a, fx.Node) else a for a in args])


def _as_val(t: Any) -> Any:
    return _val(t) if isinstance(t, fx.Node) else t


def _tables(unit: _Unit, i: int, emit: Callable[..., Any]) -> tuple[Any, Any]:
    """Segment ``i``'s (cos, sin) in the op's [B, S_i, H, D'] frame, built by ``emit(target,
    *args)``: on fake values (the guard) or as graph nodes (the rewrite). All views."""
    seg = unit.segments[i]
    seq = _val(seg.x).shape[1]

    def frame(t: Any) -> Any:
        for _ in range(4 - _ndim(t)):
            t = emit(aten.unsqueeze.default, t, 0)
        if unit.transposed:
            t = emit(aten.transpose.int, t, 1, 2)
        if seg.offset is not None and _shape(t)[1] != 1:
            t = emit(aten.slice.Tensor, t, 1, seg.offset, seg.offset + seq)
        return t

    if unit.rope == "complex":
        parts = emit(aten.view_as_real.default, frame(seg.cos))
        return emit(aten.select.int, parts, -1, 0), emit(aten.select.int, parts, -1, 1)
    return frame(seg.cos), frame(seg.sin)


def _ndim(t: Any) -> int:
    return _val(t).dim() if isinstance(t, fx.Node) else t.dim()


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(_val(t).shape if isinstance(t, fx.Node) else t.shape)


# -- rewriting ---------------------------------------------------------------------------------
def fuse(gm: fx.GraphModule, match: Match) -> None:
    uq: _Unit = match.bindings["q"]
    uk: _Unit = match.bindings["k"]
    g = gm.graph
    users = [u for n in (uq.out, uk.out) for u in n.users]
    order = {n: i for i, n in enumerate(g.nodes)}
    first_user = min(users, key=order.__getitem__) if users else match.bindings["attention"]

    def emit(target: Any, *args: Any) -> fx.Node:
        node = g.call_function(target, args)
        infer_meta(gm, node)
        return node

    def operands(unit: _Unit) -> tuple[list[fx.Node], list[fx.Node]]:
        """The segments as the op reads them, and their biases ([H, D]) if bound."""
        if unit.segments[0].bias is None:
            return [s.x for s in unit.segments], []
        shapes = [list(_val(s.x).shape) for s in unit.segments]
        return ([emit(aten.reshape.default, s.pre, shape)
                 for s, shape in zip(unit.segments, shapes, strict=True)],
                [emit(aten.view.default, s.bias, shape[2:])
                 for s, shape in zip(unit.segments, shapes, strict=True)])

    with g.inserting_before(first_user):
        tables = [_tables(uq, i, emit) for i in range(len(uq.segments))]
        (qx, qb), (kx, kb) = operands(uq), operands(uk)
        fused = emit(FUSED, qx, kx, [s.weight for s in uq.segments],
                     [s.weight for s in uk.segments], [c for c, _ in tables],
                     [s for _, s in tables], uq.eps, uq.norm, uq.rope, qb, kb)
        fused.meta["kopt_from"] = f"qk_norm_rope({describe_node(uq.out)})"
        outs = [emit(operator.getitem, fused, 0), emit(operator.getitem, fused, 1)]
        if uq.transposed:
            outs = [emit(aten.transpose.int, o, 1, 2) for o in outs]
    uq.out.replace_all_uses_with(outs[0])
    uk.out.replace_all_uses_with(outs[1])
    for node in sorted(match.nodes, key=order.__getitem__, reverse=True):
        if not node.users:
            g.erase_node(node)


def describe(match: Match) -> str:
    uq: _Unit = match.bindings["q"]
    uk: _Unit = match.bindings["k"]
    b, _, hq, d = _val(uq.segments[0].x).shape
    hk = _val(uk.segments[0].x).shape[2]
    seqs = "+".join(str(_val(s.x).shape[1]) for s in uq.segments)
    bias = "".join(f", {r} bias" for r, u in (("q", uq), ("k", uk))
                   if u.segments[0].bias is not None)
    return (f"{describe_node(uq.out)}: {uq.norm} + {uq.rope} RoPE, q {hq} / k {hk} heads x {d}, "
            f"tokens {seqs}{bias}")


QK_NORM_ROPE = StructuralRewrite(
    name=NAME,
    matcher=find_qk_norm_rope,
    applier=fuse,
    guard_fn=why_not,
    describer=describe,
    numerics=tolerance("the kernel sums each head's squares in another order than torch's "
                       "reduction (and uses libdevice rsqrt); everything else keeps the "
                       "model's op order and roundings"),
    benefit=8,
    description="rope(rmsnorm(q)), rope(rmsnorm(k)) [++ segments] -> qk_norm_rope(q, k)",
)
