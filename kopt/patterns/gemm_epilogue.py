"""GEMM epilogues: the residual update after an FP8 GEMM runs inside kopt's GEMM.

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
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

import kopt.codegen.gemm  # noqa: F401 -- registers kopt::fp8_gemm
from kopt.graph import infer_meta, other_operand, tensor_meta
from kopt.patterns.core import Match, Rejection, StructuralRewrite, tolerance

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
    a, b, sa, sb = gemm.args[:4]
    out_dtype = gemm.kwargs.get("out_dtype", gemm.args[5] if len(gemm.args) > 5 else None)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"GEMM output dtype {out_dtype} (kopt's GEMM writes bf16/fp16/fp32)"
    av, bv = tensor_meta(a), tensor_meta(b)
    if av.dtype != E4M3 or bv.dtype != E4M3:
        return "operands are not e4m3"
    if bv.dim() != 2 or bv.stride(0) != 1:
        return "B is not the column-major [K, N] weight view"
    if tensor_meta(sa).shape != (av.shape[0], 1) or tensor_meta(sb).shape != (1, bv.shape[1]):
        return "scales are not rowwise ([M, 1] x [1, N])"
    if gemm.kwargs.get("use_fast_accum", False):
        return "fast accumulation requested"
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
    a, b, sa, sb = gemm.args[:4]
    bias = gemm.kwargs.get("bias", gemm.args[4] if len(gemm.args) > 4 else None)
    out_dtype = gemm.kwargs.get("out_dtype", gemm.args[5] if len(gemm.args) > 5 else None)
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
