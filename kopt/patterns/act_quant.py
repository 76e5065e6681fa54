"""Activation + FP8 quantization: the per-token quantizer the fp8 pass puts in front of a GEMM
moves into the activation that produces its input, so the activation is never written in bf16.

    # quant(reshape(silu(g) * u)) -> act_quant(g, u, "silu_mul")     SwiGLU (gate/up: views)
    # quant(reshape(gelu(x)))     -> act_quant(x, "gelu_tanh")   (GELU(erf): rejected, see why_not)
    # quant(reshape(cat([o, act]))) -> cat_act_quant(o, g, u, ...)  (either order, last dim)
    # quant_group(reshape(act(y + b))) -> act_quant_group(y, [u,] act, b)   (1x128 groups)

Found by structure alone: a ``kopt::quant_fp8_rowwise`` of a per-call value whose producer,
through at most one reshape to [rows, features], is ``silu(g) * u`` (either operand order) or
``gelu``, or a last-dimension concatenation of such an activation with one other tensor of its
rows and dtype (FLUX.2's single-stream blocks quantize ``cat([attention, swiglu])`` for their
output projection). With ``FP8Config(activation_math="exact")`` the fused op keeps the
unfused op order and roundings (see :mod:`kopt.codegen.kernels.act_quant`), hence the exact
tier; with the default ``"fast"`` (:func:`act_quant_rewrite`) SiLU and GELU(tanh) take the
kernel's approximate-math form instead, tolerance tier.

The 1x128-group quantizer of ``FP8Config(layout="blockwise")`` (``kopt::quant_fp8_group``)
fuses the same way into ``kopt::act_quant_fp8_group``
(:mod:`kopt.codegen.kernels.act_quant_group`), and takes the bias add before a GELU with it
(``gelu(y + b)``, ``b`` a load-time vector of the features): the blockwise GEMM adds no bias
in its epilogue, so the add would otherwise be a pass of its own over the GEMM's output.
The concatenation of FLUX.2's single-stream blocks fuses too, where its first part is a
multiple of 128 wide (no group spans both parts).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

import kopt.codegen.kernels.act_quant  # noqa: F401 -- registers kopt::act_quant_fp8_rowwise
import kopt.codegen.kernels.act_quant_group  # noqa: F401 -- registers kopt::act_quant_fp8_group
import kopt.codegen.kernels.quant_fp8  # noqa: F401 -- registers kopt::quant_fp8_rowwise
from kopt.codegen.kernels.act_quant import FAST, FAST_ACTIVATIONS, KERNEL_DTYPES
from kopt.graph import (
    bias_add_operands,
    constant_nodes,
    describe_node,
    infer_meta,
    op_name,
    tensor_meta,
)
from kopt.passes.config import ACTIVATION_MATHS
from kopt.patterns.core import Match, Rejection, StructuralRewrite, exact, tolerance

aten = torch.ops.aten
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
QUANT_GROUP = torch.ops.kopt.quant_fp8_group.default
FUSED = torch.ops.kopt.act_quant_fp8_rowwise.default
FUSED_GROUP = torch.ops.kopt.act_quant_fp8_group.default
FUSED_CAT = torch.ops.kopt.cat_act_quant_fp8_rowwise.default
NAME = "fuse_act_quant"
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _activation(act: fx.Node) -> tuple[str, fx.Node, fx.Node | None, fx.Node | None] | str:
    """``(kind, gate, up, silu node)`` if ``act`` is an activation the op fuses, else why not."""
    if _is(act, aten.gelu.default):
        approximate = act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
        return ("gelu_tanh" if approximate == "tanh" else "gelu_erf"), act.args[0], None, None
    if _is(act, aten.mul.Tensor):
        a, b = act.args
        for silu, up in ((a, b), (b, a)):
            if _is(silu, aten.silu.default) and isinstance(up, fx.Node):
                return "silu_mul", silu.args[0], up, silu
    return f"the quantizer's input comes from {op_name(act)}, not silu(gate) * up or gelu"


def _bias_add(x: fx.Node, consts: set[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """``(y, b)`` if ``x`` is ``y + b`` with ``b`` a load-time vector of x's features."""
    found = bias_add_operands(x)
    return found if found is not None and found[1] in consts and found[0] not in consts \
        else None


def find_act_quant(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    consts = constant_nodes(gm.graph)
    for quant in gm.graph.nodes:
        if not _is(quant, QUANT, QUANT_GROUP) or quant.args[0] in consts:
            continue  # a weight's quantizer runs once, at load
        group = quant.target is QUANT_GROUP
        x = quant.args[0]
        reshape = x if _is(x, *_RESHAPES) else None
        act = reshape.args[0] if reshape is not None else x
        cat = other = None
        other_first = True
        if _is(act, aten.cat.default) and len(act.args[0]) == 2:
            cat = act
            first, second = cat.args[0]
            acts = [_activation(n) if _is(n, aten.mul.Tensor, aten.gelu.default) else None
                    for n in (first, second)]
            if not isinstance(acts[1], tuple) and isinstance(acts[0], tuple):
                act, other, other_first = first, second, False
            else:
                act, other = second, first
        found = _activation(act) if isinstance(act, fx.Node) else "no producer node"
        if isinstance(found, str):
            yield Rejection(NAME, quant.name, found, near_miss=True)
            continue
        kind, gate, up, silu = found
        bias = bias_add = None
        if group and kind.startswith("gelu") and isinstance(gate, fx.Node):
            found_bias = _bias_add(gate, consts)
            if found_bias is not None:
                bias_add, (gate, bias) = gate, found_bias
        bindings = {"quant": quant, "reshape": reshape, "act": act, "silu": silu,
                    "gate": gate, "up": up, "kind": kind, "cat": cat, "other": other,
                    "other_first": other_first, "group": group, "bias": bias,
                    "bias_add": bias_add}
        nodes = tuple(n for n in (bias_add, silu, act, cat, reshape, quant) if n is not None)
        yield Match(NAME, quant, nodes, bindings, outputs=(quant,))


def _still_needed(*pairs: tuple[fx.Node | None, fx.Node | None]) -> str | None:
    """Why the fusion cannot drop ``node``: a user other than ``only`` (per pair)."""
    for node, only in pairs:
        if node is None or only is None:
            continue
        others = [u.name for u in node.users if u is not only]
        if others:
            return (f"{op_name(node)} output {node.name} is also used by {', '.join(others)}: "
                    "the unfused value is still needed")
    return None


def _operands_problem(b: dict) -> str | None:
    """What the kernel cannot take in the activation (and the cat) of bindings ``b``."""
    if b["kind"] == "gelu_erf":
        # measured on the H200 (RESULTS.md, 2026-11-29): Triton's erf differs from CUDA's erff
        # in the last bit, which moves a few FP8 values by one step: not exact
        return "GELU(erf) is not bitwise in the fused kernel (erf differs in the last bit)"
    g, a = tensor_meta(b["gate"]), tensor_meta(b["act"])
    if g.dtype not in KERNEL_DTYPES:
        return f"activation dtype {g.dtype} is not bf16/fp16/fp32"
    if b["up"] is not None:
        u = tensor_meta(b["up"])
        if u.shape != g.shape:
            return f"gate {list(g.shape)} and up {list(u.shape)} differ in shape (broadcast)"
        if u.dtype != g.dtype:
            return f"gate {g.dtype} and up {u.dtype} differ in dtype"
    if a.dtype != g.dtype:
        return f"activation output {a.dtype} differs from its input's {g.dtype}"
    if b.get("bias") is not None and tensor_meta(b["bias"]).dtype != g.dtype:
        return f"bias dtype {tensor_meta(b['bias']).dtype} differs from the input's {g.dtype}"
    cat = b["cat"]
    if cat is not None:
        o, c = tensor_meta(b["other"]), tensor_meta(cat)
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if dim not in (-1, c.dim() - 1):
            return f"the concatenation is along dim {dim}, not the features"
        if o.dtype != a.dtype or tuple(o.shape[:-1]) != tuple(a.shape[:-1]):
            return (f"the tensor concatenated with the activation, {o.dtype}{list(o.shape)}, "
                    f"has other rows or dtype than {a.dtype}{list(a.shape)}")
        first = o.shape[-1] if b["other_first"] else a.shape[-1]
        if b.get("group") and first % 128:
            return (f"the concatenation's first part is {first} wide: a 1x128 group would "
                    "span both parts")
    return None


def why_not(gm: fx.GraphModule, match: Match) -> str | None:
    b = match.bindings
    quant, reshape, act, silu, cat = (b[k] for k in ("quant", "reshape", "act", "silu", "cat"))
    why = _still_needed((b["bias_add"], act), (silu, act), (act, cat or reshape or quant),
                        (cat, reshape or quant), (reshape, quant)) or _operands_problem(b)
    if why:
        return why
    x, rows = tensor_meta(quant.args[0]), tensor_meta(cat if cat is not None else act)
    if x.dim() != 2 or x.shape[-1] != rows.shape[-1] or x.numel() != rows.numel():
        return f"the quantizer reads {list(x.shape)}, not the activation's rows [-1, features]"
    return None


def fuse(gm: fx.GraphModule, match: Match, fast: bool = False) -> None:
    b = match.bindings
    quant = b["quant"]
    g = gm.graph
    kind = b["kind"] + FAST if fast and b["kind"] in FAST_ACTIVATIONS else b["kind"]
    with g.inserting_before(quant):
        if b["group"]:
            fused = g.call_function(FUSED_GROUP, (b["gate"], b["up"], kind, b["bias"],
                                                  b["other"], b["other_first"]))
        elif b["cat"] is None:
            fused = g.call_function(FUSED, (b["gate"], b["up"], kind))
        else:
            fused = g.call_function(FUSED_CAT, (b["other"], b["gate"], b["up"], kind,
                                                b["other_first"]))
        infer_meta(gm, fused)
    fused.meta["kopt_from"] = f"{kind}+quant({describe_node(b['act'])})"
    quant.replace_all_uses_with(fused)  # same outputs: (e4m3 values, fp32 scales)
    for node in (quant, b["reshape"], b["cat"], b["act"], b["silu"], b["bias_add"]):
        if node is not None and not node.users:
            g.erase_node(node)


def fuse_fast(gm: fx.GraphModule, match: Match) -> None:
    """:func:`fuse` with the fast activations (``FP8Config(activation_math="fast")``)."""
    fuse(gm, match, fast=True)


def describe(match: Match) -> str:
    b = match.bindings
    rows, features = tensor_meta(b["quant"].args[0]).shape
    cat = "" if b["cat"] is None else (" (cat after another tensor)" if b["other_first"]
                                       else " (cat before another tensor)")
    bias = "bias + " if b["bias"] is not None else ""
    quant = "quant 1x128" if b["group"] else "quant"
    return f"{describe_node(b['act'])}: {bias}{b['kind']}{cat} + {quant}, {rows} x {features}"


def describe_fast(match: Match) -> str:
    return describe(match) + " (fast math)"


NUMERICS = exact("the fused kernel repeats the unfused ops' order and roundings (activation "
                 "rounded to its dtype, amax * fp32(1/448), a true division, e4m3 RNE)")
NUMERICS_FAST = tolerance("the activation as x * sigmoid(v) with the GPU's approximate exp and "
                          "division (a few fp32 ulp from exact), then rounded to its dtype and "
                          "quantized exactly")


def act_quant_rewrite(math: str = "exact") -> StructuralRewrite:
    """``fuse_act_quant`` computing the activation ``math`` (:data:`ACTIVATION_MATHS`):
    ``exact`` bitwise the unfused ops, ``fast`` the ``:fast`` activations
    (:mod:`kopt.codegen.kernels.act_quant`)."""
    if math not in ACTIVATION_MATHS:
        raise ValueError(f"activation math {math!r} is not one of {ACTIVATION_MATHS}")
    return StructuralRewrite(
        name=NAME,
        matcher=find_act_quant,
        applier=fuse_fast if math == "fast" else fuse,
        guard_fn=why_not,
        describer=describe_fast if math == "fast" else describe,
        numerics=NUMERICS if math == "exact" else NUMERICS_FAST,
        benefit=5,
        description="quant([cat(o,)] silu(g) * u | gelu(x [+ b])) -> act_quant(g, u | x [, o] "
                    "[, b])",
    )


ACT_QUANT = act_quant_rewrite()


# -- the activation without quantization (BF16 models) ---------------------------------------
#   silu(g) * u                 -> fused_act(g, u)          one kernel instead of two
#   cat([o, act]) / cat([act, o]) -> fused_act(o, g, u)     the activation written beside o
FUSED_ACT = torch.ops.kopt.fused_act.default
NAME_ACT = "fuse_act"


def find_act(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    taken: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _is(node, aten.cat.default) and len(node.args[0]) == 2:
            first, second = node.args[0]
            for act, other, other_first in ((second, first, True), (first, second, False)):
                found = _activation(act) if _is(act, aten.mul.Tensor, aten.gelu.default) \
                    else None
                if isinstance(found, tuple):
                    kind, gate, up, silu = found
                    taken.add(act)
                    yield Match(NAME_ACT, node, tuple(n for n in (silu, act, node) if n),
                                {"cat": node, "act": act, "silu": silu, "gate": gate, "up": up,
                                 "kind": kind, "other": other, "other_first": other_first},
                                outputs=(node,))
                    break
    for node in gm.graph.nodes:
        if node in taken or not _is(node, aten.mul.Tensor):
            continue
        found = _activation(node)
        if isinstance(found, tuple):  # SwiGLU: two kernels become one (a lone GELU is one)
            kind, gate, up, silu = found
            yield Match(NAME_ACT, node, (silu, node),
                        {"cat": None, "act": node, "silu": silu, "gate": gate, "up": up,
                         "kind": kind, "other": None, "other_first": True}, outputs=(node,))


def why_not_act(gm: fx.GraphModule, match: Match) -> str | None:
    b = match.bindings
    return (_still_needed((b["silu"], b["act"]), (b["act"], b["cat"])) or _operands_problem(b)
            or _layout_problem(b["cat"] if b["cat"] is not None else b["act"]))


def _layout_problem(out: fx.Node) -> str | None:
    """The fused op writes a contiguous tensor; where the unfused op wrote another layout
    (Sana's GLU in channels-last: the product follows its inputs' strides), the consumer (a
    convolution) may take another kernel with other roundings (the zoo's Sana in bf16;
    RESULTS.md, 2026-12-03, CPU): not exact."""
    v = tensor_meta(out)
    if v.is_contiguous():
        return None
    return (f"the unfused op writes strides {list(v.stride())}, the fused op a contiguous "
            "tensor: its consumers may round differently")


def fuse_act(gm: fx.GraphModule, match: Match) -> None:
    b = match.bindings
    out = b["cat"] if b["cat"] is not None else b["act"]
    g = gm.graph
    with g.inserting_before(out):
        fused = g.call_function(FUSED_ACT, (b["other"], b["gate"], b["up"], b["kind"],
                                            b["other_first"]))
        infer_meta(gm, fused)
    fused.meta["kopt_from"] = f"{b['kind']}({describe_node(b['act'])})"
    out.replace_all_uses_with(fused)
    for node in (b["cat"], b["act"], b["silu"]):
        if node is not None and not node.users:
            g.erase_node(node)


def describe_act(match: Match) -> str:
    b = match.bindings
    shape = list(tensor_meta(b["cat"] if b["cat"] is not None else b["act"]).shape)
    cat = "" if b["cat"] is None else (" beside another tensor (cat)")
    return f"{describe_node(b['act'])}: {b['kind']}{cat}, {shape}"


ACT = StructuralRewrite(
    name=NAME_ACT,
    matcher=find_act,
    applier=fuse_act,
    guard_fn=why_not_act,
    describer=describe_act,
    numerics=exact("the kernel repeats the unfused ops' order and roundings (silu rounded to "
                   "its dtype before the product); the concatenation only moves values"),
    benefit=4,
    description="silu(g) * u | cat([o, act(x)]) -> fused_act(g, u [, o])",
)
