"""Bias absorption: a bias add left standing after a GEMM moves into the GEMM's epilogue.

    # reshape(mm_fp8(a, b, sa, sb)) + bias  ->  reshape(mm_fp8(a, b, sa, sb, bias=bias))

The FP8 rewrite produces ``_scaled_mm`` followed by a separate bias add (one more pass over the
output: the report this project grew from measured such adds after Qwen-Image's output
projections at ~5% of an FP8 step). ``torch._scaled_mm`` adds the bias in its epilogue, in fp32
before the output is rounded: one rounding fewer, so the tier is tolerance, not exact. Models
without biases (FLUX.2) have nothing to absorb, and the pass says so. Absorbing into a fused
consumer (gated residual, norm) comes with the fused kernels.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from kopt.graph import constant_nodes, tensor_meta
from kopt.patterns.core import Match, Rejection, StructuralRewrite, tolerance

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
