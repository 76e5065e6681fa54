"""Optimized graphs as plain data: stored by a knowledge base, fingerprinted for its keys.

:func:`encode_graph` turns an aten-level FX graph into a list of plain tuples, one per node
(name, op, target, arguments with :class:`Ref` to earlier nodes, the value's metadata as a
:class:`Val`, and the metadata reports read); :func:`decode_graph` builds the same graph back,
node for node, with fake values in a given fake mode. Targets are operator overloads by name or
Python functions by import path, each checked to resolve back to itself; anything else (a
closure, an object argument, symbolic shapes) raises :class:`NotSerializable` with what it met.
Tensors are never part of the encoding: the caller says where each attribute comes from.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import pickle
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from kopt.graph.query import attr

# node metadata kept besides the value: module paths (reports, ``explain``) and what a fused
# node replaced
META_KEPT = ("nn_module_stack", "kopt_from")


class NotSerializable(Exception):
    """The graph holds something the encoding cannot express (the message says what)."""


@dataclass(frozen=True)
class Ref:
    """A reference to an earlier node of the same graph, by name."""

    name: str


@dataclass(frozen=True)
class Val:
    """A tensor's metadata: what a restored node's fake value is made from. ``storage``
    numbers the storages of one graph's values (in node order): values that shared one come
    back as views of one, so a reshape that was a view still is (``kopt.graph.is_view``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    storage: int = -1
    storage_bytes: int = 0


@dataclass(frozen=True)
class Target:
    """A callable node target: an operator overload by name, or a Python function by path."""

    kind: str  # "op" (torch.ops.<ns>.<name>.<overload>) or "py" (module + qualified name)
    path: str


def encode_graph(graph: fx.Graph, keep_meta: bool = True) -> list[tuple]:
    """One plain tuple per node: (name, op, target, args, kwargs, value, metadata); with
    ``keep_meta`` False the metadata is left out (a fingerprint's form)."""
    out = []
    storages: dict[int, int] = {}
    for n in graph.nodes:
        target = _encode_target(n.target) if n.op == "call_function" else n.target
        meta = {k: _plain(n.meta[k], k) for k in META_KEPT if k in n.meta} if keep_meta else {}
        v = n.meta.get("val")
        out.append((n.name, n.op, target, _encode(n.args), _encode(n.kwargs),
                    _encode_val(v, storages) if keep_meta else _describe_val(v), meta))
    return out


def _plain(value: Any, what: str) -> Any:
    """Node metadata as plain data (module types as their names)."""
    if isinstance(value, dict):
        return {str(k): _plain(v, what) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return tuple(_plain(v, what) for v in value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise NotSerializable(f"node metadata {what} holds a {type(value).__name__}")


@functools.lru_cache(maxsize=4096)
def _encode_target_cached(target: Any) -> Target:
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
        found = _resolve(Target("op", name))
    else:
        module = getattr(target, "__module__", None)
        qualname = getattr(target, "__qualname__", None)
        if module is None or qualname is None or "<" in qualname:
            raise NotSerializable(f"call target {target!r} has no importable name")
        if module == "_operator":
            module = "operator"
        name = f"{module}:{qualname}"
        try:
            found = _resolve(Target("py", name))
        except (ImportError, AttributeError) as e:
            raise NotSerializable(f"call target {target!r} does not import: {e}") from e
        if found is not target:
            raise NotSerializable(f"call target {target!r} does not resolve to itself")
        return Target("py", name)
    if found is not target:
        raise NotSerializable(f"operator {target} does not resolve to itself")
    return Target("op", name)


def _encode_target(target: Any) -> Target:
    try:
        return _encode_target_cached(target)
    except TypeError as e:  # unhashable target
        raise NotSerializable(f"call target {target!r}: {e}") from e


def _resolve(t: Target) -> Any:
    if t.kind == "op":
        ns, name, overload = t.path.split(".")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    module, _, qualname = t.path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_SCALARS = (int, float, bool, str, complex, type(None), torch.dtype, torch.device,
            torch.layout, torch.memory_format)


def _walk(a: Any, leaf: Callable[[Any], Any]) -> Any:
    """``a`` with ``leaf`` applied inside its tuples, lists, dicts and slices."""
    if isinstance(a, tuple):
        return tuple(_walk(x, leaf) for x in a)
    if isinstance(a, list):
        return [_walk(x, leaf) for x in a]
    if isinstance(a, dict):
        return {k: _walk(v, leaf) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_walk(a.start, leaf), _walk(a.stop, leaf), _walk(a.step, leaf))
    return leaf(a)


def _encode_leaf(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return Ref(a.name)
    if isinstance(a, _SCALARS) or a is Ellipsis:
        return a
    raise NotSerializable(f"a node argument of type {type(a).__name__}")


def _encode(a: Any) -> Any:
    return _walk(a, _encode_leaf)


def val_of(t: torch.Tensor, storages: dict[int, int] | None = None) -> Val:
    """``t``'s metadata; ``storages`` numbers the storages seen so far (see :class:`Val`)."""
    storage = t.untyped_storage()
    index = -1 if storages is None else storages.setdefault(storage._cdata, len(storages))
    nbytes = storage.nbytes()
    if not isinstance(nbytes, int):  # a fake storage sized by symbols: what this view spans
        nbytes = _extent(tuple(t.shape), tuple(t.stride()), t.storage_offset()) * t.itemsize
    return Val(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device,
               index, nbytes)


def _extent(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements from the storage's start to one past the view's last."""
    if not all(shape):
        return offset
    return offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1


def _encode_val(v: Any, storages: dict[int, int]) -> Any:
    if isinstance(v, torch.Tensor):
        if any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())):
            raise NotSerializable("a value with symbolic shapes")
        return val_of(v, storages)
    if isinstance(v, tuple | list):
        return type(v)(_encode_val(x, storages) for x in v)
    if isinstance(v, int | float | bool) or v is None:
        return v
    raise NotSerializable(f"a node value of type {type(v).__name__}")


def _describe_val(v: Any) -> Any:
    """A value's shape, strides and dtype (what a fingerprint needs of it)."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.dtype)
    if isinstance(v, tuple | list):
        return tuple(_describe_val(x) for x in v)
    return v if isinstance(v, int | float | bool | None) else type(v).__name__


def meta_tensor(v: Val, base: torch.Tensor | None = None) -> torch.Tensor:
    """A meta tensor with ``v``'s metadata, a view of ``base`` (bytes on the meta device)
    where given."""
    if base is None:
        base = torch.empty(v.storage_bytes, dtype=torch.uint8, device="meta")
    if v.dtype.itemsize > 1:
        base = base[:base.numel() - base.numel() % v.dtype.itemsize].view(v.dtype)
    return base.as_strided(v.shape, v.stride, v.offset)


def decode_graph(nodes: list[tuple], mode: FakeTensorMode | None) -> fx.Graph:
    """The graph :func:`encode_graph` encoded, node for node, its values fake tensors of
    ``mode`` (made directly, not dispatched: W1's 18000 values in a quarter second); with
    ``mode`` None, without values (a graph that is only run, never inspected)."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    bases: dict[int, torch.Tensor] = {}
    need: dict[int, int] = {}  # bytes per storage: what its largest view spans

    def measure(v: Any) -> None:
        if isinstance(v, Val) and v.storage >= 0:
            spans = _extent(v.shape, v.stride, v.offset) * v.dtype.itemsize
            need[v.storage] = max(need.get(v.storage, 0), v.storage_bytes, spans)
        elif isinstance(v, tuple | list):
            for x in v:
                measure(x)

    if mode is not None:
        for node in nodes:
            measure(node[5])

    def fake(v: Any) -> Any:
        if isinstance(v, Val):
            base = bases.get(v.storage) if v.storage >= 0 else None
            if base is None:
                size = need.get(v.storage, v.storage_bytes)
                base = torch.empty(size, dtype=torch.uint8, device="meta")
                if v.storage >= 0:
                    bases[v.storage] = base
            return FakeTensor(mode, meta_tensor(v, base), v.device)
        if isinstance(v, tuple | list):
            return type(v)(fake(x) for x in v)
        return v

    def decode(a: Any) -> Any:
        return _walk(a, lambda x: env[x.name] if isinstance(x, Ref) else x)

    for name, op, target, args, kwargs, v, meta in nodes:
        if isinstance(target, Target):
            target = _resolve(target)
        node = graph.create_node(op, target, decode(args), decode(kwargs), name=name)
        if node.name != name:
            raise NotSerializable(f"node {name} came back as {node.name}")
        if op != "output" and mode is not None:
            node.meta["val"] = fake(v)
        node.meta.update(meta)
        env[name] = node
    return graph


def fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the captured graph: every node's op, target, arguments and value metadata,
    and every attribute's name, shape, strides, dtype and device (a model cast to another
    dtype is another graph). Cheap: no code generation (W1's graph is 11650 nodes). Raises
    :class:`NotSerializable` for a graph the encoding cannot name exactly (a closure as a
    target, an object as an argument, symbolic shapes): never a hash that two graphs share.

    A graph :func:`made_from` registered has the fingerprint registered with it, while it is
    unchanged: that of what made it (:func:`fingerprint_of`; W1: the 60 instances of one traced
    block)."""
    registered = _registered(gm.graph)
    if registered is not None:
        return registered
    h = hashlib.sha256()
    try:
        h.update(pickle.dumps(encode_graph(gm.graph, keep_meta=False), protocol=5))
    except NotSerializable:
        raise
    except Exception as e:  # noqa: BLE001 -- e.g. a symbolic size that does not pickle
        raise NotSerializable(f"{type(e).__name__}: {e}") from e
    for name in sorted({n.target for n in gm.graph.nodes if n.op == "get_attr"}):
        h.update(repr((name, describe_tensor(attr(gm, name)))).encode())
    return h.hexdigest()


def fingerprint_of(structure: str, tensors: dict[str, Any]) -> str:
    """The fingerprint of a graph made deterministically from what ``structure`` hashes (the
    capture's :attr:`kopt.repeated.Repeated.structure`), reading some of ``tensors`` (by name:
    their shapes, strides, dtypes and devices are hashed)."""
    h = hashlib.sha256(f"made from {structure}".encode())
    for name in sorted(tensors):
        h.update(repr((name, describe_tensor(tensors[name]))).encode())
    return h.hexdigest()


# graph -> (its fingerprint, each node's parts as registered): a node added, erased or edited
# since (a target, its arguments, its value) makes the fingerprint stale, and is seen
_MADE_FROM: weakref.WeakKeyDictionary[fx.Graph, tuple[str, list[tuple]]] = \
    weakref.WeakKeyDictionary()


def made_from(graph: fx.Graph, fingerprint: str) -> None:
    """Register ``fingerprint`` (:func:`fingerprint_of`) as that of ``graph``, for
    :func:`fingerprint` to take while ``graph`` is unchanged."""
    _MADE_FROM[graph] = (fingerprint, _parts(graph))


def _registered(graph: fx.Graph) -> str | None:
    made = _MADE_FROM.get(graph)
    if made is None:
        return None
    now = _parts(graph)  # the same objects, or an edit
    same = len(now) == len(made[1]) and all(
        all(x is y for x, y in zip(a, b, strict=True))
        for a, b in zip(now, made[1], strict=True))
    return made[0] if same else None


def _parts(graph: fx.Graph) -> list[tuple]:
    return [(n, n.op, n.target, n.args, n.kwargs, n.meta.get("val")) for n in graph.nodes]


def describe_tensor(t: Any) -> Any:
    """What a key holds of a tensor: shape, strides, dtype, device, and whether a parameter."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device),
            isinstance(t, torch.nn.Parameter))
