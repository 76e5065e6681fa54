"""Code generation: fused ops as ``torch.library`` custom ops (Triton on the GPU, the PyTorch
reference on the CPU and for verification, a fake implementation for tracing).

Each op also registers its exact fp64 function in :data:`FP64_REFERENCES`: the verifier runs a
graph in fp64 as the yardstick of the tolerance tier, and a fused op's own kernels have no fp64
variant (nor should the yardstick round where the kernel does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FP64_REFERENCES: dict[Any, Callable[..., Any]] = {}


def fp64_reference(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the fp64 function of ``op`` (an OpOverload); it receives the op's
    arguments with every floating tensor and dtype already promoted to fp64."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        FP64_REFERENCES[op] = fn
        return fn
    return register
