"""kopt's FP8 GEMM template in the graph: the residual update after an FP8 GEMM in its epilogue,
and any other rowwise FP8 GEMM on the template alone.

    # r + g * reshape(mm_fp8(a, b, sa, sb, bias))  ->  reshape(fp8_gemm(a, b, sa, sb, bias, g, r))
    # r + reshape(mm_fp8(a, b, sa, sb, bias))      ->  reshape(fp8_gemm(a, b, sa, sb, bias, r))

DiT blocks end both their attention and their feed-forward branch with a gated residual
(``hidden + gate * proj(...)``, gate per batch item from the modulation); LLM decoder layers with
a plain residual add. Unfused, each is two more passes over the [tokens, hidden] output. kopt's
GEMM (:mod:`kopt.codegen.gemm`) applies them to the accumulator tile, rounding after each op as
the eager ops do, so given the GEMM's product the epilogue is exact. The product itself is
accumulated in another order than cuBLAS's: the tier is tolerance.

Guards: the GEMM's output and the gated product have no other user (they are not materialised
any more); the gate is one vector per batch item (``[B, 1, N]`` or ``[N]``) over ``[B, T, N]``;
the residual has the output's shape and dtype.

    # mm_fp8(a, b, sa, sb, bias)  ->  fp8_gemm(a, b, sa, sb, bias)                 (triton_gemm)

The template, autotuned per (M bucket, N, K), takes 0.86-1.05x cuBLAS's time on the W1/W2
token shapes (17-18 of 22 shapes at or under it) and 0.70-0.79x on the modulation GEMVs; in the
W1/W2 graphs replayed from CUDA graphs its GEMMs take 2.0-2.6% less kernel time than cuBLAS's
(RESULTS.md, 2026-12-01, H200).
Its bias is added to the fp32 accumulator before the one rounding, as cuBLAS does; the product
is accumulated in the tensor cores' own precision over the whole K loop, so its error against
the fp64 product grows with K (1.8e-3 at K = 3072, 4.3e-3 at 24576; cuBLAS's 1.7e-3 at every
K): tier tolerance.

Both passes are off by default: a launch costs ~38 us of host time against cuBLAS's ~15, which
outweighs the kernel-time gain outside CUDA graphs (RESULTS.md, 2026-12-01, H200; the cost
model's ``host_us`` still holds the ~240 us per call that W1's ablation measured on 2026-11-30,
before the direct launch of :class:`kopt.codegen.gemm._Direct`). And on W1 the residual
epilogue makes the GEMMs slower than it saves (GEMM kernel time 49.2 -> 56.2 ms per forward
over 238 fused sites, the row-wise kernels 4.9 -> 3.6; RESULTS.md, 2026-12-01, H200): its
residual and gate are read in the accumulator's layout, tile by tile, after the K loop.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch import fx

import kopt.codegen.gemm  # noqa: F401 -- registers kopt::fp8_gemm
import kopt.codegen.kernels.act_quant  # noqa: F401 -- registers kopt::act_quant_fp8_rowwise
import kopt.codegen.kernels.act_quant_group  # noqa: F401 -- registers kopt::act_quant_fp8_group
import kopt.codegen.kernels.fp8_blockwise  # noqa: F401 -- registers kopt::fp8_blockwise_mm
from kopt.graph import describe_node, infer_meta, module_path, other_operand, tensor_meta
from kopt.patterns.core import Match, Rejection, StructuralRewrite, normalized_args, tolerance

aten = torch.ops.aten
GEMM = aten._scaled_mm.default
FUSED = torch.ops.kopt.fp8_gemm.default
NAME = "gemm_epilogue"
E4M3 = torch.float8_e4m3fn


def find_gemm_epilogues(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    for gemm in gm.graph.nodes:
        if gemm.target is not GEMM:
            continue
        reason = _gemm_unsupported(gemm)
        if reason:
            yield Rejection(NAME, gemm.name, reason)
            continue
        y = gemm
        if len(y.users) == 1 and next(iter(y.users)).target in (aten.reshape.default,
                                                                 aten.view.default):
            y = next(iter(y.users))
        if len(y.users) != 1 or len(gemm.users) != 1:
            yield Rejection(NAME, gemm.name, "the GEMM's output has other users")
            continue
        user = next(iter(y.users))
        gate = None
        if user.target is aten.mul.Tensor:
            gate = other_operand(user, y)
            if not isinstance(gate, fx.Node):
                continue
            reason = _gate_unsupported(gate, y)
            if reason:
                yield Rejection(NAME, gemm.name, reason)
                continue
            if len(user.users) != 1:
                yield Rejection(NAME, gemm.name, "the gated product has other users")
                continue
            prod, user = user, next(iter(user.users))
        else:
            prod = y
        if user.target is not aten.add.Tensor or user.kwargs:
            if gate is not None:
                yield Rejection(NAME, gemm.name, "gated product not followed by a residual add")
            continue
        residual = other_operand(user, prod)
        if not isinstance(residual, fx.Node):
            continue
        rv, yv = tensor_meta(residual), tensor_meta(prod)
        if rv.shape != yv.shape or rv.dtype != yv.dtype:
            yield Rejection(NAME, gemm.name, f"residual {tuple(rv.shape)} {rv.dtype} does not "
                                             f"match the output {tuple(yv.shape)} {yv.dtype}")
            continue
        nodes = tuple(n for n in (gemm, y if y is not gemm else None, prod if gate is not None
                                  else None, user) if n is not None)
        yield Match(NAME, user, nodes, {"gemm": gemm, "gate": gate, "residual": residual,
                                        "shape": list(yv.shape)})


def _gemm_unsupported(gemm: fx.Node) -> str | None:
    args = normalized_args(gemm)
    a, b, sa, sb = (args[k] for k in ("input", "mat2", "scale_a", "scale_b"))
    out_dtype = args["out_dtype"]
    if args["scale_result"] is not None:
        return "the GEMM scales its result (scale_result)"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"GEMM output dtype {out_dtype} (kopt's GEMM writes bf16/fp16/fp32)"
    av, bv = tensor_meta(a), tensor_meta(b)
    if av.dtype != E4M3 or bv.dtype != E4M3:
        return "operands are not e4m3"
    if bv.dim() != 2 or bv.stride(0) != 1:
        return "B is not the column-major [K, N] weight view"
    if av.dim() != 2 or av.stride(1) != 1:
        return f"A is not row-major [M, K] (strides {tuple(av.stride())})"
    if tensor_meta(sa).shape != (av.shape[0], 1) or tensor_meta(sb).shape != (1, bv.shape[1]):
        return "scales are not rowwise ([M, 1] x [1, N])"
    if not args["use_fast_accum"]:
        return ("the GEMM accumulates exactly (FP8Config(accumulate='exact')); kopt's template "
                "accumulates fast")
    return None


def _gate_unsupported(gate: fx.Node, y: fx.Node) -> str | None:
    gv, yv = tensor_meta(gate), tensor_meta(y)
    if gv.dtype != yv.dtype:
        return f"gate dtype {gv.dtype} differs from the output's {yv.dtype}"
    n = yv.shape[-1]
    if gv.dim() == 1 and gv.shape[0] == n:
        return None
    if yv.dim() == 3 and gv.dim() == 3 and gv.shape[1] == 1 and gv.shape[2] == n \
            and gv.shape[0] in (1, yv.shape[0]):
        return None
    return f"gate {tuple(gv.shape)} is not one vector per batch item of {tuple(yv.shape)}"


def fuse(gm: fx.GraphModule, match: Match) -> None:
    gemm, gate, residual = (match.bindings[k] for k in ("gemm", "gate", "residual"))
    # The residual is often the previous site's result (the residual stream), replaced when that
    # site was fused after this match was found: follow the replacement.
    # (kept on the graph object: a copied graph starts without it)
    if not hasattr(gm.graph, "_kopt_epilogue_forward"):
        gm.graph._kopt_epilogue_forward = {}
    forward: dict[fx.Node, fx.Node] = gm.graph._kopt_epilogue_forward
    while residual in forward:
        residual = forward[residual]
    args = normalized_args(gemm)
    a, b, sa, sb, bias, out_dtype = (args[k] for k in ("input", "mat2", "scale_a", "scale_b",
                                                      "bias", "out_dtype"))
    g = gm.graph
    n = tensor_meta(b).shape[1]
    with g.inserting_before(match.anchor):
        res2d = g.call_function(aten.reshape.default, (residual, [-1, n]))
        infer_meta(gm, res2d)
        fused = g.call_function(FUSED, (a, b, sa, sb, bias, gate, res2d, "none", out_dtype))
        infer_meta(gm, fused)
        out = g.call_function(aten.reshape.default, (fused, match.bindings["shape"]))
        infer_meta(gm, out)
    match.anchor.replace_all_uses_with(out)
    forward[match.anchor] = out
    for node in reversed(match.nodes):
        if not node.users:
            g.erase_node(node)


GEMM_EPILOGUE = StructuralRewrite(
    name=NAME,
    matcher=find_gemm_epilogues,
    applier=fuse,
    numerics=tolerance("the epilogue rounds like the eager ops, but kopt's GEMM accumulates "
                       "the product in another order than cuBLAS"),
    benefit=10,
    description="r + g * mm_fp8(a, b) -> fp8_gemm(a, b, gate=g, residual=r)",
)


TEMPLATE_NAME = "triton_gemm"


def find_template_gemms(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    for gemm in gm.graph.nodes:
        if gemm.target is not GEMM:
            continue
        reason = _gemm_unsupported(gemm)
        if reason:
            yield Rejection(TEMPLATE_NAME, gemm.name, reason)
            continue
        yield Match(TEMPLATE_NAME, gemm, (gemm,), {})


def to_template(gm: fx.GraphModule, match: Match) -> None:
    gemm = match.anchor
    args = normalized_args(gemm)
    with gm.graph.inserting_before(gemm):
        new = gm.graph.call_function(FUSED, (
            args["input"], args["mat2"], args["scale_a"], args["scale_b"], args["bias"], None,
            None, "none", args["out_dtype"]))
        infer_meta(gm, new)
    gemm.replace_all_uses_with(new)
    gm.graph.erase_node(gemm)


TRITON_GEMM = StructuralRewrite(
    name=TEMPLATE_NAME,
    matcher=find_template_gemms,
    applier=to_template,
    numerics=tolerance("kopt's GEMM accumulates the product in another order (and precision) "
                       "than cuBLAS; the bias and the rounding are cuBLAS's"),
    benefit=1,
    description="mm_fp8(a, b, sa, sb, bias) -> fp8_gemm(a, b, sa, sb, bias)",
)


# --- the blockwise recipe: the act + quant after the GEMM in its epilogue --------------------
#   act_quant_group(reshape(blockwise_mm(a, sa, w, sw)), act, b)
#       -> blockwise_gemm_act_quant(a, sa, w, sw, b, act)
#   blockwise_mm(a, sa, w, sw) -> blockwise_gemm(a, sa, w, sw)                       (triton_gemm)
#
# A 1x128 group's scale is the amax of its own 128 values, all in one column tile of the GEMM:
# the epilogue quantizes the tile it holds (kopt.codegen.gemm.QuantOut), and the GEMM's bf16
# output -- 4096 x 12288 for W1's MLP up projection, written and read back once each -- is never
# materialised. A per-token scale is the amax of a whole row, over every column tile: not
# tile-local, so the rowwise recipe's act + quant stays a kernel of its own (rejected below, with
# that reason).

ACT_QUANT_NAME = "gemm_act_quant"
BLOCKWISE_MM = torch.ops.kopt.fp8_blockwise_mm.default
BLOCKWISE_GEMM = torch.ops.kopt.fp8_blockwise_gemm.default
BLOCKWISE_ACT_QUANT = torch.ops.kopt.fp8_blockwise_gemm_act_quant.default
_ACT_QUANT_GROUP = torch.ops.kopt.act_quant_fp8_group.default
_ACT_QUANT_ROWWISE = torch.ops.kopt.act_quant_fp8_rowwise.default
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


_SLICES = (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
           aten.chunk.default, operator.getitem)


def _producer(x: object) -> tuple[fx.Node | None, fx.Node | None, bool]:
    """``(reshape, producer, sliced)`` of a value read through at most one reshape, or through
    slices of the producer's output (``sliced``: SwiGLU's gate and up halves)."""
    if not isinstance(x, fx.Node):
        return None, None, False
    reshape = x if x.op == "call_function" and x.target in _RESHAPES else None
    node, sliced = reshape.args[0] if reshape is not None else x, False
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target in _SLICES or node.target in _RESHAPES):
        node, sliced = node.args[0], True
    return reshape, node if isinstance(node, fx.Node) else None, sliced


def _blockwise_unsupported(gemm: fx.Node) -> str | None:
    """What kopt's template cannot take in a ``kopt::fp8_blockwise_mm`` node."""
    a, _, w, _, out_dtype = gemm.args
    av, wv = tensor_meta(a), tensor_meta(w)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"GEMM output dtype {out_dtype} (kopt's GEMM writes bf16/fp16/fp32)"
    if av.dim() != 2 or av.stride(1) != 1:
        return f"A is not row-major [M, K] (strides {tuple(av.stride())})"
    if wv.dim() != 2 or wv.stride(1) != 1:
        return f"the weight is not row-major [N, K] (strides {tuple(wv.stride())})"
    if av.shape[1] % 16:
        return f"K = {av.shape[1]} is not a multiple of 16 (16-byte FP8 rows)"
    return None


def find_gemm_act_quant(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    from kopt.codegen.gemm import QUANT_ACTIVATIONS

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _ACT_QUANT_ROWWISE:
            _, gemm, _ = _producer(node.args[0])
            if gemm is not None and gemm.target in (GEMM, FUSED):
                yield Rejection(ACT_QUANT_NAME, node.name, "per-token FP8 scales: a row's amax "
                                "spans every column tile of the GEMM before it, not one tile "
                                "(the blockwise recipe's 1x128 groups are tile-local: "
                                "FP8Config(layout='blockwise'))")
            continue
        if node.target is not _ACT_QUANT_GROUP:
            continue
        x, up, activation, bias, other, _ = node.args
        reshape, gemm, sliced = _producer(x)
        if gemm is None or gemm.target is not BLOCKWISE_MM:
            continue
        reason = _blockwise_unsupported(gemm)
        if reason is None and (sliced or up is not None or other is not None):
            reason = "SwiGLU's halves or a concatenated tensor lie in other column tiles"
        if reason is None and activation not in QUANT_ACTIVATIONS:
            reason = f"activation {activation!r} is not one the epilogue computes"
        if reason is None and (len(gemm.users) != 1 or (reshape is not None
                                                        and len(reshape.users) != 1)):
            reason = "the GEMM's output has other users: it is still needed"
        if reason is None and tensor_meta(x).dtype != gemm.args[4]:
            reason = "the activation reads another dtype than the GEMM writes"
        if reason:
            yield Rejection(ACT_QUANT_NAME, node.name, reason)
            continue
        nodes = tuple(n for n in (gemm, reshape, node) if n is not None)
        yield Match(ACT_QUANT_NAME, node, nodes, {"gemm": gemm, "reshape": reshape,
                                                  "activation": activation, "bias": bias},
                    outputs=(node,))


def fuse_act_quant(gm: fx.GraphModule, match: Match) -> None:
    b = match.bindings
    gemm, quant = b["gemm"], match.anchor
    a, sa, w, sw, out_dtype = gemm.args
    g = gm.graph
    with g.inserting_before(quant):
        fused = g.call_function(BLOCKWISE_ACT_QUANT, (a, sa, w, sw, b["bias"], b["activation"],
                                                      out_dtype))
        infer_meta(gm, fused)
    quant.replace_all_uses_with(fused)  # the same outputs: (e4m3 values, 1x128 scales)
    for n in (quant, b["reshape"], gemm):
        if n is not None and not n.users:
            g.erase_node(n)


def describe_act_quant(match: Match) -> str:
    b = match.bindings
    m, n = tensor_meta(b["gemm"]).shape
    bias = "bias + " if b["bias"] is not None else ""
    # (the FP8 GEMM node has no module path; the fused act + quant says what it was built from)
    where = module_path(b["gemm"]) or describe_node(match.anchor)
    return f"{where}: blockwise GEMM {m} x {n} -> {bias}{b['activation']} + quant 1x128 in its " \
           "epilogue"


GEMM_ACT_QUANT = StructuralRewrite(
    name=ACT_QUANT_NAME,
    matcher=find_gemm_act_quant,
    applier=fuse_act_quant,
    describer=describe_act_quant,
    numerics=tolerance("kopt's GEMM accumulates the product in another order than cuBLAS; "
                       "given its output, the epilogue is kopt::act_quant_fp8_group's "
                       "computation (bitwise on the H200)"),
    benefit=10,
    description="act_quant_group(blockwise_mm(a, w), act, b) -> blockwise_gemm_act_quant(a, w, "
                "b, act)",
)


def find_template_blockwise(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    for gemm in gm.graph.nodes:
        if gemm.op != "call_function" or gemm.target is not BLOCKWISE_MM:
            continue
        reason = _blockwise_unsupported(gemm)
        if reason:
            yield Rejection(TEMPLATE_NAME, gemm.name, reason)
            continue
        yield Match(TEMPLATE_NAME, gemm, (gemm,), {})


def to_template_blockwise(gm: fx.GraphModule, match: Match) -> None:
    gemm = match.anchor
    a, sa, w, sw, out_dtype = gemm.args
    with gm.graph.inserting_before(gemm):
        new = gm.graph.call_function(BLOCKWISE_GEMM, (a, sa, w, sw, None, out_dtype))
        infer_meta(gm, new)
    gemm.replace_all_uses_with(new)
    gm.graph.erase_node(gemm)


def describe_blockwise(match: Match) -> str:
    a, _, w, _, _ = match.anchor.args
    (m, k), n = tensor_meta(a).shape, tensor_meta(w).shape[0]
    return f"{describe_node(match.anchor)}: blockwise GEMM {m} x {n} x {k}"


TRITON_BLOCKWISE_GEMM = StructuralRewrite(
    name=TEMPLATE_NAME,
    matcher=find_template_blockwise,
    applier=to_template_blockwise,
    describer=describe_blockwise,
    numerics=tolerance("kopt's GEMM accumulates each 128-deep K step's product in another "
                       "order than cuBLAS; the scales are applied per step, as cuBLAS does"),
    benefit=1,
    description="blockwise_mm(a, sa, w, sw) -> blockwise_gemm(a, sa, w, sw)",
)
