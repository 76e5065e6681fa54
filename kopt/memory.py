"""What an optimized model holds in memory, by kind: what a serving engine sizes its GPUs by.

Tensors are counted by storage, once each (a merged weight and the views of it the graph reads
are one allocation), and only where they hold memory (not on the ``meta`` device):

* ``weights``: the model's own parameters and buffers that an optimized graph reads;
* ``packed``: constants kopt made at load time (merged, transposed, FP8-quantized weights and
  their scales) and any other tensor a graph holds that the model does not own;
* ``original_only``: the model's parameters and buffers that no optimized graph reads, kept
  alive by the original model alone (the BF16 weights that FP8 replaced, for one);
* ``caches``: the outputs hoisted regions hold for the timesteps they have seen;
* ``graph_pool``: the CUDA-graph memory pool the module's graphs share (None before a capture);
* ``host``: the model's weights no graph reads that were moved to host memory
  (``kopt.offload``), which frees their device memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt.graph.query import attr
from kopt.graph.regions import CachedRegion

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class MemoryHeld:
    """Bytes held, by kind (module docstring)."""

    weights: int
    packed: int
    original_only: int
    caches: int
    graph_pool: int | None
    host: int = 0  # the model's weights moved to host memory (``kopt.offload``)

    @property
    def optimized(self) -> int:
        """What the optimized module needs once the original model's own copies are dropped."""
        return self.weights + self.packed + self.caches + (self.graph_pool or 0)

    def describe(self) -> str:
        pool = "" if self.graph_pool is None else f", {_size(self.graph_pool)} CUDA-graph pool"
        return (f"memory held: {_size(self.weights)} of the model's weights read by the graph, "
                f"{_size(self.packed)} packed constants, {_size(self.caches)} hoisted caches"
                f"{pool}; besides, {_size(self.original_only)} of the model's weights that "
                "only the original model reads"
                + (f", and {_size(self.host)} of them moved to host memory "
                   "(keep_original=True keeps them on the device)" if self.host else ""))


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(identity, bytes) of the allocation behind ``t``; None where it holds no memory."""
    if t.device.type == "meta" or getattr(t, "fake_mode", None) is not None:
        return None
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes()), s.nbytes()


def tensors_read(graphs: Iterable[fx.GraphModule]) -> list[torch.Tensor]:
    out = []
    for gm in graphs:
        for mod in gm.modules():
            if not isinstance(mod, fx.GraphModule):
                continue
            for node in mod.graph.nodes:
                if node.op == "get_attr":
                    value = attr(mod, node.target)
                    if isinstance(value, torch.Tensor):
                        out.append(value)
    return out


def memory_held(model: torch.nn.Module | Iterable[torch.Tensor],
                graphs: Iterable[fx.GraphModule], graph_pool: int | None,
                host: int = 0) -> MemoryHeld:
    """What ``model`` (a module, or the parameters and buffers a dynamo graph was given)
    optimized into ``graphs`` (each with its hoisted regions) holds."""
    graphs = list(graphs)
    tensors = [*model.parameters(), *model.buffers()] if isinstance(model, torch.nn.Module) \
        else list(model)
    owned: dict[tuple, int] = {}
    for t in tensors:
        if (s := _storage(t)) is not None:
            owned[s[0]] = s[1]
    read: dict[tuple, int] = {}
    for t in tensors_read(graphs):
        if (s := _storage(t)) is not None:
            read[s[0]] = s[1]
    caches: dict[tuple, int] = {}
    for gm in graphs:
        for mod in gm.modules():
            if isinstance(mod, CachedRegion):
                for _, _, outputs in mod._entries:
                    for t in pytree.tree_leaves(outputs):
                        if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
                            caches[s[0]] = s[1]
    return MemoryHeld(
        weights=sum(n for k, n in read.items() if k in owned),
        packed=sum(n for k, n in read.items() if k not in owned),
        original_only=sum(n for k, n in owned.items() if k not in read),
        caches=sum(n for k, n in caches.items() if k not in read),
        graph_pool=graph_pool, host=host)
