"""SGLang diffusion: kopt on the DiT of ``sglang.multimodal_gen``, through its torch.compile path.

    from kopt.integrations.sglang import apply
    handles = apply(pipeline)      # every DiT of every denoising stage (or apply(stage))
    ...                            # requests as usual: SGLang's scheduling and CFG are untouched
    print(handles[0])              # per graph: the passes that fired, their verdicts; graph breaks

SGLang compiles its DiT itself: with ``--enable-torch-compile`` the denoising stage calls
``CompiledModuleRegistry.compile_once(dit, compile_kwargs=...)``, which runs
``dit.compile(**compile_kwargs)``. :func:`apply` goes through that registry with kopt's backend
(``dynamic=False``: kopt specialises on static shapes), so a stage that compiles later sees the DiT
as compiled, and a DiT SGLang already compiled with Inductor is recompiled with kopt. The DiT stays
the object SGLang built (its attributes, ``isinstance`` checks, TeaCache state, LoRA layers): only
``nn.Module``'s compiled call is set, so SGLang's scheduler, its CFG branches (serial or batched)
and its request handling run as they are. :func:`optimize_dit` does the same for a DiT alone.

Dynamo hands the backend one graph per stretch of the forward it traced without a break. kopt
optimizes each graph (capture, passes, verification on fresh random inputs), then the inner
compiler runs it: Inductor by default, as SGLang's own path would, or ``inner="eager"``. As with
:func:`kopt.optimize`, ``cuda_graphs="auto"`` (the default) replays each optimized graph from a
CUDA graph from its third call, where it can be captured; its report says which.

Where kopt cannot apply, SGLang's code runs unmodified there and a warning says where and why:

* a graph break (FLUX.2's single-stream blocks compare data pointers, ``flux_2.py:472``):
  the line at the break runs eagerly as SGLang wrote it, the graphs on either side are optimized.
  A break inside a repeated block makes dynamo compile the block's ``forward`` once for all its
  instances, with the weights as graph inputs; kopt packs weights as constants, so it optimizes
  that graph once per set of weights (:class:`kopt.backend.PerWeights`).
* a graph kopt cannot capture (:class:`kopt.CaptureError`: dynamic shapes, an unsupported op):
  it runs as dynamo traced it.
* the whole DiT, where SGLang's machinery around it would be bypassed or invalidated (see
  :func:`why_unsupported`): the breakable CUDA graph, cache-dit, weight offloading, FSDP.

sglang is imported lazily: importing this module needs only kopt.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from kopt.api import CudaGraphs, Report
from kopt.backend import (
    BackendOptions,
    PerWeights,
    Runner,
    inner_compile,
    optimize_dynamo_graph,
)
from kopt.capture import capture_dynamo
from kopt.errors import CaptureError, KoptError
from kopt.passes import PassConfig
from kopt.verify import VerifyOptions

log = logging.getLogger("kopt")

# What a denoising stage calls its DiTs (DenoisingStage.__init__): the expert pair of
# boundary-ratio models (Wan 2.2) has a second one.
DIT_ATTRIBUTES = ("transformer", "transformer_2")


class KoptDiT:
    """What kopt did to one SGLang DiT: the reports of the graphs it optimized, the graph breaks
    dynamo split the DiT at, and why anything ran unmodified.

    Not a module: the DiT itself is what SGLang calls (``dit.compile`` set its compiled call).
    """

    def __init__(self, dit: torch.nn.Module, options: BackendOptions) -> None:
        self.dit = dit
        self.options = options
        self.reports: list[Report] = []
        options.reports = self.reports  # the backend files one report per optimized graph
        # "reason at file:line `code`", one entry per distinct break location
        self.graph_breaks: list[str] = []
        # Why kopt left (a graph of) the DiT as it was, one line per distinct reason.
        self.fallbacks: list[str] = []
        self.compiled = False
        self._graphs = 0

    @property
    def name(self) -> str:
        return type(self.dit).__name__

    # The torch.compile backend.
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **_: Any
                 ) -> Callable[..., Any]:
        self._graphs += 1
        number = self._graphs
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            self._note_break(reason)
        try:
            captured, runtime_idx = capture_dynamo(gm, example_inputs)
        except CaptureError as exc:
            where = f" at {exc.where}" if exc.where else ""
            self._fall_back(f"graph {number} ({_ops(gm)} ops) runs as dynamo traced it: "
                            f"{exc.kind}{where}: {exc.detail}")
            return inner_compile(self.options.inner, gm, example_inputs)
        first = optimize_dynamo_graph(captured, runtime_idx, example_inputs, self.options,
                                      f"{self.name} graph {number}")
        if not first.static:
            return first
        return PerWeights(first, [i for i, _ in first.static], example_inputs,
                          lambda inputs: self._recapture(gm, inputs, number))

    def _recapture(self, gm: fx.GraphModule, inputs: list[Any], number: int) -> Runner:
        captured, runtime_idx = capture_dynamo(gm, inputs)  # captured before: cannot fail
        return optimize_dynamo_graph(captured, runtime_idx, inputs, self.options,
                                     f"{self.name} graph {number}")

    def _note_break(self, reason: Any) -> None:
        frame = reason.user_stack[-1] if reason.user_stack else None
        why = reason.reason.strip().splitlines()[0] if reason.reason.strip() else "graph break"
        where = (f"{_short(frame.filename)}:{frame.lineno}"
                 + (f" `{frame.line.strip()}`" if frame.line else "")
                 if frame is not None else "an unknown line")
        line = f"{why} at {where}"
        if line in self.graph_breaks:
            return
        self.graph_breaks.append(line)
        warnings.warn(f"kopt: {self.name}: graph break: {line}. That line runs eagerly as "
                      "SGLang wrote it; kopt optimizes the graphs on either side",
                      RuntimeWarning, stacklevel=2)

    def _fall_back(self, why: str) -> None:
        if why in self.fallbacks:
            return
        self.fallbacks.append(why)
        warnings.warn(f"kopt: {self.name}: {why}", RuntimeWarning, stacklevel=3)

    # What kopt did.
    def passes_fired(self) -> set[str]:
        """Names of the passes that rewrote something in at least one graph."""
        return {r.name for report in self.reports for r in report.passes if r.matched}

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.reports)

    def describe(self) -> str:
        if not self.compiled:
            head = f"kopt on {self.name}: not applied"
        elif not self.reports and not self.fallbacks:
            head = (f"kopt on {self.name}: compiled with kopt's backend; optimized on the first "
                    "request")
        else:
            n = len(self.reports)
            head = f"kopt on {self.name}: {n} graph{'s' * (n != 1)} optimized"
        lines = [head]
        lines += [f"graph break: {b}" for b in self.graph_breaks]
        lines += [str(r) for r in self.reports]
        lines += [f"ran unmodified: {why}" for why in self.fallbacks]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def optimize_dit(
    dit: torch.nn.Module,
    *,
    config: PassConfig | dict[str, Any] | None = None,
    verify: VerifyOptions | bool = True,
    inner: str = "inductor",
    cuda_graphs: CudaGraphs = "auto",
) -> KoptDiT:
    """Compile an SGLang DiT with kopt's passes (``dit.compile`` with kopt's backend, static
    shapes); returns the handle that says what kopt did once the DiT has run.

    ``config``: a :class:`kopt.PassConfig` or a dict of its fields; under Inductor the fusions
    Inductor does better are left to it, as with ``backend="kopt"``. ``verify`` checks every
    rewrite on fresh random inputs; ``inner``: ``"inductor"`` or ``"eager"``; ``cuda_graphs``
    as in :func:`kopt.optimize` (each optimized graph on a GPU replays from a CUDA graph from
    its third call where it can be captured).
    """
    handle = _handle(dit, config, verify, inner, cuda_graphs)
    dit.compile(**_compile_kwargs(handle))
    handle.compiled = True
    return handle


def apply(
    target: Any,
    *,
    config: PassConfig | dict[str, Any] | None = None,
    verify: VerifyOptions | bool = True,
    inner: str = "inductor",
    cuda_graphs: CudaGraphs = "auto",
) -> list[KoptDiT]:
    """Put kopt on the DiTs of an SGLang pipeline (its denoising stages) or of one stage,
    through the stage's own torch.compile registry; returns one handle per DiT.

    A DiT kopt must not take (:func:`why_unsupported`) is left as it is, with a warning; its
    handle says why. Arguments as in :func:`optimize_dit`.
    """
    stages = _denoising_stages(target)
    if not stages:
        raise KoptError(f"{type(target).__name__} has no denoising stage with a DiT to optimize "
                        "(pass an SGLang pipeline or one of its denoising stages)")
    handles = []
    for stage in stages:
        for attribute in DIT_ATTRIBUTES:
            dit = getattr(stage, attribute, None)
            if not isinstance(dit, torch.nn.Module):
                continue
            handle = _handle(dit, config, verify, inner, cuda_graphs)
            handles.append(handle)
            why = why_unsupported(stage, dit, attribute)
            if why is not None:
                handle._fall_back(f"runs unmodified: {why}")
                continue
            kwargs = _compile_kwargs(handle)
            registry = stage._torch_compile_registry
            if not registry.compile_once(dit, compile_kwargs=kwargs):
                # SGLang compiled it already (--enable-torch-compile, at the stage's creation):
                # kopt's backend takes the place of Inductor's.
                dit.compile(**kwargs)
            handle.compiled = True
    return handles


def restore(target: Any) -> None:
    """Undo :func:`apply` (on the same pipeline or stage) or :func:`optimize_dit` (on the DiT
    or its handle): the DiT runs uncompiled again (``--enable-torch-compile`` compiles it anew
    on the next request)."""
    if isinstance(target, KoptDiT):
        target = target.dit
    if isinstance(target, torch.nn.Module) and not _denoising_stages(target):
        target._compiled_call_impl = None
        return
    for stage in _denoising_stages(target):
        for attribute in DIT_ATTRIBUTES:
            dit = getattr(stage, attribute, None)
            if isinstance(dit, torch.nn.Module):
                dit._compiled_call_impl = None
                stage._torch_compile_registry.module_ids.discard(id(dit))


def why_unsupported(stage: Any, dit: torch.nn.Module, attribute: str = "transformer"
                    ) -> str | None:
    """Why kopt must leave the DiT of this denoising stage as it is, or None."""
    from sglang.multimodal_gen.runtime.managers.memory_managers.component_residency import (
        RESIDENT,
    )
    from sglang.multimodal_gen.runtime.managers.memory_managers.component_residency_strategies import (  # noqa: E501
        is_fsdp_managed_module,
    )
    from sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload import (
        is_layerwise_offloaded_module,
    )

    args = stage.server_args
    if getattr(args, "enable_breakable_cuda_graph", False):
        return ("SGLang's breakable CUDA graph captures the eager DiT's kernels, and SGLang "
                "does not torch.compile under it (--enable-breakable-cuda-graph)")
    if stage._cache_dit_requested():
        return ("cache-dit replaces the DiT's forward with hooks that skip blocks from step to "
                "step (SGLANG_CACHE_DIT_ENABLED)")
    if is_layerwise_offloaded_module(dit):
        return ("layerwise offload moves the DiT's weights during forward, while kopt packs "
                "them once")
    if is_fsdp_managed_module(dit) or getattr(args, "use_fsdp_inference", False):
        return "FSDP shards the DiT's weights and gathers them during forward"
    mode = args.residency_mode(attribute)
    if mode != RESIDENT:
        return (f"SGLang's {mode} residency moves the DiT's weights between devices, while "
                "kopt packs them once")
    return None


def _handle(dit: torch.nn.Module, config: PassConfig | dict[str, Any] | None,
            verify: VerifyOptions | bool, inner: str, cuda_graphs: CudaGraphs) -> KoptDiT:
    options: dict[str, Any] = {"inner": inner, "verify": verify, "cuda_graphs": cuda_graphs}
    if config is not None:
        options["config"] = config
    return KoptDiT(dit, BackendOptions.parse(options))


def _compile_kwargs(handle: KoptDiT) -> dict[str, Any]:
    # dynamic=False: kopt specialises on static shapes; another resolution or text length is
    # compiled anew (automatic dynamic shapes would hand kopt a symbolic graph it cannot take).
    return {"backend": handle, "dynamic": False, "fullgraph": False}


def _denoising_stages(target: Any) -> list[Any]:
    """The stages of ``target`` (a pipeline, a stage, or their list) that compile a DiT."""
    candidates = getattr(target, "stages", None)
    if candidates is None:
        candidates = target if isinstance(target, list | tuple) else [target]
    return [s for s in candidates if hasattr(s, "_torch_compile_registry")
            and any(isinstance(getattr(s, a, None), torch.nn.Module) for a in DIT_ATTRIBUTES)]


def _ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def _short(path: str) -> str:
    """An installed package's file from its package folder on (sglang/multimodal_gen/...)."""
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path
