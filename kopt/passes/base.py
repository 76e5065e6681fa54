"""What a pass is and what it returns.

A pass rewrites a GraphModule in place and returns a typed :class:`PassResult`; it never counts
into globals. :class:`RewritePass` applies a registry of rewrites (owned by the pass instance) in
benefit order, skipping sites that overlap an earlier rewrite or that a guard rejects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from kopt.graph import stable_topo_sort
from kopt.graph.splice import eliminate_dead
from kopt.patterns.core import Match, Numerics, Rejection, Rewrite, Verdict


@dataclass(frozen=True)
class PassResult:
    name: str
    matched: int
    rejected: dict[str, int]
    nodes_before: int
    nodes_after: int
    seconds: float
    sites: tuple[str, ...] = ()
    details: tuple[str, ...] = ()  # one readable line per site, parallel to ``sites``
    site_nodes: tuple[tuple[str, ...], ...] = ()  # the nodes each site replaced
    rejections: tuple[Rejection, ...] = field(default=(), repr=False)
    notes: tuple[str, ...] = ()
    verdict: Verdict | None = None
    reverted: tuple[str, ...] = ()  # sites undone because they failed verification
    from_kb: str = ""  # the knowledge-base entry this result was restored from (kopt.warm)
    check_seconds: float = 0.0  # its verification's, bisection included (``seconds``: the pass's)


def count_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


class Pass:
    """Interface of a pass. ``run`` may be limited to some ``sites`` (used to revert failures)."""

    name: str
    numerics: Numerics
    # the pass whose rewrite this one applies to the sites that one leaves by size alone
    # (``fp8_large``: FP8 on weights over 1 GiB, after ``fold_weights``): where a model cut
    # to its first blocks has no site that large, its sites were checked as that pass's
    split_from: str | None = None

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        raise NotImplementedError

    def uuid(self) -> str:
        """Stable across runs; changes when the pass's code or configuration changes."""
        h = hashlib.sha256()
        h.update(inspect.getsource(type(self)).encode())
        h.update(self.config_key().encode())
        return h.hexdigest()[:16]

    def config_key(self) -> str:
        return ""


# rounds of finding a rewrite's sites again after their inputs were rewritten (a chain of
# matched linears needs one per link)
MAX_ROUNDS = 8


def _nodes_in(value: Any, depth: int = 3) -> list[fx.Node]:
    """The graph nodes in a match binding: a node, or nodes in tuples, lists, dicts and
    dataclasses of them (``depth`` levels)."""
    if isinstance(value, fx.Node):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, (tuple, list)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    return [n for v in items for n in _nodes_in(v, depth - 1)]


def refers_to_erased(match: Match) -> bool:
    """Whether ``match`` holds a node an earlier rewrite erased from the graph."""
    refs = [match.anchor, *match.nodes, *match.outputs, *_nodes_in(match.bindings)]
    return any(getattr(n, "_erased", False) for n in refs)


class RewritePass(Pass):
    """Applies its rewrites, most beneficial first, each site at most once."""

    def __init__(self, name: str, rewrites: Sequence[Rewrite]) -> None:
        self.name = name
        self.rewrites = sorted(rewrites, key=lambda r: -r.benefit)
        # The pass is only as exact as its least exact rewrite.
        rank = {"exact": 0, "tolerance": 1, "bounded": 2}
        self.numerics = max((r.numerics for r in self.rewrites), key=lambda n: rank[n.tier],
                            default=Numerics("exact", "no rewrites"))

    def config_key(self) -> str:
        return "\n".join(f"{r.name}:{r.benefit}:{r.source_key()}" for r in self.rewrites)

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        taken: set[fx.Node] = set()
        applied: list[str] = []
        details: list[str] = []
        site_nodes: list[tuple[str, ...]] = []
        rejections: list[Rejection] = []
        for rewrite in self.rewrites:
            # A site found before an earlier site of this rewrite replaced one of its inputs
            # (fp8 on a linear that reads another linear: the first one's rewrite erases the
            # node the second's match holds) is found again on the rewritten graph.
            again: set[str] | None = None  # the first round: every site
            for _ in range(MAX_ROUNDS):
                stale: set[str] = set()
                for found in list(rewrite.find(gm)):
                    if isinstance(found, Rejection):
                        if again is None:
                            rejections.append(found)
                        continue
                    match: Match = found
                    if again is not None and match.site not in again:
                        continue
                    if taken.intersection(match.nodes):
                        rejections.append(Rejection(rewrite.name, match.site, "overlaps a site "
                                                    "of a higher-benefit rewrite"))
                        continue
                    if sites is not None and match.site not in sites:
                        continue
                    if refers_to_erased(match):
                        stale.add(match.site)
                        continue
                    reason = rewrite.guard(gm, match)
                    if reason is not None:
                        rejections.append(Rejection(rewrite.name, match.site, reason))
                        continue
                    details.append(rewrite.describe(match))
                    site_nodes.append(tuple(n.name for n in match.nodes))
                    rewrite.apply(gm, match)
                    taken.update(match.nodes)
                    applied.append(match.site)
                if not stale or stale == again:  # nothing stale, or no progress
                    break
                again = stale
            rejections += [Rejection(rewrite.name, site, "an earlier site of this rewrite "
                                     "replaced its inputs, and it was not found again")
                           for site in sorted(stale)]
        stable_topo_sort(gm.graph)
        eliminate_dead(gm)
        counted = Counter(r.reason for r in rejections if not r.near_miss)
        notes: tuple[str, ...] = ()
        if not applied and not counted:
            notes = ("nothing to rewrite: no site matches "
                     + "; ".join(f"`{r.description or r.name}`" for r in self.rewrites),)
        return PassResult(
            name=self.name,
            matched=len(applied),
            rejected=dict(counted),
            nodes_before=before,
            nodes_after=count_nodes(gm),
            seconds=time.perf_counter() - t0,
            sites=tuple(applied),
            details=tuple(details),
            site_nodes=tuple(site_nodes),
            rejections=tuple(rejections),
            notes=notes,
        )


class NodeSitePass(Pass):
    """A pass whose sites are single nodes: ``find`` says what a node is (None: not a site, a
    string: why it is not rewritten), ``apply`` rewrites it."""

    def find(self, node: fx.Node) -> Any:
        raise NotImplementedError

    def apply(self, gm: fx.GraphModule, node: fx.Node, found: Any) -> None:
        raise NotImplementedError

    def run(self, gm: fx.GraphModule, sites: set[str] | None = None) -> PassResult:
        t0 = time.perf_counter()
        before = count_nodes(gm)
        done: list[str] = []
        rejected: dict[str, int] = {}
        for node in list(gm.graph.nodes):
            found = self.find(node)
            if found is None or (sites is not None and node.name not in sites):
                continue
            if isinstance(found, str):
                rejected[found] = rejected.get(found, 0) + 1
                continue
            self.apply(gm, node, found)
            done.append(node.name)
        eliminate_dead(gm)
        return PassResult(self.name, len(done), rejected, before, count_nodes(gm),
                          time.perf_counter() - t0, sites=tuple(done))
