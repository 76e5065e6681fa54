"""``kopt::cat_rows`` tile sweep at the W1/W2 joint-V shapes against Inductor's kernel for the
same ``torch.cat`` (``kernel_times``' method: CUDA-graph replays over rotating inputs).

    python -m benchmarks.probes.cat_tiles [flat]

``flat``: Inductor's form of the kernel instead (a flat range of the output per program,
compile-time shapes and strides), at several block sizes.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl

from benchmarks.kernels_cat import NAMES, joint_v
from benchmarks.kernels_rowwise import device_ms, same_size_copy_gbps
from benchmarks.probes.kernel_times import _inductor_us, _sets
from kopt.codegen.kernels import cat_rows as cr


def _cat(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return cr.cat_rows_triton([x, y], 1)


def _us(tiling, sets: list, ref: torch.Tensor) -> float:  # noqa: ANN001
    """kopt's cat with ``_tiling`` replaced, checked against ``torch.cat`` first."""
    default, cr._tiling = cr._tiling, tiling
    try:
        assert torch.equal(_cat(sets[0]["a"], sets[0]["b"]), ref)
        return 1e3 * device_ms(lambda a, b: _cat(a, b), sets)
    finally:
        cr._tiling = default


def main() -> None:
    default = cr._tiling
    for shape, name in NAMES.items():
        text, image, heads, dim = shape
        inner = heads * dim
        moved = 2 * (text + image) * inner * 2
        sets = _sets(lambda s, shape=shape: dict(zip("ab", joint_v(*shape), strict=True)), moved)
        copy = same_size_copy_gbps(moved)
        ref = torch.cat([sets[0]["a"], sets[0]["b"]], 1)

        ind = _inductor_us(lambda a, b: torch.cat([a, b], 1), sets)
        base = _us(default, sets, ref)
        print(f"{name}: default {default(inner, text + image)} {base:.1f} us "
              f"({moved / base / 1e3 / copy:.2f} of copy), Inductor {ind:.1f} us", flush=True)
        rows = []
        blocks = [w for w in (512, 1024, 2048) if inner % w == 0]
        for block, per, warps in itertools.product(blocks, (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
            if per * block // (32 * warps) < 8 or per * block // (32 * warps) > 128:
                continue
            t = _us(lambda i, n, c=(per, block, warps): c, sets, ref)
            rows.append((t, per, block, warps))
        for t, per, block, warps in sorted(rows)[:8]:
            print(f"  rows {per:2d} block {block:4d} warps {warps:2d}: {t:6.1f} us "
                  f"({moved / t / 1e3 / copy:.2f} of copy, {t / ind:.3f}x Inductor)", flush=True)




@triton.jit
def _flat_cat_kernel(x_ptr, y_ptr, out_ptr, total, SX_OUTER: tl.constexpr,
                     SX_ROW: tl.constexpr, SY_OUTER: tl.constexpr, SY_ROW: tl.constexpr,
                     ROWS: tl.constexpr, OUT_ROWS: tl.constexpr, INNER: tl.constexpr,
                     XBLOCK: tl.constexpr):
    """Inductor's form: one flat range of the output a program, the shapes and strides
    compile-time constants, int32 indices."""
    idx = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = idx < total
    row = idx // INNER
    col = idx % INNER
    o = row // OUT_ROWS
    j = row % OUT_ROWS
    in_x = j < ROWS
    vx = tl.load(x_ptr + o * SX_OUTER + j * SX_ROW + col, mask=mask & in_x)
    vy = tl.load(y_ptr + o * SY_OUTER + (j - ROWS) * SY_ROW + col, mask=mask & (j >= ROWS))
    tl.store(out_ptr + idx, tl.where(in_x, vx, vy), mask=mask)


def _flat(a: torch.Tensor, b: torch.Tensor, xblock: int, warps: int) -> torch.Tensor:
    va, vb = cr.row_view(a, 1), cr.row_view(b, 1)
    out = torch.empty(cr._out_shape([a, b], 1), dtype=a.dtype, device=a.device)
    total = out.numel()
    _flat_cat_kernel[(triton.cdiv(total, xblock),)](
        va, vb, out, total, va.stride(0), va.stride(1), vb.stride(0), vb.stride(1),
        va.shape[1], out.shape[1], va.shape[2], XBLOCK=xblock, num_warps=warps)
    return out


def flat_main() -> None:
    for shape, name in NAMES.items():
        text, image, heads, dim = shape
        moved = 2 * (text + image) * heads * dim * 2
        sets = _sets(lambda s, shape=shape: dict(zip("ab", joint_v(*shape), strict=True)), moved)
        ref = torch.cat([sets[0]["a"], sets[0]["b"]], 1)
        rows = []
        for xblock, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
            assert torch.equal(_flat(sets[0]["a"], sets[0]["b"], xblock, warps), ref)
            t = 1e3 * device_ms(lambda a, b, c=(xblock, warps): _flat(a, b, *c), sets)
            rows.append((t, xblock, warps))
        for t, xblock, warps in sorted(rows)[:4]:
            print(f"{name} flat XBLOCK {xblock} warps {warps}: {t:.1f} us", flush=True)


if __name__ == "__main__":
    flat_main() if sys.argv[1:] == ["flat"] else main()
