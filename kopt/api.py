"""``kopt.optimize``: capture -> passes (each verified) -> an :class:`OptimizedModule`."""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from kopt.capture import (
    Captured,
    capture_module,
    describe_signature_difference,
    flatten_inputs,
    input_signature,
)
from kopt.cudagraphs import (
    CudaGraphRunner,
    NotCapturable,
    memory_pool,
    not_capturable,
    pool_bytes,
    replay_region,
)
from kopt.errors import KoptError
from kopt.graph import attr, module_path, structural_key
from kopt.graph.regions import CachedRegion, cached_regions
from kopt.memory import MemoryHeld, memory_held, tensors_read
from kopt.offload import HostCopies, bring_back, releasing
from kopt.passes import PassConfig, PassManager, PassResult
from kopt.passes.fold import LoadProgram
from kopt.passes.pipeline import format_pass_line
from kopt.runtime import ExecutionPlan, build_plan
from kopt.verify import VerifyOptions
from kopt.warm import WarmStart, captured_ops

if TYPE_CHECKING:
    from kopt.cost import CostModel, Ranking

log = logging.getLogger("kopt")

# Distinct input signatures one OptimizedModule specialises for before it stops re-optimizing.
MAX_SPECIALIZATIONS = 8
# Sites listed per pass in a report unless verbose.
DETAIL_LINES = 8

CudaGraphs = bool | Literal["auto"]


@dataclass
class Report:
    """What kopt did to one captured graph: per pass results and verification verdicts."""

    model: str
    capture: str
    capture_seconds: float
    nodes_captured: int
    passes: list[PassResult] = field(default_factory=list)
    pipeline_uuid: str = ""
    ranking: Ranking | None = None  # when optimized with a cost model
    # how the optimized module runs this graph (execution plan, CUDA graphs), kept current
    runtime: list[str] = field(default_factory=list)
    repeated: str = ""  # repeated blocks traced once (kopt.repeated), for the capture line
    warm: str = ""  # how the graph was restored from the knowledge base (kopt.warm), if it was
    verified_on: str = ""  # where the passes were checked, where not on the captured graph
    inner: str = ""  # how the backend's inner compiler took the graph (kopt.regional)

    @property
    def verified(self) -> bool:
        return all(r.verdict is None or r.verdict.passed for r in self.passes)

    @property
    def applied(self) -> int:
        return sum(r.matched for r in self.passes)

    def result(self, name: str) -> PassResult:
        for r in self.passes:
            if r.name == name:
                return r
        raise KeyError(f"no pass named {name!r} ran; passes: {[r.name for r in self.passes]}")

    def explain(self, node: str, graph: fx.GraphModule | None = None) -> str:
        """Why ``node`` was or was not rewritten by each pass.

        ``node`` is a node name of the captured graph (see ``--dump``) or a module path such as
        ``transformer_blocks.0.attn.to_q``; a module path explains every node it produced.
        """
        names = {node}
        if graph is not None:
            names |= nodes_of_module(graph, node)
        lines = [f"explain {node}" + (f" (nodes {', '.join(sorted(names - {node}))})"
                                      if len(names) > 1 else "") + ":"]
        for r in self.passes:
            said = False
            for i, s in enumerate(r.sites):
                covered = set(r.site_nodes[i]) if i < len(r.site_nodes) else {s}
                if names & (covered | {s}):
                    detail = f" ({r.details[i]})" if i < len(r.details) else ""
                    lines.append(f"  {r.name}: rewritten in site {s}{detail}")
                    said = True
            for s in r.reverted:
                if s in names:
                    lines.append(f"  {r.name}: rewritten at {s}, reverted: failed verification")
                    said = True
            for rej in r.rejections:
                if rej.node in names:
                    kind = "no match" if rej.near_miss else "rejected"
                    lines.append(f"  {r.name}: {kind} at {rej.node} by {rej.rewrite}: "
                                 f"{rej.reason}")
                    said = True
            if not said:
                lines.append(f"  {r.name}: no rewrite of this pass looks at this node")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def format(self, verbose: bool = False) -> str:
        out = [f"kopt report: {self.model}",
               f"capture: {self.capture}, {self.nodes_captured} nodes, "
               f"{self.capture_seconds:.2f} s" + (f" ({self.repeated})" if self.repeated else "")]
        if self.warm:
            out.append(self.warm)
        for r in self.passes:
            out.append("  " + format_pass_line(r))
            shown = r.details if verbose else r.details[:DETAIL_LINES]
            for d in shown:
                out.append(f"      {d}")
            if len(r.details) > len(shown):
                out.append(f"      ... {len(r.details) - len(shown)} more sites (--verbose)")
            for reason, n in sorted(r.rejected.items(), key=lambda kv: -kv[1]):
                out.append(f"      rejected x{n}: {reason}")
            for s in r.reverted:
                out.append(f"      reverted {s}: failed verification")
            for note in r.notes:
                out.append(f"      {note}")
        if not any(r.verdict is not None for r in self.passes):
            status = "off (nothing was checked)" if self.applied else "not needed"
        else:
            status = "passed" if self.verified else "FAILED (failing rewrites were reverted)"
        checks = sum(r.check_seconds for r in self.passes)
        took = (f" ({checks:.1f} s of checks, {sum(r.seconds for r in self.passes):.1f} s of "
                f"rewriting)" if checks else "")
        out.append(f"summary: {len(self.passes)} passes, {self.applied} rewrites applied, "
                   f"{sum(len(r.reverted) for r in self.passes)} reverted; verification "
                   f"{status}{took}")
        if self.verified_on:
            out.append(f"verification: {self.verified_on}")
        if self.inner:
            out.append(f"inner compiler: {self.inner}")
        out += self.runtime
        return "\n".join(out)


def nodes_of_module(gm: fx.GraphModule, path: str) -> set[str]:
    """Names of the nodes traced directly in the module at ``path`` (export's module stack)."""
    return {n.name for n in gm.graph.nodes if module_path(n) == path}


class _Specialization:
    """One captured + optimized graph for one input signature."""

    def __init__(self, captured: Captured, gm: fx.GraphModule, report: Report) -> None:
        self.captured = captured
        self.gm = gm
        self.report = report
        self.programs: list[LoadProgram] = list(gm.meta.get("kopt_load_programs", []))
        self.sources = [
            (attr(p.graph_module, s), p) for p in self.programs for s in p.sources
        ]
        self.source_names = [s for p in self.programs for s in p.sources]
        self.versions = [t._version for t, _ in self.sources]
        self.plan: ExecutionPlan | None = None
        self.runner: CudaGraphRunner | None = None
        self.graphs_off: str | None = None  # why this graph runs without CUDA graphs
        self.pool_mib: float | None = None  # what the module's CUDA-graph pool holds
        self.said_strides = False
        # the graph's outputs on seed 0's random inputs, where a check ran it (the plan's check
        # then runs the plan alone); dropped once the plan is built
        self.outputs: list[Any] | None = None

    def runtime_lines(self, cuda_graphs: CudaGraphs) -> list[str]:
        """The report's lines on how this graph runs."""
        lines = []
        if self.plan is not None:
            lines.append(self.plan.describe())
        if self.runner is not None and self.runner.graph is not None:
            lines.append("CUDA graphs: replayed from one graph"
                         + (" (hoisted regions outside it)" if self.runner.hoisted_outside
                            else "")
                         + (f"; the memory pool its graphs share holds {self.pool_mib:.1f} MiB"
                            if self.pool_mib is not None else ""))
        elif self.graphs_off is not None:
            lines.append(f"CUDA graphs: off ({self.graphs_off})")
        elif cuda_graphs is False:
            lines.append("CUDA graphs: off (cuda_graphs=False)")
        elif self.captured.example_inputs and any(
                isinstance(a, torch.Tensor) and a.is_cuda for a in self.captured.example_inputs):
            lines.append(f"CUDA graphs: {'on' if cuda_graphs is True else 'auto'} (captured "
                         "at the third call)")
        else:
            lines.append("CUDA graphs: off (the inputs are not on a CUDA device)")
        return lines

    def stale(self) -> bool:
        """Whether a parameter a load program reads was changed in place since packing."""
        return any(t._version != v for (t, _), v in zip(self.sources, self.versions,
                                                         strict=True))

    def refresh_if_stale(self) -> None:
        """Re-run the load programs whose parameters were changed in place since packing."""
        # a program may read the constants of one before it (folded after it), which a re-pack
        # writes in place: that one is then stale in turn
        for _ in range(len(self.programs)):
            stale: dict[int, tuple[LoadProgram, list[str]]] = {}
            for (t, p), v, name in zip(self.sources, self.versions, self.source_names,
                                       strict=True):
                if t._version != v:
                    stale.setdefault(id(p), (p, []))[1].append(name)
            if not stale:
                return
            self.versions = [t._version for t, _ in self.sources]
            for program, changed in stale.values():
                log.info("kopt: %s changed in place; re-packing %d constants",
                         ", ".join(changed), len(program.targets))
                for name, value in zip(program.targets, program.run(), strict=True):
                    write_constant(getattr(self.gm, name), value, name)


def write_constant(dst: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Write a re-packed constant into ``dst`` in place (a CUDA graph reads its address).

    A broadcast constant (a stride-0 view, e.g. an ``expand`` folded at load time) holds one
    element per memory location: the new value is written through that storage, which needs
    it to be constant along the broadcast dimensions too; otherwise the packed graph cannot
    hold it and this raises instead of keeping a stale constant."""
    if dst.shape != value.shape:
        raise KoptError(f"kopt: re-packed constant {name} has shape {tuple(value.shape)}, "
                        f"the graph holds {tuple(dst.shape)}; re-optimize the model")
    if (dst.data_ptr(), dst.shape, dst.stride()) == (value.data_ptr(), value.shape,
                                                     value.stride()):
        return  # a constant that views its parameter: writing it would only bump a version
    broadcast = [d for d in range(dst.dim()) if dst.stride(d) == 0 and dst.shape[d] > 1]
    if not broadcast:
        dst.copy_(value)
        return
    first = value
    for d in broadcast:
        first = first.narrow(d, 0, 1)
    if not torch.equal(first.expand_as(value), value):
        raise KoptError(f"kopt: re-packed constant {name} now varies along dims {broadcast}, "
                        "which the graph holds broadcast; re-optimize the model")
    dst.as_strided(first.shape, dst.stride()).copy_(first)


def graphs_allowed(spec: _Specialization, body: Any, flat: Sequence[Any],
                   cuda_graphs: CudaGraphs) -> bool:
    """Whether this call of ``spec`` (running ``body``, the graph a runner would capture) runs
    from a CUDA graph: on unless ``cuda_graphs`` is False, the inputs are not on a GPU, the
    caller captures this call itself, or (``"auto"``) the graph cannot be captured, which is
    recorded in ``spec.graphs_off`` for the report."""
    if cuda_graphs is False or spec.graphs_off is not None:
        return False
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in flat):
        return False
    if torch.cuda.is_current_stream_capturing():  # the caller captures this call itself
        return False
    if spec.runner is None and cuda_graphs == "auto":
        reason = not_capturable(spec.gm if not isinstance(body, fx.GraphModule) else body)
        if reason is not None:
            spec.graphs_off = reason
            log.info("kopt: CUDA graphs off for this input signature: %s", reason)
            return False
    return True


def run_from_graph(spec: _Specialization, body: Any, flat: Sequence[Any], forced: bool,
                   pool: Any) -> tuple[Any, bool]:
    """``(outputs, whether this call captured the graph)``: ``body(*flat)`` through
    ``spec``'s :class:`CudaGraphRunner` (made on the first call, in memory pool ``pool``).
    A capture that fails turns graphs off for ``spec`` and runs ``body`` as it is, unless
    ``forced`` (``cuda_graphs=True``), where the error propagates."""
    if spec.runner is None:
        spec.runner = CudaGraphRunner(body, pool=pool)
    runner = spec.runner
    if runner.graph is not None or runner.calls < runner.warmup:
        return runner(*flat), False
    try:
        return runner(*flat), True
    except (NotCapturable, RuntimeError) as e:
        if forced:
            raise
        torch.cuda.synchronize()
        spec.graphs_off = f"the capture failed: {type(e).__name__}: " \
                          f"{str(e).splitlines()[0][:160]}"
        log.warning("kopt: %s; running without CUDA graphs", spec.graphs_off)
        spec.runner = None
        return body(*flat), False


class OptimizedModule:
    """The optimized model: call it like the original.

    Specialised on its inputs' shapes, dtypes and Python values (like ``torch.export``); a call
    with other inputs is captured and optimized anew, up to :data:`MAX_SPECIALIZATIONS`, then
    runs the original model with a warning. Attributes it does not define are the original
    model's (``.config``, ``.dtype``, ...).
    """

    def __init__(self, model: torch.nn.Module, first: _Specialization, config: PassConfig,
                 verify: VerifyOptions, dump_dir: Path | None, cuda_graphs: CudaGraphs = "auto",
                 execution_plan: bool = True, keep_original: bool = False,
                 host: HostCopies | None = None) -> None:
        self.original = model
        self.keep_original = keep_original
        # the weights moved to host memory (``host``: those the optimization released already)
        self._host = host if host is not None else HostCopies()
        self._hooks: list[Any] = []  # forward pre-hooks on the original model
        self.config = config
        self._verify = verify
        self._dump_dir = dump_dir
        self._specs: dict[tuple, _Specialization] = {}
        self._first_key = _key(first.captured.example_inputs, first.captured.in_spec)
        self._specs[self._first_key] = first
        self._warned = False
        self._watched = _watch_identity(model, first.gm)
        self.cuda_graphs: CudaGraphs = _check_cuda_graphs(cuda_graphs)
        self.execution_plan = execution_plan
        self._cost: CostModel | None = None  # ranks and gates the passes of new signatures too
        self._regions: dict[tuple, CachedRegion] = {}
        self._constants: dict[str, torch.Tensor] = {}
        self._pool: Any = None  # the CUDA graph memory pool every specialisation captures into
        self._adopt(first)
        self._move_superseded()
        self._host.drop_ahead()
        # weights moved to host memory come back if this module goes before the model does
        self._finalizer = weakref.finalize(self, self._host.restore)
        self._finalizer.atexit = False

    @property
    def report(self) -> Report:
        """The report of the first (example-input) specialisation."""
        return self._specs[self._first_key].report

    @property
    def reports(self) -> list[Report]:
        return [s.report for s in self._specs.values()]

    @property
    def graph_modules(self) -> list[fx.GraphModule]:
        """The optimized graph of every input signature seen so far."""
        return [s.gm for s in self._specs.values()]

    @property
    def captured_graph(self) -> fx.GraphModule:
        """The graph as captured, before any pass (node names in reports refer to it)."""
        return self._specs[self._first_key].captured.gm

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._specs[self._first_key].gm

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("original",):
            raise AttributeError(name)
        return getattr(self.original, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = flatten_inputs(args, kwargs)
        if self._replaced_parameters():
            log.warning("kopt: a parameter object of the model was replaced; re-optimizing")
            self._specs.clear()
            self._regions.clear()
            self._constants.clear()
        key = _key(flat, spec)
        spec_entry = self._specs.get(key)
        if spec_entry is None:
            if len(self._specs) >= MAX_SPECIALIZATIONS:
                if not self._warned:
                    first = self._specs[self._first_key].captured
                    why = describe_signature_difference(
                        input_signature(first.example_inputs), input_signature(flat))
                    warnings.warn(f"kopt: {MAX_SPECIALIZATIONS} input signatures already "
                                  f"optimized; running the original model ({why})",
                                  stacklevel=2)
                    self._warned = True
                with self._host.on_device():
                    return self.original(*args, **kwargs)
            log.info("kopt: new input signature; capturing and optimizing again")
            with self._host.on_device():
                spec_entry = _specialize(self.original, args, kwargs, self.config,
                                         self._verify, self._dump_dir, cost=self._cost,
                                         cuda_graphs=_will_replay(self.cuda_graphs, flat))
                self._specs[key] = spec_entry
                self._adopt(spec_entry)
                if len(self._specs) == 1:
                    self._first_key = key
                    self._watched = _watch_identity(self.original, spec_entry.gm)
                self._move_superseded()
        if spec_entry.stale():
            with self._host.on_device():  # the load programs read the moved weights
                spec_entry.refresh_if_stale()
        with torch.no_grad():
            out = self._run(spec_entry, flat)
        return spec_entry.captured.unflatten_outputs(out)

    def _run(self, spec: _Specialization, flat: list[Any]) -> Any:
        """One call of ``spec``'s graph: its execution plan where the inputs have the plan's
        strides (else the optimized graph as verified), from a CUDA graph where
        :attr:`cuda_graphs` and the graph allow."""
        plan = spec.plan
        planned = plan is not None and plan.matches(flat)
        if plan is not None and plan.off is None and not planned and not spec.said_strides:
            log.info("kopt: inputs with other strides than the execution plan's; running the "
                     "optimized graph")
            spec.said_strides = True
        gm = plan.gm if planned else spec.gm
        if spec.runner is not None and not (plan is None or plan.off is not None or planned):
            return gm(*flat)  # the graph was captured from the plan; these strides are not it
        off = spec.graphs_off
        if not graphs_allowed(spec, gm, flat, self.cuda_graphs):
            if spec.graphs_off != off:
                self._refresh_report(spec)
            return gm(*flat)
        if self._pool is None:
            self._pool = memory_pool()
        out, captured = run_from_graph(spec, gm, flat, self.cuda_graphs is True, self._pool.id)
        if captured:
            held = pool_bytes(self._pool.id)
            for other in self._specs.values():  # one pool: every report gives what it holds
                other.pool_mib = None if held is None else held / 2**20
                self._refresh_report(other)
        elif spec.graphs_off is not None:
            self._refresh_report(spec)
        return out

    def _adopt(self, spec: _Specialization) -> None:
        """Share ``spec``'s constants and regions with the others, and build its plan."""
        self._share(spec)
        example = spec.captured.example_inputs
        real = all(not isinstance(t, torch.Tensor) or (t.device.type != "meta" and not
                                                       isinstance(t, FakeTensor))
                   for t in example)
        if self.execution_plan and real:
            spec.plan = build_plan(spec.gm, example, outputs=spec.outputs)
        spec.outputs = None
        self._refresh_report(spec)

    @contextmanager
    def original_weights(self) -> Iterator[torch.nn.Module]:
        """The original model with all its weights on their device, for the block's duration
        (to run it, or to change weights in place: what changed is re-packed when the block
        ends). Outside it, the weights the optimized graphs no longer read (the BF16 weights
        FP8 replaced) are in host memory unless ``keep_original=True``."""
        with self._host.on_device():
            try:
                yield self.original
            finally:
                for spec in self._specs.values():
                    spec.refresh_if_stale()

    def restore_original(self) -> torch.nn.Module:
        """Put every weight moved to host memory back on its device for good (this module
        keeps working, and moves nothing from now on); returns the original model."""
        self._host.restore()
        self.keep_original = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for spec in self._specs.values():
            self._refresh_report(spec)
        return self.original

    def _watch_original_calls(self) -> None:
        """A forward pre-hook on the original model and on every module owning a moved weight:
        calling them brings the weights back for good, so the original model keeps working
        (at the memory it held), and says so once."""
        if self._hooks or not self._host.moved:
            return
        moved = {k for k in self._host._moved}
        owners = [m for m in self.original.modules() if any(
            t.untyped_storage()._cdata in moved
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
        host, me = self._host, weakref.ref(self)  # the model must not keep this module alive

        def called(module: torch.nn.Module, args: Any) -> None:
            if host.moved:
                warnings.warn(f"kopt: {type(module).__name__} was called with weights kopt had "
                              f"moved to host memory ({host.nbytes / 2**30:.2f} GiB); they are "
                              "back on the device for good (kopt.optimize(..., "
                              "keep_original=True) keeps them there)", stacklevel=2)
                opt = me()
                opt.restore_original() if opt is not None else host.restore()

        self._hooks = [m.register_forward_pre_hook(called) for m in {id(m): m for m in
                                                                        (self.original, *owners)
                                                                        }.values()]

    def _move_superseded(self) -> None:
        """Move to host memory the model's weights that no optimized graph reads and that a
        load program packed (``kopt.passes.fold``): the BF16 weights FP8 replaced. A storage
        a graph still reads (a tied weight, a packed buffer the parameters view) stays."""
        if self.keep_original or self._host.done:
            return
        read = {t.untyped_storage()._cdata for t in tensors_read(self._graphs())}
        owned = {t.untyped_storage()._cdata for t in (*self.original.parameters(),
                                                      *self.original.buffers())}
        # a new signature's graph that reads a weight an earlier one superseded (a rewrite
        # reverted there, another config) keeps it on the device
        self._host.give_back(read & self._host.keys)
        superseded = [t for spec in self._specs.values() for t, _ in spec.sources
                      if t.untyped_storage()._cdata in owned - read]
        if self._host.move(superseded):
            for spec in self._specs.values():
                self._refresh_report(spec)
        self._watch_original_calls()

    def _graphs(self) -> list[fx.GraphModule]:
        graphs = [s.gm for s in self._specs.values()]
        return graphs + [s.plan.gm for s in self._specs.values() if s.plan is not None]

    def _refresh_report(self, spec: _Specialization) -> None:
        spec.report.runtime[:] = [*spec.runtime_lines(self.cuda_graphs),
                                  self.memory().describe()]

    def memory(self) -> MemoryHeld:
        """What this module holds now, by kind (:mod:`kopt.memory`): the model's weights its
        graphs read, packed constants, hoisted caches, the CUDA-graph pool, and the model's
        weights only the original model reads."""
        pool = pool_bytes(self._pool.id) if self._pool is not None else None
        return memory_held(self.original, self._graphs(), pool, host=self._host.nbytes)

    def clear_caches(self) -> None:
        """Empty every hoisted region's cache (a new denoising loop: entries of the last run
        would otherwise serve equal timesteps, which is right but counted as hits)."""
        for region in self._all_regions():
            region.clear()
            cut = replay_region(region)
            if cut is not None:
                cut.clear()

    def _all_regions(self) -> list[CachedRegion]:
        seen: dict[int, CachedRegion] = {}
        for spec in self._specs.values():
            for mod in cached_regions(spec.gm):
                seen[id(mod)] = mod
        return list(seen.values())

    def _share(self, spec: _Specialization) -> None:
        """Specialisations share what they compute alike: packed constants (one copy of the
        merged weights, not one per input signature) and hoisted regions (the two calls of a
        CFG pair often differ in text length, another signature, but share the timestep work).
        """
        gm = spec.gm
        graphs = _graph_modules(gm)
        for program in spec.programs:
            out = next(n for n in program.graph_module.graph.nodes if n.op == "output")
            for target, root in zip(program.targets, out.args[0], strict=True):
                key = structural_key(program.graph_module, [root])
                existing = self._constants.setdefault(key, getattr(gm, target))
                for holder in graphs:
                    if target in holder._buffers:
                        setattr(holder, target, existing)
        for mod in cached_regions(gm):
            mod.bind_params()
        for name, mod in list(gm.named_children()):
            if isinstance(mod, CachedRegion) and mod.shareable:
                existing = self._regions.setdefault(mod.share_key(), mod)
                if existing is not mod:
                    setattr(gm, name, existing)

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        """(hits, misses) of each hoisted region, by its key inputs."""
        out: dict[str, tuple[int, int]] = {}
        for m in self._all_regions():  # and the form a CUDA-graph runner calls, where it has one
            r = replay_region(m)
            name = "{" + ", ".join(m.key_names) + "}"
            hits, misses = out.get(name, (0, 0))
            out[name] = (hits + m.hits + (r.hits if r else 0),
                         misses + m.misses + (r.misses if r else 0))
        return out

    def _replaced_parameters(self) -> bool:
        return any(owner.get(name) is not t for owner, name, t in self._watched)


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The graph module and its submodule graphs (hoisted regions): where a packed constant
    is held. Listed once per module, not per constant: ``gm`` also holds the model's module
    tree for the weights it reads (W1: 1753 modules, 1445 constants)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _key(flat: Sequence[Any], spec: Any) -> tuple:
    return (str(spec), input_signature(list(flat)))


def _watch_identity(model: torch.nn.Module, gm: fx.GraphModule) -> list[tuple[dict, str, Any]]:
    """(owner dict, name, tensor) for every model parameter/buffer the optimized graph uses,
    directly or through a load program: replacing one of them invalidates the graph."""
    captured_ids = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for program in gm.meta.get("kopt_load_programs", []):
        captured_ids |= {id(attr(program.graph_module, s)) for s in program.sources}
    out = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None and id(t) in captured_ids:
                    out.append((store, name, t))
    return out


def _specialize(model: torch.nn.Module, args: tuple, kwargs: dict | None, config: PassConfig,
                verify: VerifyOptions, dump_dir: Path | None,
                name: str | None = None, cost: CostModel | None = None,
                cuda_graphs: bool = False) -> _Specialization:
    t0 = time.perf_counter()
    log.info("kopt: capturing %s", name or type(model).__name__)
    captured = capture_module(model, args, kwargs)
    capture_s = time.perf_counter() - t0
    return optimize_captured(captured, config, verify, dump_dir, name or type(model).__name__,
                             capture_s, cost=cost, cuda_graphs=cuda_graphs)


def optimize_captured(captured: Captured, config: PassConfig, verify: VerifyOptions,
                      dump_dir: Path | None, name: str, capture_seconds: float,
                      cost: CostModel | None = None,
                      cuda_graphs: bool = False) -> _Specialization:
    """``cost``: ranks the passes and skips those predicted to lose (``kopt.cost``);
    ``cuda_graphs``: the module will replay from CUDA graphs (dead ends recorded only for
    that mode apply).

    Inside a knowledge base's scope (:func:`kopt.kb.using`; the ``kopt`` command's default),
    an optimization that scope recorded before is restored instead of run (:mod:`kopt.warm`),
    and a cold one is recorded for the next process. Not with ``cost``, whose ranking is
    measured afresh, nor with ``dump_dir``, whose files are written by the passes."""
    manager = PassManager(config, verify, dump_dir, cost=cost, cuda_graphs=cuda_graphs)
    repeated = captured.repeated.describe() if captured.repeated else ""
    warm = WarmStart.lookup(captured, manager, verify, cuda_graphs) if (
        cost is None and dump_dir is None) else None
    hit = warm.restore(captured, verify) if warm is not None else None
    if hit is not None:
        gm, results, uuid, line, outputs, nodes = hit
        spec = _Specialization(captured, gm, Report(
            name, captured.source, capture_seconds,
            captured_ops(captured.gm) if nodes is None else nodes, results, uuid,
            repeated=repeated, warm=line))
        spec.outputs = outputs
        return spec
    # before the whole graph is made: the cut is made from the same traces
    shallow = captured.shallow(verify.blocks) if (
        verify.enabled and verify.blocks is not None and cost is None) else None
    nodes = captured_ops(captured.gm)
    repeated = captured.repeated.describe() if captured.repeated else ""  # as made
    log.info("kopt: captured %d nodes in %.2f s; running %d passes", nodes, capture_seconds,
             len(manager.passes))
    gm, results = manager.run(captured.gm, captured.example_inputs,
                              workload=warm.workload if warm is not None else None,
                              shallow=shallow)
    uuid = manager.uuid()
    if warm is not None:
        warm.record(captured, gm, results, verify, uuid, outputs=manager.end_to_end)
    report = Report(name, captured.source, capture_seconds, nodes, results, uuid,
                    manager.ranking, repeated=repeated, verified_on=manager.verified_on)
    spec = _Specialization(captured, gm, report)
    if manager.end_to_end is not None:
        spec.outputs = manager.end_to_end[0]
    return spec


def optimize(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    config: PassConfig = PassConfig(),
    *,
    verify: VerifyOptions | bool = VerifyOptions(),
    dump_dir: str | Path | None = None,
    cuda_graphs: CudaGraphs = "auto",
    cost: CostModel | None = None,
    execution_plan: bool = True,
    keep_original: bool = False,
) -> OptimizedModule:
    """Optimize ``model`` for inputs like ``(args, kwargs)``.

    Every rewrite is verified on fresh random inputs at its declared numerics tier; a failing
    one is reverted and the report says so. Raises :class:`kopt.errors.CaptureError` if the
    model cannot be captured (the model is left as it was). ``cost``: a
    ``kopt.cost.CostModel``; the passes are then ranked by predicted time saved
    (``report.ranking``) and a pass predicted to lose on this workload is not applied.

    ``verify``: a :class:`kopt.verify.VerifyOptions` (seeds, fp64 runs), or a bool for the
    default seeds or none.

    ``cuda_graphs``: ``"auto"`` replays each input signature's forward from a CUDA graph when
    its inputs are on a CUDA device and the graph can be captured (no host sync, no host tensor
    copied in; a capture that fails falls back), else runs it eagerly; the report says which
    and why. ``True`` forces the graphs (a failed capture raises), ``False`` turns them off.
    ``execution_plan``: run the graph in its cheapest form for the host (:mod:`kopt.runtime`:
    fused ops launched directly, views folded), bitwise the optimized graph; ``False`` runs the
    optimized graph through the dispatcher, as verified.
    ``keep_original``: keep on the GPU the model's weights the optimized graphs no longer read
    (the BF16 weights FP8 packed at load time). By default they move to host memory once the
    optimization is done: the original model and its parameters stay as they are, and
    :meth:`OptimizedModule.original_weights` brings them back for what needs them.
    """
    if model.training:
        warnings.warn("kopt optimizes inference: the model is in training mode, so dropout and "
                      "batch-norm statistics are traced as in training; call model.eval() first",
                      stacklevel=2)
    cuda_graphs = _check_cuda_graphs(cuda_graphs)
    verify = _check_verify(verify)
    if bring_back([*model.parameters(), *model.buffers()]):
        warnings.warn("kopt: this model's weights that an earlier kopt.optimize moved to host "
                      "memory are back on the device for good (keep_original=True keeps them "
                      "there from the start)", stacklevel=2)
    dump = Path(dump_dir) if dump_dir else None
    flat, _ = flatten_inputs(tuple(args), kwargs)
    # the BF16 weights FP8 packs leave for host memory as the optimization packs them
    host = None if keep_original else HostCopies()
    try:
        with releasing(host, [*model.parameters(), *model.buffers()],
                       ahead=config.fp8 is not None):
            first = _specialize(model, tuple(args), kwargs, config, verify, dump, cost=cost,
                                cuda_graphs=_will_replay(cuda_graphs, flat))
    except BaseException:
        if host is not None:
            host.restore()  # the model as it was
        raise
    opt = OptimizedModule(model, first, config, verify, dump, cuda_graphs, execution_plan,
                          keep_original, host)
    opt._cost = cost
    return opt


def _check_cuda_graphs(value: Any) -> CudaGraphs:
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"cuda_graphs must be 'auto', True or False, got {value!r}")


def _check_verify(value: Any) -> VerifyOptions:
    if isinstance(value, VerifyOptions):
        return value
    if value is True or value is False:
        return VerifyOptions(enabled=value)
    raise TypeError(f"verify must be a bool or a kopt.verify.VerifyOptions, got "
                    f"{type(value).__name__}")


def _will_replay(cuda_graphs: CudaGraphs, flat: Sequence[Any]) -> bool:
    """Whether calls with inputs like ``flat`` are meant to replay from CUDA graphs (the
    knowledge base's dead ends recorded for that mode then apply): forced on, or "auto" with
    inputs on CUDA."""
    return cuda_graphs is True or (cuda_graphs == "auto" and any(
        isinstance(a, torch.Tensor) and a.is_cuda for a in flat))
