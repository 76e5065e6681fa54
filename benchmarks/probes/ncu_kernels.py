"""Launch some of kopt's memory-bound kernels at W1/W2 shapes for Nsight Compute to profile.

    NCU_REPS=1 ncu --clock-control none -k regex:"rowwise_kernel|_act_quant_kernel" \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m benchmarks.probes.ncu_kernels [rowwise|act]

Row-wise: LayerNorm + adaLN + FP8 (fp32 steps, and the 1x128 variant), RMSNorm + FP8 and the
NVFP4 quantizer, each at W1 and W2 rows followed by a copy of its input; act + quant: W1's
GELU(tanh) image and text rows and W2's SwiGLU image rows (fast math). Each kernel runs
``NCU_REPS`` times (3).
With ``TRITON_CACHE_DIR`` set, the compiled kernels (PTX, cubin: ``cuobjdump -sass``) land
there: RESULTS.md's instruction counts per value (2026-12-01, H200) come from them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from benchmarks.kernels_rowwise import CASES, workload_shape
from benchmarks.kernels_specialised import ACT_CASES, act_inputs
from kopt.codegen.kernels.act_quant import act_quant_triton

ROWWISE = ("layernorm+adaLN+fp8, fp32 steps", "layernorm+adaLN+fp8 1x128", "rmsnorm+fp8",
           "quant nvfp4")
ACT = ("W1 image MLP, GELU(tanh) fast", "W1 text MLP, GELU(tanh) fast",
       "W2 image FF, SwiGLU fast")


def repeat(fn: Callable[[], object]) -> None:
    for _ in range(int(os.environ.get("NCU_REPS", "3"))):
        fn()
    torch.cuda.synchronize()


def main(which: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    if which in ("all", "rowwise"):
        for case in (c for c in CASES if c.name in ROWWISE):
            for w in ("W1", "W2"):
                ins = case.inputs(*workload_shape(w), g)
                print(case.name, w, flush=True)
                repeat(lambda case=case, ins=ins: case.kopt(**ins))
                x = ins["x"]
                repeat(lambda x=x: torch.empty_like(x).copy_(x))
    if which in ("all", "act"):
        for c in (c for c in ACT_CASES if c.name in ACT):
            x, up = act_inputs(c)
            print(c.name, flush=True)
            repeat(lambda c=c, x=x, up=up: act_quant_triton(x, up, c.activation))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
