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


def _fake(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.empty(_out_shape(xs, dim), dtype=xs[0].dtype, device=xs[0].device)


def _out_shape(xs: Sequence[torch.Tensor], dim: int) -> list[int]:
    shape = list(xs[0].shape)
    shape[dim] = sum(x.shape[dim] for x in xs)
    return shape


def _reference(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(xs, dim)


@triton.jit
def _cat_rows_kernel(x_ptr, out_ptr, rows, inner, stride_outer, stride_row, out_rows,
                     row_offset, BLOCK: tl.constexpr):
    """Program (r, c): chunk c of row r (r over outer x rows) of x into the output's row
    ``row_offset + r % rows`` of the same outer index."""
    r = tl.program_id(0)
    o = r // rows
    i = r % rows
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < inner
    src = x_ptr + o.to(tl.int64) * stride_outer + i.to(tl.int64) * stride_row + col
    dst = out_ptr + (o.to(tl.int64) * out_rows + row_offset + i) * inner + col
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def cat_rows_triton(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The Triton implementation (CUDA, or any device under ``TRITON_INTERPRET=1``); inputs it
    cannot view as rows go to ``torch.cat``."""
    if not xs:
        raise ValueError("kopt::cat_rows needs at least one tensor")
    dim = dim % xs[0].dim()
    views = [row_view(x, dim) for x in xs]
    if any(isinstance(v, str) for v in views) or len({x.dtype for x in xs}) != 1 \
            or xs[0].element_size() not in _INT_OF_SIZE:
        return torch.cat(xs, dim)
    out = torch.empty(_out_shape(xs, dim), dtype=xs[0].dtype, device=xs[0].device)
    as_int = _INT_OF_SIZE[xs[0].element_size()]
    out_rows = out.shape[dim]
    flat = out.view(-1).view(as_int)
    offset = 0
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        for v in views:
            outer, rows, inner = v.shape
            if outer * rows * inner:
                grid = (outer * rows, triton.cdiv(inner, _BLOCK))
                _cat_rows_kernel[grid](v.view(as_int), flat, rows, inner, v.stride(0),
                                       v.stride(1), out_rows, offset,
                                       BLOCK=min(_BLOCK, triton.next_power_of_2(inner)))
            offset += rows
    return out


cat_rows = define("cat_rows", "(Tensor[] xs, int dim) -> Tensor", _reference, fake=_fake,
                  cuda=cat_rows_triton)
