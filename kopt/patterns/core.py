"""Rewrites are data: a name, what is equal (pattern -> replacement, or a structural matcher),
when it applies (a guard returning a reason), its numerics tier, and a benefit for ordering.

Two kinds share one interface (:class:`Rewrite`):

* :class:`PatternRewrite` -- pattern and replacement are plain PyTorch functions, traced to aten
  graphs with ``make_fx(pre_dispatch=True)`` (the same IR as capture). The matcher anchors on the
  pattern's output op and walks inputs backwards, recording why a near miss failed.
* :class:`StructuralRewrite` -- a matcher function for rewrites no fixed pattern can express
  (N parallel projections, hoisting).

Cost and choice live elsewhere (``kopt.cost``, ``kopt.passes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from kopt.graph import describe_node, fake_mode_of, inline_graph, op_name, remove_dead_code

# node.meta key of a site that the verifier checks against its own fp64 computation:
# (fp64 function, names of the nodes whose values are its arguments) (kopt.verify)
LOCAL_REFERENCE = "kopt_local_reference"


@dataclass(frozen=True)
class Numerics:
    """The numerics tier a rewrite promises, checked by :mod:`kopt.verify`.

    ``exact``: outputs bitwise equal to the original graph's.
    ``tolerance``: against an fp64 run of the original graph, the rewritten graph's relative error
    (Frobenius norm) is at most ``factor`` times the original's, or ``factor`` times the dtype's
    floor (:data:`kopt.verify.RTOL_FLOOR`) when the original is more accurate than that.
    ``bounded``: for rewrites that lower precision on purpose (FP8): the rewritten graph's
    relative error against the fp64 run is at most ``bound``, whatever the original's.
    """

    tier: Literal["exact", "tolerance", "bounded"]
    why: str
    factor: float = 2.0
    bound: float = 0.0

    def __str__(self) -> str:
        if self.tier == "exact":
            return "exact"
        if self.tier == "bounded":
            return f"bounded (<= {self.bound:g} relative error vs fp64)"
        return f"tolerance (<= {self.factor:g}x original error vs fp64)"


def exact(why: str) -> Numerics:
    return Numerics("exact", why)


def tolerance(why: str, factor: float = 2.0) -> Numerics:
    return Numerics("tolerance", why, factor)


def bounded(why: str, bound: float) -> Numerics:
    return Numerics("bounded", why, bound=bound)


@dataclass
class Match:
    """One site where a rewrite's structure was found.

    ``anchor`` is the node the site is reported at; ``nodes`` the graph nodes the rewrite
    replaces (used to keep matches of one pass from overlapping); ``bindings`` maps the
    rewrite's inputs to graph nodes or Python values.
    """

    rewrite: str
    anchor: fx.Node
    nodes: tuple[fx.Node, ...]
    bindings: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[fx.Node, ...] = ()  # graph nodes whose values the replacement provides

    @property
    def site(self) -> str:
        return self.anchor.name


@dataclass(frozen=True)
class Rejection:
    """A site a rewrite looked at and did not take, with the reason.

    ``near_miss`` is True when the structure itself did not match (the pattern's anchor op was
    there but its inputs differed); False when the structure matched and a guard said no.
    """

    rewrite: str
    node: str
    reason: str
    near_miss: bool = False


class Rewrite:
    """Interface of every rewrite. Subclasses implement :meth:`find` and :meth:`apply`."""

    name: str
    numerics: Numerics
    benefit: int
    description: str

    def find(self, gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        raise NotImplementedError

    def guard(self, gm: fx.GraphModule, match: Match) -> str | None:
        """Why this site must not be rewritten, or None if it may."""
        return None

    def apply(self, gm: fx.GraphModule, match: Match) -> None:
        raise NotImplementedError

    def describe(self, match: Match) -> str:
        """One human-readable line for a site (module paths where export recorded them)."""
        where = describe_node(match.anchor)
        return f"{match.site} ({where})" if where != match.site else match.site

    def source_key(self) -> str:
        """Text that changes when the rewrite's behaviour changes (for pass uuids)."""
        raise NotImplementedError


GuardFn = Callable[[fx.GraphModule, Match], "str | None"]


@dataclass
class StructuralRewrite(Rewrite):
    """A rewrite given by a matcher function and an apply function."""

    name: str
    matcher: Callable[[fx.GraphModule], Iterable[Match | Rejection]]
    applier: Callable[[fx.GraphModule, Match], None]
    numerics: Numerics
    benefit: int = 1
    description: str = ""
    guard_fn: GuardFn | None = None
    describer: Callable[[Match], str] | None = None

    def describe(self, match: Match) -> str:
        return self.describer(match) if self.describer else super().describe(match)

    def find(self, gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        yield from self.matcher(gm)

    def guard(self, gm: fx.GraphModule, match: Match) -> str | None:
        return self.guard_fn(gm, match) if self.guard_fn else None

    def apply(self, gm: fx.GraphModule, match: Match) -> None:
        self.applier(gm, match)

    def source_key(self) -> str:
        return _source_of(self.matcher, self.applier, self.guard_fn) + repr(self.numerics)


class PatternRewrite(Rewrite):
    """``pattern(*inputs) -> replacement(*inputs)``, both plain PyTorch functions.

    ``example_inputs`` builds small tensors to trace the pattern with (their shapes do not
    matter to matching, only their number, dtypes and ranks do, through the ops they induce).
    ``scalars`` names Python-number arguments that match any literal value: the pattern is
    traced with the given sentinel and the matched value is bound under that name, e.g.
    ``scalars={"eps": 1e-6}`` for a norm's epsilon. Pattern arguments are the tensors first,
    then the scalars, in that order.
    """

    def __init__(
        self,
        name: str,
        pattern: Callable[..., Any],
        replacement: Callable[..., Any],
        example_inputs: Callable[[], Sequence[torch.Tensor]],
        numerics: Numerics,
        *,
        benefit: int | None = None,
        guard: GuardFn | None = None,
        scalars: Mapping[str, float | int] | None = None,
        description: str = "",
    ) -> None:
        self.name = name
        self.pattern_fn = pattern
        self.replacement_fn = replacement
        self.example_inputs = example_inputs
        self.numerics = numerics
        self.guard_fn = guard
        self.scalars = dict(scalars or {})
        self.description = description
        self._graph: fx.Graph | None = None
        self._benefit = benefit

    # -- the traced pattern ------------------------------------------------------------------
    @property
    def graph(self) -> fx.Graph:
        if self._graph is None:
            examples = list(self.example_inputs())
            gm = make_fx(self.pattern_fn, pre_dispatch=True)(*examples, *self.scalars.values())
            remove_dead_code(gm.graph)
            self._graph = gm.graph
            outs = self.outputs
            if not outs or not all(isinstance(o, fx.Node) for o in outs):
                raise ValueError(f"pattern {self.name} must return tensors")
        return self._graph

    @property
    def outputs(self) -> list[fx.Node]:
        out = next(n for n in self.graph.nodes if n.op == "output")
        return pytree.tree_leaves(out.args[0])

    @property
    def benefit(self) -> int:  # type: ignore[override]
        # By default a larger pattern outranks the smaller patterns it contains.
        if self._benefit is not None:
            return self._benefit
        return sum(1 for n in self.graph.nodes if n.op == "call_function")

    def source_key(self) -> str:
        return str(self.graph) + _source_of(self.replacement_fn, self.guard_fn) + repr(
            (self.numerics, self.scalars)
        )

    # -- matching ------------------------------------------------------------------------------
    def find(self, gm: fx.GraphModule) -> Iterator[Match | Rejection]:
        anchor_p = self.outputs[0]
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target != anchor_p.target:
                continue
            state = _MatchState(self)
            try:
                state.match(anchor_p, node)
                for extra in self.outputs[1:]:
                    if extra not in state.pmap:
                        raise _NoMatch(f"pattern output {extra.name} is not reachable")
                state.check_no_escape(set(self.outputs))
            except _NoMatch as miss:
                yield Rejection(self.name, node.name, str(miss), near_miss=True)
                continue
            nodes = tuple(state.pmap[p] for p in self.graph.nodes if p in state.pmap)
            outputs = tuple(state.pmap[p] for p in self.outputs)
            yield Match(self.name, node, nodes, state.bindings(), outputs)

    def guard(self, gm: fx.GraphModule, match: Match) -> str | None:
        return self.guard_fn(gm, match) if self.guard_fn else None

    # -- replacing -----------------------------------------------------------------------------
    def apply(self, gm: fx.GraphModule, match: Match) -> None:
        tensor_names = [p.name for p in self.graph.nodes if p.op == "placeholder"]
        tensor_names = tensor_names[: len(tensor_names) - len(self.scalars)]
        fake_inputs = [match.bindings[n].meta["val"] for n in tensor_names]
        scalar_values = [match.bindings[n] for n in self.scalars]
        with fake_mode_of(gm):
            rep = make_fx(self.replacement_fn, pre_dispatch=True)(*fake_inputs, *scalar_values)
        remove_dead_code(rep.graph)
        rep_ph = [n.name for n in rep.graph.nodes if n.op == "placeholder"]
        inputs = dict(zip(rep_ph, [match.bindings[n] for n in tensor_names] + scalar_values,
                          strict=True))
        new_outs = inline_graph(gm, rep.graph, inputs, before=match.anchor)
        if len(new_outs) != len(match.outputs):
            raise ValueError(f"{self.name}: replacement returns {len(new_outs)} values, "
                             f"pattern {len(match.outputs)}")
        for old, new in zip(match.outputs, new_outs, strict=True):
            old.replace_all_uses_with(new)
        for node in reversed(match.nodes):
            if not node.users:
                gm.graph.erase_node(node)


class _NoMatch(Exception):
    pass


class _MatchState:
    """Backward walk from the anchor, binding pattern placeholders to graph nodes."""

    def __init__(self, rewrite: PatternRewrite) -> None:
        self.rewrite = rewrite
        self.pmap: dict[fx.Node, fx.Node] = {}
        self.bound: dict[fx.Node, Any] = {}
        phs = [n for n in rewrite.graph.nodes if n.op == "placeholder"]
        n_tensors = len(phs) - len(rewrite.scalars)
        self.scalar_sentinels = {
            value: (ph, name)
            for ph, (name, value) in zip(phs[n_tensors:], rewrite.scalars.items(), strict=True)
        }
        self.scalar_values: dict[str, Any] = {}
        self.tensor_placeholders = phs[:n_tensors]

    def match(self, p: fx.Node, g: Any) -> None:
        if p.op == "placeholder":
            if p in self.bound and self.bound[p] is not g:
                raise _NoMatch(
                    f"input {p.name} of the pattern is used twice but the graph has "
                    f"{_nm(self.bound[p])} and {_nm(g)}"
                )
            self.bound[p] = g
            return
        if p in self.pmap:
            if self.pmap[p] is not g:
                raise _NoMatch(f"{p.name} of the pattern maps to {_nm(self.pmap[p])} and {_nm(g)}")
            return
        if not isinstance(g, fx.Node) or g.op != "call_function" or g.target != p.target:
            found = op_name(g) if isinstance(g, fx.Node) else repr(g)
            raise _NoMatch(f"expected {op_name(p)} where the graph has {found}")
        p_args, g_args = normalized_args(p), normalized_args(g)
        if p_args.keys() != g_args.keys():
            raise _NoMatch(f"{op_name(g)} called with other arguments than in the pattern")
        self.pmap[p] = g
        for key, pa in p_args.items():
            self.match_arg(pa, g_args[key], f"{op_name(p)}.{key}")

    def match_arg(self, pa: Any, ga: Any, where: str) -> None:
        if isinstance(pa, fx.Node):
            if pa.op == "placeholder" and pa not in self.tensor_placeholders:
                self.match_scalar(pa, ga, where)
                return
            if not isinstance(ga, fx.Node):
                raise _NoMatch(f"{where}: expected a tensor, the graph passes {ga!r}")
            self.match(pa, ga)
        elif isinstance(pa, list | tuple):
            if not isinstance(ga, list | tuple) or len(pa) != len(ga):
                raise _NoMatch(f"{where}: expected {pa!r}, the graph passes {ga!r}")
            for i, (x, y) in enumerate(zip(pa, ga, strict=True)):
                self.match_arg(x, y, f"{where}[{i}]")
        elif _is_number(pa) and pa in self.scalar_sentinels:
            self.match_scalar(self.scalar_sentinels[pa][0], ga, where)
        elif pa != ga or type(pa) is not type(ga):
            raise _NoMatch(f"{where}: expected {pa!r}, the graph passes {ga!r}")

    def match_scalar(self, ph: fx.Node, ga: Any, where: str) -> None:
        name = next(n for p, n in self.scalar_sentinels.values() if p is ph)
        if isinstance(ga, fx.Node) or isinstance(ga, bool) or not isinstance(ga, float | int):
            raise _NoMatch(f"{where}: expected a number for {name}, the graph passes {_nm(ga)}")
        if name in self.scalar_values and self.scalar_values[name] != ga:
            raise _NoMatch(f"{where}: {name} is {self.scalar_values[name]!r} and {ga!r}")
        self.scalar_values[name] = ga

    def check_no_escape(self, outputs: set[fx.Node]) -> None:
        inside = set(self.pmap.values())
        for p, g in self.pmap.items():
            if p in outputs:
                continue
            for user in g.users:
                if user not in inside:
                    raise _NoMatch(
                        f"intermediate {g.name} ({op_name(g)}) is also used by {user.name} "
                        "outside the pattern"
                    )

    def bindings(self) -> dict[str, Any]:
        missing = [p.name for p in self.tensor_placeholders if p not in self.bound]
        if missing:
            raise ValueError(f"pattern {self.rewrite.name} does not use its inputs {missing}")
        out: dict[str, Any] = {p.name: g for p, g in self.bound.items()}
        out.update(self.scalar_values)
        return out


def normalized_args(node: fx.Node) -> dict[str, Any]:
    """An aten op node's arguments by their schema names, positional or keyword, defaults filled
    in (``arg0``, ``arg1``, ... for other targets)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        pair = normalize_function(
            target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
        )
        if pair is not None:
            return dict(pair.kwargs)
    out = {f"arg{i}": a for i, a in enumerate(node.args)}
    out.update(node.kwargs)
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool)


def _nm(x: Any) -> str:
    return x.name if isinstance(x, fx.Node) else repr(x)


def _source_of(*fns: Callable | None) -> str:
    """The source of each function: the same text in every process (a ``functools.partial``
    is its function's source and its bound arguments, never its repr, which holds an
    address)."""
    import functools
    import inspect

    parts = []
    for fn in fns:
        if fn is None:
            continue
        if isinstance(fn, functools.partial):
            parts.append(_source_of(fn.func) + repr((fn.args, sorted(fn.keywords.items()))))
            continue
        try:
            parts.append(inspect.getsource(fn))
        except (OSError, TypeError):
            parts.append(getattr(fn, "__qualname__", repr(fn)))
    return "\n".join(parts)


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one pass (or one site) on fresh random inputs."""

    passed: bool
    tier: str
    detail: str
    # failed because the check itself could not run (e.g. the fp64 reference ran out of
    # memory): says nothing about any one site, so bisecting the sites cannot help
    unverifiable: bool = False

    def __str__(self) -> str:
        return f"{'passed' if self.passed else 'FAILED'} ({self.tier}: {self.detail})"
