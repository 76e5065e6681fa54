"""diffusers: ``optimize_pipeline(pipe)`` runs a pipeline's transformer through kopt.

    handle = optimize_pipeline(pipe)      # pipe.transformer is now a KoptTransformer
    image = pipe(prompt, negative_prompt=" ", true_cfg_scale=4.0).images[0]
    print(handle)                         # per pass: what fired, the verification verdicts

The transformer is optimized lazily, on the pipeline's first call to it, with that call's own
arguments (:func:`kopt.optimize`): the shapes, the Python values (``img_shapes``,
``return_dict``) and the inputs left as ``None`` are those the denoising loop really passes. A
call with other shapes (another resolution, a negative prompt of another length) is specialised
anew; the specialisations share packed weights and hoisted caches.

A CFG pair shares its timestep work: ``QwenImagePipeline`` computes ``timestep / 1000`` afresh
for each of the two calls of a step, and the hoist pass matches such an equal key by value
(:data:`kopt.graph.regions.MAX_VALUE_KEY_ELEMENTS`), so the uncond call reuses the cond call's
timestep embedding and modulation GEMMs.

Where kopt cannot apply, the transformer runs unmodified and a warning says where and why:
a model that cannot be captured (:class:`kopt.CaptureError`: data-dependent control flow, an
unsupported op, with the source line), or hooks that change what ``forward`` does between calls
(accelerate offloading, diffusers caches, group offloading, layerwise casting). Under
``torch.compile`` tracing, the wrapper calls the transformer as is, so compiling the pipeline's
transformer compiles what it would without kopt (``backend="kopt"`` runs kopt's passes there).
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kopt.api import CudaGraphs, OptimizedModule, Report, optimize
from kopt.capture import flatten_inputs, input_signature
from kopt.errors import CaptureError, KoptError
from kopt.passes import PassConfig
from kopt.passes.pipeline import PIPELINE
from kopt.verify import VerifyOptions

log = logging.getLogger("kopt")

# Public methods of the transformer that leave what its forward computes as it is. Any other
# public method called through the wrapper (set_attention_backend, load_lora_adapter,
# fuse_qkv_projections, enable_cache, ...) may change it, so the optimized graphs are dropped
# and the next call captures the transformer as it is then. Private methods are diffusers' own
# plumbing, which pipelines call on every run (_reset_stateful_cache): they reconfigure nothing.
PURE_METHODS = frozenset({"cache_context", "save_pretrained", "num_parameters",
                          "get_memory_footprint"})



class KoptTransformer(torch.nn.Module):
    """Stands in for ``pipe.transformer``: optimizes it on the first call, then runs kopt's graph.

    What diffusers reads from a transformer is the transformer's: ``config``, ``dtype``,
    ``device``, ``state_dict`` and every other attribute (``cache_context``,
    ``set_attention_backend``, ...). Moving or casting it (``.to``, ``.half``) or calling one of
    its methods that may change the forward (see :data:`PURE_METHODS`) drops the optimized
    graphs; the next call optimizes again.
    """

    def __init__(self, transformer: torch.nn.Module, pass_config: PassConfig,
                 verify: VerifyOptions, cuda_graphs: CudaGraphs) -> None:
        super().__init__()
        self.transformer = transformer
        self.pass_config = pass_config
        self.verify = verify
        self.cuda_graphs = cuda_graphs
        self.optimized: OptimizedModule | None = None
        # Why kopt left calls to the transformer as they were, one line per distinct reason.
        self.fallbacks: list[str] = []
        self._hooks_checked = False
        self._hooks: str | None = None
        self._failed: dict[tuple, str] = {}  # input signature -> why it cannot be captured
        self._params = tuple(inspect.signature(transformer.forward).parameters)

    # What diffusers reads from the transformer.
    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        transformer = super().__getattr__("transformer")
        value = getattr(transformer, name)
        if (name.startswith("_") or name in PURE_METHODS
                or getattr(value, "__self__", None) is not transformer):
            return value

        @functools.wraps(value)
        def reconfigure(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            self.reset(f"{name}() was called on the transformer")
            return out

        return reconfigure

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._weights_back()  # the caller keeps the tensors: they must hold their values
        return self.transformer.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        # In place: kopt re-packs what it packed; assign=True replaces parameters: re-optimized.
        if self.optimized is None:
            return self.transformer.load_state_dict(state_dict, strict=strict, assign=assign)
        with self.optimized.original_weights() as transformer:
            return transformer.load_state_dict(state_dict, strict=strict, assign=assign)

    def _weights_back(self) -> None:
        """The weights kopt moved to host memory back on their device for good."""
        if self.optimized is not None:
            self.optimized.restore_original()

    def to(self, *args: Any, **kwargs: Any) -> KoptTransformer:
        if _moves_or_casts(self.transformer, args, kwargs):
            self._weights_back()  # copied to the new device or dtype: they need their values
        before = _placement(self.transformer)
        self.transformer.to(*args, **kwargs)  # the model's own .to, with diffusers' checks
        if _placement(self.transformer) != before:
            self.reset("the transformer was moved or cast")
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> KoptTransformer:
        self._weights_back()
        super()._apply(fn, recurse)
        self.reset("the transformer was moved or cast")
        return self

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` this wrapper: traced, it calls the transformer as is, so this compiles
        the unmodified transformer (kopt's passes under torch.compile: ``backend="kopt"``)."""
        self._fall_back("torch.compile traces the transformer itself (compile it with "
                        "backend=\"kopt\" for kopt's passes under torch.compile)")
        self._weights_back()
        super().compile(*args, **kwargs)

    def reset(self, why: str = "reset") -> None:
        """Drop the optimized graphs: the next call captures the transformer as it is then."""
        if self.optimized is not None:
            log.info("kopt: %s; optimizing again on the next call", why)
        self._weights_back()
        self.optimized = None
        self._hooks_checked = False
        self._failed.clear()

    # The call.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._original(*args, **kwargs)
        why = self._why_unoptimized()
        if why is not None:
            self._fall_back(why)
            return self._original(*args, **kwargs)
        flat, spec = flatten_inputs(args, kwargs)
        signature = (str(spec), input_signature(flat))
        if signature in self._failed:
            return self._original(*args, **kwargs)
        try:
            if self.optimized is None:
                self.optimized = optimize(self.transformer, args, kwargs, self.pass_config,
                                          verify=self.verify, cuda_graphs=self.cuda_graphs)
            return self.optimized(*args, **kwargs)
        except CaptureError as exc:
            self._failed[signature] = str(exc)
            where = f" at {exc.where}" if exc.where else ""
            self._fall_back(f"{exc.kind}{where}: {exc.detail}")
            return self._original(*args, **kwargs)

    def _original(self, *args: Any, **kwargs: Any) -> Any:
        """The transformer itself, with the weights kopt moved to host memory back on its
        device for the call."""
        if self.optimized is None or torch.compiler.is_compiling():
            return self.transformer(*args, **kwargs)  # compile() brought the weights back
        with self.optimized.original_weights() as transformer:
            return transformer(*args, **kwargs)

    def _why_unoptimized(self) -> str | None:
        """Hooks that replace or wrap forward: kopt's graph would bypass them."""
        on_wrapper = self.__dict__.get("_hf_hook")
        if on_wrapper is not None:
            return (f"accelerate hook {type(on_wrapper).__name__} on the transformer "
                    "(model offloading) moves it between devices around every call")
        if not self._hooks_checked:
            self._hooks = _hooks(self.transformer)
            self._hooks_checked = True
        return self._hooks

    def _fall_back(self, why: str) -> None:
        if why in self.fallbacks:
            return
        self.fallbacks.append(why)
        warnings.warn(f"kopt: {type(self.transformer).__name__} runs unmodified: {why}",
                      RuntimeWarning, stacklevel=3)

    # What kopt did.
    @property
    def report(self) -> Report | None:
        """The report of the first optimized input signature (None before the first call)."""
        return self.optimized.report if self.optimized is not None else None

    @property
    def reports(self) -> list[Report]:
        return self.optimized.reports if self.optimized is not None else []

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        """(hits, misses) of each hoisted region, by its key inputs."""
        return self.optimized.cache_stats() if self.optimized is not None else {}

    def describe(self) -> str:
        name = type(self.transformer).__name__
        lines = []
        if self.optimized is None:
            lines.append(f"kopt on {name}: not optimized yet (it is optimized on the "
                         "pipeline's first call)" if not self.fallbacks else
                         f"kopt on {name}: not optimized")
        else:
            n = len(self.reports)
            lines.append(f"kopt on {name}: {n} input signature{'s' * (n != 1)} optimized")
            for keys, (hits, misses) in self.cache_stats().items():
                lines.append(f"hoisted {keys}: {hits} hits, {misses} misses")
            lines += [str(r) for r in self.reports]
        lines += [f"ran unmodified: {why}" for why in self.fallbacks]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def optimize_pipeline(
    pipe: Any,
    *,
    config: PassConfig = PassConfig(),
    verify: VerifyOptions | bool = True,
    cuda_graphs: CudaGraphs = "auto",
    component: str = "transformer",
) -> KoptTransformer:
    """Put kopt in front of ``pipe.transformer`` (or another ``component``); returns the wrapper,
    which prints what kopt did (after the pipeline's first call).

    ``config`` picks the passes (:func:`exact_tier` for images bitwise equal to the original
    pipeline's); ``verify`` checks every rewrite on fresh random inputs; ``cuda_graphs``
    (``"auto"``, as :func:`kopt.optimize`) replays each input signature from a CUDA graph where
    the transformer runs on CUDA and its graph can be captured. :func:`restore` undoes it.
    """
    model = getattr(pipe, component, None)
    if isinstance(model, KoptTransformer):
        raise KoptError(f"pipe.{component} is already optimized by kopt; restore(pipe) first")
    if not isinstance(model, torch.nn.Module):
        raise KoptError(f"{type(pipe).__name__} has no module {component!r} to optimize "
                        f"(got {type(model).__name__})")
    if isinstance(verify, bool):
        verify = VerifyOptions(enabled=verify)
    wrapper = KoptTransformer(model, config, verify, cuda_graphs)
    # Past DiffusionPipeline.__setattr__: pipe.config keeps naming the diffusers class, so
    # save_pretrained and from_pipe see the model they know.
    object.__setattr__(pipe, component, wrapper)
    return wrapper


def restore(pipe: Any, component: str = "transformer") -> torch.nn.Module:
    """Put the original transformer back; returns it."""
    wrapper = getattr(pipe, component, None)
    if not isinstance(wrapper, KoptTransformer):
        raise KoptError(f"pipe.{component} is not optimized by kopt")
    if wrapper.optimized is not None:
        wrapper.optimized.restore_original()  # the weights it moved to host memory
    object.__setattr__(pipe, component, wrapper.transformer)
    return wrapper.transformer


def exact_tier(config: PassConfig = PassConfig()) -> PassConfig:
    """``config`` with every pass whose declared numerics tier is not ``exact`` turned off: the
    pipeline's outputs are then bitwise those of the original."""
    off = {}
    for name, factory in PIPELINE:
        value = getattr(config, name)
        made = factory(config) if value else None
        if made is not None and made.numerics.tier != "exact":
            off[name] = False if isinstance(value, bool) else None
    return config.replace(**off)


def _hooks(model: torch.nn.Module) -> str | None:
    """Why kopt's graph must not stand in for ``model``'s forward, or None."""
    for path, mod in model.named_modules():
        where = f"on {path}" if path else "on the transformer"
        hook = mod.__dict__.get("_hf_hook")
        if hook is not None:
            return (f"accelerate hook {type(hook).__name__} {where} (offloading or a device "
                    "map) moves weights during forward")
        registry = mod.__dict__.get("_diffusers_hook")
        names = sorted(getattr(registry, "hooks", None) or ())
        if names:
            return (f"diffusers hooks {', '.join(names)} {where} (a cache, group offloading or "
                    "layerwise casting) change what forward does from call to call")
    return None


def _moves_or_casts(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``model.to(*args, **kwargs)`` would copy a parameter (another device or dtype)."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    for t in model.parameters():
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return True
        if device is not None and (device.type != t.device.type or (
                device.index is not None and device.index != t.device.index)):
            return True
    return False


def _placement(model: torch.nn.Module) -> list[tuple[int, torch.dtype]]:
    return [(t.data_ptr(), t.dtype) for t in (*model.parameters(), *model.buffers())]

