"""Repeated blocks, found by structure and captured once.

A DiT or an LLM is mostly one block class stacked in an ``nn.ModuleList`` (W1: 60 blocks, 11650
of its 11880 captured nodes). Tracing every block through ``torch.export`` costs the same each
time, so :func:`capture_repeated` traces the model with each repeated block standing in as one
opaque op, traces one block per distinct call, and instantiates that block's graph at every
call site with that instance's own parameters. The result is the graph a whole-model export
gives, node for node (a test compares the two), at a fraction of the trace time.

Blocks count as repeated by structure alone, never by name: children of one ``ModuleList`` of
one class whose parameters and buffers have the same names, shapes, dtypes and devices, whose
submodules hold equal non-tensor attributes (a flag that differs, such as a per-layer sliding
window or a layer index, would change the trace) and no hooks. Calls share a trace only where
their non-tensor arguments and their tensors' shapes, strides and dtypes agree.

A block that mutates its inputs or buffers, returns an alias of an input, or cannot be traced on
its own makes :func:`capture_repeated` return ``None``: the caller then exports the whole model
as it is (an error there names the construct, as it always does).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import pickle
import re
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt.graph.query import attr, compact_paths, fake_mode_of
from kopt.graph.serialize import encode_graph
from kopt.graph.splice import remove_dead_code

log = logging.getLogger("kopt")

# attributes every nn.Module has, not part of what makes two blocks trace alike
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()).keys())
# nested plain objects (an attention processor, a config) are compared this deep
_ATTR_DEPTH = 3
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)


class NotRepeatable(Exception):
    """A repeated block that cannot stand for its siblings; the whole model is exported."""


@dataclass
class _Call:
    """What one traced call of a repeated block looked like: enough to rebuild its arguments
    from the opaque op's tensor inputs, and its outputs from the op's results."""

    block: torch.nn.Module
    in_spec: pytree.TreeSpec
    leaves: tuple  # per input leaf: None for a tensor (taken from the op's inputs), else (value,)
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)  # per output leaf: meta tuple or (value,)


@dataclass
class _Group:
    paths: list[str]  # the instances' module paths, in list order


class _Registry:
    """The calls seen while tracing with stand-ins, keyed by what makes their traces equal."""

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}
        self.calls: dict[int, _Call] = {}
        self.paths: dict[int, str] = {}  # id(module) -> path, for every stubbed instance

    def key(self, group: int, block: torch.nn.Module, spec: pytree.TreeSpec,
            flat: list[Any]) -> int:
        sig = (group, str(spec), tuple(
            ("t", tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type)
            if isinstance(x, torch.Tensor) else ("v", type(x).__name__, repr(x)) for x in flat))
        k = self.keys.setdefault(sig, len(self.keys))
        if k not in self.calls:
            leaves = tuple(None if isinstance(x, torch.Tensor) else (x,) for x in flat)
            self.calls[k] = _Call(block, spec, leaves)
        return k


_ACTIVE: list[_Registry] = []  # the registry of the capture in progress (captures nest not)


@torch.library.custom_op("kopt::repeated_block", mutates_args=())
def _repeated_block(xs: list[torch.Tensor], key: int, instance: int) -> list[torch.Tensor]:
    raise RuntimeError("kopt::repeated_block stands in for a block only while a model is "
                       "captured; it never runs")


@_repeated_block.register_fake
def _(xs: list[torch.Tensor], key: int, instance: int) -> list[torch.Tensor]:
    call = _ACTIVE[-1].calls[key]
    if call.out_spec is None:  # the first call of this kind: run the block on fake tensors
        args, kwargs = _rebuild(call, xs)
        out = type(call.block).forward(call.block, *args, **kwargs)
        flat, call.out_spec = pytree.tree_flatten(out)
        taken = {x.untyped_storage()._cdata for x in xs}
        for o in flat:
            if isinstance(o, torch.Tensor):
                if o.untyped_storage()._cdata in taken:
                    raise NotRepeatable("it returns a view of its input")
                call.out_leaves.append((tuple(o.shape), tuple(o.stride()), o.dtype, o.device))
            else:
                call.out_leaves.append((o,))
    return [torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3])
            for m in call.out_leaves if len(m) == 4]


def _rebuild(call: _Call, tensors: list[Any]) -> tuple[tuple, dict]:
    it = iter(tensors)
    flat = [next(it) if leaf is None else leaf[0] for leaf in call.leaves]
    args, kwargs = pytree.tree_unflatten(flat, call.in_spec)
    return tuple(args), kwargs


def find_groups(model: torch.nn.Module, min_size: int = 2) -> list[_Group]:
    """The outermost ``ModuleList``\\ s whose children trace alike (module docstring)."""
    if torch.nn.modules.module._global_forward_hooks or \
            torch.nn.modules.module._global_forward_pre_hooks:
        return []
    groups: list[_Group] = []
    taken: list[str] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < min_size:
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue  # inside a block already stood in for: traced with its block
        children = list(mod)
        if len({type(c) for c in children}) != 1 or not all(_standable(c) for c in children):
            continue
        first = _signature(children[0])
        if any(_signature(c) != first for c in children[1:]):
            continue
        prefix = f"{path}." if path else ""
        paths = [f"{prefix}{i}" for i in range(len(children))]
        groups.append(_Group(paths))
        taken += paths
    return groups


def _standable(block: torch.nn.Module) -> bool:
    """No hooks anywhere in it, and ``forward`` not replaced on the instance (a wrapper such as
    an offloading hook's would be bypassed)."""
    if "forward" in vars(block):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                   or getattr(m, "_forward_hooks_with_kwargs", None)
                   for m in block.modules())


def _signature(block: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type)
                   for n, t in block.named_parameters())
    buffers = tuple((n, tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type)
                    for n, t in block.named_buffers())
    attrs = tuple((n, type(m).__name__, _attrs(m)) for n, m in block.named_modules())
    return params, buffers, attrs


def _attrs(mod: torch.nn.Module) -> tuple:
    return tuple(sorted((k, _value(v, _ATTR_DEPTH)) for k, v in vars(mod).items()
                        if k not in _MODULE_INTERNALS))


def _value(v: Any, depth: int) -> Any:
    """A comparable stand-in for an attribute: plain values by value, tensors and opaque
    objects by identity (two blocks holding different tensors do not trace alike)."""
    if v is None or isinstance(v, bool | int | float | str | torch.dtype | torch.device):
        return v
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(_value(x, depth) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), _value(x, depth)) for k, x in v.items())))
    if isinstance(v, (torch.Tensor, torch.nn.Module, *_FUNCTIONS)) or depth == 0:
        return ("id", id(v))
    fields = getattr(v, "__dict__", None)
    if fields is None:
        return ("id", id(v))
    return (type(v).__qualname__,
            tuple(sorted((k, _value(x, depth - 1)) for k, x in fields.items())))


@contextmanager
def _standing_in(groups: list[_Group], model: torch.nn.Module) -> Iterator[_Registry]:
    """Put a parameterless stand-in in each grouped block's place while tracing: the trace
    then neither walks the blocks nor lifts their parameters (torch.export's bookkeeping
    grows with the square of the parameter count)."""
    registry = _Registry()
    swapped: list[tuple[torch.nn.ModuleList, int, torch.nn.Module]] = []
    _ACTIVE.append(registry)
    try:
        for g, group in enumerate(groups):
            for path in group.paths:
                head, _, index = path.rpartition(".")
                container = model.get_submodule(head)
                block = container[int(index)]
                instance = len(registry.paths)
                registry.paths[instance] = path
                container[int(index)] = _StandIn(block, _stand_in(registry, g, instance, block))
                swapped.append((container, int(index), block))
        yield registry
    finally:
        for container, index, block in swapped:
            container[index] = block
        _ACTIVE.remove(registry)


class _StandIn(torch.nn.Module):
    """A block's place-holder during the outer trace: calls the opaque op; other attributes
    read through to the block."""

    def __init__(self, block: torch.nn.Module, forward: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_kopt_block", block)
        object.__setattr__(self, "_kopt_forward", forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._kopt_forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_kopt_block"), name)


def _stand_in(registry: _Registry, group: int, instance: int, block: torch.nn.Module) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        key = registry.key(group, block, spec, flat)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        outs = iter(torch.ops.kopt.repeated_block(tensors, key, instance))
        call = registry.calls[key]
        leaves = [next(outs) if len(m) == 4 else m[0] for m in call.out_leaves]
        return pytree.tree_unflatten(leaves, call.out_spec)
    return forward


@dataclass
class Repeated:
    """How a capture used repeated blocks (the report's line)."""

    instances: int  # block calls instantiated from a traced block
    traced: int  # blocks traced
    paths: list[str]
    # a hash of what the instantiated graph is made from (the outer trace, each traced block,
    # the instances' paths): the fingerprint without encoding every instance (W1: 11644
    # nodes); None where a graph cannot be encoded (the fingerprint then encodes the whole)
    structure: str | None = None

    def describe(self) -> str:
        return (f"repeated blocks {_compact(self.paths)}: {self.traced} "
                f"trace{'s' if self.traced != 1 else ''} for {self.instances} calls")


def _compact(paths: list[str]) -> str:
    """``transformer_blocks.{0..59}, single_transformer_blocks.{0..19}``."""
    by_list: dict[str, list[str]] = {}
    for p in paths:
        by_list.setdefault(p.rpartition(".")[0], []).append(p)
    return ", ".join(compact_paths(ps) for ps in by_list.values())


def trace_with_stand_ins(
    model: torch.nn.Module, args: tuple, kwargs: dict, export: Any,
) -> tuple[Any, _Registry] | None:
    """``export(model, args, kwargs)`` with the repeated blocks standing in as opaque ops;
    ``None`` where the model has no repeated blocks. Whatever ``export`` returns (a program
    whose graph :func:`trace_blocks` reads) is returned with the calls it saw."""
    groups = find_groups(model)
    if not groups:
        return None
    with _standing_in(groups, model) as registry:
        traced = export(model, args, kwargs)
    return traced, registry


@contextmanager
def calls_of(registry: _Registry) -> Iterator[None]:
    """The stand-in ops of ``registry``'s trace known to their fake kernel again: for the
    outer trace's decompositions, which run it once more."""
    _ACTIVE.append(registry)
    try:
        yield
    finally:
        _ACTIVE.remove(registry)


@dataclass
class Blocks:
    """Each distinct kind of repeated block traced once (:func:`trace_blocks`): what
    :func:`instantiate` inlines, and the hash that names the graph it makes."""

    traces: dict[int, fx.GraphModule]  # registry key -> the block's traced graph
    repeated: Repeated


def trace_blocks(graph: fx.Graph, registry: _Registry, export: Any) -> Blocks:
    """Trace each kind of block that the stand-in ops of ``graph`` (the outer trace) call, with
    its first call's arguments. ``export(block, args, kwargs)`` traces one block (kopt's flat
    IR). :attr:`Repeated.structure` hashes ``graph``, each block's graph, the attributes it
    reads and the instances' paths: the graph :func:`instantiate` makes from them is a function
    of these and of the kopt and torch builds."""
    ops = [n for n in graph.nodes if n.target is torch.ops.kopt.repeated_block.default]
    paths = [registry.paths[op.args[2]] for op in ops]
    structure = _Structure(graph, paths)
    traces: dict[int, fx.GraphModule] = {}
    for op in ops:
        xs, key, _ = op.args
        if key not in traces:
            call = registry.calls[key]
            traces[key] = export(call.block, *_rebuild(call, [x.meta["val"] for x in xs]))
            structure.add(key, traces[key].graph, _block_attrs(traces[key], call))
    return Blocks(traces, Repeated(len(ops), len(traces), paths, structure.digest()))


def instantiate(gm: fx.GraphModule, registry: _Registry, model: torch.nn.Module,
                blocks: Blocks) -> None:
    """Replace every stand-in op of ``gm`` (the outer trace, decomposed) by its block's traced
    graph, reading the instance's own parameters. Raises :class:`NotRepeatable` where a call's
    arguments are not laid out as the block was traced with."""
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.kopt.repeated_block.default]
    mode = fake_mode_of(gm)
    traces: dict[int, _Trace] = {}
    anchor = next(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr"))
    for op in ops:
        xs, key, instance = op.args
        if key not in traces:
            traces[key] = _Trace(blocks.traces[key], mode, registry.calls[key], len(traces))
        _check_layout(xs, traces[key])
        _inline(gm, op, traces[key], registry.paths[instance], anchor, model)
    remove_dead_code(gm.graph)


def _check_layout(xs: list[fx.Node], trace: _Trace) -> None:
    """The decomposed outer trace hands the block what it was traced with (shapes, strides,
    dtypes): its views are valid for those strides only."""
    args, kwargs = _rebuild(trace.call, list(xs))
    leaves, _ = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))  # the block's order
    for x, p in zip(leaves, trace.placeholders, strict=True):
        if not isinstance(x, fx.Node):
            continue
        a, b = x.meta["val"], p.meta["val"]
        if (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype):
            raise NotRepeatable(f"a call's argument is laid out as {list(a.shape)} "
                                f"{list(a.stride())} {a.dtype} after the decompositions, the "
                                f"block was traced with {list(b.shape)} {list(b.stride())} "
                                f"{b.dtype}")


def block_tensors(blocks: Blocks) -> dict[str, torch.Tensor]:
    """The traced blocks' own constants, by the names :func:`instantiate` gives them."""
    out = {}
    for index, block_gm in enumerate(blocks.traces.values()):
        for node in block_gm.graph.nodes:
            if node.op == "get_attr":
                value = attr(block_gm, node.target)
                if isinstance(value, torch.Tensor):
                    out[_shared_name(index, node.target)] = value
    return out


def _shared_name(index: int, target: str) -> str:
    return f"_kopt_repeated_{index}_{target.replace('.', '_')}"


def _block_attrs(block_gm: fx.GraphModule, call: _Call) -> dict[str, str | None]:
    """Per attribute the traced block reads: its name relative to the block where it is one of
    the block's parameters or buffers (each instance reads its own), else None (a constant of
    the trace, shared by the instances)."""
    own = {id(t): n for n, t in (*call.block.named_parameters(), *call.block.named_buffers())}
    return {node.target: own.get(id(attr(block_gm, node.target)))
            for node in block_gm.graph.nodes if node.op == "get_attr"}


class _Structure:
    """The hash of :attr:`Repeated.structure`: the outer graph with its stand-ins (encoded
    before they are inlined), each block's traced graph and the attributes it reads of its
    instance. The instantiated graph is a function of these and the kopt version (which keys
    a warm start too); the weights' shapes and dtypes are hashed by the fingerprint itself."""

    def __init__(self, outer: fx.Graph, paths: list[str]) -> None:
        self.hash: Any = hashlib.sha256()
        self._add(("outer", outer, paths))

    def add(self, key: int, block: fx.Graph, attrs: dict[str, str | None]) -> None:
        self._add(("block", key, block, sorted(attrs.items())))

    def _add(self, part: tuple) -> None:
        if self.hash is None:
            return
        try:
            part = tuple(encode_graph(p, keep_meta=False) if isinstance(p, fx.Graph) else p
                         for p in part)
            self.hash.update(pickle.dumps(part, protocol=5))
        except Exception:  # noqa: BLE001 -- NotSerializable, a symbolic size: the whole graph
            self.hash = None

    def digest(self) -> str | None:
        return None if self.hash is None else self.hash.hexdigest()


class _Trace:
    """One block's traced graph, with its values moved into the outer graph's fake mode."""

    def __init__(self, block_gm: fx.GraphModule, mode: Any, call: _Call, index: int) -> None:
        self.gm = block_gm
        self.call = call
        self.index = index  # names the block's shared constants alike in every process
        self.vals: dict[fx.Node, Any] = {}
        for node in block_gm.graph.nodes:
            if "val" in node.meta:
                self.vals[node] = pytree.tree_map_only(
                    torch.Tensor, lambda v: mode.from_tensor(v, static_shapes=True),
                    node.meta["val"])
        self.attrs = _block_attrs(block_gm, call)  # -> instance-relative name
        tensor_out = [i for i, m in enumerate(call.out_leaves) if len(m) == 4]
        out = next(n for n in block_gm.graph.nodes if n.op == "output")
        flat_out = list(out.args[0])
        self.outputs = [flat_out[i] for i in tensor_out]
        self.placeholders = [n for n in block_gm.graph.nodes if n.op == "placeholder"]


def _inline(gm: fx.GraphModule, op: fx.Node, trace: _Trace, path: str,
            anchor: fx.Node, model: torch.nn.Module) -> None:
    args, kwargs = _rebuild(trace.call, list(op.args[0]))
    leaves, _ = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))  # the block's order
    env: dict[fx.Node, Any] = dict(zip(trace.placeholders, leaves, strict=True))
    outer_stack = {k: v for k, v in (op.meta.get("nn_module_stack") or {}).items()
                   if v[0] != path}  # the stand-in's own entry: the block's class instead
    outer_stack[f"L__self__{path}"] = (path, _qualname(type(trace.call.block)))
    stacks: dict[int, dict] = {}
    for node in trace.gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            env[node] = _instance_attr(gm, node, trace, path, anchor, model)
            continue
        with gm.graph.inserting_before(op):
            new = gm.graph.node_copy(node, lambda n: env[n])
        meta = dict(node.meta)
        if node in trace.vals:
            meta["val"] = trace.vals[node]
        inner = node.meta.get("nn_module_stack")
        if inner:
            k = id(inner)
            if k not in stacks:
                stacks[k] = {**outer_stack, **{
                    f"L__self__{path}.{p}": (f"{path}.{p}", t)
                    for p, t in inner.values() if p}}
            meta["nn_module_stack"] = stacks[k]
        new.meta = meta
        env[node] = new
    for user in list(op.users):
        if user.target is not operator.getitem:
            raise NotRepeatable(f"its stand-in is used by {user.format_node()}")
        user.replace_all_uses_with(env[trace.outputs[user.args[1]]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(op)


def _instance_attr(gm: fx.GraphModule, node: fx.Node, trace: _Trace, path: str,
                   anchor: fx.Node, model: torch.nn.Module) -> fx.Node:
    """A ``get_attr`` of the instance's own parameter, or of the traced block's constant
    (computed alike in every instance: shared)."""
    rel = trace.attrs[node.target]
    if rel is not None:
        target = f"{path}.{rel}"
        if not _has(gm, target):  # the outer trace never saw the block: attach its tensor
            _attach(gm, target, attr(model, target))
    else:
        target = _shared_name(trace.index, node.target)
        if not hasattr(gm, target):
            value = attr(trace.gm, node.target)
            if isinstance(value, torch.nn.Parameter):
                gm.register_parameter(target, value)
            elif isinstance(value, torch.Tensor):
                gm.register_buffer(target, value)
            else:
                setattr(gm, target, value)
    with gm.graph.inserting_before(anchor):
        new = gm.graph.get_attr(target)
    new.meta = dict(node.meta)
    if node in trace.vals:
        new.meta["val"] = trace.vals[node]
    return new


def _attach(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Register the model's own tensor (shared, not copied) at ``target`` under ``gm``,
    making the intermediate modules as ``ExportedProgram.module()`` does."""
    *parents, name = target.split(".")
    mod: torch.nn.Module = gm
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(name, value)
    else:
        mod.register_buffer(name, value)


def _has(mod: torch.nn.Module, target: str) -> bool:
    try:
        attr(mod, target)
    except AttributeError:
        return False
    return True


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# -- dynamo graphs -----------------------------------------------------------------------------
# a list child in dynamo's nn_module_stack paths: "L['self'].transformer_blocks.3"
_LIST_CHILD = re.compile(r"^(.*)\.(\d+)$")
# one module name of such a path: ".name" or "['name']" (dynamo writes "__dict__['_modules']")
_NAME = re.compile(r"\.([A-Za-z_]\w*)|\['([^']+)'\]")
_PLUMBING = frozenset({"__dict__", "_modules"})


class _Region(torch.nn.Module):
    """One block's nodes of a dynamo graph as a module of its own: its weights are its
    parameters (``w0``, ``w1``, ... in order of first use), its ``forward`` the nodes' code,
    shared by every region whose code is the same (a class per code)."""


_REGION_CLASSES: dict[str, type[_Region]] = {}  # code -> class (a class compares by identity)


def outline_dynamo_blocks(gm: fx.GraphModule) -> int:
    """Move each repeated block's nodes of a dynamo graph (whose modules dynamo inlined) into a
    module of its own, in a ``ModuleList`` per block list, so that :func:`trace_with_stand_ins`
    finds them as it finds a model's blocks; returns the blocks outlined.

    A block is the run of nodes whose ``nn_module_stack`` names one child of a list (its
    outermost such entry); blocks whose runs are split, that call modules or read attributes
    that are not tensors (a higher-order op's subgraph), or whose code differs from their
    siblings' stay inline (a list keeps only blocks of one code). The
    weights a block alone reads move into it; everything else it reads becomes an argument,
    and what later nodes read of it its outputs. ``gm`` computes what it computed: its
    graph calls the blocks where their nodes were."""
    runs: dict[tuple[str, int], list[fx.Node]] = {}
    split: set[str] = set()
    last: tuple[str, int] | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        key = _list_child(node)
        if key is not None and key != last and key in runs:
            split.add(key[0])  # the block's nodes are not one run
        if key is not None:
            runs.setdefault(key, []).append(node)
        last = key
    lists: dict[str, list[tuple[int, list[fx.Node]]]] = {}
    for (path, index), nodes in runs.items():
        if path not in split and all(n.op in ("call_function", "call_method") for n in nodes):
            lists.setdefault(path, []).append((index, nodes))
    chosen = []  # planned in full before the graph changes
    for path, blocks in lists.items():
        try:
            plans = [_plan(gm, nodes) for _, nodes in sorted(blocks, key=lambda b: b[0])]
        except NotRepeatable as e:
            log.info("kopt: blocks %s stay in dynamo's graph (%s)", path, e)
            continue
        by_code: dict[str, list[tuple]] = {}
        for plan in plans:
            by_code.setdefault(plan[0].python_code("self").src, []).append(plan)
        code, same = max(by_code.items(), key=lambda kv: len(kv[1]))
        if len(same) >= 2:
            # the model's own list path where every block is here, in order
            every = len(same) == len(plans) and sorted(i for i, _ in blocks) == \
                list(range(len(plans)))
            base = "_".join(_module_names(path)) or "blocks"
            chosen.append((base if every else f"{base}_repeated", _region_class(code, same[0][0]),
                           same))
    outlined = 0
    moved: dict[fx.Node, fx.Node] = {}  # an outlined block's output -> the getitem reading it
    for base, cls, same in chosen:
        name = _free_name(gm, base)
        container = torch.nn.ModuleList()
        gm.add_module(name, container)
        for _graph, inputs, weights, outputs, nodes in same:
            region = cls()
            for j, w in enumerate(weights):
                value = attr(gm, w.target)
                if isinstance(value, torch.nn.Parameter):
                    region.register_parameter(f"w{j}", value)
                else:
                    region.register_buffer(f"w{j}", value)
            container.append(region)
            _replace(gm, f"{name}.{len(container) - 1}", nodes,
                     [moved.get(x, x) for x in inputs], outputs, moved)
            outlined += 1
    if outlined:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                target = node.target
                gm.graph.erase_node(node)
                if "." not in target and hasattr(gm, target):
                    delattr(gm, target)
        gm.recompile()
    return outlined


def _module_names(path: str) -> list[str]:
    """``L['self'].__dict__['_modules']['transformer_blocks']`` -> ``["transformer_blocks"]``:
    the module names below dynamo's root."""
    names = [a or b for a, b in _NAME.findall(path)]
    return [n for n in names[1:] if n not in _PLUMBING and n.isidentifier()]


def _list_child(node: fx.Node) -> tuple[str, int] | None:
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():  # outermost first
        m = _LIST_CHILD.match(str(path))
        if m:
            return m.group(1), int(m.group(2))
    return None


def _plan(gm: fx.GraphModule, nodes: list[fx.Node]
          ) -> tuple[fx.Graph, list[fx.Node], list[fx.Node], list[fx.Node], list[fx.Node]]:
    """(the block's graph, its inputs, the weights it alone reads, its outputs, its nodes)."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    weights: list[fx.Node] = []
    for node in nodes:
        for x in node.all_input_nodes:
            if x in inside or x in inputs or x in weights:
                continue
            if x.op == "get_attr" and not isinstance(attr(gm, x.target), torch.Tensor):
                raise NotRepeatable(f"it reads {x.target}, not a tensor (a subgraph)")
            if x.op == "get_attr" and all(u in inside for u in x.users):
                weights.append(x)
            else:
                inputs.append(x)
    # what later nodes read, and what nothing reads (the last block's output the model drops
    # is its siblings' output too: the same code)
    outputs = [n for n in nodes if not n.users or any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, x in enumerate(inputs):
        env[x] = graph.placeholder(f"x{i}")
    for j, w in enumerate(weights):
        env[w] = graph.get_attr(f"w{j}")
    for k, node in enumerate(nodes):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=f"n{k}")
    graph.output(tuple(env[o] for o in outputs))
    return graph, inputs, weights, outputs, nodes


def _region_class(code: str, graph: fx.Graph) -> type[_Region]:
    cls = _REGION_CLASSES.get(code)
    if cls is None:
        python = graph.python_code("self")
        namespace = dict(python.globals)
        exec(compile(python.src, f"<kopt block {len(_REGION_CLASSES)}>", "exec"),  # noqa: S102
             namespace)
        cls = type(f"Block{len(_REGION_CLASSES)}", (_Region,),
                   {"forward": namespace["forward"], "__module__": __name__})
        _REGION_CLASSES[code] = cls
    return cls


def _free_name(gm: fx.GraphModule, name: str) -> str:
    base, n = name, 1
    while hasattr(gm, name):
        name = f"{base}_{n}"
        n += 1
    return name


def _replace(gm: fx.GraphModule, target: str, nodes: list[fx.Node], inputs: list[fx.Node],
             outputs: list[fx.Node], moved: dict[fx.Node, fx.Node]) -> None:
    inside = set(nodes)
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(target, tuple(inputs))
        for i, out in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            moved[out] = item
    for node in reversed(nodes):
        gm.graph.erase_node(node)


@dataclass
class Cut:
    """What :func:`cut_repeats` left of each repeated list: (list path, instances kept, of)."""

    lists: list[tuple[str, int, int]]

    def describe(self) -> str:
        return ", ".join(f"{keep} of {n} {path}" for path, keep, n in self.lists)


def cut_repeats(gm: fx.GraphModule, registry: _Registry, keep: int) -> Cut | None:
    """Keep the first ``keep`` calls of each repeated list in ``gm`` (the outer trace with its
    stand-ins, before :func:`instantiate`), the outputs of the last one kept standing for the
    last call's: a model as deep as ``keep`` blocks per list, on which the passes meet every
    rewrite site a block holds (and the sites between two blocks) at a fraction of the cost.

    A list is cut only where its calls form a chain: each call after the second reads the call
    before it exactly as the second reads the first (the same outputs in the same places, every
    other argument the same node), each call but the last is read only by the next one, and the
    calls from the last kept on were traced alike. Returns what was cut, or None where nothing
    could be (no list longer than ``keep`` that forms a chain)."""
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.kopt.repeated_block.default]
    by_list: dict[str, list[fx.Node]] = {}
    for op in ops:
        by_list.setdefault(registry.paths[op.args[2]].rpartition(".")[0], []).append(op)
    cut = []
    for path, calls in by_list.items():
        if len(calls) <= keep or not _chained(calls, keep):
            continue
        last, kept = calls[-1], calls[keep - 1]
        for user in list(last.users):
            user.args = (kept, *user.args[1:])
        for op in reversed(calls[keep:]):
            for user in list(op.users):
                gm.graph.erase_node(user)
            gm.graph.erase_node(op)
        cut.append((path, keep, len(calls)))
    if not cut:
        return None
    remove_dead_code(gm.graph)
    return Cut(cut)


def _chained(calls: list[fx.Node], keep: int) -> bool:
    def reads(op: fx.Node, before: fx.Node) -> list[tuple]:
        return [("out", x.args[1]) if isinstance(x, fx.Node) and x.target is operator.getitem
                and x.args[0] is before else ("same", x) for x in op.args[0]]

    pattern = reads(calls[1], calls[0])
    if not any(kind == "out" for kind, _ in pattern):
        return False
    if any(reads(op, before) != pattern for before, op in zip(calls[1:], calls[2:], strict=False)):
        return False
    # only the next call reads a call's outputs
    for op, after in zip(calls, calls[1:], strict=False):
        if any(user.target is not operator.getitem or not set(user.users) <= {after}
               for user in op.users):
            return False
    if any(user.target is not operator.getitem for user in calls[-1].users):
        return False
    return len({op.args[1] for op in calls[keep - 1:]}) == 1
