"""act + quant with the whole row in registers (one pass, two tiles) against the default stashing
two-pass kernel, now that the activation costs about half the instructions (RESULTS.md,
2026-12-01); and
the NVFP4 quantizer's tiling (rows per program x warps). Each replayed from a CUDA graph over
rotating inputs; outputs checked bitwise against the default's.

    python -m benchmarks.probes.act_onepass [act|nvfp4]
"""

from __future__ import annotations

import torch
import triton

from benchmarks.kernels_rowwise import L2_BYTES, device_ms
from benchmarks.kernels_specialised import ACT_CASES, act_inputs
from kopt.codegen.kernels import nvfp4 as nv
from kopt.codegen.kernels.act_quant import _config, act_quant_triton
from kopt.codegen.kernels.quant_fp8 import even_tiles, row_split

CASES = {"W1 image MLP, GELU(tanh) fast": (8192, 4096), "W2 image FF, SwiGLU fast": (16384, 2048),
         "W3 Qwen3-8B prefill, SwiGLU fast": (8192, 4096),
         "W1 text MLP, GELU(tanh) fast": (8192, 4096), "W2 text FF, SwiGLU fast": (16384, 2048)}


def _equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b,
                                                                                    strict=True))


def act() -> None:
    for case in (c for c in ACT_CASES if c.name in CASES):
        block, block2 = CASES[case.name]
        x, up = act_inputs(case)
        moved = x.numel() * 2 * (2 if up is not None else 1) + x.numel()
        sets = [dict(zip(("x", "up"), act_inputs(case, seed=s), strict=True))
                for s in range(max(2, -(-4 * L2_BYTES // moved)))]
        configs = {"stash (the earlier default)": _config(case.features)}
        configs["default"] = _config(case.features, case.activation)
        for warps in (8, 16, 32):
            for merged in (False, True):
                if merged and (warps != 8 or block != 2 * block2):
                    continue  # (the reshape is a layout conversion there: SASS on the CPU)
                configs[f"one pass {block}+{block2}, {warps} warps"
                        + (", one reduction" if merged else "")] = {
                    "BLOCK": block, "BLOCK2": block2, "ONE_PASS": True, "STASH": False,
                    "num_warps": warps, "ONE_REDUCTION": merged}
        want = act_quant_triton(x, up, case.activation)
        for name, cfg in configs.items():
            same = _equal(act_quant_triton(x, up, case.activation, config=cfg), want)
            us = 1e3 * device_ms(lambda x, up, cfg=cfg, a=case.activation: act_quant_triton(
                x, up, a, config=cfg), sets)
            print(f"{case.name:36s} {name:34s} {us:8.1f} us  bitwise {same}", flush=True)


def _nvfp4(x: torch.Tensor, g: torch.Tensor, rows_per: int, warps: int) -> tuple:
    """``quant_nvfp4_triton``'s launch with another tiling."""
    rows, k = x.shape
    q = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty(nv.scale_numel(rows, k), dtype=nv.E4M3, device=x.device)
    launch = nv.nvfp4_launch_rows(rows)
    block, block2 = row_split(k, 64)
    nv._quant_nvfp4_kernel[(triton.cdiv(launch, rows_per),)](
        x, q, s.view(torch.uint8), g, rows, k, x.stride(0), ROWS=rows_per, BLOCK=block,
        BLOCK2=block2, EVEN=launch == rows and even_tiles(rows, rows_per, k, block, block2),
        CUDA=True, num_warps=warps, enable_fp_fusion=False)
    return q, s


def nvfp4() -> None:
    g = torch.tensor([0.003], device="cuda")
    for wl, (rows, k) in {"W1": (4224, 3072), "W2": (4608, 6144)}.items():
        sets = [{"x": torch.randn(rows, k, device="cuda").bfloat16()} for _ in range(8)]
        want = nv.quant_nvfp4_triton(sets[0]["x"], g)
        for rows_per in (1, 2, 4):
            for warps in (2, 4, 8, 16):
                same = _equal(_nvfp4(sets[0]["x"], g, rows_per, warps), want)
                us = 1e3 * device_ms(lambda x, r=rows_per, w=warps: _nvfp4(x, g, r, w), sets)
                print(f"NVFP4 {wl} rows/program {rows_per} warps {warps:2d} {us:8.1f} us  "
                      f"bitwise {same}", flush=True)


if __name__ == "__main__":
    import sys

    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "act"):
        act()
    if which in ("all", "nvfp4"):
        nvfp4()
