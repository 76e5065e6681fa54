"""FP8 linears: a GEMM in e4m3 with per-output-channel weight scales and per-token activation
scales (``torch._scaled_mm`` with rowwise scaling).

    # x@W.T + b  ->  mm_fp8(quant(x), quant(W).T) * sx * sw.T + b

The weight's quantization depends only on the parameter, so the constant-folding pass evaluates
it at load; the activation's is an explicit ``kopt::quant_fp8_rowwise`` node, for the fusion
passes to pull into its producer. Eligibility (sizes, alignment, dtypes) is a guard with reasons.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import fx

import kopt.codegen.kernels.fp8_blockwise  # noqa: F401 -- registers the blockwise ops
import kopt.codegen.kernels.quant_fp8  # noqa: F401 -- registers kopt::quant_fp8_rowwise
from kopt.graph import constant_nodes, describe_node, infer_meta, tensor_meta
from kopt.passes.config import FP8Config
from kopt.patterns.core import LOCAL_REFERENCE, Match, Rejection, StructuralRewrite, bounded

aten = torch.ops.aten
QUANT = torch.ops.kopt.quant_fp8_rowwise.default
QUANT_GROUP = torch.ops.kopt.quant_fp8_group.default
QUANT_BLOCK = torch.ops.kopt.quant_fp8_block128.default
BLOCKWISE_MM = torch.ops.kopt.fp8_blockwise_mm.default
BLOCK = 128
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch._scaled_mm needs both GEMM dimensions to be multiples of 16.
ALIGN = 16
# Linears with a weight larger than this are quantized in a second round (``fp8_large``, after
# ``fold_weights``): until the weights are packed, a check quantizes each weight per call, and
# the FP8 copy of the largest (W1's 121 modulation weights merged: 6.3 GiB) would sit beside
# every BF16 weight; by the second round the others' BF16 copies have left.
LARGE_BYTES = 1 << 30


def find_fp8_linears(config: FP8Config, large: bool | None = None):  # noqa: ANN201
    """The eligible linears; ``large``: only those whose weight is over :data:`LARGE_BYTES`
    (True), only the others (False: the large ones rejected, left to the second round), or
    all (None)."""
    def find(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        consts = constant_nodes(gm.graph)
        for node in gm.graph.nodes:
            if node.target is not aten.linear.default:
                continue
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            nbytes = _nbytes(w)
            if large is not None and (nbytes > LARGE_BYTES) != large:
                if not large:
                    yield Rejection(NAME, node.name, f"weight over {LARGE_BYTES >> 20} MiB: "
                                    "quantized after fold_weights, by fp8_large")
                continue
            reason = _ineligible(x, w, bias, consts, config)
            if reason:
                yield Rejection(NAME, node.name, reason)
                continue
            yield Match(NAME, node, (node,), {"x": x, "weight": w, "bias": bias})
    return find


def _ineligible(x: fx.Node, w: fx.Node, bias: fx.Node | None, consts: set[fx.Node],
                config: FP8Config) -> str | None:
    if w not in consts or (bias is not None and bias not in consts):
        return "weight is computed per call, not a load-time constant"
    xv, wv = tensor_meta(x), tensor_meta(w)
    if xv.dtype not in ACTIVATION_DTYPES:
        return f"activation dtype {xv.dtype} is not bf16/fp16/fp32"
    n, k = wv.shape
    if min(n, k) < config.min_features:
        return f"features {k} -> {n} below min_features {config.min_features}"
    if config.layout == "blockwise" and (k % BLOCK or n % BLOCK):
        return f"features {k} -> {n} not multiples of {BLOCK} (128x128 weight blocks)"
    if config.layout == "blockwise" and k % (BLOCK * 4):
        # torch checks the blockwise scale tensors against cuBLAS's padded layout: K/128
        # scale columns rounded up to 4 (H200 run of 2026-11-29)
        return f"in-features {k} not a multiple of {BLOCK * 4} (cuBLAS pads blockwise scales " \
               f"to 4 per K)"
    if k % ALIGN or n % ALIGN:
        return f"features {k} -> {n} not multiples of {ALIGN} (torch._scaled_mm)"
    if xv.numel() == 0:
        return "empty activation"
    return None


def to_fp8(gm: fx.GraphModule, match: Match, layout: str = "rowwise",
           accumulate: str = "fast") -> None:
    x, w, bias = match.bindings["x"], match.bindings["weight"], match.bindings["bias"]
    node = match.anchor
    g = gm.graph
    xv = tensor_meta(x)
    n, k = tensor_meta(w).shape

    def call(target, *args, **kwargs) -> fx.Node:  # noqa: ANN001
        out = g.call_function(target, args, kwargs)
        infer_meta(gm, out)
        return out

    with g.inserting_before(node):
        if layout == "blockwise":
            y = _blockwise(call, x, w, xv, n, k)
        else:
            y = _rowwise(call, x, w, xv, n, k, fast=accumulate == "fast")
        if bias is not None:
            y = call(aten.add.Tensor, y, bias)
    y.meta["kopt_from"] = f"fp8({describe_node(node)})"
    # verification checks this site against the fp64 linear it replaces (the bounded tier)
    y.meta[LOCAL_REFERENCE] = (F.linear, (x.name, w.name, bias.name if bias is not None else None))
    node.replace_all_uses_with(y)
    g.erase_node(node)


def _rowwise(call, x: fx.Node, w: fx.Node,  # noqa: ANN001
             xv: torch.Tensor, n: int, k: int, fast: bool) -> fx.Node:
    item = operator.getitem
    wq = call(QUANT, w)  # load time: folded
    w_t = call(aten.t.default, call(item, wq, 0))  # [K, N], column-major
    ws_t = call(aten.t.default, call(item, wq, 1))  # [1, N]
    xq = _shared_quant(x, k, QUANT) or call(QUANT, call(aten.reshape.default, x, [-1, k]))
    # ^ per call: the node fusion passes pull into x's producer
    y = call(aten._scaled_mm.default, call(item, xq, 0), w_t, call(item, xq, 1), ws_t,
             out_dtype=xv.dtype, **({"use_fast_accum": True} if fast else {}))
    return call(aten.reshape.default, y, [*xv.shape[:-1], n])


def _shared_quant(x: fx.Node, k: int, quant: object) -> fx.Node | None:
    """The quantizer an earlier FP8 linear of the same activation ``x`` already placed (the
    pass runs after CSE, which cannot share its nodes): linears of one input that were not
    merged -- 120 modulation GEMVs of one timestep embedding in Qwen-Image with
    ``merge_projections`` off -- quantize it once. The pass rewrites in graph order, so that
    quantizer comes before this linear."""
    for r in x.users:
        if r.target is aten.reshape.default and list(r.args[1]) == [-1, k]:
            for q in r.users:
                if q.target is quant:
                    return q
    return None


def _blockwise(call, x: fx.Node, w: fx.Node,  # noqa: ANN001
               xv: torch.Tensor, n: int, k: int) -> fx.Node:
    item = operator.getitem
    wq = call(QUANT_BLOCK, w)  # load time: folded
    xq = _shared_quant(x, k, QUANT_GROUP) or call(  # per call, 1x128 groups
        QUANT_GROUP, call(aten.reshape.default, x, [-1, k]))
    y = call(BLOCKWISE_MM, call(item, xq, 0), call(item, xq, 1), call(item, wq, 0),
             call(item, wq, 1), xv.dtype)
    return call(aten.reshape.default, y, [*xv.shape[:-1], n])


NAME = "fp8_linear"

# e4m3 keeps 3 mantissa bits: each quantized operand is off by at most 2^-4 relative, so a
# product by 2^-3; a GEMM's norm-wise relative error stays under that.
FP8_BOUND = 2.0**-3


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def fp8_linear(config: FP8Config, large: bool | None = None) -> StructuralRewrite:
    """The rewrite, on the linears :func:`find_fp8_linears` takes for ``large``."""
    return StructuralRewrite(
        name=NAME,
        matcher=find_fp8_linears(config, large),
        applier=functools.partial(to_fp8, layout=config.layout, accumulate=config.accumulate),
        numerics=bounded("e4m3 operands with per-row scales: each GEMM within 2^-3 relative "
                         "error of its fp64 product", FP8_BOUND),
        benefit=5,
        description="x@W.T + b -> mm_fp8(quant(x), quant(W).T) * sx * sw.T + b",
    )
