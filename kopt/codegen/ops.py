"""kopt's hot operators, registered with torch.library's low-level API.

``torch.library.custom_op`` wraps every call of an op in Python layers: an autograd function,
a guard that keeps dynamo out of the implementation, output checks. For an inference kernel
launched hundreds of times per model call those layers are host time: on the H200,
``kopt::rowwise`` took 77.8 us per launch through them and 46.4 us without; on the CPU its
dispatch costs 16.2 us registered here, 29.2 us as a ``custom_op``
(``benchmarks/probes/launch_cost.py``; RESULTS.md, 2026-11-30, H200 and CPU).

:func:`define` registers an op the plain way: its schema, the PyTorch reference as the kernel
of every device (``CompositeExplicitAutograd``), the Triton implementation as the CUDA kernel,
and a fake implementation for tracing (``torch.compile``, FakeTensor propagation). The ops have
no backward: they are inference kernels, as under ``custom_op`` without ``register_autograd``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIB = torch.library.Library("kopt", "FRAGMENT")  # noqa: TOR901 -- kopt's namespace

# op -> its Python implementations, by role: the execution plan (:mod:`kopt.runtime`) calls
# them without the dispatcher (``reference`` inlined into a CPU graph, ``cuda`` recorded once
# and its Triton launches replayed)
REFERENCES: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
CUDA_IMPLS: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def define(name: str, schema: str, reference: Callable[..., Any], *,
           fake: Callable[..., Any], cuda: Callable[..., Any] | None = None
           ) -> torch._ops.OpOverload:
    """``kopt::name`` with ``schema`` (``"(Tensor x) -> (Tensor, Tensor)"``): ``reference`` on
    every device, ``cuda`` on CUDA tensors, ``fake`` under tracing. Returns the overload."""
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, reference, "CompositeExplicitAutograd")
    if cuda is not None:
        _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"kopt::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.kopt, name).default
    REFERENCES[op] = reference
    if cuda is not None:
        CUDA_IMPLS[op] = cuda
    return op
