"""Concatenation of strided views as whole-row copies: ``kopt::cat_rows``.

    out = cat(xs, dim)        out contiguous; every x viewed as [outer, rows_i, inner]

``inner`` is the product of the sizes after ``dim`` and must be contiguous in every input (the
views of a merged projection's output are: ``[B, S, H, D]`` slices of ``[B, S, 3 H D]``, each
token's ``H D`` values in a row); the row and outer strides are free. ATen's ``cat`` copies
such inputs element by element (``CatArrayBatchedCopy`` over 2-byte ``OpaqueType``s): on the
H200, W1's joint [text; image] V concatenation runs at ~560 GB/s, 93 us per block, 5.6 ms per
forward (benchmarks/RESULTS.md, session 8). The kernel instead copies each row as contiguous
vectors, one launch per input, every input's rows into their place of the output.

A copy: bitwise the reference (``torch.cat``) on every device, any dtype (the values move as
integers of the element's width).

``biases`` (one entry per input: a vector of the ``inner`` values of a row, or None) adds a
bias to an input's rows on the way, rounded to the dtype as torch's add: ``cat([v + b, ...])``
where a projection's bias was left standing after its GEMM (the blockwise FP8 GEMM's; see
:mod:`kopt.patterns.bias`). Bitwise the reference too (one add, rounded once).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kopt.codegen.ops import define

# Elements one program copies (a chunk of a row).
_BLOCK = 4096
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_view(x: torch.Tensor, dim: int) -> torch.Tensor | str:
    """``x`` viewed as ``[outer, rows, inner]`` around ``dim`` (no copy), or why it cannot be:
    the values after ``dim`` must be one contiguous run per row, the dims before it one stride."""
    outer = math.prod(x.shape[:dim])
    inner = math.prod(x.shape[dim + 1:])
    try:
        v = x.view(outer, x.shape[dim], inner)
    except (RuntimeError, ValueError):  # a fake tensor's view raises ValueError
        return "dims before or after the cat dim do not collapse to one stride"
    if inner > 1 and v.stride(2) != 1:
        return "the values after the cat dim are not contiguous in each row"
    return v


def _fake(xs: list[torch.Tensor], dim: int,
          biases: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    _check_biases(xs, dim, biases)
    return torch.empty(_out_shape(xs, dim), dtype=xs[0].dtype, device=xs[0].device)


def _check_biases(xs: list[torch.Tensor], dim: int,
                  biases: list[torch.Tensor | None] | None) -> None:
    if not biases:
        return
    if len(biases) != len(xs):
        raise ValueError(f"kopt::cat_rows: {len(biases)} biases for {len(xs)} inputs")
    dim = dim % xs[0].dim()
    inner = math.prod(xs[0].shape[dim + 1:])
    for i, b in enumerate(biases):
        if b is not None and (b.dim() != 1 or b.shape[0] != inner or b.dtype != xs[i].dtype):
            raise ValueError(f"kopt::cat_rows: bias {i} is {b.dtype}{list(b.shape)}, not one "
                             f"{xs[i].dtype} vector of the {inner} values of a row")


def _out_shape(xs: Sequence[torch.Tensor], dim: int) -> list[int]:
    shape = list(xs[0].shape)
    shape[dim] = sum(x.shape[dim] for x in xs)
    return shape


def _reference(xs: list[torch.Tensor], dim: int,
               biases: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    _check_biases(xs, dim, biases)
    if biases:
        dim = dim % xs[0].dim()
        xs = [x if b is None else x + b.view(x.shape[dim + 1:]) for x, b in zip(xs, biases,
                                                                              strict=True)]
    return torch.cat(xs, dim)


@triton.jit
def _cat_rows_kernel(x_ptr, out_ptr, b_ptr, rows, inner, stride_outer, stride_row, out_rows,
                     row_offset, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (r, c): chunk c of row r (r over outer x rows) of x into the output's row
    ``row_offset + r % rows`` of the same outer index. Without a bias the values move as
    integers; with one (``HAS_BIAS``: x and out in their float dtype) ``x + b``, rounded once."""
    r = tl.program_id(0)
    o = r // rows
    i = r % rows
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < inner
    src = x_ptr + o.to(tl.int64) * stride_outer + i.to(tl.int64) * stride_row + col
    dst = out_ptr + (o.to(tl.int64) * out_rows + row_offset + i) * inner + col
    if HAS_BIAS:
        v = tl.load(src, mask=mask).to(tl.float32) + tl.load(b_ptr + col, mask=mask).to(tl.float32)
        tl.store(dst, v.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def cat_rows_triton(xs: list[torch.Tensor], dim: int,
                    biases: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The Triton implementation (CUDA, or any device under ``TRITON_INTERPRET=1``); inputs it
    cannot view as rows go to ``torch.cat`` (the reference)."""
    if not xs:
        raise ValueError("kopt::cat_rows needs at least one tensor")
    _check_biases(xs, dim, biases)
    dim = dim % xs[0].dim()
    views = [row_view(x, dim) for x in xs]
    float_bias = xs[0].dtype in (torch.bfloat16, torch.float16, torch.float32)
    if any(isinstance(v, str) for v in views) or len({x.dtype for x in xs}) != 1 \
            or xs[0].element_size() not in _INT_OF_SIZE \
            or (biases and any(b is not None for b in biases) and not float_bias):
        return _reference(xs, dim, biases)
    out = torch.empty(_out_shape(xs, dim), dtype=xs[0].dtype, device=xs[0].device)
    as_int = _INT_OF_SIZE[xs[0].element_size()]
    out_rows = out.shape[dim]
    flat = out.view(-1)
    offset = 0
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        for v, b in zip(views, biases or [None] * len(views), strict=True):
            outer, rows, inner = v.shape
            if outer * rows * inner:
                grid = (outer * rows, triton.cdiv(inner, _BLOCK))
                src, dst = (v, flat) if b is not None else (v.view(as_int), flat.view(as_int))
                _cat_rows_kernel[grid](src, dst, b if b is not None else src, rows, inner,
                                       v.stride(0), v.stride(1), out_rows, offset,
                                       BLOCK=min(_BLOCK, triton.next_power_of_2(inner)),
                                       HAS_BIAS=b is not None)
            offset += rows
    return out


cat_rows = define("cat_rows", "(Tensor[] xs, int dim, Tensor?[]? biases=None) -> Tensor",
                  _reference, fake=_fake, cuda=cat_rows_triton)
