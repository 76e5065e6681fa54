"""Warm start: an optimization the knowledge base has seen is restored, not redone.

A process that optimizes the same model as an earlier one finds the optimized graph that run
recorded and restores it: no pass runs, nothing is matched, re-verified or re-tuned (tuned
kernel configs come from the knowledge base as they always do). "The same" is :func:`key`: the
captured graph's fingerprint (every node, every weight's shape, strides and dtype), the input
signature, the device, the pass pipeline (its configuration and each pass's source), the
verification options, the dead ends in force, and the kopt build (version and source hash) with
torch's and Triton's versions. A changed model, weights' dtype, device or kopt is a miss,
never a stale hit.

What is stored is the optimized graph's structure (:mod:`kopt.graph.serialize`), never a weight:
each attribute the graph reads is a weight of the captured model (taken from the new process's
model), an output of a load program (re-run on the weights now loaded, so FP8 weights and
scales are those of this checkpoint), or a small constant kept by value. A new checkpoint of
the same architecture is therefore a hit.

One cheap end-to-end check guards every hit that can run one (verification on, inputs on a real
device): the restored graph and the captured computation run once on seed 0's random inputs,
and the restored graph's relative error must stay within :data:`CHECK_FACTOR` x what the
recording run measured the same way, or the output dtype's floor. A hit that fails it is
dropped from the knowledge base and the model is optimized cold. A model of repeated blocks
has its captured graph made only when read (:class:`kopt.capture.Captured`): a hit restores
over the model's own tensors and checks against the model's forward, so the graph is never
made.

The stored form is a pickle read by :class:`_Unpickler`, which knows plain data, torch's dtypes
and devices and the few kopt types below: an entry cannot make the reader run code.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import pickle
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from kopt import offload
from kopt.collect import collector_skips_what_lives_already
from kopt.graph import attr, fake_mode_of
from kopt.graph.regions import CachedRegion, cached_regions
from kopt.graph.serialize import (
    NotSerializable,
    Ref,
    Target,
    Val,
    decode_graph,
    describe_tensor,
    encode_graph,
    meta_tensor,
    val_of,
)
from kopt.graph.splice import _LAZY
from kopt.kb.session import Session, active
from kopt.kb.store import KnowledgeBaseError, format_time, kopt_build
from kopt.kb.verdicts import inputs_device, skip_reason, workload_key
from kopt.passes.base import PassResult
from kopt.passes.fold import LoadProgram, skip_packed_rows
from kopt.patterns.core import Rejection, Verdict

if TYPE_CHECKING:
    from kopt.capture import Captured
    from kopt.passes import PassManager
    from kopt.verify import VerifyOptions

log = logging.getLogger("kopt")

# The stored form's version: bump it when what :func:`pack` writes changes meaning.
FORMAT = 1
# A hit passes its end-to-end check when its error is at most this many times the recording
# run's: other weights of the same architecture move the error a little, a wrong constant by
# orders of magnitude.
CHECK_FACTOR = 1.5
# Attributes a pass made outside any load program are stored by value up to this size.
MAX_INLINE_BYTES = 1 << 16


@dataclass(frozen=True)
class _Saved:
    """A small tensor as ``torch.save`` writes it (read back with ``weights_only``)."""

    data: bytes
    device: torch.device


@dataclass
class Stored:
    """What the knowledge base keeps of one optimization (see :func:`pack`)."""

    graph: list[tuple]  # encode_graph of the optimized graph
    class_name: str
    weights: list[str]  # attributes that are the captured model's weights, by name
    inline: dict[str, _Saved | Val]  # small constants; a meta tensor's shape on meta
    # per load program: (its graph, targets, sources, outputs packed in place)
    programs: list[tuple[list[tuple], tuple[str, ...], tuple[str, ...], tuple[int, ...]]]
    regions: dict[str, tuple[list[tuple], tuple[int, ...], tuple[str, ...]]]  # hoisted
    passes: list[PassResult]
    error: float | None  # end-to-end relative error against the captured graph, seed 0
    verified: str  # how the recording run verified: "on seeds 0, 1, 2", or "off"
    pipeline_uuid: str  # the report's (the same build has the same passes)
    meta: dict[str, Any] = field(default_factory=dict)  # the graph module's plain metadata
    captured_nodes: int | None = None  # the captured graph's ops (the report's count)


# -- the key -------------------------------------------------------------------------------


def key(captured: Captured, graph_fingerprint: str, manager: PassManager,
        verify: VerifyOptions, device: str, skipped: Sequence[str], cuda_graphs: bool) -> str:
    """What makes two optimizations the same (the module docstring)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    signature = tuple(describe_tensor(x) if isinstance(x, torch.Tensor) else ("value", repr(x))
                      for x in captured.example_inputs)
    # the passes' code is in the build; their configuration and order here
    pipeline = (repr(manager.config), tuple(p.name for p in manager.passes))
    parts = (FORMAT, kopt_build(), str(torch.__version__), triton_version, device,
             graph_fingerprint, str(captured.in_spec), signature, pipeline,
             verify.enabled, tuple(verify.seeds), verify.blocks, tuple(sorted(skipped)),
             cuda_graphs)
    text = repr(parts)
    if " at 0x" in text:  # an object's address: another process would never match
        at = text.index(" at 0x")
        raise NotSerializable(f"the key would hold an address: ...{text[at - 60:at + 20]}")
    return hashlib.sha256(text.encode()).hexdigest()


# -- packing -------------------------------------------------------------------------------


def pack(captured: Captured, gm: fx.GraphModule, passes: Sequence[PassResult],
         error: float | None, verified: str, pipeline_uuid: str = "") -> bytes:
    """The stored form of ``gm``, the optimized graph of ``captured``: its nodes, where each
    attribute it reads comes from, its load programs and hoisted regions, and the pass
    results for the report. Raises :class:`NotSerializable`."""
    cap = captured.gm
    programs: list[LoadProgram] = list(gm.meta.get("kopt_load_programs", []))
    from_programs = {t for p in programs for t in p.targets}
    regions: dict[str, tuple[list[tuple], tuple[int, ...], tuple[str, ...]]] = {}
    graphs = [gm]
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if type(mod) is not CachedRegion or any(
                n.op == "call_module" for n in mod.region.graph.nodes):
            raise NotSerializable(f"submodule {node.target} ({type(mod).__name__})")
        regions[node.target] = (encode_graph(mod.region.graph), tuple(mod.key_positions),
                                tuple(mod.key_names))
        graphs.append(mod.region)
    weights: list[str] = []
    inline: dict[str, _Saved | Val] = {}
    seen: set[str] = set()
    for g in graphs:
        for node in g.graph.nodes:
            if node.op != "get_attr" or node.target in seen:
                continue
            seen.add(node.target)
            t = attr(g, node.target)
            if node.target in from_programs:
                if t is not attr(gm, node.target):
                    raise NotSerializable(f"{node.target} differs between the graph and a "
                                          "hoisted region")
            elif _attr_or_none(cap, node.target) is t:
                weights.append(node.target)
            elif isinstance(t, torch.Tensor) and t.device.type == "meta":
                inline[node.target] = val_of(t)
            elif isinstance(t, torch.Tensor) and t.nbytes <= MAX_INLINE_BYTES:
                buf = io.BytesIO()
                torch.save(t.detach().to("cpu", copy=True), buf)
                inline[node.target] = _Saved(buf.getvalue(), t.device)
            else:
                raise NotSerializable(f"attribute {node.target} is neither a weight of the "
                                      "model, a load program's output nor a small constant")
    stored_programs = []
    made: set[str] = set()  # targets of the programs before (one may read another's)
    for p in programs:
        for s in p.sources:
            if s not in made and _attr_or_none(cap, s) is not attr(p.graph_module, s):
                raise NotSerializable(f"load program source {s} is not a weight of the model")
        made.update(p.targets)
        stored_programs.append((encode_graph(p.graph_module.graph), tuple(p.targets),
                                tuple(p.sources), tuple(p.packed_in_place)))
    meta = {k: v for k, v in gm.meta.items()
            if k != "kopt_load_programs" and isinstance(v, str | int | float | bool)}
    stored = Stored(encode_graph(gm.graph), type(gm).__name__, weights, inline,
                    stored_programs, regions, list(passes), error, verified, pipeline_uuid,
                    meta, captured_ops(cap))
    return zlib.compress(pickle.dumps(stored, protocol=5), 1)


def _attr_or_none(module: torch.nn.Module, target: str) -> Any:
    try:
        return attr(module, target)
    except AttributeError:
        return None


# -- restoring -----------------------------------------------------------------------------


class _Unpickler(pickle.Unpickler):
    """Reads plain data, torch's dtypes, layouts and devices, and the types a stored graph is
    made of; any other name in the file is refused."""

    _KNOWN = {(c.__module__, c.__qualname__): c
              for c in (Stored, _Saved, Ref, Val, Target, PassResult, Rejection, Verdict)}
    _BUILTINS = {"slice": slice, "complex": complex, "set": set, "frozenset": frozenset}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._KNOWN:
            return self._KNOWN[(module, name)]
        if module == "builtins" and name in self._BUILTINS:
            return self._BUILTINS[name]
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        if module in ("torch", "torch._utils"):  # a memory format pickles as torch._utils's
            obj = getattr(torch, name.removeprefix("torch."), None)
            if obj is torch.device or isinstance(obj, torch.dtype | torch.memory_format):
                return obj
        raise pickle.UnpicklingError(f"a stored graph never names {module}.{name}")


def _layout(name: str) -> torch.layout:
    obj = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(obj, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a tensor layout")
    return obj


def unpack(payload: bytes) -> Stored:
    """The stored form back; raises on anything that is not one."""
    stored = _Unpickler(io.BytesIO(zlib.decompress(payload))).load()
    if not isinstance(stored, Stored):
        raise pickle.UnpicklingError(f"a {type(stored).__name__}, not a stored graph")
    return stored


def restore(captured: Captured, stored: Stored, release: bool = False) -> fx.GraphModule:
    """The optimized graph module of ``stored`` over ``captured``'s weights: the load
    programs run on them, the hoisted regions rebuilt; node for node the graph packed.
    ``release``: each weight the restored graph does not read goes to
    :func:`kopt.offload.release` once the programs read it for the last time."""
    # the captured graph is not made for this (a model's weights are its tensors, by name)
    weight = captured.tensor
    # what stays: the weights the graph reads, and those a program packs in place
    keep = {weight(name).untyped_storage()._cdata for name in stored.weights}
    mode = fake_mode_of(captured.gm) if captured.made else FakeTensorMode()
    root: dict[str, Any] = {name: weight(name) for name in stored.weights}
    for name, v in stored.inline.items():
        root[name] = meta_tensor(v) if isinstance(v, Val) else torch.load(
            io.BytesIO(v.data), weights_only=True).to(v.device)
    reads = {node[2] for nodes in (stored.graph, *(r[0] for r in stored.regions.values()))
             for node in nodes if node[1] == "get_attr"}  # encoded: (name, op, target, ...)
    # run, never inspected: no fake values
    parts = skip_packed_rows([(decode_graph(nodes, None), targets, sources, in_place)
                              for nodes, targets, sources, in_place in stored.programs], reads)
    programs = []
    for graph, targets, sources, in_place in parts:
        out = next(n for n in graph.nodes if n.op == "output").args[0]
        keep.update((root[a.target] if a.target in root else weight(a.target)
                     ).untyped_storage()._cdata for i in in_place for a in out[i].args[0])
        # sources: the model's weights, or the constants of a program before (folded after it)
        program = LoadProgram(_LAZY({s: root[s] if s in root else weight(s)
                                     for s in sources}, graph), targets, sources, in_place)
        # packed as fold_constants did: the merged weights held once
        values = program.run(frozenset(keep) if release else None, pack=True)
        root.update(zip(targets, values, strict=True))
        programs.append(program)
    constants = {t for p in programs for t in p.targets}
    for name, (nodes, positions, names) in stored.regions.items():
        region = _graph_module(decode_graph(nodes, mode), root, constants, "GraphModule")
        root[name] = CachedRegion(region, positions, names)
    graph = decode_graph(stored.graph, mode)
    graph._codegen = captured.gm.graph._codegen if captured.made else fx.graph.CodeGen()
    gm = _graph_module(graph, root, constants, stored.class_name)
    for name in constants - set(gm._buffers):  # read by a hoisted region only
        gm.register_buffer(name, root[name], persistent=False)
    gm.train(captured.training)
    gm.meta.update(captured.meta)
    gm.meta.update(stored.meta)
    gm.meta["kopt_load_programs"] = programs
    return gm


def _graph_module(graph: fx.Graph, root: dict[str, Any], constants: set[str],
                  class_name: str) -> fx.GraphModule:
    used = {n.target for n in graph.nodes if n.op in ("get_attr", "call_module")}
    gm = _LAZY({t: root[t] for t in used}, graph, class_name=class_name)
    for name in used & constants:  # packed constants stay out of the state dict, as made
        gm.register_buffer(name, attr(gm, name), persistent=False)
    return gm


def captured_ops(gm: fx.GraphModule) -> int:
    """The ops of a captured graph: the report's size of it."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


# -- the end-to-end check ------------------------------------------------------------------


def why_unchecked(captured: Captured, verify: VerifyOptions) -> str | None:
    """Why the end-to-end check cannot run on ``captured``, or None."""
    if not verify.enabled:
        return "verification off"
    for x in captured.example_inputs:
        if isinstance(x, torch.Tensor) and (x.device.type == "meta" or isinstance(
                x, torch._subclasses.fake_tensor.FakeTensor)):
            return "inputs on the meta device"
    return None


def end_to_end_error(captured: Captured, gm: fx.GraphModule) -> float:
    """The largest relative error (Frobenius) of ``gm``'s floating outputs against the
    captured graph's on seed 0's random inputs; inf where one of them is not finite where
    the captured graph's is."""
    inputs, want = captured_outputs(captured)
    return error_against(gm, inputs, want)[0]


def captured_outputs(captured: Captured) -> tuple[list[Any], list[Any]]:
    """Seed 0's random inputs and the captured computation's outputs on them
    (:meth:`Captured.outputs`: a warm start makes no captured graph for them): the reference of
    :func:`error_against`, computed first where the other graph's making releases weights."""
    from kopt.verify import random_inputs

    inputs = random_inputs(captured.example_inputs, 0)
    return inputs, captured.outputs(inputs)


def error_against(gm: fx.GraphModule, inputs: list[Any], want: list[Any]
                  ) -> tuple[float, list[Any]]:
    """(:func:`end_to_end_error` of ``gm`` against the captured graph's outputs ``want``,
    ``gm``'s outputs)."""
    from kopt.verify import run_flat

    got = pytree.tree_leaves(run_flat(gm, inputs))
    for region in cached_regions(gm):
        region.clear()  # random inputs are no entry to serve later calls from
    return outputs_error(got, want), got


def outputs_error(got: Sequence[Any], want: Sequence[Any]) -> float:
    """:func:`end_to_end_error` of outputs already computed."""
    from kopt.verify import relative_error

    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            continue
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite):
            return math.inf
        worst = max(worst, relative_error(a[finite], b[finite]))
    return worst


def error_bound(want: Sequence[Any], recorded: float | None) -> float:
    """The error a hit may show: :data:`CHECK_FACTOR` x the recording run's, and at least the
    floor of the captured computation's floating output dtypes (``want``, its outputs;
    ``kopt.verify.RTOL_FLOOR``)."""
    from kopt.verify import RTOL_FLOOR

    floors = [RTOL_FLOOR.get(v.dtype, RTOL_FLOOR[torch.bfloat16]) for v in want
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return max(CHECK_FACTOR * (recorded or 0.0), max(floors, default=0.0))


# -- the knowledge base's part -------------------------------------------------------------


@dataclass
class WarmStart:
    """One optimization's lookup and record in the active knowledge base. :meth:`lookup`
    returns None outside a :func:`kopt.kb.using` scope."""

    session: Session
    key: str
    workload: str
    device: str

    @classmethod
    def lookup(cls, captured: Captured, manager: PassManager, verify: VerifyOptions,
               cuda_graphs: bool) -> WarmStart | None:
        s = active()
        if s is None or s.retry:  # asked to run the dead ends again: every pass runs afresh
            return None
        try:
            graph_fingerprint = captured.fingerprint()
        except NotSerializable as e:
            log.info("kopt: no warm start for this model: %s", e)
            return None
        workload = s.workload or workload_key(None, captured.example_inputs,
                                              graph_fingerprint)
        device = s.device or inputs_device(captured.example_inputs)

        def dead_end(p: Any, uuid: str | None) -> bool:
            return s.guard("reading verdicts", lambda: skip_reason(
                s.kb, p.name, workload, device, regime=s.regime, uuid=uuid,
                cuda_graphs=cuda_graphs), None) is not None

        def skipped(p: Any) -> bool:  # a dead end of any version first: a uuid costs 10 ms
            return dead_end(p, None) and dead_end(p, p.uuid())

        dead = [p.name for p in manager.passes if skipped(p)]
        try:
            k = key(captured, graph_fingerprint, manager, verify, device, dead, cuda_graphs)
        except NotSerializable as e:
            log.info("kopt: no warm start for this model: %s", e)
            return None
        return cls(s, k, workload, device)

    def restore(self, captured: Captured, verify: VerifyOptions
                ) -> tuple[fx.GraphModule, list[PassResult], str, str, list[Any] | None,
                           int | None] | None:
        """(graph, marked pass results, the pipeline's uuid, the report's line, the graph's
        outputs on seed 0's random inputs where its check ran it, the captured graph's op count
        as recorded) of a stored optimization that restores and passes its check, or None (a
        miss, or an entry dropped: logged)."""
        s = self.session
        found = s.guard("reading optimized graphs", lambda: s.kb.graph(self.key), None)
        if found is None:
            return None
        record, payload = found
        t0 = time.perf_counter()
        why = why_unchecked(captured, verify)
        try:  # the captured graph's outputs first: the restore releases the weights FP8 packs
            inputs, want = captured_outputs(captured) if why is None else ([], [])
        except Exception as e:  # noqa: BLE001 -- never the user's: optimized cold instead
            self._drop(record.entry_id, f"its end-to-end check raised {type(e).__name__} in "
                                        "the captured graph")
            return None
        before = offload.released()
        try:
            with collector_skips_what_lives_already():  # W1: 18000 values made, none freed
                stored = unpack(payload)
                gm = restore(captured, stored, release=True)
        except Exception as e:  # an entry this kopt cannot use: never a reason to fail
            offload.give_back(offload.released() - before)  # the cold passes read them
            self._drop(record.entry_id, f"it could not be restored ({type(e).__name__}: {e})")
            return None
        if why is None:
            try:
                error, outputs = error_against(gm, inputs, want)
            except Exception as e:  # the restored graph does not even run: never the user's
                offload.give_back(offload.released() - before)
                self._drop(record.entry_id, f"its end-to-end check raised {type(e).__name__}: "
                                            f"{str(e).splitlines()[0][:200] if str(e) else ''}")
                return None
            bound = error_bound(want, stored.error)
            recorded = "" if stored.error is None else f", {stored.error:.3g} when recorded"
            if not error <= bound:
                offload.give_back(offload.released() - before)
                self._drop(record.entry_id, f"its end-to-end check failed: relative error "
                                            f"{error:.3g} against the captured graph, above "
                                            f"{bound:.3g}{recorded}")
                return None
            check = f"end-to-end check on seed 0 passed: relative error {error:.3g} " \
                    f"(at most {bound:.3g}{recorded})"
        else:
            check, outputs = f"end-to-end check not run ({why})", None
        s.guard("recording a hit", lambda: s.kb.graph_used(record.id), None)
        line = (f"warm start: optimized graph {record.entry_id} restored from the knowledge "
                f"base in {time.perf_counter() - t0:.2f} s (recorded "
                f"{format_time(record.created_at)}, verification {stored.verified}); no pass "
                f"re-run or re-verified; {check}")
        s.used.append(line.removeprefix("warm start: "))
        s.last_workload, s.last_device = self.workload, self.device
        log.debug("kopt: %s", line)  # the report prints it
        passes = [replace(r, seconds=0.0, check_seconds=0.0, from_kb=record.entry_id)
                  for r in stored.passes]
        return gm, passes, stored.pipeline_uuid, line, outputs, stored.captured_nodes

    def record(self, captured: Captured, gm: fx.GraphModule, passes: Sequence[PassResult],
               verify: VerifyOptions, pipeline_uuid: str,
               outputs: tuple[Sequence[Any], Sequence[Any]] | None = None) -> None:
        """Store a cold optimization: a hit gives what this run kept (a pass that failed
        verification is left out there too). A run where a check could not run at all (a pass
        raised, a reference ran out of memory) is not stored, since the next run may get
        further; nor is a graph the stored form cannot express (logged). ``outputs``: (``gm``'s
        outputs, the captured graph's) on seed 0's inputs, as verification kept them; else
        both graphs run again (the captured one with the weights FP8 released, brought back
        for it)."""
        if any(r.verdict is not None and r.verdict.unverifiable for r in passes):
            return
        verified = f"on seeds {', '.join(map(str, verify.seeds))}" if verify.enabled else "off"
        try:
            if why_unchecked(captured, verify) is not None:
                error = None
            elif outputs is not None:
                error = outputs_error(*outputs)
            else:
                with offload.on_device():
                    error = end_to_end_error(captured, gm)
            payload = pack(captured, gm, passes, error, verified, pipeline_uuid)
        except Exception as e:  # noqa: BLE001 -- storing is a bonus: never fail the user's run
            log.info("kopt: the optimized graph is not stored for a warm start: %s: %s",
                     type(e).__name__, e)
            return
        nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        s = self.session
        gid = s.guard("recording an optimized graph", lambda: s.kb.record_graph(
            self.key, self.workload, self.device, kopt_build(), nodes, len(payload), payload),
            None)
        if gid is not None:
            s.recorded.append(f"G{gid}: the optimized graph ({nodes} nodes, "
                              f"{len(payload) / 2**20:.1f} MiB), for a warm start")

    def _drop(self, entry: str, why: str) -> None:
        s = self.session
        log.warning("kopt: knowledge-base entry %s dropped: %s; optimizing cold", entry, why)
        s.used.append(f"{entry} dropped: {why}; optimized cold")
        try:
            s.kb.drop_graph(int(entry[1:]))
        except KnowledgeBaseError as e:
            log.warning("kopt: could not drop %s: %s", entry, e)
