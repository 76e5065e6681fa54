"""Row-wise fusions: a normalisation with the residual update before it and the pointwise ops and
FP8 quantization after it, as one ``kopt::rowwise`` call (:mod:`kopt.codegen.rowwise`).

    # quant(chain(norm(x)))          -> rowwise(x)        -> fp8 [, out]             norm_quant
    # quant(chain(norm(x + g * y)))  -> rowwise(x, y, g)  -> [res,] fp8 [, out]  residual_norm_quant
    # chain(norm(x + g * y))         -> rowwise(x, y, g)  -> [res,] out          residual_norm
    # adaln(norm(x), s, t)           -> rowwise(x, s, t)  -> out                 norm_modulation

``norm`` is any normalisation over the last axis that :func:`kopt.patterns.norms.find_norm`
recognises (aten.layer_norm, aten.rms_norm, a hand-written RMSNorm), with its affine weight and
bias. ``chain`` is a run of pointwise ops on the normalised rows: exactly the adaLN modulation
``(1 + s) * n + t`` with per-batch ``s``, ``t`` becomes the template's modulation step; anything
else (``n * s1 + t`` once ``1 + s`` is a hoisted value, a separate weight, a cast) a generated
epilogue (:class:`kopt.codegen.pointwise.PointwiseProgram`). ``g`` (optional) is one gate vector
per batch item. ``quant`` is the per-token ``kopt::quant_fp8_rowwise`` (or 1x128-group
``kopt::quant_fp8_group``) the fp8 pass puts before the next GEMM. Qwen-Image's and FLUX.2's
``hidden + gate * attn_out`` -> norm2 -> modulation -> quant and the LLM's residual add ->
post-attention RMSNorm -> quant become one kernel each. A residual add already in kopt's GEMM
epilogue (the gemm_epilogue pass) leaves ``norm(reshape(fp8_gemm(...)))``, where norm_quant
applies. Without FP8 the bf16 result is the output (residual_norm, and norm_modulation, which
needs a chain reading per-call per-batch vectors: a norm with nothing to fuse around it is left
alone, QK norms being the qk_norm_rope rewrite's).

Outputs: the residual ``h`` when later blocks read it, FP8 values and scales in the layout the
GEMM reads, and the bf16 result when something besides the quantizer reads it.

Numerics: the template's prologue, modulation, epilogue and quantizer round like the eager ops,
but its norm reduces in another order than PyTorch's kernels (one ulp of a bf16 norm output on a
few elements, which can move an FP8 value by one step): tolerance. On the CPU the op runs its
reference, the unfused ops, so the outputs are bitwise equal there.

Guards, each with its reason: the row fits one tile (``MAX_COLS``); x, y, gate, scale and shift
share one dtype (eager would promote otherwise); gate, scale and shift are one vector per batch
item (B of 1 or of x's B); no intermediate has a user outside the site; the statistics are fp32
over the last axis. ``affine_after_round`` follows the matched norm: a hand-written RMSNorm
multiplies its weight after rounding (``w * n.to(dtype)``), aten.rms_norm / aten.layer_norm
before.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import kopt.codegen.kernels.quant_fp8  # noqa: F401 -- registers kopt::quant_fp8_{rowwise,group}
import kopt.codegen.rowwise  # noqa: F401 -- registers kopt::rowwise
from kopt.codegen.kernels.quant_fp8 import MAX_COLS
from kopt.codegen.pointwise import DTYPE_NAMES, PointwiseProgram, try_from_fx
from kopt.codegen.rowwise import EPILOGUE_INPUT, INTERMEDIATES, RowwiseError, RowwiseSpec
from kopt.graph import (
    bias_add_operands,
    constant_nodes,
    describe_node,
    fake_call,
    fake_mode_of,
    infer_meta,
    is_tensor_node,
    op_name,
    other_operand,
    tensor_meta,
)
from kopt.patterns.core import Match, Rejection, StructuralRewrite, tolerance
from kopt.patterns.norms import NormSite, find_norm

aten = torch.ops.aten
prims = torch.ops.prims
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
QUANT_GROUP = torch.ops.kopt.quant_fp8_group.default
# the fp8 pass's activation quantizers (per token, per 1x128 group) -> the template's output
QUANT_OUTPUTS = {QUANT: ("fp8_row", "fp8_row_scale"),
                 QUANT_GROUP: ("fp8_group", "fp8_group_scale")}
ROWWISE = torch.ops.kopt.rowwise.default
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_NORM_OPS = (aten.layer_norm.default, aten.rms_norm.default)
# ops the epilogue translator (kopt.codegen.pointwise.from_fx) may accept
_POINTWISE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.maximum.default,
    aten.minimum.default, aten.neg.default, aten.abs.default, aten.relu.default,
    aten.square.default, aten.reciprocal.default, aten.sqrt.default, aten.rsqrt.default,
    aten.exp.default, aten.sigmoid.default, aten.tanh.default, aten.silu.default,
    aten.gelu.default, aten.pow.Tensor_Scalar, aten._to_copy.default, aten.to.dtype,
    prims.convert_element_type.default, aten.type_as.default, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.clone.default, aten.alias.default,
})
_MAX_CHAIN = 12  # pointwise ops searched between a quantizer and its norm


@dataclass(frozen=True)
class Flavour:
    """What one rewrite fuses around the norm: the residual update before it, the quantizer
    after it. Larger flavours outrank the ones they contain (benefit)."""

    name: str
    residual: bool
    quant: bool
    benefit: int
    rule: str


@dataclass
class Site:
    """The structure of one site (the graph nodes; the guard decides whether it may fuse)."""

    norm: NormSite
    chain: tuple[fx.Node, ...]  # pointwise ops after the norm, in order
    quant: fx.Node | None = None
    rows_view: fx.Node | None = None  # the reshape to [rows, cols] the quantizer reads
    h: fx.Node | None = None  # the residual add (the norm's input)
    x: fx.Node | None = None  # the residual stream
    y: fx.Node | None = None  # the branch added to it
    gate: fx.Node | None = None
    product: fx.Node | None = None  # gate * y
    rbias: fx.Node | None = None  # y = y0 + rbias, rbias one vector of the features
    bias_add: fx.Node | None = None  # that add (y is then y0)

    @property
    def end(self) -> fx.Node:
        """The value the chain produces (the norm's output when there is no chain)."""
        return self.chain[-1] if self.chain else self.norm.out

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """Every node the fused op replaces."""
        front = [n for n in (self.bias_add, self.product, self.h) if n is not None]
        back = [n for n in (self.rows_view, self.quant) if n is not None]
        return tuple(dict.fromkeys([*front, *self.norm.nodes, *self.chain, *back]))

    def operands(self) -> list[fx.Node]:
        """Nodes the chain reads besides the chain itself and the norm's output."""
        inside = {*self.chain, self.norm.out}
        return list(dict.fromkeys(a for n in self.chain for a in n.all_input_nodes
                                  if a not in inside))


@dataclass(frozen=True)
class _Miss:
    reason: str
    near_miss: bool


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(tensor_meta(node).shape)


def _is_tile(node: object, main: tuple[int, ...]) -> bool:
    return is_tensor_node(node) and _shape(node) == main  # type: ignore[arg-type]


def _norm_at(node: fx.Node) -> NormSite | None:
    return find_norm(node) if is_tensor_node(node) else None


def _other_axis_norm(node: fx.Node) -> str | None:
    """Why ``node`` normalises something other than the last axis, if it looks like a norm."""
    if _is(node, aten.layer_norm.default) and len(node.args[1]) != 1:
        return f"layer_norm over the last {len(node.args[1])} axes, not over one row"
    if not _is(node, aten.mul.Tensor):
        return None
    for r in node.args[:2]:
        add = r.args[0] if _is(r, aten.rsqrt.default) else None
        mean = add.args[0] if _is(add, aten.add.Tensor) else None
        if _is(mean, aten.mean.dim):
            rank = tensor_meta(mean.args[0]).dim()
            dims = list(mean.args[1])
            if dims not in ([-1], [rank - 1]):
                return f"RMS statistics over axis {dims} of a rank-{rank} tensor, not the last"
    return None


# ------------------------------------------------------------------------------------------------
# Finding sites

def _walk_to_norm(v: fx.Node, main: tuple[int, ...],
                  depth: int) -> tuple[NormSite, list[fx.Node]] | _Miss:
    """The norm at the start of a pointwise chain ending in ``v`` (through tile-shaped inputs),
    and the chain; or why there is none."""
    site = _norm_at(v)
    if site is not None:
        return site, []
    other = _other_axis_norm(v)
    if other:
        return _Miss(other, near_miss=False)
    if not _is(v, *_POINTWISE) or depth == 0:
        return _Miss(f"the quantizer's input comes from {op_name(v)} ({v.name}), not from a "
                     "norm and pointwise ops", near_miss=True)
    best: _Miss | None = None
    for a in dict.fromkeys(v.all_input_nodes):
        if not _is_tile(a, main):
            continue
        found = _walk_to_norm(a, main, depth - 1)
        if isinstance(found, tuple):
            return found[0], [*found[1], v]
        if best is None or best.near_miss and not found.near_miss:
            best = found
    return best or _Miss(f"no norm before {op_name(v)} ({v.name})", near_miss=True)


def _site_before_quant(quant: fx.Node) -> Site | _Miss:
    x2 = quant.args[0]
    rows_view = x2 if _is(x2, *_RESHAPES) else None
    end = rows_view.args[0] if rows_view is not None else x2
    if not is_tensor_node(end):
        return _Miss("the quantizer's input is not a tensor node", near_miss=True)
    if _shape(x2)[-1] != _shape(end)[-1]:
        return _Miss(f"the quantizer's rows {list(_shape(x2))} are not the rows of {end.name} "
                     f"{list(_shape(end))}", near_miss=True)
    found = _walk_to_norm(end, _shape(end), _MAX_CHAIN)
    if isinstance(found, _Miss):
        return found
    norm, chain = found
    return Site(norm, tuple(chain), quant=quant, rows_view=rows_view)


def _chain_after(norm: NormSite) -> tuple[fx.Node, ...]:
    """The pointwise ops after ``norm``, each the single user of the one before, same shape."""
    chain: list[fx.Node] = []
    cur, main = norm.out, _shape(norm.out)
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if not _is(user, *_POINTWISE) or user in norm.nodes or not _is_tile(user, main):
            break
        chain.append(user)
        cur = user
    return tuple(chain)


def _per_batch(shape: Sequence[int], main: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts against ``main`` ([B, ..., cols]) as one vector per batch
    item: [b, 1, ..., cols] with b in {1, B} (or fewer leading dims)."""
    shape = list(shape)
    while len(shape) > len(main) and shape[0] == 1:
        shape = shape[1:]
    if len(shape) > len(main) or not shape or shape[-1] != main[-1]:
        return False
    shape = [1] * (len(main) - len(shape)) + shape
    return all(d == 1 for d in shape[1:-1]) and shape[0] in (1, main[0])


def _per_call_vector(node: fx.Node, main: tuple[int, ...], consts: set[fx.Node]) -> bool:
    return node not in consts and _per_batch(_shape(node), main)


def _add_residual(site: Site) -> Site | _Miss:
    """Bind ``h = x + g * y`` (or ``x + y``) at the norm's input."""
    h = site.norm.x
    if not (_is(h, aten.add.Tensor) and len(h.args) == 2 and not h.kwargs
            and all(isinstance(a, fx.Node) for a in h.args)):
        return _Miss(f"the norm's input {h.name} ({op_name(h)}) is not a residual add",
                     near_miss=True)
    a, b = h.args
    main = _shape(h)
    products = [(p, other) for p, other in ((b, a), (a, b)) if _is(p, aten.mul.Tensor)
                and not p.kwargs and all(isinstance(t, fx.Node) for t in p.args[:2])]
    # the gated product: a tile times something smaller; tile * tile is a gate per token
    products.sort(key=lambda po: sum(_is_tile(t, main) for t in po[0].args[:2]) != 1)
    for p, other in products:
        g0, g1 = p.args[:2]
        gate, y = (g1, g0) if _is_tile(g0, main) and not _is_tile(g1, main) else (g0, g1)
        site.h, site.x, site.y, site.gate, site.product = h, other, y, gate, p
        return _bias_before(site, p)
    site.h, site.x, site.y = h, a, b
    return _bias_before(site, h)


def _bias_before(site: Site, reader: fx.Node) -> Site:
    """Bind ``y = y0 + b`` (``b`` one vector of the features, the add read only by ``reader``):
    a GEMM's bias its epilogue did not add (the blockwise FP8 GEMM's) goes into the prologue."""
    found = bias_add_operands(site.y)
    if found is not None and set(site.y.users) == {reader}:
        site.y, site.rbias, site.bias_add = found[0], found[1], site.y
    return site


def _depends_on_site(site: Site, order: dict[fx.Node, int]) -> str | None:
    """Why the fused op could not run (an input it needs is computed from its own values)."""
    fused = set(site.nodes)
    start = min(order[n] for n in fused)
    inputs = [site.x, site.y, site.rbias, site.gate, site.norm.weight, site.norm.bias,
              *site.operands()]
    for node in inputs:
        if node is None or not isinstance(node, fx.Node):
            continue
        if node in fused:
            return f"the site reads its own intermediate {node.name} ({op_name(node)})"
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in fused:
                    return (f"{node.name} ({op_name(node)}) is computed from the site's own "
                            f"value {a.name}")
                if a not in seen and order.get(a, -1) > start:
                    seen.add(a)
                    stack.append(a)
    return None


def _finder(flavour: Flavour, intermediates: str = "eager"
            ) -> Callable[[fx.GraphModule], Iterator[Match | Rejection]]:
    def find(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        consts = constant_nodes(gm.graph)
        for anchor, found in _candidates(gm, flavour, consts):
            if flavour.residual:
                # misses of the norm and what follows it are the plain flavour's to report
                found = (_add_residual(found) if isinstance(found, Site)
                         else _Miss(found.reason, near_miss=True))
            if isinstance(found, Site) and not flavour.quant and not flavour.residual:
                main = _shape(found.end)
                if not any(_per_call_vector(o, main, consts) for o in found.operands()):
                    found = _Miss("no modulation after the norm (nothing to fuse with it)",
                                  near_miss=True)
            if isinstance(found, Site):
                cycle = _depends_on_site(found, order)
                found = _Miss(cycle, near_miss=False) if cycle else found
            if isinstance(found, _Miss):
                yield Rejection(flavour.name, anchor.name, found.reason, found.near_miss)
                continue
            yield Match(flavour.name, anchor, found.nodes,
                        {"site": found, "intermediates": intermediates})
    return find


def _candidates(gm: fx.GraphModule, flavour: Flavour,
                consts: set[fx.Node]) -> Iterator[tuple[fx.Node, Site | _Miss]]:
    if flavour.quant:
        for quant in gm.graph.nodes:
            # a weight's quantizer runs once, at load
            if _is(quant, *QUANT_OUTPUTS) and quant.args[0] not in consts:
                yield quant, _site_before_quant(quant)
        return
    norms = {n: s for n in gm.graph.nodes if (s := _norm_at(n)) is not None}
    inner = {m for s in norms.values() for m in s.nodes if m is not s.out}
    for node, norm in norms.items():
        if node in inner:  # the unweighted core of a weighted RMSNorm
            continue
        site = Site(norm, _chain_after(norm))
        yield site.end, site


# ------------------------------------------------------------------------------------------------
# Guard: the spec a site fuses into, or why it cannot

@dataclass
class Plan:
    spec: RowwiseSpec
    inputs: dict[str, fx.Node]  # by the spec's input names, in its order


def _extra_users(node: fx.Node, allowed: set[fx.Node]) -> list[str]:
    return [u.name for u in node.users if u not in allowed]


def _modulation(site: Site, dtype: torch.dtype) -> tuple[fx.Node, fx.Node] | None:
    """(scale, shift) when the chain is exactly ``(1 + scale) * n + shift`` per batch item
    (``1 + scale`` possibly viewed to broadcast, as ``(1 + scale)[:, None]``)."""
    if len(site.chain) != 2:
        return None
    mul, add = site.chain
    if not (_is(mul, aten.mul.Tensor) and _is(add, aten.add.Tensor)) or mul.kwargs or add.kwargs:
        return None
    viewed, shift = other_operand(mul, site.norm.out), other_operand(add, mul)
    if not (isinstance(viewed, fx.Node) and isinstance(shift, fx.Node)):
        return None
    one_plus = viewed
    while _is(one_plus, aten.unsqueeze.default, *_RESHAPES):  # views keep the element order
        one_plus = one_plus.args[0]
    if not _is(one_plus, aten.add.Tensor) or one_plus.kwargs:
        return None
    nodes = [a for a in one_plus.args[:2] if isinstance(a, fx.Node)]
    numbers = [a for a in one_plus.args[:2] if not isinstance(a, fx.Node)]
    if len(nodes) != 1 or numbers != [1] or isinstance(numbers[0], bool):
        return None
    scale = nodes[0]
    main = _shape(site.end)
    if not (_per_batch(_shape(viewed), main) and _per_batch(_shape(shift), main)):
        return None
    sv, tv = tensor_meta(scale), tensor_meta(shift)
    if _shape(one_plus) != tuple(sv.shape) or sv.shape[-1] != main[-1] or sv.numel() != tv.numel():
        return None
    if any(tensor_meta(n).dtype != dtype for n in (scale, shift, one_plus, mul, add)):
        return None
    return scale, shift


def plan(gm: fx.GraphModule, site: Site, intermediates: str = "eager") -> Plan | str:
    """The ``kopt::rowwise`` call that replaces ``site``, or why there is none
    (``intermediates``: the spec's, see :mod:`kopt.codegen.rowwise`)."""
    norm = site.norm
    hv = tensor_meta(norm.x)
    dtype, cols = hv.dtype, hv.shape[-1] if hv.dim() else 0
    if dtype not in DTYPE_NAMES:
        return f"dtype {dtype} (the row-wise template takes bf16/fp16/fp32)"
    if hv.dim() == 0 or cols > MAX_COLS:
        return f"rows of {cols} values: the template keeps a row in one tile (at most {MAX_COLS})"
    fused = set(site.nodes)
    # -- the norm
    out_dtype = tensor_meta(norm.out).dtype
    if out_dtype != dtype:
        return f"the norm's output is {out_dtype}, its input {dtype}"
    if not norm.internal_users_only():
        leak = next(n for n in norm.nodes if n is not norm.out and _extra_users(n, fused))
        return (f"norm intermediate {leak.name} ({op_name(leak)}) is also used by "
                f"{', '.join(_extra_users(leak, fused))}")
    decomposed = not _is(norm.out, *_NORM_OPS)
    for m in norm.nodes:
        if _is(m, aten.mean.dim) and tensor_meta(m).dtype != torch.float32:
            return f"RMS statistics computed in {tensor_meta(m).dtype}; the template's are fp32"
    after_round = decomposed and norm.weight is not None
    for name, p in (("weight", norm.weight), ("bias", norm.bias)):
        if p is None:
            continue
        pv = tensor_meta(p)
        if pv.numel() != cols:
            return f"norm {name} has shape {list(pv.shape)}, not [{cols}]"
        if pv.dtype != dtype and (after_round or pv.dtype != torch.float32):
            return f"norm {name} is {pv.dtype}, the rows {dtype}"
    inputs: dict[str, fx.Node] = {}
    # -- the residual update
    if site.h is not None:
        for t in (site.x, site.y):
            tv = tensor_meta(t)
            if tuple(tv.shape) != tuple(hv.shape) or tv.dtype != dtype:
                return (f"residual operand {t.name} is {tv.dtype}{list(tv.shape)}, the sum "
                        f"{dtype}{list(hv.shape)}")
        if site.gate is not None:
            gv = tensor_meta(site.gate)
            if not _per_batch(gv.shape, tuple(hv.shape)):
                return (f"gate {tuple(gv.shape)} is not one vector per batch item of "
                        f"{tuple(hv.shape)}")
            if gv.dtype != dtype or tensor_meta(site.product).dtype != dtype:
                return f"gate dtype {gv.dtype} differs from the residual's {dtype}"
            if _extra_users(site.product, {site.h}):
                return (f"the gated product {site.product.name} is also used by "
                        f"{', '.join(_extra_users(site.product, {site.h}))}")
        inputs.update(x=site.x, y=site.y)
        if site.rbias is not None:
            bv = tensor_meta(site.rbias)
            if bv.dtype != dtype or tensor_meta(site.bias_add).dtype != dtype:
                return f"the bias added to y is {bv.dtype}, the residual {dtype}"
            inputs["residual_bias"] = site.rbias
        if site.gate is not None:
            inputs["gate"] = site.gate
    else:
        inputs["x"] = norm.x
    # -- the chain: modulation or a generated epilogue
    for n in (norm.out, *site.chain[:-1]) if site.chain else ():
        extra = _extra_users(n, fused)
        if extra:
            return f"intermediate {n.name} ({op_name(n)}) is also used by {', '.join(extra)}"
    modulation = _modulation(site, dtype)
    epilogue: PointwiseProgram | None = None
    operands = site.operands()
    if site.chain and modulation is None:
        names = [EPILOGUE_INPUT, *(f"e{i}" for i in range(len(operands)))]
        program = try_from_fx(site.chain, [norm.out, *operands], [site.end], names)
        if isinstance(program, str):
            return f"epilogue: {program}"
        epilogue = program
    # -- outputs
    outputs: list[str] = []
    if site.h is not None and _extra_users(site.h, fused):
        outputs.append("residual")
    if site.quant is not None:
        for u in site.quant.users:
            if not (u.target is operator.getitem and u.args[1] in (0, 1)):
                return f"the quantizer's result is used by {u.name} ({op_name(u)}) whole"
        if site.rows_view is not None and _extra_users(site.rows_view, {site.quant}):
            return f"the quantizer's 2-D input {site.rows_view.name} has other users"
        outputs.append(QUANT_OUTPUTS[site.quant.target][0])
        if _extra_users(site.end, fused):
            outputs.append("out")
    else:
        outputs.append("out")
    if norm.weight is not None:
        inputs["weight"] = norm.weight
    if norm.bias is not None:
        inputs["bias"] = norm.bias
    if modulation is not None:
        inputs.update(scale=modulation[0], shift=modulation[1])
    if epilogue is not None:
        inputs.update({f"ep_{name}": o for name, o in zip(names[1:], operands, strict=True)})
    try:
        spec = RowwiseSpec(
            dtype=DTYPE_NAMES[dtype], norm=norm.kind, eps=norm.eps, weight=norm.weight is not None,
            bias=norm.bias is not None, affine_after_round=after_round,
            residual=site.h is not None, residual_bias=site.rbias is not None,
            gate=site.gate is not None,
            modulation=modulation is not None, epilogue=epilogue, outputs=tuple(outputs),
            intermediates=intermediates)
        ordered = {name: inputs[name] for name in spec.input_names()}
        # the op's own checks (shapes, batch sizes, dtypes); remembered for equal metadata
        fake_call(fake_mode_of(gm), ROWWISE,
                  ([tensor_meta(n) for n in ordered.values()], spec.to_json()))
    except RowwiseError as exc:
        return str(exc)
    return Plan(spec, ordered)


def _why_not(gm: fx.GraphModule, match: Match) -> str | None:
    p = plan(gm, match.bindings["site"], match.bindings.get("intermediates", "eager"))
    return p if isinstance(p, str) else None


# ------------------------------------------------------------------------------------------------
# Rewriting

def _forwarding(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Values earlier sites replaced (a residual stream, a norm's output), old node -> new one:
    a site found before an earlier site was fused may still name the old node as an input."""
    if not hasattr(graph, "_kopt_rowwise_forward"):
        graph._kopt_rowwise_forward = {}  # type: ignore[attr-defined]
    return graph._kopt_rowwise_forward  # type: ignore[attr-defined]


def fuse(gm: fx.GraphModule, match: Match) -> None:
    splice(gm, match, ROWWISE, "rowwise")


def splice(gm: fx.GraphModule, match: Match, op: Any, label: str,
           substitute: dict[str, fx.Node] | None = None, extra_args: tuple = (),
           extra_dead: tuple[fx.Node, ...] = ()) -> None:
    """Replace the matched site by ``op(inputs, spec, *extra_args)`` (the planned row-wise spec;
    ``substitute`` names inputs taken from elsewhere, e.g. the partial sum an all-reduce
    read): its outputs take over the residual stream, the norm chain's end and the quantized
    values; the site's nodes and ``extra_dead`` are erased."""
    site: Site = match.bindings["site"]
    p = plan(gm, site, match.bindings.get("intermediates", "eager"))
    if isinstance(p, str):  # the pass runs the guard first
        raise RuntimeError(f"{match.rewrite} at {match.site}: {p}")
    g = gm.graph
    forward = _forwarding(g)
    substitute = substitute or {}

    def live(n: fx.Node) -> fx.Node:
        while n in forward:
            n = forward[n]
        return n

    def call(target: object, *args: object) -> fx.Node:
        node = g.call_function(target, args)
        infer_meta(gm, node)
        return node

    inputs = [live(substitute.get(name, n)) for name, n in p.inputs.items()]
    replaced: list[fx.Node] = []
    with g.inserting_before(match.anchor):
        fused = call(op, inputs, p.spec.to_json(), *extra_args)
        fused.meta["kopt_from"] = f"{label}({describe_node(site.norm.out)})"
        outs = {name: call(operator.getitem, fused, i)
                for i, name in enumerate(p.spec.output_names())}
        if site.quant is not None:
            for u in list(site.quant.users):
                value = outs[QUANT_OUTPUTS[site.quant.target][u.args[1]]]
                if _shape(value) != _shape(u):  # the 1x128 scales are [rows, groups] already
                    value = call(aten.reshape.default, value, list(_shape(u)))
                u.replace_all_uses_with(value)
                forward[u] = value
                replaced.append(u)
    for kind, old in (("residual", site.h), ("out", site.end)):
        if kind in outs:
            old.replace_all_uses_with(outs[kind])
            forward[old] = outs[kind]
    dead = set(site.nodes) | set(replaced) | set(extra_dead)
    while dead:
        gone = [n for n in dead if not n.users]
        if not gone:
            raise RuntimeError(f"{match.rewrite} at {match.site}: nodes still used: "
                               f"{sorted(n.name for n in dead)}")
        for n in gone:
            g.erase_node(n)
            dead.discard(n)


def describe(match: Match) -> str:
    site: Site = match.bindings["site"]
    steps = []
    if site.h is not None:
        y = "(y + b)" if site.rbias is not None else "y"
        steps.append(f"x + g * {y}" if site.gate is not None else f"x + {y}")
    steps.append(f"{site.norm.kind}_norm")
    if site.chain:
        dtype = tensor_meta(site.norm.x).dtype
        steps.append("modulation" if _modulation(site, dtype) is not None
                     else f"epilogue of {len(site.chain)} ops")
    if site.quant is not None:
        steps.append("fp8")
    shape = _shape(site.norm.out)
    return (f"{describe_node(site.norm.out)}: {' -> '.join(steps)}, "
            f"{math.prod(shape[:-1])} x {shape[-1]}")


NUMERICS = tolerance("the norm reduces in another order than PyTorch's kernels (one ulp of its "
                     "rounded output on a few elements); residual, modulation, epilogue and "
                     "quantization round like the eager ops")
NUMERICS_FP32 = tolerance("fp32 from the residual update to the outputs, no rounding between "
                          "steps (Inductor's order): each output rounded once, the FP8 values "
                          "quantized from the unrounded result")

FLAVOURS = (
    Flavour("fuse_residual_norm_quant", residual=True, quant=True, benefit=40,
            rule="quant(chain(norm(x + g * y))) -> rowwise(x, y, g) -> residual, fp8"),
    Flavour("fuse_norm_quant", residual=False, quant=True, benefit=30,
            rule="quant(chain(norm(x))) -> rowwise(x) -> fp8"),
    Flavour("fuse_residual_norm", residual=True, quant=False, benefit=20,
            rule="chain(norm(x + g * y)) -> rowwise(x, y, g) -> residual, out"),
    Flavour("fuse_norm_modulation", residual=False, quant=False, benefit=10,
            rule="chain(norm(x)) reading per-batch vectors (adaLN) -> rowwise(x, s, t) -> out"),
)


def rowwise_rewrite(flavour: Flavour, intermediates: str = "eager") -> StructuralRewrite:
    """``intermediates``: ``"eager"`` (every step rounded like the eager op) or ``"fp32"``
    (:data:`NUMERICS_FP32`); see :mod:`kopt.codegen.rowwise`."""
    if intermediates not in INTERMEDIATES:
        raise ValueError(f"intermediates {intermediates!r} is not one of {INTERMEDIATES}")
    return StructuralRewrite(
        name=flavour.name,
        matcher=_finder(flavour, intermediates),
        applier=fuse,
        guard_fn=_why_not,
        describer=describe,
        numerics=NUMERICS if intermediates == "eager" else NUMERICS_FP32,
        benefit=flavour.benefit,
        description=flavour.rule,
    )


def rowwise_fusions(intermediates: str = "eager") -> tuple[StructuralRewrite, ...]:
    return tuple(rowwise_rewrite(f, intermediates) for f in FLAVOURS)


ROWWISE_FUSIONS: Sequence[StructuralRewrite] = rowwise_fusions()
RESIDUAL_NORM_QUANT, NORM_QUANT, RESIDUAL_NORM, NORM_MODULATION = ROWWISE_FUSIONS
