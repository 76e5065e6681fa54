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

A graph kopt cannot take (dynamic shapes, an unsupported op) is logged with the reason and given
to the inner compiler unmodified, so compilation still succeeds. A graph dynamo reuses for several
modules (a repeated block's ``forward`` after a graph break inside it) is optimized once per
module's weights (:class:`PerWeights`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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
from kopt.cudagraphs import pool_bytes
from kopt.errors import CaptureError, KoptError
from kopt.memory import memory_held
from kopt.passes import PassConfig
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

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        unknown = set(options) - {"inner", "config", "verify", "reports", "cuda_graphs"}
        if unknown:
            raise KoptError(f"unknown kopt backend option(s) {sorted(unknown)}; "
                            "valid: inner, config, verify, reports, cuda_graphs")
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
    try:
        captured, runtime_idx = capture_dynamo(gm, example_inputs)
    except CaptureError as exc:
        log.warning("kopt: graph left unoptimized: %s", exc)
        return inner_compile(opts.inner, gm, example_inputs)
    first = optimize_dynamo_graph(captured, runtime_idx, example_inputs, opts,
                                  f"dynamo graph ({len(gm.graph.nodes)} nodes)")
    if not first.static:
        return first

    def build(inputs: list[Any]) -> Runner:
        again, idx = capture_dynamo(gm, inputs)  # the same graph captured before: cannot fail
        return optimize_dynamo_graph(again, idx, inputs, opts,
                                     f"dynamo graph ({len(gm.graph.nodes)} nodes), other weights")

    return PerWeights(first, [i for i, _ in first.static], example_inputs, build)


def optimize_dynamo_graph(captured: Any, runtime_idx: list[int], example_inputs: list[Any],
                          opts: BackendOptions, name: str) -> Runner:
    """kopt's passes on a captured dynamo graph, then the inner compiler: the runner of one
    graph for the parameters in ``example_inputs``."""
    spec = optimize_captured(captured, opts.config, opts.verify, None, name, 0.0)
    if opts.reports is not None:
        opts.reports.append(spec.report)
    log.info("%s", spec.report)
    runtime_examples = [example_inputs[i] for i in runtime_idx]
    compiled = inner_compile(opts.inner, spec.gm, runtime_examples)
    static_idx = [i for i in range(len(example_inputs)) if i not in set(runtime_idx)]
    # run eagerly, the graph module itself is the body: its hoisted regions stay outside a
    # CUDA graph
    body = spec.gm if opts.inner == "eager" else compiled
    runner = Runner(body, spec, runtime_idx, static_idx, example_inputs, opts.cuda_graphs)
    runner.refresh_report()
    return runner


# The CUDA-graph memory pool of each device, shared by every graph the backend captures in this
# process: graphs replay one after another on one stream, and each keeps its outputs alive
# (copied out at every call), so one graph's freed intermediates can serve the next.
_POOLS: dict[int, Any] = {}


def _pool(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        _POOLS[index] = torch.cuda.graph_pool_handle()
    return _POOLS[index]


class Runner:
    """Calls the compiled graph with the runtime inputs (from a CUDA graph where
    ``cuda_graphs`` and the graph allow); re-packs weights changed in place."""

    def __init__(self, compiled: Callable[..., Any], spec: _Specialization,
                 runtime_idx: list[int], static_idx: list[int], examples: list[Any],
                 cuda_graphs: CudaGraphs = "auto") -> None:
        self.compiled = compiled
        self.spec = spec
        self.runtime_idx = runtime_idx
        self.static = [(i, examples[i]) for i in static_idx]
        self.cuda_graphs = cuda_graphs

    def __call__(self, *args: Any) -> Any:
        for i, t in self.static:
            if args[i] is not t:
                raise KoptError(
                    "kopt: a parameter or buffer object was replaced after compilation; kopt "
                    "packed the old one. Update it in place (e.g. load_state_dict) or recompile "
                    "(torch._dynamo.reset())."
                )
        spec = self.spec
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
                           [spec.gm], pool)
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


def inner_compile(inner: str, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    if inner == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    # For an nn.Module, compile_fx returns aot_autograd's unboxed forward(*args) (its
    # _boxed_call attribute is copied from the inner function and does not describe it).
    # kopt optimizes inference: compiling without grad gives Inductor's inference graph even
    # where the model's parameters require grad (FP8 GEMMs have no derivative at all).
    with torch.no_grad():
        compiled = compile_fx(gm, example_inputs)

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return compiled(*args)

    return run
