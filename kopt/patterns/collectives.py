"""Graphs with collectives: what the passes must respect, and the all-reduce + norm fusion.

A tensor-parallel graph captured with torch's functional collectives carries
``_c10d_functional.all_reduce(partial, "sum", group)`` + ``wait_tensor`` where a row-parallel
GEMM's partial sums are completed. Every rank runs the same graph, and every rank must issue the
same collectives in the same order: a collective skipped on one rank (a cache hit), run at load
on one rank only (a re-pack), or merged away leaves its peers waiting. So:

* :func:`is_collective` -- the nodes no pass may cache, fold or deduplicate (the hoisting,
  constant-folding and CSE passes keep them per call, with a reason in the report);
* :func:`partial_sum_nodes` -- how the merge pass tells row-parallel projections (their output is
  a partial sum: it reaches an all-reduce through no other contraction) from column-parallel and
  replicated ones (their output is complete on this rank) without knowing the model: it merges
  only projections of one kind.

And the fusion, one rewrite per output flavour (the kopt::rowwise residual flavours):

    # rowwise(x, wait(all_reduce(p)), g) -> allreduce_residual_norm(x, p, g)

``norm(x + g * all_reduce(p))`` with its modulation / epilogue and FP8 quantizer, as
:mod:`kopt.patterns.rowwise_fusion` finds them when ``y`` is the all-reduced value, becomes one
``kopt::allreduce_residual_norm`` call (:mod:`kopt.codegen.kernels.allreduce_norm`). Guards, each
with its reason: the reduction is a sum; the all-reduced value has no reader outside the site;
everything :func:`kopt.patterns.rowwise_fusion.plan` checks. An all-reduce whose result goes
anywhere else (straight into a GEMM, an activation) is reported as a near miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import fx

import kopt.codegen.gemm  # noqa: F401 -- registers kopt::fp8_gemm
import kopt.codegen.kernels.allreduce_norm  # noqa: F401 -- registers kopt::allreduce_residual_norm
from kopt.graph import op_name
from kopt.patterns.core import Match, Rejection, StructuralRewrite
from kopt.patterns.rowwise_fusion import (
    NUMERICS,
    RESIDUAL_NORM,
    RESIDUAL_NORM_QUANT,
    Site,
    plan,
    splice,
)
from kopt.patterns.rowwise_fusion import describe as describe_rowwise

aten = torch.ops.aten
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
ALLREDUCE_NORM = torch.ops.kopt.allreduce_residual_norm.default

# op namespaces whose ops communicate (functional and in-place c10d, symmetric memory)
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional",
                                   "_c10d_functional_autograd", "c10d", "symm_mem"})
# kopt's own ops that communicate
KOPT_COLLECTIVES = frozenset({ALLREDUCE_NORM})
# ops that contract over a dimension: a partial sum stops being one after them
_CONTRACTIONS = frozenset({
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten.baddbmm.default, aten.matmul.default, aten.convolution.default,
    aten.scaled_dot_product_attention.default, aten._scaled_mm.default,
    torch.ops.kopt.fp8_gemm.default,
})

# why the passes leave a collective where it is (the reports' reasons)
KEEP_PER_CALL = ("collective: runs on every call on every rank (a cached or load-time collective "
                 "would be skipped on one rank while its peers wait in it)")
NOT_DEDUPLICATED = ("collective: every rank issues each one as written (merging collectives "
                    "changes the communication every peer must match)")


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` communicates with other ranks (or waits for such communication)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace in COLLECTIVE_NAMESPACES or target in KOPT_COLLECTIVES


def has_collectives(graph: fx.Graph) -> bool:
    return any(is_collective(n) for n in graph.nodes)


def partial_sum_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value is a partial sum: it reaches an all-reduce's input through pointwise and
    view ops only (no contraction, no other collective). A projection in this set is
    row-parallel; one outside it computes its complete (column-sharded or replicated) output."""
    if not any(n.target is ALL_REDUCE for n in graph.nodes):
        return set()
    partial: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        for user in node.users:
            if user.target is ALL_REDUCE or (user in partial and user.target not in _CONTRACTIONS
                                             and not is_collective(user)):
                partial.add(node)
                break
    return partial


# ------------------------------------------------------------------------------------------------
# The fusion

@dataclass(frozen=True)
class Reduced:
    """``wait`` = wait_tensor(``reduce`` = all_reduce(``partial``, op, ``group``))."""

    reduce: fx.Node
    wait: fx.Node
    partial: fx.Node
    op: str
    group: str


def reduced(node: object) -> Reduced | None:
    """The all-reduce whose completed value ``node`` is, if it is one."""
    if not (isinstance(node, fx.Node) and node.target is WAIT):
        return None
    ar = node.args[0]
    if not (isinstance(ar, fx.Node) and ar.target is ALL_REDUCE
            and isinstance(ar.args[0], fx.Node)):
        return None
    return Reduced(ar, node, ar.args[0], str(ar.args[1]), str(ar.args[2]))


def _reduced_as_y(site: Site) -> Site:
    """``x + y`` is ``y + x``: put the all-reduced operand of an ungated residual add in ``y``."""
    if site.gate is None and reduced(site.y) is None and reduced(site.x) is not None:
        return dataclasses.replace(site, x=site.y, y=site.x)
    return site


def _finder(inner: StructuralRewrite, name: str,
            report_misses: bool) -> Callable[[fx.GraphModule], Iterator[Match | Rejection]]:
    def find(gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        seen: set[fx.Node] = set()
        for found in inner.find(gm):
            if isinstance(found, Rejection):
                continue  # the norm's own misses are the rowwise pass's to report
            site = _reduced_as_y(found.bindings["site"])
            r = reduced(site.y)
            if r is None:
                continue
            seen.add(r.reduce)
            inside = set(site.nodes)
            outside = [u.name for u in r.wait.users if u not in inside]
            outside += [u.name for u in r.reduce.users if u is not r.wait]
            if outside:
                yield Rejection(name, r.reduce.name, f"the all-reduced value {r.wait.name} is "
                                f"also read by {', '.join(outside)} outside the site")
                continue
            yield Match(name, found.anchor, (r.reduce, r.wait, *site.nodes),
                        {"site": site, "reduced": r})
        if not report_misses:
            return
        for node in gm.graph.nodes:
            if node.target is ALL_REDUCE and node not in seen:
                readers = [u for w in node.users for u in (w.users if w.target is WAIT else [w])]
                what = ", ".join(f"{u.name} ({op_name(u)})" for u in readers) or "nothing"
                yield Rejection(name, node.name, f"the all-reduced value goes to {what}, not to "
                                "a residual add before a norm", near_miss=True)
    return find


def _why_not(gm: fx.GraphModule, match: Match) -> str | None:
    r: Reduced = match.bindings["reduced"]
    if r.op != "sum":
        return f"the all-reduce computes {r.op!r}, not a sum"
    p = plan(gm, match.bindings["site"])
    return p if isinstance(p, str) else None


def fuse(gm: fx.GraphModule, match: Match) -> None:
    r: Reduced = match.bindings["reduced"]
    splice(gm, match, ALLREDUCE_NORM, "allreduce_residual_norm", substitute={"y": r.partial},
           extra_args=(r.group,), extra_dead=(r.wait, r.reduce))


def describe(match: Match) -> str:
    r: Reduced = match.bindings["reduced"]
    return f"all_reduce({r.partial.name}, group {r.group}) + {describe_rowwise(match)}"


def allreduce_norm_rewrite(inner: StructuralRewrite, name: str, benefit: int, rule: str,
                           report_misses: bool) -> StructuralRewrite:
    return StructuralRewrite(
        name=name,
        matcher=_finder(inner, name, report_misses),
        applier=fuse,
        guard_fn=_why_not,
        describer=describe,
        numerics=NUMERICS,
        benefit=benefit,
        description=rule,
    )


ALLREDUCE_NORM_FUSIONS: tuple[StructuralRewrite, ...] = (
    allreduce_norm_rewrite(
        RESIDUAL_NORM_QUANT, "fuse_allreduce_residual_norm_quant", 50,
        "quant(chain(norm(x + g * all_reduce(p)))) -> allreduce_residual_norm(x, p, g) -> "
        "residual, fp8", report_misses=False),
    allreduce_norm_rewrite(
        RESIDUAL_NORM, "fuse_allreduce_residual_norm", 45,
        "chain(norm(x + g * all_reduce(p))) -> allreduce_residual_norm(x, p, g) -> residual, out",
        report_misses=True),
)
