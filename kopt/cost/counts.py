"""What each node of a graph asks of the device: FLOPs, bytes moved, kernel launches.

Counted from the graph alone (the fake tensors in ``node.meta["val"]``), never by running it.
The formulas take shapes, not tensors, so the same code counts a concrete graph (integer
shapes) and a symbolic one (:mod:`kopt.cost.symbolic`: shapes whose dimensions are sympy
expressions of the workload's symbols):

* FLOPs: ``torch.utils.flop_counter``'s own formulas where it has one (``mm``, ``addmm``,
  ``bmm``, ``_scaled_mm``, convolutions, ...), and for the ops it only sees decomposed or not at
  all: ``linear`` / ``matmul`` (2 x output elements x K), scaled-dot-product attention
  (``flop_counter.sdpa_flop_count``: its CPU kernel has no formula, so ``FlopCounterMode``
  counts 0 there) and kopt's GEMM ops (2 x M x N x K). Element-wise work counts 0 FLOPs, as in
  ``FlopCounterMode``: it is bandwidth-bound and costed by its bytes.
* Bytes: every distinct tensor a node reads plus what it writes. Views (``view``, ``permute``,
  a ``reshape`` that aliases its input, ``getitem``, ...) move nothing and launch nothing.
* Launches: one per computing node; the device model (``kopt.cost.device``) corrects this per
  op where a trace showed otherwise.

A hoisted region (``kopt.passes.hoist``) is counted node by node, each marked with how its cache
is keyed (``step``: a conditioning input such as the timestep, recomputed once per denoising
step; ``static``: only integer inputs such as position ids, recomputed once per generation), so
a cost model can weigh it by how often it misses. Its trailing views (``replayed``) run in
the CUDA graph's replay, not in the eager prelude, where a runner captures one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils import flop_counter

from kopt.graph import constant_nodes, is_view, op_category, qualified_name
from kopt.graph.regions import CachedRegion, trailing_views

aten = torch.ops.aten


@dataclass(frozen=True)
class TensorInfo:
    """What counting needs of a tensor: its shape (ints or sympy expressions) and dtype."""

    shape: tuple[Any, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> Any:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> Any:
        return self.numel * self.dtype.itemsize


# node -> pytree of TensorInfo (None for non-tensor values)
InfoOf = Callable[[fx.Node], Any]


@dataclass(frozen=True)
class OpCount:
    """One node's demand on the device. ``flops`` and ``bytes`` are ints for a concrete graph,
    sympy expressions for a symbolic one."""

    node: str
    op: str  # qualified op name: aten::linear, kopt::rowwise
    category: str  # gemm / attention / quantization / elementwise (kopt.graph.op_category)
    dtype: str  # of the first floating-point input: what a GEMM's peak rate depends on
    flops: Any
    bytes: Any
    kernel: bool  # False for views: no launch, no bytes
    cached: str | None = None  # in a hoisted region keyed on "step" or "static" inputs
    dispatched: bool = True  # an aten/kopt op (False: Python such as operator.getitem)
    layout: str = ""  # "broadcast", "strided" (element-wise operands), "bias,fast" (see layout)
    # a hoisted region's trailing view, which a CUDA graph's replay computes instead of the
    # eager prelude (kopt.graph.regions.trailing_views)
    replayed: bool = False

    @property
    def rate_key(self) -> str:
        """The op, with its operands' layout where that sets another rate: ``aten::add``,
        ``aten::add[broadcast]``."""
        return f"{self.op}[{self.layout}]" if self.layout else self.op

    @property
    def dtype_key(self) -> str:
        """The rate key with the element type (``aten::mul[broadcast]@bfloat16``): an ATen
        element-wise kernel's rate per byte depends on it where it is bound by elements."""
        return f"{self.rate_key}@{self.dtype}"

    def at(self, values: dict) -> OpCount:
        """This count with its symbols replaced by ``values`` (numbers)."""
        return OpCount(self.node, self.op, self.category, self.dtype, _number(self.flops, values),
                       _number(self.bytes, values), self.kernel, self.cached, self.dispatched,
                       self.layout, self.replayed)


def _number(x: Any, values: dict) -> float | int:
    if hasattr(x, "xreplace"):
        x = x.xreplace({k: v if hasattr(v, "is_Integer") else sympy.Integer(v)
                        for k, v in values.items()})
        if not x.is_number:
            raise ValueError(f"{x}: no value given for {sorted(map(str, x.free_symbols))}")
        return int(x) if x.is_Integer else float(x)
    return x


def meta_info(node: fx.Node) -> Any:
    """TensorInfo pytree of a node's traced value."""
    return pytree.tree_map(
        lambda v: TensorInfo(tuple(int(s) for s in v.shape), v.dtype)
        if isinstance(v, torch.Tensor) else None,
        node.meta.get("val"))


def _leaves(info: Any) -> list[TensorInfo]:
    return [t for t in pytree.tree_leaves(info) if isinstance(t, TensorInfo)]


def _shape_args(args: Any, info: InfoOf) -> Any:
    """Replace every node argument by its shape (a tuple, as the flop formulas expect)."""
    def one(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = info(a)
            return v.shape if isinstance(v, TensorInfo) else v
        return a
    return pytree.tree_map(one, args)


def _tensor_args(node: fx.Node, info: InfoOf) -> list[TensorInfo]:
    return [v for a in node.args if isinstance(a, fx.Node)
            for v in [info(a)] if isinstance(v, TensorInfo)]


def count_flops(node: fx.Node, info: InfoOf) -> Any:
    """FLOPs of one call_function node (0 for element-wise work)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    out = _leaves(info(node))
    if target in (aten.linear.default, aten.matmul.default):
        a = _tensor_args(node, info)[0]
        return 2 * out[0].numel * a.shape[-1]
    if target is aten.scaled_dot_product_attention.default:
        q, k, v = _tensor_args(node, info)[:3]
        return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
    formula = flop_counter.flop_registry.get(target.overloadpacket)
    if formula is not None:
        raw = getattr(formula, "__wrapped__", formula)  # the shape formula behind the wrapper
        args, kwargs = _shape_args((node.args, node.kwargs), info)
        out_shape = pytree.tree_map(lambda t: t.shape if isinstance(t, TensorInfo) else t,
                                    info(node))
        return raw(*args, out_shape=out_shape, **kwargs)
    if target.namespace == "kopt" and op_category(qualified_name(target)) == "gemm":
        a = _tensor_args(node, info)[0]  # kopt's GEMMs take a [M, K] first
        return 2 * out[0].numel * a.shape[-1]
    return 0


def count_node(node: fx.Node, info: InfoOf = meta_info, cached: str | None = None,
               name: str | None = None) -> OpCount:
    """The count of one call_function node; ``info`` gives its and its inputs' tensors."""
    qualified = qualified_name(node.target)
    view = is_view(node)
    dtype = ""
    moved: Any = 0
    if not view:
        # an op that writes into its first argument (copy_, index_copy_) reads what it writes
        # from the others and touches only that much of the target: not the whole of it twice
        into = _writes_first_argument(node)
        seen: set[fx.Node] = set()
        for i, a in enumerate(node.all_input_nodes):
            if a in seen:
                continue
            seen.add(a)
            for t in _leaves(info(a)):
                if into and i == 0:
                    continue
                moved = moved + (2 if into else 1) * t.nbytes
                if not dtype and t.dtype.is_floating_point:
                    dtype = str(t.dtype).removeprefix("torch.")
        if not into:
            for t in _leaves(info(node)):
                moved = moved + t.nbytes
    return OpCount(name or node.name, qualified, op_category(qualified), dtype,
                   0 if view else count_flops(node, info), moved, not view, cached,
                   isinstance(node.target, torch._ops.OpOverload),
                   "" if view else layout(node))


def layout(node: fx.Node) -> str:
    """How an aten element-wise op's operands are laid out, where that changes its kernel:
    ``broadcast`` (a point-wise op with an operand smaller than its output: a bias or a
    modulation vector), ``strided`` (a non-contiguous operand or output: a slice of a merged
    projection, a transposed view), ``""`` (all contiguous, the same shape). ATen's
    element-wise kernels vectorize only contiguous operands; fitted to W1 on an H200, a bias
    add over a whole activation runs at 0.39 of the copy bandwidth, a plain add at 1.08. Read
    from the traced tensors, so the class holds for every size of a symbolic graph.

    And for an FP8 GEMM, ``bias`` where it adds a bias in its epilogue (cuBLAS's bias kernels
    are slower: :data:`kopt.cost.device.EPILOGUE_SLOWDOWN`) and ``fast`` where it accumulates
    fast (``use_fast_accum``: :data:`kopt.cost.device.FAST_ACCUM_SPEEDUP`), both as
    ``bias,fast``."""
    target = node.target
    if target is torch.ops.aten._scaled_mm.default:
        bias = node.args[4] if len(node.args) > 4 else node.kwargs.get("bias")
        fast = node.args[7] if len(node.args) > 7 else node.kwargs.get("use_fast_accum", False)
        return ",".join(p for p, on in (("bias", bias is not None), ("fast", fast)) if on)
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" \
            or op_category(qualified_name(target)) != "elementwise":
        return ""
    out = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    ins = [t for a in node.all_input_nodes
           for t in pytree.tree_leaves(a.meta.get("val")) if isinstance(t, torch.Tensor)]
    if not out or not ins:
        return ""
    if torch.Tag.pointwise in target.tags and any(t.numel() < out[0].numel() for t in ins):
        return "broadcast"
    if not all(t.is_contiguous() for t in ins + out[:1]):
        return "strided"
    return ""


def _writes_first_argument(node: fx.Node) -> bool:
    """An aten op that mutates its first argument in place and returns it."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write and isinstance(node.args[0], fx.Node) \
        and node.all_input_nodes[:1] == [node.args[0]]


def region_kind(gm: fx.GraphModule, node: fx.Node) -> str:
    """``static`` when a hoisted region is keyed only on integer inputs (positions: the same
    for every call of a generation), ``step`` when a floating-point input (the timestep) is in
    its key."""
    region = gm.get_submodule(node.target)
    keys = [node.args[i] for i in region.key_positions]
    floating = [v.is_floating_point() for k in keys for v in [k.meta.get("val")]
                if isinstance(v, torch.Tensor)]
    return "step" if any(floating) else "static"


def count_graph(gm: fx.GraphModule, info: InfoOf = meta_info, *, folded: bool = False,
                prefix: str = "", cached: str | None = None) -> list[OpCount]:
    """Counts of every node that runs per call. ``folded``: nodes that only read parameters
    are left out (computed once at load by ``fold_constants``)."""
    skip = constant_nodes(gm.graph) if folded else set()
    out: list[OpCount] = []
    for node in gm.graph.nodes:
        if node in skip:
            continue
        if node.op == "call_function":
            out.append(count_node(node, info, cached, prefix + node.name))
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            inner = mod.region if isinstance(mod, CachedRegion) else mod
            if not isinstance(inner, fx.GraphModule):
                raise TypeError(f"cannot count module {node.target} ({type(mod).__name__}): "
                                "not a graph")
            kind = region_kind(gm, node) if isinstance(mod, CachedRegion) else cached
            scope = f"{prefix}{node.target}/"
            inner_counts = count_graph(inner, _scoped(info, scope), folded=folded,
                                       prefix=scope, cached=kind)
            if isinstance(mod, CachedRegion):
                views = {scope + v.name for v in trailing_views(inner.graph)}
                inner_counts = [replace(c, replayed=True) if c.node in views else c
                                for c in inner_counts]
            out.extend(inner_counts)
    return out


def _scoped(info: InfoOf, prefix: str) -> InfoOf:
    """The provider for a region's inner nodes: a symbolic provider keys them by qualified name
    (``region/node``, its ``scoped``); the meta of the inner nodes serves as it is."""
    scoped = getattr(info, "scoped", None)
    return scoped(prefix) if scoped is not None else info


def totals(counts: Iterable[OpCount]) -> tuple[Any, Any, int]:
    """(FLOPs, bytes, kernels) summed over ``counts``."""
    flops: Any = 0
    moved: Any = 0
    kernels = 0
    for c in counts:
        flops, moved, kernels = flops + c.flops, moved + c.bytes, kernels + int(c.kernel)
    return flops, moved, kernels
