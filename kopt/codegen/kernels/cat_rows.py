"""Concatenation of strided views as whole-row copies: ``kopt::cat_rows``.

    out = cat(xs, dim)        out contiguous; every x viewed as [outer, rows_i, inner]

``inner`` is the product of the sizes after ``dim`` and must be contiguous in every input (the
views of a merged projection's output are: ``[B, S, H, D]`` slices of ``[B, S, 3 H D]``, each
token's ``H D`` values in a row); the row and outer strides are free. ATen's ``cat`` copies
such inputs element by element (``CatArrayBatchedCopy`` over 2-byte ``OpaqueType``s): on the
H200, W1's joint [text; image] V concatenation runs at ~560 GB/s, 93 us per block, 5.6 ms per
forward (RESULTS.md, 2026-11-30). The kernel instead copies each row as contiguous
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

from kopt.codegen.launch import launch
from kopt.codegen.ops import define

# A flat range of the output a program, at 8 bf16 (16 bytes) a thread: Inductor's form for the
# same cat. W1's joint V on the H200: 14.1 us flat, 14.2 at the best of 75 2-D tilings, 14.7
# as 2-D tiles of 8192 values at 8 warps; Inductor's kernel 14.0-14.1 (RESULTS.md, 2026-12-01).
_XBLOCK = 1024
_WARPS = 4
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
def _cat_rows_kernel(x_ptr, y_ptr, out_ptr, bx_ptr, by_ptr, total, rows, out_rows, row_offset,
                     sx_outer, sx_row, sy_outer, sy_row, INNER: tl.constexpr,
                     XBLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, TWO: tl.constexpr,
                     OUTER: tl.constexpr, WIDE: tl.constexpr):
    """A flat range of XBLOCK elements a program, over the ``total`` elements of ``rows``
    rows of ``INNER`` values per outer index, each row's values contiguous. ``TWO``: the range
    is the output's, row ``j`` of an outer index from x (``j < rows``) or y (both inputs in
    one launch); else x's, each row going to the output's row ``row_offset + i``. ``OUTER``:
    more than one outer index (else no division by the rows). ``WIDE``: 64-bit offsets.
    Without a bias the values move as integers; with one (``HAS_BIAS``: x and out in their
    float dtype) ``x + b``, rounded once. The row length is a compile-time constant (a model's
    hidden size: its division is a multiply), the row counts not (a new text length does not
    recompile)."""
    idx = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    if WIDE:
        idx = tl.program_id(0).to(tl.int64) * XBLOCK + tl.arange(0, XBLOCK)
    mask = idx < total
    r = idx // INNER
    col = idx % INNER
    if TWO:
        o = r // out_rows if OUTER else 0
        j = r % out_rows if OUTER else r
        in_x = j < rows
        vx = tl.load(x_ptr + o * sx_outer + j * sx_row + col, mask=mask & in_x)
        vy = tl.load(y_ptr + o * sy_outer + (j - rows) * sy_row + col, mask=mask & (j >= rows))
        v = tl.where(in_x, vx, vy)
        dst = idx
        if HAS_BIAS:
            b = tl.where(in_x, tl.load(bx_ptr + col, mask=mask & in_x),
                         tl.load(by_ptr + col, mask=mask & (j >= rows)))
    else:
        o = r // rows if OUTER else 0
        i = r % rows if OUTER else r
        v = tl.load(x_ptr + o * sx_outer + i * sx_row + col, mask=mask)
        dst = (o * out_rows + row_offset + i) * INNER + col
        if HAS_BIAS:
            b = tl.load(bx_ptr + col, mask=mask)
    if HAS_BIAS:
        v = (v.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty,
                                                      fp_downcast_rounding="rtne")
    tl.store(out_ptr + dst, v, mask=mask)


def _launch(x: torch.Tensor, y: torch.Tensor, flat: torch.Tensor, bx: torch.Tensor | None,
            by: torch.Tensor | None, total_rows: int, rows: int, out_rows: int, offset: int,
            two: bool) -> None:
    inner, outer = x.shape[2], x.shape[0]
    total = total_rows * inner
    spans = [flat.numel()] + [(t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1)
                              + inner for t in (x, y) if t.shape[1]]
    launch(_cat_rows_kernel, (triton.cdiv(total, _XBLOCK),),
        x, y, flat, bx if bx is not None else x, by if by is not None else x, total, rows,
        out_rows, offset, x.stride(0), x.stride(1), y.stride(0), y.stride(1), INNER=inner,
        XBLOCK=_XBLOCK, HAS_BIAS=bx is not None, TWO=two, OUTER=outer > 1,
        WIDE=max(spans) >= 2**31 - _XBLOCK, num_warps=_WARPS)


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
