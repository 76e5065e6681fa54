"""``kopt::allreduce_residual_norm``: a tensor-parallel block's all-reduce fused with the residual
update and the norm after it.

    h = x + gate * all_reduce(y_partial)      the row-parallel GEMM's partial sums, completed
    n = norm(h) [-> modulation / epilogue]    the kopt::rowwise spec's steps
    -> out, residual = h, FP8 per token ...   the spec's outputs

``(Tensor[] inputs, str spec, str group_name) -> Tensor[]``: ``inputs`` and ``spec`` are exactly a
``kopt::rowwise`` call (:class:`kopt.codegen.rowwise.RowwiseSpec`, with ``residual``), except that
the ``y`` input is this rank's partial sum; ``group_name`` names the process group to sum over.

Implementations:

* generic (CPU, and any device without the CUDA path): ``_c10d_functional.all_reduce`` +
  ``wait_tensor`` on ``y``, then ``kopt::rowwise`` -- the unfused ops, so the result is bitwise
  the unfused graph's.
* CUDA: ``torch.distributed._symmetric_memory`` -- ``y`` is copied into a symmetric buffer of
  its shape (allocated and rendezvoused once per shape, dtype and group) and summed by
  ``symm_mem::one_shot_all_reduce_copy`` (each rank reads every peer's buffer over NVLink; one
  kernel, no NCCL launch) for small messages, or ``symm_mem::two_shot_all_reduce_``
  (reduce-scatter + all-gather through peer memory) above :data:`ONE_SHOT_MAX_BYTES`; then
  the row-wise Triton kernel. Both are PyTorch's own collectives (no multicast / NVLS object is
  used, so NCCL_NVLS_ENABLE=0 is respected); nothing here moves bytes itself. Untested by the
  CPU suite: tests/gpu/test_tp_gpu.py and benchmarks/tp_allreduce_norm.py check it on 2 GPUs.
  Where symmetric memory is unavailable (no such ops in this torch build, a non-NCCL group) the
  generic path runs instead; the choice depends only on the build and the group, so every rank
  makes the same one.

Numerics: ``tolerance`` -- the norm's reduction order (the rowwise kernel), and on more than two
ranks the order in which the partial sums are added (one-shot adds rank 0..N-1 in every rank's
kernel; NCCL's ring another order). For two ranks the sum itself is one IEEE add (commutative),
bitwise NCCL's.
"""

from __future__ import annotations

import functools

import torch

import kopt.codegen.rowwise  # noqa: F401 -- registers kopt::rowwise
from kopt.codegen import FP64_REFERENCES, fp64_reference
from kopt.codegen.rowwise import RowwiseError, RowwiseSpec

# messages up to this size go one-shot; above it, two-shot. At W2's 4608 x 6144 bf16 (57 MB) on
# 2 H200s, one-shot + norm took 0.52 ms, NCCL + norm 0.34-0.48, two-shot + norm 0.28-0.36
# (RESULTS.md, 2026-11-29); where the crossover lies below that is not measured yet.
ONE_SHOT_MAX_BYTES = 1 << 20


def _spec(text: str) -> RowwiseSpec:
    spec = RowwiseSpec.from_json(text)
    if not spec.residual:
        raise RowwiseError("allreduce_residual_norm needs a spec with a residual input (y)")
    return spec


def _y_index(spec: RowwiseSpec) -> int:
    return spec.input_names().index("y")


def _all_reduce(y: torch.Tensor, group_name: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", group_name))


def allreduce_residual_norm_reference(inputs: list[torch.Tensor], spec: str,
                                      group_name: str) -> list[torch.Tensor]:
    """The unfused computation: the functional all-reduce, then the row-wise op."""
    s = _spec(spec)
    i = _y_index(s)
    inputs = [*inputs[:i], _all_reduce(inputs[i], group_name), *inputs[i + 1:]]
    return torch.ops.kopt.rowwise(inputs, spec)


@torch.library.custom_op("kopt::allreduce_residual_norm", mutates_args=())
def allreduce_residual_norm_op(inputs: list[torch.Tensor], spec: str,
                               group_name: str) -> list[torch.Tensor]:
    return allreduce_residual_norm_reference(inputs, spec, group_name)


@allreduce_residual_norm_op.register_fake
def _(inputs: list[torch.Tensor], spec: str, group_name: str) -> list[torch.Tensor]:
    _spec(spec)
    return torch.ops.kopt.rowwise(inputs, spec)  # the row-wise op's fake: shapes, dtypes, checks


@allreduce_residual_norm_op.register_kernel("cuda")
def _(inputs: list[torch.Tensor], spec: str, group_name: str) -> list[torch.Tensor]:
    s = _spec(spec)
    if not symm_mem_available(group_name):
        return allreduce_residual_norm_reference(inputs, spec, group_name)
    i = _y_index(s)
    summed = symm_mem_all_reduce(inputs[i], group_name)
    return torch.ops.kopt.rowwise([*inputs[:i], summed, *inputs[i + 1:]], spec)


@fp64_reference(torch.ops.kopt.allreduce_residual_norm.default)
def _allreduce_norm64(inputs: list[torch.Tensor], spec: str,
                      group_name: str) -> list[torch.Tensor]:
    """The verifier's yardstick: the fp64 partial sums all-reduced in fp64, then the row-wise
    op's exact fp64 function."""
    s = _spec(spec)
    i = _y_index(s)
    inputs = [*inputs[:i], _all_reduce(inputs[i], group_name), *inputs[i + 1:]]
    return FP64_REFERENCES[torch.ops.kopt.rowwise.default](inputs, spec)


# ------------------------------------------------------------------------------------------------
# CUDA: PyTorch's symmetric-memory all-reduce

@functools.cache
def symm_mem_available(group_name: str) -> bool:
    """Whether this torch build has the symmetric-memory all-reduce ops and the group is a CUDA
    (NCCL) group. Depends on the build and the group only, never on a rank's data."""
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return False
    try:
        torch.ops.symm_mem.one_shot_all_reduce_copy.default  # noqa: B018 -- presence check
        torch.ops.symm_mem.two_shot_all_reduce_.default  # noqa: B018
        from torch.distributed import _symmetric_memory  # noqa: F401
        from torch.distributed.distributed_c10d import _resolve_process_group
    except (AttributeError, ImportError, RuntimeError):
        return False
    group = _resolve_process_group(group_name)
    return dist.get_backend(group) == "nccl"


# (group, shape, dtype, device) -> the symmetric buffer; rendezvous is collective, so every rank
# allocates the same buffers in the same order (the op runs at the same points on every rank).
_BUFFERS: dict[tuple, torch.Tensor] = {}


def symm_mem_buffer(group_name: str, shape: torch.Size, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A symmetric-memory tensor of ``shape`` on ``device``, rendezvoused in ``group_name``."""
    from torch.distributed import _symmetric_memory as symm_mem

    key = (group_name, tuple(shape), dtype, device)
    buf = _BUFFERS.get(key)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("allreduce_residual_norm: first call of a shape under CUDA graph "
                               "capture; run it once eagerly (warm-up) to allocate its buffer")
        buf = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        _BUFFERS[key] = buf
    return buf


def symm_mem_all_reduce(y: torch.Tensor, group_name: str, algorithm: str = "auto") -> torch.Tensor:
    """Sum of ``y`` over the group through symmetric memory: ``one_shot`` (each rank reads every
    peer's buffer), ``two_shot`` (reduce-scatter + all-gather through peer memory, in place in
    the symmetric buffer, whose contents the next call of this shape overwrites), or ``auto``."""

    y = y.contiguous()
    buf = symm_mem_buffer(group_name, y.shape, y.dtype, y.device)
    if algorithm == "auto":
        small = y.numel() * y.element_size() <= ONE_SHOT_MAX_BYTES
        algorithm = "one_shot" if small else "two_shot"
    if algorithm == "one_shot":
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, y, "sum", group_name)
    if algorithm == "two_shot":
        buf.copy_(y)
        return torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
    raise ValueError(f"algorithm must be auto, one_shot or two_shot, got {algorithm!r}")


def allreduce_residual_norm(spec: RowwiseSpec, group_name: str,
                            **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Call the op with named inputs (:meth:`RowwiseSpec.input_names`, ``y`` the partial sum);
    returns the outputs by name."""
    names = spec.input_names()
    missing, extra = set(names) - set(inputs), set(inputs) - set(names)
    if missing or extra:
        raise RowwiseError(f"spec takes inputs {names}: missing {sorted(missing)}, unexpected "
                           f"{sorted(extra)}")
    outs = torch.ops.kopt.allreduce_residual_norm([inputs[n] for n in names], spec.to_json(),
                                                  group_name)
    return dict(zip(spec.output_names(), outs, strict=True))
