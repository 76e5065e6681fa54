"""FLOPs and bytes as sympy expressions of the workload's symbols.

A captured graph is specialised to one input shape. To cost it at other shapes without
capturing each one, the reference workloads are captured at two *probe* shapes whose symbol
values are chosen so that no two candidate expressions agree on both: every tensor dimension of
every node is then identified as ``c * m`` with ``c`` a constant of the model and ``m`` a
monomial of the symbols::

    m in {1, B} x {1, S_img, S_txt, S_img + S_txt}        # DiTs (W1, W2)
    m in {1, B} x {1, S}                                  # LLM prefill
    m in {1, B} x {1, C}                                  # LLM decode (C: KV-cache capacity)

(a constant equal to the model's hidden size is written ``D``). Batch 1 is its own regime: a
graph captured at batch 1 can have other ops than at batch 2 (export drops a copy whose input
is already contiguous at batch 1), so a workload at batch 1 is costed from probes at batch 1
(``B`` fixed to 1, the other symbols free) and one at batch >= 2 from probes at batch 2 and 3.

The symbolic shapes go through the same counting code as concrete ones
(:mod:`kopt.cost.counts`, whose FLOP formulas are torch's own), so each node's FLOPs and bytes
come out as polynomials: ``2*B*S_img*D**2`` for a D x D projection of the image stream. A third
probe checks the result: every node's evaluated counts must equal the counts of a graph
actually captured there.

Symbolic counts are built for every stage of the pass pipeline (the graph after each pass), so
the predicted saving of each pass -- and the fused kernels it inserts -- can be evaluated at any
workload: the ranking at 512, 1024 and 2048 px from one set of probes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt.capture import capture_module
from kopt.cost.counts import OpCount, TensorInfo, count_graph, meta_info
from kopt.cost.device import Prediction
from kopt.cost.rank import CostModel, PassPrediction
from kopt.graph import copy_graph_module
from kopt.graph.regions import CachedRegion
from kopt.models import Workload, build
from kopt.passes import PassConfig, build_passes
from kopt.passes.fold import FoldConstants

B, S_IMG, S_TXT, S, C, D = sympy.symbols("B S_img S_txt S C D", positive=True, integer=True)
# the latent grid of a DiT, patches per side (S_img = H_p * W_p): RoPE tables are built per axis
HP, WP = sympy.symbols("H_p W_p", positive=True, integer=True)


class SymbolicFitError(ValueError):
    """A node's shapes do not fit the family's expressions, or differ between probes."""


@dataclass(frozen=True)
class Family:
    """How a reference model's workloads are described by symbols."""

    lengths: tuple[sympy.Symbol, ...]  # token counts and capacities
    values: Callable[[Workload], dict[sympy.Symbol, int]]
    probes: tuple[dict[str, Any], ...]  # builder shapes without the batch: fit, fit, check
    extra: tuple[sympy.Expr, ...] = ()  # further candidates, not multiplied by the batch

    def monomials(self, batched: bool) -> list[sympy.Expr]:
        """Candidate expressions of one dimension, simplest first."""
        tokens: list[sympy.Expr] = [sympy.Integer(1), *self.lengths]
        tokens += [a + b for i, a in enumerate(self.lengths) for b in self.lengths[i + 1:]]
        factors = (sympy.Integer(1), B) if batched else (sympy.Integer(1),)
        return [t * b for b in factors for t in tokens] + list(self.extra)

    def probe_shapes(self, batched: bool) -> list[dict[str, Any]]:
        """The builder shapes of the fit probes and of the check probe."""
        batches = PROBE_BATCHES if batched else (1, 1, 1)
        return [dict(p, batch=b) for p, b in zip(self.probes, batches, strict=True)]


def _hidden(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None) or model.model.config
    if hasattr(config, "hidden_size"):
        return int(config.hidden_size)
    return int(config.num_attention_heads * config.attention_head_dim)


def _dit_values(w: Workload) -> dict[sympy.Symbol, int]:
    img, txt = w.kwargs["hidden_states"], w.kwargs["encoder_hidden_states"]
    out = {B: img.shape[0], S_IMG: img.shape[1], S_TXT: txt.shape[1], D: _hidden(w.model)}
    grid = w.kwargs.get("img_shapes")  # Qwen-Image: [[(frames, H_p, W_p)]] per sample
    if grid:
        out[HP], out[WP] = grid[0][0][1], grid[0][0][2]
    return out


def _prefill_values(w: Workload) -> dict[sympy.Symbol, int]:
    ids = w.kwargs["input_ids"]
    return {B: ids.shape[0], S: ids.shape[1], D: _hidden(w.model)}


def _decode_values(w: Workload) -> dict[sympy.Symbol, int]:
    cache = next(t for name, t in w.model.named_buffers() if name.startswith("key_cache"))
    return {B: w.kwargs["input_ids"].shape[0], C: cache.shape[2], D: _hidden(w.model)}


# Probe symbol values: the ratios between the two fit probes differ for every candidate
# expression (batch 2 -> 3 included), so a dimension seen at both fits at most one of them.
PROBE_BATCHES = (2, 3, 4)
_DIT = Family((S_IMG, S_TXT), _dit_values, (
    dict(height=80, width=112, text_tokens=11),  # 5 x 7 = 35 image, 11 text tokens
    dict(height=128, width=64, text_tokens=7),  # 8 x 4 = 32, 7
    dict(height=96, width=144, text_tokens=13),  # 6 x 9 = 54, 13
), extra=(HP, WP, sympy.floor(HP / 2), HP - sympy.floor(HP / 2), sympy.floor(WP / 2),
          WP - sympy.floor(WP / 2)))
_PREFILL = Family((S,), _prefill_values, (
    dict(mode="prefill", seq_len=19), dict(mode="prefill", seq_len=13),
    dict(mode="prefill", seq_len=23),
))
_DECODE = Family((C,), _decode_values, (
    dict(mode="decode", seq_len=9, max_cache_len=19),
    dict(mode="decode", seq_len=7, max_cache_len=13),
    dict(mode="decode", seq_len=5, max_cache_len=23),
))


def family(model: str, shape: Mapping[str, Any] | None = None) -> Family:
    """The symbols of a reference model (``kopt.models`` name) and, for the LLM, its mode."""
    if model.startswith(("qwen-image", "flux2")):
        return _DIT
    if model.startswith("llm"):
        return _DECODE if (shape or {}).get("mode") == "decode" else _PREFILL
    raise ValueError(f"no symbolic description of model {model!r} (reference models only)")


def workload_values(model: str, **shape: Any) -> dict[sympy.Symbol, int]:
    """Symbol values of the workload ``build(model, **shape)`` (built on meta: no weights)."""
    return family(model, shape).values(build(model, device="meta", **shape))


def fit_dimension(values: Sequence[int],
                  table: Sequence[tuple[sympy.Expr, tuple[int, ...]]],
                  hidden: int) -> sympy.Expr | None:
    """The expression ``c * m`` equal to ``values[p]`` at every probe p, with ``(m, m's value
    at each probe)`` from ``table`` (simplest first) and ``c`` a positive integer (written as a
    multiple of ``D`` where it is one: the hidden size); ``None`` if none is."""
    if all(v == values[0] for v in values) and values[0] in (0, 1):
        return sympy.Integer(values[0])
    for m, ms in table:
        if ms[0] <= 0 or values[0] % ms[0]:
            continue
        c = values[0] // ms[0]
        if c > 0 and all(c * mp == v for mp, v in zip(ms, values, strict=True)):
            factor = D * (c // hidden) if c % hidden == 0 else sympy.Integer(c)
            return factor * m
    return None


def _all_nodes(gm: fx.GraphModule, prefix: str = "") -> dict[str, fx.Node]:
    """Every node by qualified name (a hoisted region's nodes as ``region/node``)."""
    out: dict[str, fx.Node] = {}
    for n in gm.graph.nodes:
        out[prefix + n.name] = n
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            inner = mod.region if isinstance(mod, CachedRegion) else mod
            if isinstance(inner, fx.GraphModule):
                out.update(_all_nodes(inner, f"{prefix}{n.target}/"))
    return out


class SymbolicShapes:
    """Shapes of every node of a graph as expressions; callable as a counting ``info``."""

    def __init__(self, shapes: dict[str, Any], problems: dict[str, str],
                 prefix: str = "") -> None:
        self.shapes = shapes
        self.problems = problems
        self.prefix = prefix

    def __call__(self, node: fx.Node) -> Any:
        name = self.prefix + node.name
        if name in self.problems:
            raise SymbolicFitError(f"node {name}: {self.problems[name]}")
        return self.shapes[name]

    def scoped(self, prefix: str) -> SymbolicShapes:
        return SymbolicShapes(self.shapes, self.problems, prefix)


def fit_shapes(graphs: Sequence[fx.GraphModule], at: Sequence[Mapping[sympy.Symbol, int]],
               candidates: Sequence[sympy.Expr], hidden: int) -> SymbolicShapes:
    """Symbolic shapes of the nodes of ``graphs[0]`` from the same graph captured at each
    probe (``at``: the probes' symbol values). Nodes are matched by name and op."""
    nodes = [_all_nodes(g) for g in graphs]
    table = [(m, tuple(int(m.subs(point)) for point in at)) for m in candidates]
    fitted_dims: dict[tuple[int, ...], sympy.Expr | None] = {}
    shapes: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for name, node in nodes[0].items():
        others = [n.get(name) for n in nodes[1:]]
        if any(o is None or o.target != node.target for o in others):
            problems[name] = "not in the graph of every probe (structure depends on the shape)"
            continue
        infos = [meta_info(node)] + [meta_info(o) for o in others]
        leaves = [pytree.tree_flatten(i) for i in infos]
        if any(spec != leaves[0][1] for _, spec in leaves):
            problems[name] = "different value structure at the probes"
            continue
        fitted = []
        for k, first in enumerate(leaves[0][0]):
            if not isinstance(first, TensorInfo):
                fitted.append(first)
                continue
            seen = [lv[0][k] for lv in leaves]
            if any(len(t.shape) != len(first.shape) or t.dtype != first.dtype for t in seen):
                problems[name] = "rank or dtype differs between probes"
                break
            dims = []
            for d in range(len(first.shape)):
                seen_d = tuple(t.shape[d] for t in seen)
                if seen_d not in fitted_dims:
                    fitted_dims[seen_d] = fit_dimension(seen_d, table, hidden)
                expr = fitted_dims[seen_d]
                if expr is None:
                    problems[name] = (f"dimension {d} = {[t.shape[d] for t in seen]} at the "
                                      f"probes fits no c * m, m in {candidates}")
                    break
                dims.append(expr)
            if name in problems:
                break
            fitted.append(TensorInfo(tuple(dims), first.dtype))
        if name not in problems:
            shapes[name] = pytree.tree_unflatten(fitted, leaves[0][1])
    return SymbolicShapes(shapes, problems)


@dataclass(frozen=True)
class Stage:
    """The graph after one pass (or as captured), at the first probe, with symbolic shapes."""

    name: str
    sites: int
    graph: fx.GraphModule
    shapes: SymbolicShapes

    def counts(self, *, folded: bool = False) -> list[OpCount]:
        return count_graph(self.graph, self.shapes, folded=folded)


@dataclass(frozen=True)
class Candidate:
    """What one pass changes, symbolically: the nodes it removed and the kernels it inserted."""

    name: str
    sites: int
    removed: tuple[OpCount, ...]
    inserted: tuple[OpCount, ...]

    def totals(self) -> dict[str, sympy.Expr]:
        def tot(counts: Sequence[OpCount], field: str) -> sympy.Expr:
            return sympy.expand(sum((getattr(c, field) for c in counts if c.kernel),
                                    sympy.Integer(0)))
        return {"flops_removed": tot(self.removed, "flops"),
                "flops_inserted": tot(self.inserted, "flops"),
                "bytes_removed": tot(self.removed, "bytes"),
                "bytes_inserted": tot(self.inserted, "bytes"),
                "kernels_removed": sympy.Integer(sum(c.kernel for c in self.removed)),
                "kernels_inserted": sympy.Integer(sum(c.kernel for c in self.inserted))}


@dataclass(frozen=True)
class SymbolicPipeline:
    """Symbolic counts of every stage of the pass pipeline for one reference model."""

    model: str
    family: Family
    batched: bool  # fitted at batch >= 2 (else at batch 1)
    hidden: int
    stages: tuple[Stage, ...]  # captured, then one per pass
    folded_before: tuple[bool, ...]  # per pass: fold_constants comes later

    def values(self, **shape: Any) -> dict[sympy.Symbol, int]:
        """Symbol values of the workload at ``shape`` (builder keywords)."""
        values = workload_values(self.model, **shape)
        if (values[B] > 1) != self.batched:
            raise ValueError(f"batch {values[B]}: this pipeline was fitted at batch "
                             f"{'>= 2' if self.batched else '1'} (symbolic_pipeline(batch=...))")
        return values

    def predictions(self, cost: CostModel,
                    values: Mapping[sympy.Symbol, int]) -> list[PassPrediction]:
        """Each pass's predicted saving at ``values`` (every earlier pass applied)."""
        values = {**values, D: self.hidden}
        out = []
        for i, stage in enumerate(self.stages[1:]):
            folded = self.folded_before[i]
            before = self._predict(cost, self.stages[i], values, folded)
            after = self._predict(cost, stage, values, folded)
            out.append(cost.judge(stage.name, before, after, stage.sites))
        return out

    @staticmethod
    def _predict(cost: CostModel, stage: Stage, values: Mapping, folded: bool) -> Prediction:
        return cost.predict([c.at(values) for c in stage.counts(folded=folded)])

    def candidates(self) -> list[Candidate]:
        """Per pass: the nodes it removed and those it inserted, with symbolic counts."""
        out = []
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            b = {c.node: c for c in before.counts()}
            a = {c.node: c for c in after.counts()}
            same = {k for k in b.keys() & a.keys() if b[k].op == a[k].op}
            out.append(Candidate(after.name, after.sites,
                                 tuple(c for k, c in b.items() if k not in same),
                                 tuple(c for k, c in a.items() if k not in same)))
        return out

    def check(self, graphs: Sequence[fx.GraphModule],
              values: Mapping[sympy.Symbol, int]) -> list[str]:
        """Mismatches between the symbolic counts at ``values`` and the concrete counts of
        ``graphs`` (each stage captured and rewritten at that workload); empty when they agree."""
        values = {**values, D: self.hidden}
        problems = []
        for stage, gm in zip(self.stages, graphs, strict=True):
            want = {c.node: c for c in count_graph(gm)}
            got = {c.node: c.at(values) for c in stage.counts()}
            for name in sorted(want.keys() | got.keys()):
                w, g = want.get(name), got.get(name)
                if w is None or g is None:
                    problems.append(f"{stage.name}: node {name} only in one graph")
                elif (w.flops, w.bytes, w.kernel) != (g.flops, g.bytes, g.kernel):
                    problems.append(f"{stage.name}: {name} ({w.op}) flops {g.flops} vs "
                                    f"{w.flops}, bytes {g.bytes} vs {w.bytes}")
        return problems


def pipeline_stages(gm: fx.GraphModule,
                    config: PassConfig) -> list[tuple[str, int, fx.GraphModule]]:
    """(name, sites, graph) as captured and after each pass, without verification."""
    out = [("captured", 0, gm)]
    for p in build_passes(config):
        gm = copy_graph_module(gm)
        result = p.run(gm)
        out.append((p.name, result.matched, gm))
    return out


def capture_stages(model: str, config: PassConfig, *, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, keep_weights: bool = True,
                   **shape: Any) -> tuple[dict[sympy.Symbol, int], list[tuple[str, int,
                                                                               fx.GraphModule]]]:
    """Symbol values and pipeline stages of ``model`` built at ``shape``. Without
    ``keep_weights`` the graphs' tensors are moved to meta once the passes ran: counting needs
    the nodes' metadata only, and a probe of a 20B model need not hold its weights."""
    w = build(model, device=device, dtype=dtype, **shape)
    cap = capture_module(w.model, w.args, w.kwargs)
    values = family(model, shape).values(w)
    stages = pipeline_stages(cap.gm, config)
    if not keep_weights:
        for _, _, gm in stages:
            gm.to("meta")
        w.model.to("meta")
    return values, stages


def symbolic_pipeline(model: str, config: PassConfig = PassConfig(), *, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, check: bool = True,
                      mode: str | None = None, batch: int = 1) -> SymbolicPipeline:
    """Probe ``model`` at its family's probe shapes and fit symbolic counts of every pipeline
    stage, for workloads at ``batch`` 1 or (any value >= 2) batch >= 2; with ``check``, verify
    them at the third probe (raises :class:`SymbolicFitError` listing what disagrees).

    Probe on the device (and dtype) the workload runs on: the graph depends on it (attention
    kernels return other strides on CUDA, the CPU and meta, and export adds copies to match).
    """
    fam = family(model, {"mode": mode} if mode else None)
    batched = batch > 1
    shapes = fam.probe_shapes(batched)
    probes = [capture_stages(model, config, device=device, dtype=dtype, keep_weights=False, **p)
              for p in shapes[:2]]
    at = [v for v, _ in probes]
    hidden = int(at[0][D])
    if [[(n, s) for n, s, _ in st] for _, st in probes[1:]] != \
            [[(n, s) for n, s, _ in probes[0][1]]] * (len(probes) - 1):
        raise SymbolicFitError("the passes rewrote a different number of sites at the probes: "
                               f"{[[(n, s) for n, s, _ in st] for _, st in probes]}")
    candidates = fam.monomials(batched)
    stages = []
    for k, (name, sites, gm) in enumerate(probes[0][1]):
        fitted = fit_shapes([st[k][2] for _, st in probes], at, candidates, hidden)
        stages.append(Stage(name, sites, gm, fitted))
    passes = build_passes(config)
    folded = tuple(any(isinstance(q, FoldConstants) for q in passes[i + 1:])
                   for i in range(len(passes)))
    pipe = SymbolicPipeline(model, fam, batched, hidden, tuple(stages), folded)
    if check:
        values, graphs = capture_stages(model, config, device=device, dtype=dtype,
                                        keep_weights=False, **shapes[2])
        problems = pipe.check([g for _, _, g in graphs], values)
        if problems:
            raise SymbolicFitError(f"{len(problems)} counts disagree at the check probe "
                                   f"{shapes[2]}: " + "; ".join(problems[:5]))
    return pipe
