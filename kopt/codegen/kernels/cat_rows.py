"""Concatenation of strided views as whole-row copies: ``kopt::cat_rows``.

    out = cat(xs, dim)        out contiguous; every x viewed as [outer, rows_i, inner]

``inner`` is the product of the sizes after ``dim`` and must be contiguous in every input (the
views of a merged projection's output are: ``[B, S, H, D]`` slices of ``[B, S, 3 H D]``, each
token's ``H D`` values in a row); the row and outer strides are free. ATen's ``cat`` copies
such inputs element by element (``CatArrayBatchedCopy`` over 2-byte ``OpaqueType``s): on the
H200, W1's joint [text; image] V concatenation runs at ~560 GB/s, 93 us per block, 5.6 ms per
forward (benchmarks/RESULTS.md, session 8). The kernel instead copies each row as contiguous
vectors, every input's rows into their place of the output: two inputs (the joint [text;
image] attention inputs) in one launch, more in one launch each.

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

# Elements of one row a program copies at most, and of all its rows (H200, session 17: W1's
# joint V 16.4 -> 14.8 us, 0.91 -> 1.02 of a same-size copy, with one launch for both inputs
# against one row of 3072 as a masked 4096 per program and a launch per input).
_BLOCK = 4096
_TILE = 8192
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
def _cat_rows_kernel(x_ptr, y_ptr, out_ptr, bx_ptr, by_ptr, total_rows, rows, inner,
                     sx_outer, sx_row, sy_outer, sy_row, out_rows, row_offset,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     TWO: tl.constexpr):
    """Program (p, c): chunk c of rows p * ROWS .. p * ROWS + ROWS - 1 (over outer x rows) of x
    into the output's rows ``row_offset + r % rows`` of the same outer index. ``TWO``: the
    rows are the output's (``out_rows`` a outer index), the first ``rows`` of each from x and
    the others from y: both inputs in one launch. Without a bias the values move as integers;
    with one (``HAS_BIAS``: x and out in their float dtype) ``x + b``, rounded once."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < total_rows)[:, None] & (col < inner)[None, :]
    if TWO:
        o = (r // out_rows).to(tl.int64)
        j = (r % out_rows).to(tl.int64)
        in_x = j < rows
        base = tl.where(in_x, x_ptr + o * sx_outer + j * sx_row,
                        y_ptr + o * sy_outer + (j - rows) * sy_row)
        dst_row = o * out_rows + j
    else:
        o = (r // rows).to(tl.int64)
        i = (r % rows).to(tl.int64)
        base = x_ptr + o * sx_outer + i * sx_row
        dst_row = o * out_rows + row_offset + i
    src = base[:, None] + col[None, :]
    dst = out_ptr + (dst_row * inner)[:, None] + col[None, :]
    if HAS_BIAS:
        if TWO:
            b = tl.load(tl.where(in_x, bx_ptr, by_ptr)[:, None] + col[None, :], mask=mask)
        else:
            b = tl.load(bx_ptr + col, mask=col < inner)[None, :]
        v = tl.load(src, mask=mask).to(tl.float32) + b.to(tl.float32)
        tl.store(dst, v.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _tiling(inner: int, total_rows: int) -> tuple[int, int, int]:
    """(rows per program, columns per program, warps): a chunk of a row is the largest power of
    two up to _BLOCK dividing ``inner`` (no masked lanes: 3072 = 3 x 1024), or the whole row
    rounded up when that is under 128; rows are stacked to _TILE values a program."""
    block = min(_BLOCK, inner & -inner) if inner else 1
    if block < 128:
        block = min(_BLOCK, triton.next_power_of_2(inner))
    rows = max(1, min(_TILE // block, triton.next_power_of_2(total_rows)))
    return rows, block, max(1, min(8, rows * block // 1024))


def _launch(x: torch.Tensor, y: torch.Tensor, flat: torch.Tensor, bx: torch.Tensor | None,
            by: torch.Tensor | None, total_rows: int, rows: int, out_rows: int, offset: int,
            two: bool) -> None:
    inner = x.shape[2]
    per, block, warps = _tiling(inner, total_rows)
    grid = (triton.cdiv(total_rows, per), triton.cdiv(inner, block))
    _cat_rows_kernel[grid](x, y, flat, bx if bx is not None else x, by if by is not None else x,
                           total_rows, rows, inner, x.stride(0), x.stride(1), y.stride(0),
                           y.stride(1), out_rows, offset, ROWS=per, BLOCK=block,
                           HAS_BIAS=bx is not None, TWO=two, num_warps=warps)


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
    out_rows = out.shape[dim]
    bs = list(biases or [None] * len(views))
    as_int = _INT_OF_SIZE[xs[0].element_size()]

    def moved(v: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy moves the values as integers; a bias add in the float dtype."""
        flat = out.view(-1)
        return (v, flat) if b is not None else (v.view(as_int), flat.view(as_int))

    outer, inner = views[0].shape[0], views[0].shape[2]
    if outer * out_rows * inner == 0:
        return out
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        if len(views) == 2 and (bs[0] is None) == (bs[1] is None):
            # (the joint [text; image] attention inputs) both in one launch
            (x, flat), (y, _) = moved(views[0], bs[0]), moved(views[1], bs[1])
            _launch(x, y, flat, bs[0], bs[1], outer * out_rows, x.shape[1], out_rows, 0, True)
        else:
            offset = 0
            for v, b in zip(views, bs, strict=True):
                if v.shape[1]:
                    src, flat = moved(v, b)
                    _launch(src, src, flat, b, b, outer * v.shape[1], v.shape[1], out_rows,
                            offset, False)
                offset += v.shape[1]
    return out


cat_rows = define("cat_rows", "(Tensor[] xs, int dim, Tensor?[]? biases=None) -> Tensor",
                  _reference, fake=_fake, cuda=cat_rows_triton)
