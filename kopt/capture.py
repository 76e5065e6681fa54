"""Model -> functional aten-level GraphModule with fake-tensor metadata on every node.

One function per capture mode, both producing the same IR:

* :func:`capture_module` -- an ``nn.Module`` and example inputs, through non-strict
  ``torch.export`` (no graph breaks: a construct it cannot trace is an error that names it).
* :func:`capture_dynamo` -- the graph a ``torch.compile`` backend receives from dynamo; its
  parameter and buffer inputs become constants, the rest stay inputs.

The IR is what ``torch.export`` yields with an empty decomposition table: functional aten with
the composite ops that rewrites care about kept whole (``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention``, ...). Parameters and buffers are ``get_attr`` nodes that
read the model's own tensors (shared, not copied), so weight-side work can be done at load time.
The captured graph takes one placeholder per flattened input leaf and returns a flat tuple.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from kopt.collect import collector_skips_what_lives_already
from kopt.errors import CaptureError
from kopt.graph.query import attr
from kopt.graph.serialize import fingerprint, fingerprint_of, made_from
from kopt.graph.splice import _LAZY, copy_graph_module
from kopt.repeated import (
    Blocks,
    Cut,
    NotRepeatable,
    Repeated,
    block_tensors,
    calls_of,
    cut_repeats,
    instantiate,
    outline_dynamo_blocks,
    trace_blocks,
    trace_with_stand_ins,
)
from kopt.verify import run_flat

log = logging.getLogger("kopt")

# gm.meta key: how the graph was captured. Passes that touch the model's own tensors (packing
# merged weights in place) do so for the captures whose attributes are the model's parameter
# objects (:data:`MODEL_SOURCES`): export's, and dynamo's, whose static inputs are (dynamo's
# guards check their sizes and strides, which the views of a packed buffer keep).
SOURCE_KEY = "kopt_capture_source"
MODEL_SOURCES = ("export", "dynamo")


@dataclass
class Shallow:
    """The captured graph of a model cut to its first blocks (:meth:`Captured.shallow`)."""

    gm: fx.GraphModule
    cut: Cut

_TORCH_DIR = os.path.dirname(torch.__file__)
_KOPT_DIR = os.path.dirname(__file__)


class Captured:
    """A captured graph and how to call it with the model's (args, kwargs).

    A model of repeated blocks is captured in two steps (:mod:`kopt.repeated`): the traces,
    which name the graph (:meth:`fingerprint`), and the graph made from them (its
    decompositions, and every instance inlined), made when :attr:`gm` is first read. A warm
    start never reads it: it restores the optimized graph over the model's own tensors
    (:meth:`tensor`) and checks it against the model's forward (:meth:`outputs`)."""

    def __init__(self, gm: fx.GraphModule | None, in_spec: pytree.TreeSpec,
                 out_spec: pytree.TreeSpec, example_inputs: list[Any], source: str,
                 repeated: Repeated | None = None, *,
                 make: Callable[[], tuple[fx.GraphModule, Repeated | None]] | None = None,
                 fingerprint: str | None = None,
                 tensors: Callable[[str], torch.Tensor | None] | None = None,
                 model: torch.nn.Module | None = None,
                 shallow: Callable[[int], Shallow | None] | None = None) -> None:
        if (gm is None) == (make is None):
            raise ValueError("a capture has its graph or the means to make it, not both")
        self._gm = gm
        self._make = make
        self._fingerprint = fingerprint
        self._tensors = tensors
        self._model = model
        self._shallow = shallow
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.example_inputs = example_inputs  # flat leaves of (args, kwargs), placeholder order
        self.source = source  # "export" or "dynamo"
        self.repeated = repeated  # repeated blocks traced once and instantiated

    @property
    def gm(self) -> fx.GraphModule:
        if self._gm is None:
            gm, repeated = self._make()
            gm.meta[SOURCE_KEY] = self.source
            self._gm, self._make, self._tensors, self._model = gm, None, None, None
            self._shallow = None
            self.repeated = repeated  # None where the model was exported whole after all
        return self._gm

    def shallow(self, keep: int) -> Shallow | None:
        """The captured graph of a model cut to its first ``keep`` blocks per repeated list
        (:func:`kopt.repeated.cut_repeats`): what verification checks the passes on in place of
        the whole model (:class:`kopt.verify.VerifyOptions`). None where no list could be cut,
        the model was not captured in repeated blocks, or its graph was made already."""
        return self._shallow(keep) if self._shallow is not None else None

    @property
    def made(self) -> bool:
        """Whether the graph was made (:attr:`gm` read)."""
        return self._gm is not None

    def fingerprint(self) -> str:
        """:func:`kopt.graph.serialize.fingerprint` of :attr:`gm`, without making it where the
        traces name it (once made, the graph's own: it may have been edited since)."""
        if self._gm is None and self._fingerprint is not None:
            return self._fingerprint
        return fingerprint(self.gm)

    def tensor(self, name: str) -> torch.Tensor:
        """The attribute ``name`` of :attr:`gm` (a weight of the model, shared), without making
        the graph where the model holds it under that name."""
        if self._gm is None and self._tensors is not None:
            found = self._tensors(name)
            if found is not None:
                return found
        return attr(self.gm, name)

    def outputs(self, inputs: list[Any]) -> list[Any]:
        """The flat outputs of the captured computation on the flat ``inputs``: the graph's,
        or, while it is not made, the model's own forward (the ops the graph traced, run
        eagerly; a model in eval mode without hooks), which makes no graph."""
        if self._gm is None and self._model is not None:
            args, kwargs = pytree.tree_unflatten(list(inputs), self.in_spec)
            with torch.no_grad():
                return pytree.tree_leaves(self._model(*args, **kwargs))
        return run_flat(self.gm, inputs)

    @property
    def training(self) -> bool:
        # ExportedProgram.module() makes its module in training mode (a test compares the two)
        return self._gm.training if self._gm is not None else True

    @property
    def meta(self) -> dict[str, Any]:
        """:attr:`gm`'s metadata; before it is made, only how it was captured."""
        return self._gm.meta if self._gm is not None else {SOURCE_KEY: self.source}

    def unflatten_outputs(self, flat: Any) -> Any:
        return pytree.tree_unflatten(list(flat), self.out_spec)


def flatten_inputs(args: tuple, kwargs: dict | None) -> tuple[list[Any], pytree.TreeSpec]:
    """Flatten the call inputs the way capture does (kwargs sorted by name)."""
    kwargs = dict(sorted((kwargs or {}).items()))
    return pytree.tree_flatten((tuple(args), kwargs))


def input_signature(flat: list[Any]) -> tuple:
    """What a captured graph is specialised on: tensor shape/dtype/device, Python leaf values."""
    sig: list[Any] = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            sig.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            sig.append(("value", type(leaf).__name__, repr(leaf)))
    return tuple(sig)


def describe_signature_difference(expected: tuple, got: tuple) -> str:
    if len(expected) != len(got):
        return f"{len(got)} input leaves, captured with {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e != g:
            return f"input leaf {i}: got {_fmt_leaf(g)}, captured with {_fmt_leaf(e)}"
    return "inputs match"


def _fmt_leaf(sig: tuple) -> str:
    if sig[0] == "tensor":
        return f"tensor{list(sig[1])} {sig[2]} on {sig[3]}"
    return f"{sig[1]} {sig[2]}"


def capture_module(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                   repeated: bool = True) -> Captured:
    """Capture ``model(*args, **kwargs)`` through non-strict ``torch.export``.

    ``repeated``: trace each kind of repeated block once and instantiate it for its siblings
    (:mod:`kopt.repeated`; the same graph as a whole-model trace). A model whose blocks cannot
    be traced that way is traced whole. Raises :class:`CaptureError` naming the construct that
    cannot be captured; the model is not modified either way.
    """
    with collector_skips_what_lives_already():
        return _capture(model, args, kwargs, repeated)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict | None,
             repeated: bool) -> Captured:
    kwargs = dict(sorted((kwargs or {}).items()))
    flat, _ = flatten_inputs(args, kwargs)
    if repeated:
        try:
            traced = trace_with_stand_ins(model, tuple(args), kwargs, _trace)
            if traced is not None:
                ep, registry = traced
                blocks = trace_blocks(ep.graph, registry, _export_block)
                return _made_later(model, tuple(args), kwargs, flat, ep, registry, blocks)
        except Exception as exc:  # noqa: BLE001 -- the whole-model trace decides, and names it
            _traced_whole(exc)
    return _finish(_export_whole(model, tuple(args), kwargs), flat, None)


def _traced_whole(exc: Exception) -> None:
    why = exc.args[0] if isinstance(exc, NotRepeatable) else \
        f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    log.info("kopt: repeated blocks traced with the whole model (%s)", why)


def _export_whole(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    try:
        return _export(model, args, kwargs)
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a CaptureError naming it
        raise _classify(exc) from exc


def _made_later(model: torch.nn.Module, args: tuple, kwargs: dict, flat: list[Any],
                ep: torch.export.ExportedProgram, registry: Any, blocks: Blocks) -> Captured:
    """The capture of a model of repeated blocks, its graph made when first read: the outer
    trace decomposed and every block inlined, which a warm start never needs. Where that
    fails, the whole model is exported then."""
    shared = block_tensors(blocks)

    def tensor(name: str) -> torch.Tensor | None:
        if name in shared:
            return shared[name]
        try:  # the outer trace's weights and each instance's: the model's own, by their paths
            value = attr(model, name)
        except AttributeError:
            return None
        return value if isinstance(value, torch.Tensor) else None

    fp = _traces_fingerprint(blocks, ep, model, tensor)

    decomposed: list[fx.GraphModule] = []

    def outer() -> fx.GraphModule:
        """The outer trace decomposed, its stand-ins still in: made once for the shallow model
        (a copy) and the whole graph."""
        if not decomposed:
            with calls_of(registry):
                decomposed.append(ep.run_decompositions({}).module())
        return decomposed[0]

    def make() -> tuple[fx.GraphModule, Repeated | None]:
        with collector_skips_what_lives_already():
            try:
                gm = outer()
                decomposed.clear()
                instantiate(gm, registry, model, blocks)
                made = blocks.repeated
            except Exception as exc:  # noqa: BLE001 -- the whole-model trace decides
                _traced_whole(exc)
                gm, made = _export_whole(model, args, kwargs), None
            module = _flat_module(gm)
        if fp is not None:  # made deterministically from what ``fp`` hashes, either way
            made_from(module.graph, fp)
        return module, made

    lists = Counter(path.rpartition(".")[0] for path in blocks.repeated.paths)  # calls a list

    def shallow(keep: int) -> Shallow | None:
        if all(n <= keep for n in lists.values()):
            return None  # nothing past the cut
        with collector_skips_what_lives_already():
            try:
                gm = copy_graph_module(outer())  # the whole graph is made from the original
                cut = cut_repeats(gm, registry, keep)
                if cut is None:
                    return None
                instantiate(gm, registry, model, blocks)
                module = _flat_module(gm)
            except Exception as exc:  # noqa: BLE001 -- the whole model is then verified
                log.info("kopt: no shallow model to verify on (%s: %s)", type(exc).__name__,
                         (str(exc).strip().splitlines() or [""])[0][:200])
                return None
        module.meta[SOURCE_KEY] = "export"
        return Shallow(module, cut)

    # the model's forward stands for the graph only where it runs nothing the graph does not:
    # no hooks (an offloading hook moves weights), no training-mode randomness
    plain = not model.training and not any(
        m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return Captured(None, ep.call_spec.in_spec, ep.call_spec.out_spec, flat, "export",
                    blocks.repeated, make=make, fingerprint=fp, tensors=tensor,
                    model=model if plain else None, shallow=shallow)


def _traces_fingerprint(blocks: Blocks, ep: torch.export.ExportedProgram,
                        model: torch.nn.Module,
                        tensor: Callable[[str], torch.Tensor | None]) -> str | None:
    """The fingerprint of the graph made from the traces: their hash
    (:attr:`Repeated.structure`) and every tensor that graph can read -- the outer trace's, each
    instance's own, the blocks' constants -- by name, shape, strides, dtype and device."""
    structure = blocks.repeated.structure
    if structure is None:
        return None
    found = {**ep.state_dict, **ep.constants}
    names = {*found, *block_tensors(blocks)}
    for path in blocks.repeated.paths:
        block = model.get_submodule(path)
        names.update(f"{path}.{n}" for n, _ in (
            *block.named_parameters(remove_duplicate=False),
            *block.named_buffers(remove_duplicate=False)))
    return fingerprint_of(structure, {n: tensor(n) if n not in found else found[n]
                                      for n in names})


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    return torch.export.export(model, tuple(args), kwargs, strict=False)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    return _trace(model, args, kwargs).run_decompositions({}).module()


def _export_block(block: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """One repeated block in kopt's flat IR; it must not write into its inputs or buffers
    (the stand-in op declared it pure)."""
    ep = torch.export.export(block, tuple(args), dict(sorted(kwargs.items())), strict=False)
    ep = ep.run_decompositions({})
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise NotRepeatable("it writes into its inputs or buffers")
    gm = ep.module()
    _make_flat(gm)
    return gm


def _flat_module(gm: fx.GraphModule) -> fx.GraphModule:
    _make_flat(gm, recompile=False)
    # its Python code made when first called or read (as the passes' copies are): the passes
    # copy the graph, and a warm start never runs it on the meta device (W1: 11644 nodes)
    lazy = _LAZY(gm, gm.graph, class_name=type(gm).__name__)
    lazy.meta.update(gm.meta)
    lazy.train(gm.training)
    lazy.meta[SOURCE_KEY] = "export"
    return lazy


def _finish(gm: fx.GraphModule, flat: list[Any], blocks: Repeated | None) -> Captured:
    info = gm.graph._codegen.pytree_info
    return Captured(_flat_module(gm), info.in_spec, info.out_spec, flat, "export", blocks)


def capture_dynamo(
    gm: fx.GraphModule, example_inputs: list[Any]
) -> tuple[Captured, list[int]]:
    """Lower a dynamo graph to kopt's IR. Returns the capture and the indices of the inputs that
    stay runtime inputs (parameters and buffers become constants of the captured graph).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise CaptureError("capture failed", "dynamo graph inputs do not match example inputs")
    for node, ex in zip(placeholders, example_inputs, strict=True):
        if isinstance(ex, torch.SymInt | torch.SymFloat) or (
            isinstance(ex, torch.Tensor)
            and any(isinstance(s, torch.SymInt) for s in ex.shape)
        ):
            raise CaptureError(
                "dynamic shapes", f"input {node.name} has a symbolic size; kopt specialises on "
                "static shapes (compile with dynamic=False)"
            )

    root = torch.nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    runtime: list[int] = []
    runtime_examples: list[Any] = []
    for i, (node, ex) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if _is_static_input(node, ex):
            name = f"static_{i}"
            if isinstance(ex, torch.nn.Parameter):
                root.register_parameter(name, ex)
            else:
                root.register_buffer(name, ex)
            env[node] = graph.get_attr(name)
        else:
            env[node] = graph.placeholder(node.name)
            runtime.append(i)
            runtime_examples.append(ex)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a,
                                         node.args[0]))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    for name, mod in gm.named_children():
        root.add_module(name, mod)
    lifted = fx.GraphModule(root, graph)
    outline_dynamo_blocks(lifted)  # so that the capture traces each repeated block once
    # outside dynamo's tracing context: export would adopt dynamo's fake mode, which refuses
    # the real weights a repeated block's stand-in runs on
    with torch._guards.tracing(None):
        captured = capture_module(lifted, tuple(runtime_examples))
    captured.source = "dynamo"
    if captured.made:  # else set as it is made
        captured.gm.meta[SOURCE_KEY] = "dynamo"
    return captured, runtime


def _is_static_input(node: fx.Node, example: Any) -> bool:
    # dynamo tags the parameters and buffers of nn.Modules it inlined as static inputs.
    if isinstance(example, torch.nn.Parameter):
        return True
    tensor_dict = node.meta.get("tensor_dict") or {}
    return tensor_dict.get("_dynamo_static_input_type") is not None


def _make_flat(gm: fx.GraphModule, recompile: bool = True) -> None:
    """Drop export's input-guard hook and its pytree calling convention: callers flatten.
    ``recompile``: make ``gm``'s Python code now (else the caller replaces ``gm``)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and not node.users and str(node.target).startswith("_guards"):
            target = str(node.target)
            gm.graph.erase_node(node)
            if hasattr(gm, target):
                delattr(gm, target)
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            # export's dtype/device checks on intermediates: capture is already specialised on
            # the input signature, and these extra users would block every pattern match.
            gm.graph.erase_node(node)
    gm.graph._codegen = fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()  # export's pytree input check; callers check signatures
    gm._forward_pre_hooks_with_kwargs.clear()
    if recompile:
        gm.recompile()
    for node in gm.graph.nodes:
        if node.op != "output" and node.users and "val" not in node.meta:
            written = node.args[0] if node.target is torch.ops.aten.copy_.default else None
            if isinstance(written, fx.Node) and written.op == "placeholder":
                raise CaptureError(
                    "input mutation", f"the model writes into its input {written.name} in "
                    "place; kopt captures functional graphs (return the value instead)")
            raise CaptureError("capture failed", f"node {node.name} has no traced value")


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame in the user's code (outside torch and kopt)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_KOPT_DIR):
            code = f" `{frame.line.strip()}`" if frame.line else ""
            return f"{frame.filename}:{frame.lineno}{code}"
    return None


def _classify(exc: BaseException) -> CaptureError:
    where = _user_frame(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, GuardOnDataDependentSymNode):
        return CaptureError(
            "data-dependent control flow",
            "the model branches on a tensor value, which a static graph cannot capture "
            f"({first})",
            where,
        )
    unsupported = (
        torch._subclasses.fake_tensor.UnsupportedOperatorException,
        torch._subclasses.fake_tensor.DynamicOutputShapeException,
        torch._subclasses.fake_tensor.DataDependentOutputException,
    )
    if isinstance(exc, unsupported) or "not supported" in first or "unsupported" in first.lower():
        return CaptureError("unsupported operation", first, where)
    return CaptureError("capture failed", f"{type(exc).__name__}: {first}", where)
