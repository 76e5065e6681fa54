"""Bias absorption: a bias add left standing after a GEMM moves into the GEMM's epilogue.

    # reshape(mm_fp8(a, b, sa, sb)) + bias  ->  reshape(mm_fp8(a, b, sa, sb, bias=bias))

The FP8 rewrite produces ``_scaled_mm`` followed by a separate bias add (one more pass over the
output: the report this project grew from measured such adds after Qwen-Image's output
projections at ~5% of an FP8 step). ``torch._scaled_mm`` adds the bias in its epilogue, in fp32
before the output is rounded: one rounding fewer, so the tier is tolerance, not exact. Models
without biases (FLUX.2) have nothing to absorb, and the pass says so.

A GEMM that cannot add its bias (the blockwise FP8 GEMM: cuBLAS's blockwise kernel with a bias
measured slower than a separate add) leaves it to the fused kernel after it: the gated
residual + norm (:mod:`kopt.patterns.rowwise_fusion`), the activation + quantizer
(:mod:`kopt.patterns.act_quant`), QK-norm + RoPE (:mod:`kopt.patterns.qk_norm_rope`). A merged
QKV projection's add comes before the split into q, k and v, so this pass first splits it:

    # split(y + b, sizes, -1)[i]  ->  split(y, sizes, -1)[i] + split(b, sizes)[i]     (exact)

after which each slice's add is its consumer's to take (the same values, added elementwise).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch import fx

from kopt.graph import bias_add_operands, constant_nodes, infer_meta, tensor_meta
from kopt.patterns.core import Match, Rejection, StructuralRewrite, exact, tolerance

aten = torch.ops.aten
GEMM = aten._scaled_mm.default
NAME = "absorb_bias"


def find_bias_adds(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    consts = constant_nodes(gm.graph)
    for node in gm.graph.nodes:
        if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        out, bias = node.args
        if not (isinstance(out, fx.Node) and isinstance(bias, fx.Node)):
            continue
        reshape = out if out.target is aten.reshape.default else None
        gemm = reshape.args[0] if reshape is not None else out
        if not isinstance(gemm, fx.Node) or gemm.target is not GEMM:
            continue
        b = tensor_meta(bias)
        if b.dim() != 1 or b.shape[0] != tensor_meta(gemm).shape[-1]:
            continue  # a residual or other add, not a bias over the output features
        reason = _why_not(gemm, reshape, bias, consts)
        if reason:
            yield Rejection(NAME, node.name, reason)
            continue
        yield Match(NAME, node, (node,), {"gemm": gemm, "bias": bias})


def _why_not(gemm: fx.Node, reshape: fx.Node | None, bias: fx.Node,
             consts: set[fx.Node]) -> str | None:
    if len(gemm.args) > 4 and gemm.args[4] is not None or gemm.kwargs.get("bias") is not None:
        return "the GEMM already adds a bias"
    if len(gemm.users) != 1 or (reshape is not None and len(reshape.users) != 1):
        return "the GEMM's output has other users, which must not see the bias"
    if bias not in consts:
        return "bias is computed per call, not a load-time constant"
    out, b = tensor_meta(gemm), tensor_meta(bias)
    if b.dtype != out.dtype:
        return f"bias dtype {b.dtype} differs from the GEMM output's {out.dtype}"
    if out.dtype == torch.float32 and out.device.type == "cuda":
        # cuBLAS's FP8 GEMM takes no bias with a float32 output ("Bias is not supported when
        # out_dtype is set to Float32"): an fp32 layer (a time embedding kept in fp32) keeps
        # its add.
        return "the GEMM writes float32, where cuBLAS's FP8 GEMM adds no bias"
    return None


def absorb(gm: fx.GraphModule, match: Match) -> None:
    gemm, bias, add = match.bindings["gemm"], match.bindings["bias"], match.anchor
    gemm.kwargs = {**gemm.kwargs, "bias": bias}
    add.replace_all_uses_with(add.args[0])
    gm.graph.erase_node(add)


ABSORB_BIAS = StructuralRewrite(
    name=NAME,
    matcher=find_bias_adds,
    applier=absorb,
    numerics=tolerance("the bias is added in fp32 in the GEMM epilogue, before the output is "
                       "rounded, instead of after: one rounding fewer"),
    benefit=5,
    description="reshape(mm_fp8(a, b)) + bias -> reshape(mm_fp8(a, b, bias=bias))",
)


# -- a bias add before a split along the features: one add per slice ---------------------------
SPLIT_NAME = "split_bias_add"
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def find_split_bias_adds(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
    for add in gm.graph.nodes:
        found = bias_add_operands(add)
        if found is None or len(add.users) != 1:
            continue
        split = next(iter(add.users))
        if split.target not in _SPLITS:
            continue
        rank = tensor_meta(add).dim()
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim % rank != rank - 1:
            yield Rejection(SPLIT_NAME, add.name, f"the split after the bias add is along dim "
                            f"{dim}, not the features")
            continue
        if not all(u.target is operator.getitem for u in split.users):
            yield Rejection(SPLIT_NAME, add.name, "the split's result is used whole")
            continue
        y, b = found
        yield Match(SPLIT_NAME, add, (add, split), {"y": y, "bias": b, "split": split})


def split_add(gm: fx.GraphModule, match: Match) -> None:
    add, split = match.anchor, match.bindings["split"]
    y, b = match.bindings["y"], match.bindings["bias"]
    g = gm.graph

    def call(target: object, *args: object) -> fx.Node:
        node = g.call_function(target, args)
        infer_meta(gm, node)
        return node

    sizes = split.args[1]
    with g.inserting_before(split):
        ys = call(split.target, y, sizes, -1)
        bs = call(split.target, b, sizes, 0)
    for item in list(split.users):
        i = item.args[1]
        with g.inserting_before(item):
            piece = call(aten.add.Tensor, call(operator.getitem, ys, i),
                         call(operator.getitem, bs, i))
        item.replace_all_uses_with(piece)
        g.erase_node(item)
    g.erase_node(split)
    g.erase_node(add)


SPLIT_BIAS_ADD = StructuralRewrite(
    name=SPLIT_NAME,
    matcher=find_split_bias_adds,
    applier=split_add,
    numerics=exact("the same elementwise adds, of the same values, per slice"),
    benefit=1,
    description="split(y + b, -1)[i] -> split(y, -1)[i] + split(b)[i]",
)
