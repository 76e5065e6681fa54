"""``torch.compile(model, backend="kopt", options={...})``.

Registered through the ``torch_dynamo_backends`` entry point, so no ``import kopt`` is needed.
Each graph dynamo hands over is lowered to kopt's IR (parameters become constants), run through
the pass pipeline with verification, then handed to the inner compiler: Inductor by default
(``inner="inductor"``) or run as is (``inner="eager"``).

Options (all optional):

* ``inner``: ``"inductor"`` | ``"eager"``
* ``config``: a :class:`kopt.PassConfig`, or a dict of its fields
* ``verify``: a :class:`kopt.VerifyOptions`, or a bool
* ``reports``: a list that receives one :class:`kopt.Report` per compiled graph
* ``cuda_graphs``: ``"auto"`` (the default) | True | False, as in :func:`kopt.optimize`: each
  optimized graph whose inputs are on a GPU replays the inner compiler's code from a CUDA graph
  from its third call, where the graph can be captured (else it runs as compiled, and its
  report says why). The graphs of a process share one memory pool per device; outputs are
  copies, so a caller may keep them across calls.
* ``keep_original``: False (the default) moves to host memory, as :func:`kopt.optimize` does,
  the model's weights that no optimized graph reads any more (the BF16 weights FP8 packed at
  load time), each as soon as it is packed; True keeps them on the device.
* ``regional``: True (the default) has Inductor compile each kind of repeated block of the
  optimized graph once, its sites calling it (:mod:`kopt.regional`); False compiles the graph
  flat. A graph whose outlined form Inductor rejects is compiled flat, with the reason logged.

The moved weights stay the model's parameters, with their shapes, and come back bit for bit for
whatever needs them:

* a graph dynamo compiles later (a recompile, a graph break's other graph, another block's
  weights) gets them back while kopt captures and checks it, and keeps those it reads;
* a module owning one that runs outside the compiled graphs (the model called uncompiled, a
  frame dynamo gave up on) brings back every weight the backend moved, for good, with a
  warning; the backend then moves none for the rest of the process;
* :func:`original_weights` brings them back for a block, e.g. to change weights in place
  (``load_state_dict``); the graphs re-pack what changed at their next call.

Dynamo inlines the model's modules into one graph; the capture finds the repeated blocks in it
again (:func:`kopt.repeated.outline_dynamo_blocks`) and traces each kind once.

A graph kopt cannot take (dynamic shapes, an unsupported op) is logged with the reason and given
to the inner compiler unmodified, so compilation still succeeds. A graph dynamo reuses for several
modules (a repeated block's ``forward`` after a graph break inside it) is optimized once per
module's weights (:class:`PerWeights`).
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from kopt.api import (
    CudaGraphs,
    Report,
    _check_cuda_graphs,
    _Specialization,
    graphs_allowed,
    optimize_captured,
    run_from_graph,
)
from kopt.capture import capture_dynamo
from kopt.cudagraphs import memory_pool, pool_bytes
from kopt.errors import CaptureError, KoptError
from kopt.graph.splice import copy_graph_module
from kopt.memory import memory_held, tensors_read
from kopt.offload import HostCopies, holder, releasing
from kopt.passes import PassConfig
from kopt.regional import outline_blocks
from kopt.verify import VerifyOptions

log = logging.getLogger("kopt")

INNER = ("inductor", "eager")

# Fusions that Inductor's own fused kernel for the same subgraph does as well: under Inductor
# they are left to Inductor unless the caller's config names them. Pass name -> why.
# (Not fuse_act_quant: its stashed two-pass kernel takes 0.77x, 0.98x and 0.91x of Inductor's
# time on the W1, W2 and LLM image-token shapes; RESULTS.md, 2026-11-30, H200.)
LEFT_TO_INDUCTOR = {
    "fuse_act": "Inductor fuses the activation and the concatenation into its own kernels",
    # kopt's kernel is Inductor's form: 1.01x / 1.00x Inductor's time at W1 / W2's joint V
    # (RESULTS.md, 2026-12-01, H200), a tie, not a win; Inductor can also fuse the copy into
    # the ops around it
    "cat_rows": "Inductor's kernel for the same concatenation is as fast (1.00-1.01x)",
}


@dataclass
class BackendOptions:
    inner: str = "inductor"
    config: PassConfig = field(default_factory=PassConfig)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    reports: list[Report] | None = None
    cuda_graphs: CudaGraphs = "auto"
    keep_original: bool = False
    regional: bool = True

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        unknown = set(options) - {"inner", "config", "verify", "reports", "cuda_graphs",
                                  "keep_original", "regional"}
        if unknown:
            raise KoptError(f"unknown kopt backend option(s) {sorted(unknown)}; valid: inner, "
                            "config, verify, reports, cuda_graphs, keep_original, regional")
        out = cls()
        if "inner" in options:
            if options["inner"] not in INNER:
                raise KoptError(f"inner must be one of {INNER}, got {options['inner']!r}")
            out.inner = options["inner"]
        config = options.get("config")
        named = set(config) if isinstance(config, dict) else set()
        if isinstance(config, dict):
            try:
                out.config = PassConfig().replace(**config)
            except ValueError as exc:
                raise KoptError(f"kopt backend option 'config': {exc}") from exc
        elif config is not None:
            out.config = config
        verify = options.get("verify")
        if isinstance(verify, bool):
            out.verify = VerifyOptions(enabled=verify)
        elif verify is not None:
            out.verify = verify
        out.reports = options.get("reports")
        if "keep_original" in options:
            if not isinstance(options["keep_original"], bool):
                raise KoptError("kopt backend option 'keep_original' must be a bool, got "
                                f"{options['keep_original']!r}")
            out.keep_original = options["keep_original"]
        if "regional" in options:
            if not isinstance(options["regional"], bool):
                raise KoptError("kopt backend option 'regional' must be a bool, got "
                                f"{options['regional']!r}")
            out.regional = options["regional"]
        if "cuda_graphs" in options:
            try:
                out.cuda_graphs = _check_cuda_graphs(options["cuda_graphs"])
            except ValueError as exc:
                raise KoptError(f"kopt backend option 'cuda_graphs': {exc}") from exc
        if out.inner == "inductor" and not isinstance(config, PassConfig):
            # a PassConfig object is taken as given; defaults and dicts leave these to Inductor
            off = {name: False for name in LEFT_TO_INDUCTOR if name not in named}
            if off:
                log.info("kopt: under Inductor, left to Inductor: %s",
                         "; ".join(f"{n} ({LEFT_TO_INDUCTOR[n]})" for n in off))
                out.config = out.config.replace(**off)
        if out.inner == "inductor" and out.config.hoist:
            # Inductor would trace through the cached regions and drop the caching; their
            # state lives in kopt's runner, which only the eager inner compiler keeps.
            out.config = out.config.replace(hoist=False)
        return out


def kopt_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
    **_: Any,
) -> Callable[..., Any]:
    opts = BackendOptions.parse(options)
    name = f"dynamo graph ({len(gm.graph.nodes)} nodes)"
    first = _compile(gm, example_inputs, opts, name)
    if not isinstance(first, Runner) or not first.static:
        return first

    def build(inputs: list[Any]) -> Runner:
        # the same graph captured before, with other weights: cannot fail
        runner = _compile(gm, inputs, opts, f"{name}, other weights")
        assert isinstance(runner, Runner)
        return runner

    return PerWeights(first, [i for i, _ in first.static], example_inputs, build)


def _compile(gm: fx.GraphModule, inputs: list[Any], opts: BackendOptions,
             name: str) -> Callable[..., Any]:
    """One dynamo graph for the weights in ``inputs``: optimized by kopt (a :class:`Runner`),
    or left to the inner compiler with the reason logged. Weights the backend moved for other
    graphs are on the device while it is captured and checked; afterwards the weights this
    graph reads stay there, and those its packing superseded move to host memory."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    with _on_device(tensors):
        t0 = time.perf_counter()
        try:
            captured, runtime_idx = capture_dynamo(gm, inputs)
        except CaptureError as exc:
            log.warning("kopt: graph left unoptimized: %s", exc)
            compiled: Callable[..., Any] = inner_compile(opts.inner, gm, inputs)
            runner = None
        else:
            runner = optimize_dynamo_graph(captured, runtime_idx, inputs, opts, name,
                                           time.perf_counter() - t0)
            compiled = runner
    _keep_on_device(tensors if runner is None else tensors_read([runner.spec.gm]))
    if runner is not None:
        runner.move_superseded()
    return compiled


def optimize_dynamo_graph(captured: Any, runtime_idx: list[int], example_inputs: list[Any],
                          opts: BackendOptions, name: str,
                          capture_seconds: float = 0.0) -> Runner:
    """kopt's passes on a captured dynamo graph, then the inner compiler: the runner of one
    graph for the parameters in ``example_inputs``. Unless ``opts.keep_original``, each weight
    FP8 packs leaves for host memory as soon as it is packed (:mod:`kopt.offload`)."""
    runtime = set(runtime_idx)
    static_idx = [i for i in range(len(example_inputs)) if i not in runtime]
    host = None if opts.keep_original or _MOVED.restored else HostCopies()
    # a weight another graph moved stays that graph's to move (it is back for this block)
    owned = [example_inputs[i] for i in static_idx if isinstance(example_inputs[i], torch.Tensor)
             and holder(example_inputs[i]) is None]
    try:
        with releasing(host, owned, ahead=opts.config.fp8 is not None):
            spec = optimize_captured(captured, opts.config, opts.verify, None, name,
                                     capture_seconds)
    except BaseException:
        if host is not None:
            host.restore()  # the weights as they were
        raise
    if opts.reports is not None:
        opts.reports.append(spec.report)
    log.info("%s", spec.report)
    runtime_examples = [example_inputs[i] for i in runtime_idx]
    compiled = inner_compile(opts.inner, spec.gm, runtime_examples,
                             regional=opts.regional, report=spec.report)
    # run eagerly, the graph module itself is the body: its hoisted regions stay outside a
    # CUDA graph
    body = spec.gm if opts.inner == "eager" else compiled
    runner = Runner(body, spec, runtime_idx, static_idx, example_inputs, opts.cuda_graphs, host)
    runner.refresh_report()
    return runner


class _Moved:
    """What the backend moved to host memory in this process: the holder of each optimized
    graph, and the forward pre-hooks on the modules owning a moved weight."""

    def __init__(self) -> None:
        self.hosts: weakref.WeakSet[HostCopies] = weakref.WeakSet()
        self.hooks: weakref.WeakKeyDictionary[torch.nn.Module, Any] = \
            weakref.WeakKeyDictionary()
        self.restored = False  # a module ran with moved weights: the backend moves no more
        # id of a parameter or buffer -> (it, the modules owning it) at the last scan
        self.owners: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}

    def watch(self, tensors: Sequence[torch.Tensor]) -> None:
        """A forward pre-hook on each module owning one of ``tensors`` (not graph modules):
        dynamo does not guard on hooks added after it compiled (``skip_nnmodule_hook_guards``),
        so only calls outside the compiled graphs run it."""
        if not all(self._known(t) for t in tensors):
            self._scan(tensors)
        for t in tensors:
            for ref in self.owners[id(t)][1]:
                module = ref()
                if module is not None and module not in self.hooks:
                    self.hooks[module] = module.register_forward_pre_hook(_called)

    def _known(self, t: torch.Tensor) -> bool:
        entry = self.owners.get(id(t))
        return entry is not None and entry[0]() is t  # (an id may be reused once freed)

    def _scan(self, tensors: Sequence[torch.Tensor]) -> None:
        """The modules owning each parameter and buffer, by a scan of the objects the garbage
        collector tracks (a dynamo graph is given its weights, not their modules): once for a
        model's graphs, whose later graphs (other blocks' weights) find theirs in it."""
        owners: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {
            id(t): (weakref.ref(t), []) for t in tensors}  # owned by no module: found so
        for obj in gc.get_objects():
            # (type(): isinstance on a dead weakref proxy raises; graph modules are kopt's own
            # graphs and load programs, which run the moved weights only inside on_device())
            kind = type(obj)
            if issubclass(kind, torch.nn.Module) and not issubclass(kind, fx.GraphModule):
                for t in (*obj._parameters.values(), *obj._buffers.values()):
                    if t is not None:
                        owners.setdefault(id(t), (weakref.ref(t), []))[1].append(
                            weakref.ref(obj))
        self.owners = owners

    def restore(self) -> None:
        """Every weight the backend moved back on its device for good."""
        for host in list(self.hosts):
            host.restore()
        for hook in list(self.hooks.values()):
            hook.remove()
        self.hooks.clear()
        self.restored = True


_MOVED = _Moved()


def _called(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling() or not any(h.moved for h in list(_MOVED.hosts)):
        return
    nbytes = sum(h.nbytes for h in list(_MOVED.hosts))
    warnings.warn(f"kopt: {type(module).__name__} ran outside the compiled graphs with weights "
                  f"the kopt backend had moved to host memory ({nbytes / 2**30:.2f} GiB); "
                  "every weight it moved is back on the device for good (options="
                  "{'keep_original': True} keeps them there from the start)", stacklevel=2)
    _MOVED.restore()


def _holders(tensors: Sequence[torch.Tensor]) -> list[HostCopies]:
    found = (holder(t) for t in tensors)
    return list({id(h): h for h in found if h is not None}.values())


@contextmanager
def _on_device(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The moved storages of ``tensors`` (and the rest of their holders') back on the device
    for the block."""
    with ExitStack() as stack:
        for host in _holders(tensors):
            stack.enter_context(host.on_device())
        yield


def _keep_on_device(tensors: Sequence[torch.Tensor]) -> None:
    """Storages of ``tensors`` that a graph reads: back on the device, their holders forget
    them."""
    for t in tensors:
        if (host := holder(t)) is not None:
            host.give_back([t.untyped_storage()._cdata])


@contextmanager
def original_weights() -> Iterator[None]:
    """Every weight the kopt backend moved to host memory back on its device for the block's
    duration: to run the model uncompiled, or to change weights in place (``load_state_dict``;
    the graphs re-pack what changed at their next call). They move again when it ends."""
    with ExitStack() as stack:
        for host in list(_MOVED.hosts):
            stack.enter_context(host.on_device())
        yield


# The CUDA-graph memory pool of each device, shared by every graph the backend captures in this
# process: graphs replay one after another on one stream, and each keeps its outputs alive
# (copied out at every call), so one graph's freed intermediates can serve the next.
_POOLS: dict[int, Any] = {}


def _pool(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        _POOLS[index] = memory_pool(index)
    return _POOLS[index].id


class Runner:
    """Calls the compiled graph with the runtime inputs (from a CUDA graph where
    ``cuda_graphs`` and the graph allow); re-packs weights changed in place."""

    def __init__(self, compiled: Callable[..., Any], spec: _Specialization,
                 runtime_idx: list[int], static_idx: list[int], examples: list[Any],
                 cuda_graphs: CudaGraphs = "auto", host: HostCopies | None = None) -> None:
        self.compiled = compiled
        self.spec = spec
        self.runtime_idx = runtime_idx
        self.static = [(i, examples[i]) for i in static_idx]
        self.cuda_graphs = cuda_graphs
        self.host = host  # the weights this graph's packing superseded, in host memory
        if host is not None:
            _MOVED.hosts.add(host)
            # they come back when the graph goes (torch._dynamo.reset())
            weakref.finalize(self, host.restore).atexit = False

    def move_superseded(self) -> None:
        """Move to host memory the weights this graph no longer reads that its load programs
        packed (those FP8 packing did not release at once), and watch their modules."""
        if self.host is None:
            return
        if _MOVED.restored:
            self.host.drop_ahead()
            return
        read = {t.untyped_storage()._cdata for t in tensors_read([self.spec.gm])}
        static = {t.untyped_storage()._cdata for _, t in self.static
                  if isinstance(t, torch.Tensor)}
        superseded = [t for t, _ in self.spec.sources
                      if t.untyped_storage()._cdata in static - read
                      and holder(t) in (None, self.host)]
        if self.host.move(superseded) or self.host.moved:
            self.refresh_report()
        self.host.drop_ahead()
        moved = self.host.keys
        _MOVED.watch([t for _, t in self.static if isinstance(t, torch.Tensor)
                      and t.untyped_storage()._cdata in moved])

    def __call__(self, *args: Any) -> Any:
        for i, t in self.static:
            if args[i] is not t:
                raise KoptError(
                    "kopt: a parameter or buffer object was replaced after compilation; kopt "
                    "packed the old one. Update it in place (e.g. load_state_dict) or recompile "
                    "(torch._dynamo.reset())."
                )
        spec = self.spec
        if spec.stale():
            with _on_device([t for t, _ in spec.sources]):  # the load programs read them
                spec.refresh_if_stale()
        flat = [args[i] for i in self.runtime_idx]
        off = spec.graphs_off
        if not graphs_allowed(spec, self.compiled, flat, self.cuda_graphs):
            if spec.graphs_off != off:
                self.refresh_report()
            return spec.captured.unflatten_outputs(self.compiled(*flat))
        device = next(a.device for a in flat if isinstance(a, torch.Tensor) and a.is_cuda)
        pool = _pool(device)
        out, captured = run_from_graph(spec, self.compiled, flat, self.cuda_graphs is True,
                                       pool)
        if captured or spec.graphs_off is not None:
            if captured:
                held = pool_bytes(pool)
                spec.pool_mib = None if held is None else held / 2**20
            self.refresh_report()
        return spec.captured.unflatten_outputs(out)

    def refresh_report(self) -> None:
        """The report's lines on how this graph runs and what it holds."""
        spec = self.spec
        pool = None if spec.pool_mib is None else int(spec.pool_mib * 2**20)
        held = memory_held([t for _, t in self.static if isinstance(t, torch.Tensor)],
                           [spec.gm], pool, host=self.host.nbytes if self.host else 0)
        spec.report.runtime[:] = [*spec.runtime_lines(self.cuda_graphs), held.describe()]


class PerWeights:
    """One optimized graph per set of parameter objects.

    Dynamo passes a module's parameters to its graph as inputs. After a graph break inside a
    repeated block (a transformer's blocks), it compiles the block's ``forward`` as a frame of
    its own whose one graph serves every instance of the block, each call with that instance's
    parameters. kopt's graph holds the parameters it was captured with as constants (packed,
    folded), so a call with other parameter objects gets a graph of its own: the same code
    captured and optimized with that instance's weights. Parameters changed in place are
    re-packed by the graph that holds them (:meth:`kopt.api._Specialization.refresh_if_stale`);
    a parameter replaced by a new object gets a new graph (the old one keeps the old object).
    """

    def __init__(self, first: Runner, static_idx: list[int], examples: Sequence[Any],
                 build: Callable[[list[Any]], Runner]) -> None:
        self.static_idx = static_idx
        self.build = build
        self.graphs = {self._key(examples): first}

    def _key(self, inputs: Sequence[Any]) -> tuple[int, ...]:
        # The graphs hold their parameters (``Runner.static``): ids are not reused meanwhile.
        return tuple(id(inputs[i]) for i in self.static_idx)

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self.build(list(args))
        return graph(*args)


def inner_compile(inner: str, gm: fx.GraphModule, example_inputs: list[Any],
                  regional: bool = False, report: Report | None = None) -> Callable:
    """The inner compiler's callable for ``gm``. ``regional``: Inductor compiles each kind of
    repeated block once, then a copy of ``gm`` whose blocks call their kind's code
    (:mod:`kopt.regional`); ``report`` says how it went."""
    if inner == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    # For an nn.Module, compile_fx returns aot_autograd's unboxed forward(*args) (its
    # _boxed_call attribute is copied from the inner function and does not describe it).
    # kopt optimizes inference: compiling without grad gives Inductor's inference graph even
    # where the model's parameters require grad (FP8 GEMMs have no derivative at all).
    kinds: list[Any] = []
    with torch.no_grad():
        said = "Inductor"
        compiled = None
        if regional:
            try:
                target = copy_graph_module(gm)
                kinds = outline_blocks(target, compile=_compile_kind)
                if kinds:
                    compiled = compile_fx(target, example_inputs)
                    said = (f"Inductor, {sum(k.sites for k in kinds)} repeated block sites "
                            f"compiled as {len(kinds)} kind(s) of block")
            except Exception as exc:  # noqa: BLE001 -- the flat graph is what Inductor took before
                said = (f"Inductor, the graph flat (with its repeated blocks outlined it "
                        f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                log.warning("kopt: %s", said)
                kinds, compiled = [], None
        if compiled is None:
            compiled = compile_fx(gm, example_inputs)
    if report is not None:
        report.inner = said

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return compiled(*args)

    run.kinds = kinds  # type: ignore[attr-defined]  # the blocks' code lives while this does
    return run


def _compile_kind(graph: fx.GraphModule, examples: list[torch.Tensor]) -> Callable:
    """Inductor's code for one kind of block, compiled apart from the graph dynamo is
    compiling: its example operands are made up (no source dynamo could guard them by), so
    its trace must not share dynamo's fake mode and shape environment."""
    from torch._inductor.compile_fx import compile_fx

    with torch._guards.tracing(None):
        return compile_fx(graph, examples)
