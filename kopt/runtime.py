"""The execution plan: an optimized graph rewritten into the form that runs cheapest on the host.

The optimized graph is what the passes produced and verification checked: kopt's fused ops are
``torch.library`` ops (so the graph exports, traces under ``torch.compile`` and propagates
fake tensors) and aten ops are ``OpOverload`` calls. Run as it is, each node pays the
dispatcher's boxed path and each fused op its Python checks and Triton's launch path: on the
H200's host 70-300 us per fused op, which made kopt slower than the model it replaces outside
CUDA graphs (RESULTS.md, 2026-12-04, H200). The plan is a copy of that graph, computing
the same values bit for bit, in which:

- a fused op on CUDA is a :class:`kopt.codegen.launch.DirectOp`: its CUDA implementation
  without the dispatcher, then its recorded Triton launches replayed;
- a fused op on the CPU is its PyTorch reference traced to aten ops and inlined, so that it
  costs what the unfused ops cost (no dispatcher into Python, no per-call checks);
- a chain of views is one view, and a view to the shape it already has is dropped;
- an aten op is called through its Python binding (``torch._C._VariableFunctions.add``,
  ``TensorBase.view``) rather than its ``OpOverload`` where that binding is checked, on meta
  tensors, to dispatch exactly the ops the overload does: half the host time per op.

A plan is specialised on the strides of the graph's tensor inputs (the optimized module is
specialised on their shapes, dtypes and devices): its recorded launches and folded views hold
for those. A call with other strides runs the optimized graph. Before a plan is used, it and
the optimized graph run once on the same random inputs and must agree bit for bit (graphs that
write a buffer in place rely on each fused op's own check instead); otherwise the optimized
graph runs and the report says why.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kopt import streams
from kopt.codegen.launch import DirectOp
from kopt.codegen.ops import CUDA_IMPLS, REFERENCES
from kopt.graph.regions import CachedRegion, cached_regions, layout, same_value
from kopt.graph.splice import copy_graph_module, inline_graph, remove_dead_code
from kopt.verify import mutated_attributes, random_inputs

log = logging.getLogger("kopt")

aten = torch.ops.aten

# Views whose chains fold into one ``view`` of the chain's first input, when that view is valid
# (checked on the values' metadata) and gives the chain's strides.
_FOLDABLE = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_VIEW_LIKE = _FOLDABLE | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                          aten.flatten.using_ints, aten.unflatten.int}


@dataclass
class PlanSummary:
    """What the plan did, for the report."""

    direct: int = 0  # fused ops launched by DirectOp
    inlined: int = 0  # fused ops inlined as their reference's aten ops (CPU)
    python: int = 0  # fused ops whose reference is called without the dispatcher
    folded_views: int = 0
    bound: int = 0  # aten ops called through their Python binding
    kept: Counter = field(default_factory=Counter)  # op -> nodes left as OpOverload calls
    not_inlined: dict[str, str] = field(default_factory=dict)  # op -> why
    left_out: str | None = None  # stages left out after a failed check, and why
    streams: str | None = None  # the side stream's share (kopt.streams), or why there is none

    def line(self, ops: Sequence[DirectOp] = ()) -> str:
        replayed = sum(op.direct for op in ops)
        parts = []
        if self.direct:
            parts.append(f"{self.direct} fused-op calls launched directly"
                         + (f" ({replayed} replayed, {self.direct - replayed} through their "
                            "Python launch)" if any(op.recorded for op in ops) else ""))
        if self.inlined:
            parts.append(f"{self.inlined} fused ops inlined as aten ops")
        if self.python:
            parts.append(f"{self.python} fused ops called without the dispatcher")
        parts.append(f"{self.folded_views} views folded, {self.bound} aten ops through their "
                     "Python bindings")
        if self.streams:
            parts.append(self.streams)
        if self.left_out:
            parts.append(self.left_out)
        return "execution plan: " + "; ".join(parts)


class ExecutionPlan:
    """The runtime form of one optimized graph (module docstring)."""

    def __init__(self, gm: fx.GraphModule, for_layout: tuple, summary: PlanSummary,
                 ops: list[DirectOp]) -> None:
        self.gm = gm
        self.layout = for_layout
        self.summary = summary
        self.ops = ops
        self.off: str | None = None  # why the plan is not used (the optimized graph runs)

    def matches(self, flat: Sequence[Any]) -> bool:
        """Whether a call's inputs have the strides (and dtypes, devices) the plan was made
        for."""
        return self.off is None and layout(flat) == self.layout

    def describe(self) -> str:
        if self.off is not None:
            return f"execution plan: off ({self.off}); the optimized graph runs as verified"
        line = self.summary.line(self.ops)
        why = Counter(op.why_not for op in self.ops if op.recorded and not op.direct)
        for reason, n in why.most_common(3):
            line += f"\n      {n} not replayed: {reason}"
        return line


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory once each (any order of dims): what a
    buffer made by ``torch.empty_strided`` with its strides holds exactly."""
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# The plan's rewrites, each of which can be left out: inlining or direct launches of the fused
# ops, folded views, Python bindings, concurrent branches on a second CUDA stream
# (kopt.streams). A plan that does not match the optimized graph is made again without one of
# them, then two (largest plan first), so that a rewrite that fails on some graph costs only its
# own saving (the report names it).
STAGES = ("fused", "views", "bindings", "streams")


def build_plan(gm: fx.GraphModule, example: Sequence[Any], check: bool = True,
               outputs: Sequence[Any] | None = None, branch_streams: bool = False
               ) -> ExecutionPlan:
    """The execution plan of ``gm`` for inputs like ``example`` (flat leaves); ``check`` runs
    the plan against ``gm`` once (module docstring). Each hoisted region ``gm`` calls gets its
    own plan (:meth:`CachedRegion.set_plan`), kept with the region: regions are shared by the
    graphs of one optimized module, and so is what they cache. ``outputs``: ``gm``'s outputs on
    seed 0's random inputs (:func:`kopt.verify.random_inputs`), its hoisted regions empty
    before, where a check ran it already (verification's last check, or a warm start's): the
    check then runs the plan alone, where its inputs are those (W1: one run of 0.4-0.9 s).
    ``branch_streams=True`` runs the lighter of two concurrent branches on a second CUDA stream
    (:mod:`kopt.streams`). Off, and not offered to users: replayed from a CUDA graph, the
    two-stream plan gave wrong outputs on the GPU (RESULTS.md, 2026-12-08, H100)."""
    first_problem = ""
    stages_on = STAGES if branch_streams else tuple(st for st in STAGES if st != "streams")
    subsets = [tuple(st for st in stages_on if st not in out) for k in range(len(stages_on) + 1)
               for out in itertools.combinations(stages_on, k)]
    for stages in subsets:
        plan = _make_plan(gm, example, stages)
        if not check:
            return plan
        problem = _check(plan, gm, example, outputs)
        if problem is None:
            if first_problem:
                left = ", ".join(st for st in stages_on if st not in stages)
                plan.summary.left_out = f"{left} left out ({first_problem} with all)"
            return plan
        if not first_problem:
            first_problem = problem
            if not _repeatable(gm, example):
                plan.summary.left_out = ("checked op by op: the optimized graph does not "
                                         "repeat its outputs bit for bit on this device")
                return plan
    plan.off = first_problem
    for region in cached_regions(gm):
        region.set_plan(None, ())
    log.warning("kopt: %s", plan.describe())
    return plan


def _make_plan(gm: fx.GraphModule, example: Sequence[Any], stages: tuple[str, ...]
               ) -> ExecutionPlan:
    summary = PlanSummary()
    ops: list[DirectOp] = []
    plan_gm = copy_graph_module(gm)
    for node in plan_gm.graph.nodes:
        if node.op == "call_module":
            module = plan_gm.get_submodule(node.target)
            if isinstance(module, CachedRegion):
                plan_region(module, layout(_meta_of(a) for a in node.args), summary, ops,
                            stages)
    _lower(plan_gm, summary, ops, stages, branch_streams="streams" in stages)
    return ExecutionPlan(plan_gm, layout(example), summary, ops)


def plan_region(region: CachedRegion, for_layout: tuple, summary: PlanSummary | None = None,
                ops: list[DirectOp] | None = None, stages: tuple[str, ...] = STAGES) -> None:
    """Give ``region`` the plan of its graph, for inputs of ``for_layout``
    (:func:`kopt.graph.regions.layout`)."""
    lowered = _lower(copy_graph_module(region.region), summary or PlanSummary(),
                     [] if ops is None else ops, stages, branch_streams=False)
    region.set_plan(lowered, for_layout)


def _meta_of(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _lower(gm: fx.GraphModule, summary: PlanSummary, ops: list[DirectOp],
           stages: tuple[str, ...] = STAGES, branch_streams: bool = False) -> fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if "fused" in stages and node.op == "call_function" and node.target in REFERENCES:
            _lower_fused(gm, node, summary, ops)
    if "views" in stages:
        summary.folded_views += _fold_views(graph)
    remove_dead_code(graph)
    side = None
    if branch_streams:  # chosen on the ops themselves, before bindings replace them
        device = streams.graph_device(graph)
        if device is not None and device.type == "cuda":
            assignment = streams.assign(graph)
            side = assignment.side or None
            streams.mark_aliases(graph)
            summary.streams = assignment.line(0) if side is None else None
    bindings = _Bindings()
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            fn = bindings.of(node) if "bindings" in stages else None
            if fn is not None:
                node.target = fn
                summary.bound += 1
            else:
                summary.kept[str(node.target)] += 1
    if side:
        waits = streams.apply(gm, side, streams.BranchStreams(device))
        summary.streams = assignment.line(waits)
    gm.recompile()
    return gm


def _device(node: fx.Node) -> torch.device | None:
    vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    for v in pytree.tree_leaves(vals):
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def _positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` as the full positional list of ``op``'s schema (defaults
    filled), as the dispatcher hands them to a Python kernel."""
    out = list(args)
    for a in op._schema.arguments[len(args):]:
        if a.kwarg_only:
            raise ValueError(f"{op} has keyword-only arguments")
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise ValueError(f"{op}: missing argument {a.name}")
    return tuple(out)


def _lower_fused(gm: fx.GraphModule, node: fx.Node, summary: PlanSummary,
                 ops: list[DirectOp]) -> None:
    op = node.target
    device = _device(node)
    try:
        args = _positional(op, node.args, dict(node.kwargs))
    except ValueError:
        return
    if device is not None and device.type == "cuda" and op in CUDA_IMPLS:
        direct = DirectOp(op, CUDA_IMPLS[op], f"kopt_{node.name}")
        node.target, node.args, node.kwargs = direct, args, {}
        ops.append(direct)
        summary.direct += 1
        return
    if device is not None and device.type == "cuda":
        return
    reference = REFERENCES[op]
    try:
        _inline_reference(gm, node, reference, args)
        summary.inlined += 1
    except Exception as e:  # noqa: BLE001 -- a reference make_fx cannot trace: call it as it is
        summary.not_inlined[str(op)] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        node.target, node.args, node.kwargs = reference, args, {}
        node.meta["kopt_reference"] = str(op)
        summary.python += 1


def _inline_reference(gm: fx.GraphModule, node: fx.Node, reference: Any, args: tuple) -> None:
    """Replace ``node`` by the aten ops of ``reference(*args)``, traced on its fake values."""
    leaves, spec = pytree.tree_flatten(args)
    where = [i for i, v in enumerate(leaves) if isinstance(v, fx.Node)]
    fakes = [leaves[i].meta["val"] for i in where]

    def fn(*tensors: Any) -> Any:
        values = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            values[i] = t
        return reference(*pytree.tree_unflatten(values, spec))

    traced = make_fx(fn, tracing_mode="fake")(*fakes)
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        raise ValueError("the traced reference reads a constant")
    names = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    outputs = inline_graph(gm, traced.graph, dict(zip(names, [leaves[i] for i in where],
                                                      strict=True)), node)
    result = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    if isinstance(result, list | tuple):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise ValueError(f"the op's outputs are used by {user.target}")
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs[0])
    gm.graph.erase_node(node)


def _fold_views(graph: fx.Graph) -> int:
    """Fold each chain of reshapes into one ``view`` of its first input, where that single view
    is valid and gives the chain's strides; drop a reshape to the shape it already has."""
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FOLDABLE:
            continue
        src = node.args[0]
        out, base = node.meta.get("val"), getattr(src, "meta", {}).get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(base, torch.Tensor):
            continue
        if (base.shape == out.shape and base.stride() == out.stride()
                and base.storage_offset() == out.storage_offset() and src.op != "placeholder"):
            node.replace_all_uses_with(src)
            folded += 1
            continue
        first = src
        while _pure_view(first):
            first = first.args[0]
        if first is src:
            continue
        origin = first.meta.get("val")
        if not isinstance(origin, torch.Tensor) or not _views_as(_meta(origin), _meta(out)):
            continue
        node.target = aten.view.default
        node.args = (first, list(out.shape))
        folded += 1
    return folded


def _pure_view(node: fx.Node) -> bool:
    """A view-like node that aliases its input (a reshape that copies does not)."""
    if node.op != "call_function" or node.target not in _VIEW_LIKE or not isinstance(
            node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return node.target not in _FOLDABLE or _views_as(_meta(src), _meta(out))


def _views_as(origin: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``origin.view(out.shape)`` is valid and has ``out``'s strides and offset."""
    try:
        v = origin.view(list(out.shape))
    except RuntimeError:
        return False
    return v.stride() == out.stride() and v.storage_offset() == out.storage_offset()


class _Ops(TorchDispatchMode):
    """Records the aten ops a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)


class _Bindings:
    """The Python binding of an aten overload, where calling it with a node's arguments
    dispatches exactly the ops the overload does (checked on fake values, once per overload
    and argument kinds)."""

    def __init__(self) -> None:
        self.checked: dict[tuple, Any] = {}

    def of(self, node: fx.Node) -> Any:
        op = node.target
        if op.namespace != "aten" or not all(_plain(a) for a in (*node.args,
                                                                  *node.kwargs.values())):
            return None
        name = op._schema.name.split("::")[1]
        candidates = [getattr(ns, name) for ns in _NAMESPACES if hasattr(ns, name)]
        if not candidates:
            return None
        key = (op, _kinds(node.args), tuple(sorted(node.kwargs)),
               tuple(_kind(v) for v in node.kwargs.values()))
        if key not in self.checked:
            self.checked[key] = next((fn for fn in candidates if _same_dispatch(op, fn, node)),
                                     None)
        return self.checked[key]


_SCALARS = (fx.Node, int, float, bool, str, type(None), torch.dtype, torch.device,
            torch.layout, torch.memory_format)


def _plain(a: Any) -> bool:
    """An argument a binding takes as the overload does: a value, a scalar, or a flat list."""
    return isinstance(a, _SCALARS) or (isinstance(a, list | tuple)
                                       and all(isinstance(v, _SCALARS) for v in a))


def _kind(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        return "T" if isinstance(v, torch.Tensor) else type(v).__name__
    if isinstance(a, list | tuple):
        return (type(a).__name__, *[_kind(v) for v in a])
    return type(a).__name__


def _kinds(args: tuple) -> tuple:
    return tuple(_kind(a) for a in args)


def _meta(v: Any) -> Any:
    """A meta tensor with ``v``'s shape, strides, offset and dtype (any fake mode's value)."""
    if not isinstance(v, torch.Tensor):
        return v
    size = 1 + v.storage_offset() + sum((s - 1) * st for s, st in zip(v.shape, v.stride(),
                                                                      strict=True))
    base = torch.empty(max(size, 1) if v.numel() else 1, dtype=v.dtype, device="meta")
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def _same_dispatch(op: Any, fn: Any, node: fx.Node) -> bool:
    """Whether ``fn(*node.args)`` dispatches the ops ``op(*node.args)`` does and returns values
    of the same kind, shapes, strides and dtypes (a list where ``op`` returns a tuple only if
    the node's users index it)."""
    def meta(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _meta(a.meta.get("val"))
        if isinstance(a, list | tuple):
            return type(a)(meta(v) for v in a)
        return a

    args = tuple(meta(a) for a in node.args)
    kwargs = {k: meta(v) for k, v in node.kwargs.items()}
    try:
        with _Ops() as want:
            expected = op(*args, **kwargs)
        with _Ops() as got:
            result = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- the binding does not take these arguments
        return False
    if want.ops != got.ops:
        return False
    if type(expected) is not type(result) and not (
            isinstance(expected, list | tuple) and isinstance(result, list | tuple)
            and _only_indexed(node)):
        return False
    a, b = pytree.tree_leaves(expected), pytree.tree_leaves(result)
    return len(a) == len(b) and all(
        type(x) is type(y) and (not isinstance(x, torch.Tensor) or (
            x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype))
        for x, y in zip(a, b, strict=True))


def _only_indexed(node: fx.Node) -> bool:
    """Whether every use of ``node`` takes one element by index (a list and a tuple alike)."""
    return bool(node.users) and all(u.op == "call_function" and u.target is operator.getitem
                                    for u in node.users)


def _restrided(value: Any, like: Any) -> Any:
    """``value``'s values laid out with ``like``'s strides and offset: the plan's launches are
    recorded on this call, for the strides it is specialised on (an overlapping layout, such as
    an expanded tensor's, takes as many of the values as it has memory locations)."""
    if not isinstance(value, torch.Tensor) or (
            value.stride() == like.stride() and value.storage_offset() == like.storage_offset()):
        return value
    if is_dense(like) and not like.storage_offset():
        return torch.empty_strided(like.shape, like.stride(), dtype=value.dtype,
                                   device=value.device).copy_(value)
    size = like.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(
        like.shape, like.stride(), strict=True))
    flat = value.reshape(-1)
    base = flat.repeat(-(-size // flat.numel()))[:size] if flat.numel() else \
        torch.zeros(size, dtype=value.dtype, device=value.device)
    return base.as_strided(like.shape, like.stride(), like.storage_offset())


def _runnable(gm: fx.GraphModule, example: Sequence[Any]) -> bool:
    """Whether the plan can be checked here: real inputs, and no buffer the graph writes in
    place (running it twice would write it twice)."""
    return not mutated_attributes(gm) and all(
        not isinstance(t, torch.Tensor) or (not getattr(t, "fake_mode", None)
                                            and t.device.type != "meta") for t in example)


def _inputs(example: Sequence[Any]) -> list[Any]:
    return [_restrided(r, e) for r, e in zip(random_inputs(example, seed=0), example,
                                             strict=True)]


def _run_clean(gm: fx.GraphModule, inputs: Sequence[Any], planned_regions: bool) -> list[Any]:
    """``gm(*inputs)``'s outputs, its hoisted regions empty before (so that they compute) and
    after, computing with their plans or without them."""
    regions = cached_regions(gm)
    plans = [(r, r.planned, r.planned_for) for r in regions]
    try:
        for r in regions:
            r.clear()
            if not planned_regions:
                r.set_plan(None, ())
        with torch.no_grad():
            return pytree.tree_leaves(gm(*inputs))
    finally:
        for r, planned, for_layout in plans:
            r.clear()
            r.set_plan(planned, for_layout)


def _differ(got: Sequence[Any], want: Sequence[Any]) -> int | None:
    """The first output that is not bitwise equal, or None."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True))
                 if not same_value(a, b)), None)


def _check(plan: ExecutionPlan, gm: fx.GraphModule, example: Sequence[Any],
           outputs: Sequence[Any] | None = None) -> str | None:
    """Run the plan and the optimized graph (its regions without their plans) on the same
    random inputs; None if they agree bit for bit, else what went wrong. A graph that cannot be
    run here (a buffer written in place, fake inputs) is not: each fused op's replay was still
    checked against its own recorded call. ``outputs``: the graph's, where known
    (:func:`build_plan`)."""
    if not _runnable(gm, example):
        return None
    seed0 = random_inputs(example, seed=0)
    inputs = [_restrided(r, e) for r, e in zip(seed0, example, strict=True)]
    if outputs is not None and not all(a is b for a, b in zip(inputs, seed0, strict=True)):
        outputs = None  # the plan runs on another layout than the graph ran on
    try:
        want = list(outputs) if outputs is not None else \
            _run_clean(gm, inputs, planned_regions=False)
        got = _run_clean(plan.gm, inputs, planned_regions=True)
    except Exception as e:  # noqa: BLE001 -- the plan is an optimization: say why, run the graph
        return f"it raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    i = _differ(got, want)
    return None if i is None else f"output {i} differs from the optimized graph's"


def _repeatable(gm: fx.GraphModule, example: Sequence[Any]) -> bool:
    """Whether two runs of ``gm`` on the same inputs give the same bits."""
    inputs = _inputs(example)
    first = _run_clean(gm, inputs, planned_regions=False)
    return _differ(_run_clean(gm, inputs, planned_regions=False), first) is None
