"""Read-only questions about nodes: their value, shape, dtype, a printable op name, whether it
is a view, and what kind of work its op is."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten

# Ops that alias their input: no kernel, no bytes (``reshape`` is one only when its output
# aliases, decided from the traced storages).
_ALIASES = {aten._unsafe_view.default, aten.alias.default, aten.detach.default,
            aten.lift_fresh.default, operator.getitem}
_MAYBE_COPY = {aten.reshape.default, aten.contiguous.default}


def val(node: Any) -> Any:
    """The traced value of ``node`` (a fake tensor or a Python value); non-nodes as is."""
    if isinstance(node, fx.Node):
        return node.meta.get("val")
    return node


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def bias_add_operands(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """``(y, b)`` if ``node`` is ``aten.add(y, b)`` (either order) with ``b`` one vector of the
    last dim and ``y`` of the sum's shape and dtype: a bias added over the features."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is torch.ops.aten.add.Tensor and len(node.args) == 2
            and not node.kwargs and is_tensor_node(node)):
        return None
    out = node.meta["val"]
    for y, b in (node.args, node.args[::-1]):
        if is_tensor_node(y) and is_tensor_node(b):
            yv, bv = y.meta["val"], b.meta["val"]
            if bv.dim() == 1 and out.dim() >= 1 and bv.shape[0] == out.shape[-1] \
                    and yv.shape == out.shape and bv.dtype == yv.dtype == out.dtype:
                return y, b
    return None


def tensor_meta(node: fx.Node) -> torch.Tensor:
    """The fake tensor of ``node``; raises if the node does not produce exactly one tensor."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"node {node.name} ({op_name(node)}) has no tensor value: {type(value)}")
    return value


def op_name(node: fx.Node) -> str:
    """A short, stable name of what a node computes: ``aten.linear``, ``placeholder``, ..."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode that produced the graph's metadata (one per captured graph).

    The first fake value decides: scanning every node here made each metadata update linear in
    the graph's size, and a pass of such updates quadratic (minutes on a 60-block model).
    """
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if isinstance(v, torch.Tensor):
            mode = detect_fake_mode([v])
            if mode is not None:
                return mode
    raise RuntimeError("graph has no fake-tensor metadata; capture it with kopt.capture first")


def attr(module: torch.nn.Module, target: str) -> Any:
    """The value of a ``get_attr`` target (a dotted path such as ``blocks.0.attn.to_q.weight``)."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def module_path(node: fx.Node) -> str | None:
    """The innermost module the node was traced in (``blocks.0.attn.to_q``), if recorded."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "") or None


def module_paths(node: fx.Node) -> list[str]:
    """Every module on the node's stack, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [p.replace("L['self'].", "") for p, _ in stack.values()]


def _ranges(numbers: list[int]) -> str:
    """``0..59`` for a run, ``0..3,5,7..9`` otherwise."""
    numbers = sorted(set(numbers))
    out, start = [], numbers[0]
    for prev, cur in zip(numbers, [*numbers[1:], None], strict=True):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}..{prev}")
            start = cur
    return ",".join(out)


def compact_paths(paths: list[str]) -> str:
    """Module paths in a few words: a handful with their common prefix factored out
    (``blocks.0.attn.{to_q,to_k,to_v}``); many, grouped on their first numeric component
    (``blocks.{0..59}.img_mod.1, blocks.{0..59}.txt_mod.1, norm_out.linear``)."""
    parts = [p.split(".") for p in paths]
    if len(paths) <= 4:
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        prefix = ".".join(parts[0][:common])
        rest = ",".join(".".join(p[common:]) for p in parts)
        return f"{prefix}.{{{rest}}}" if prefix else f"{{{rest}}}"
    groups: dict[tuple[str, ...], list[int]] = {}
    for p in parts:
        i = next((i for i, c in enumerate(p) if c.isdigit()), None)
        if i is None:
            groups.setdefault(tuple(p), [])
            continue
        groups.setdefault((*p[:i], "#", *p[i + 1:]), []).append(int(p[i]))
    return ", ".join(".".join(f"{{{_ranges(numbers)}}}" if c == "#" else c for c in key)
                     for key, numbers in groups.items())


def describe_node(node: fx.Node) -> str:
    """Where a node comes from: its module path, what kopt built it from, or its name."""
    return node.meta.get("kopt_from") or module_path(node) or node.name


def structural_key(gm: fx.GraphModule, roots: list[fx.Node]) -> str:
    """Canonical text of what computes ``roots``: ops, arguments, placeholder names and the
    identity of every tensor read. Equal for two graphs that compute the same values from the
    same inputs and tensors, whatever their nodes are called."""
    needed: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    index: dict[fx.Node, int] = {}
    parts: list[str] = []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        index[node] = len(index)
        if node.op == "get_attr":
            parts.append(f"attr {id(attr(gm, node.target))}")
            continue
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a]}")
        target = node.name if node.op == "placeholder" else node.target
        parts.append(f"{node.op} {target} {args}")
    parts.append("roots " + " ".join(str(index[r]) for r in roots))
    return "\n".join(parts)


def other_operand(node: fx.Node, one: fx.Node) -> Any:
    """The argument of binary ``node`` that is not ``one`` (None if both or neither are)."""
    a, b = node.args[:2]
    if a is one and b is not one:
        return b
    if b is one and a is not one:
        return a
    return None


def is_view(node: fx.Node) -> bool:
    """True when the node launches nothing: an alias of its input."""
    target = node.target
    if target in _ALIASES:
        return True
    if target in _MAYBE_COPY:
        out, src = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
        if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)):
            return False
        if out.untyped_storage()._cdata == src.untyped_storage()._cdata:
            return True
        # a pass's new node carries a value traced on its own (another storage): a view
        # whenever the input's strides allow one, as torch.reshape decides
        try:
            torch.empty_strided(src.shape, src.stride(), dtype=src.dtype,
                                device="meta").view(out.shape)
        except (RuntimeError, TypeError):
            return False
        return target is aten.reshape.default or src.is_contiguous()
    return bool(getattr(target, "is_view", False))


CATEGORIES = ("gemm", "attention", "quantization", "elementwise")

# op -> category, by qualified op name (``aten::mm``, ``kopt::fp8_gemm``): the same names the
# profiler gives the events, so nodes and events (inside a hoisted region, unattributed) agree.
_GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
    "aten::_scaled_mm", "aten::_scaled_grouped_mm", "aten::convolution", "aten::_convolution",
    "kopt::fp8_gemm", "kopt::bf16_gemm", "kopt::fp8_blockwise_mm",
})


def op_category(qualified: str) -> str:
    """``gemm``, ``attention``, ``quantization`` or ``elementwise`` for an op name such as
    ``aten::addmm`` or ``kopt::quant_fp8_rowwise`` (kopt's generated GEMM-with-epilogue ops are
    GEMMs: their names end in ``_gemm``)."""
    ns, _, name = qualified.partition("::")
    if qualified in _GEMM_OPS or (ns == "kopt" and name.endswith(("_gemm", "_mm"))):
        return "gemm"
    if "scaled_dot_product" in name or name.endswith(("flash_attention", "efficient_attention")):
        return "attention"
    if ns == "kopt" and (name.startswith("quant_") or "act_quant" in name):
        return "quantization"
    return "elementwise"


def qualified_name(target: Any) -> str:
    """``aten::linear`` for ``torch.ops.aten.linear.default``; the Python name otherwise."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(target, "__name__", str(target))
