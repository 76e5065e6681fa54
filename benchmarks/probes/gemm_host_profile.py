"""Where kopt's GEMM launch spends its host time on the GPU machine (cProfile), and what a
launch that skips Triton's autotuner / JIT dispatch costs (the prototype of
``kopt.codegen.gemm._Direct``; with it in kopt, the profiled ``gemm()`` calls take that path).

    python benchmarks/probes/gemm_host_profile.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
import traceback

import torch

from benchmarks.gemm_launch_cost import operands
from kopt.codegen import gemm as g


def per_call(fn, n=500) -> float:
    """Best of 5 of the mean us per call of ``fn`` over ``n`` calls back to back."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> None:
    a, b, sa, sb, bias = operands("cuda")
    call = (a, b, sa, sb, bias, None, None, "none", torch.bfloat16)
    for _ in range(20):
        g.gemm(*call, fp8=True)
    torch.cuda.synchronize()

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        g.gemm(*call, fp8=True)
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(35)
        print(s.getvalue())

    print(f"gemm(): {per_call(lambda: g.gemm(*call, fp8=True)):.1f} us")
    launch = next(iter(g._LAUNCHES.values()))
    tuner = launch.kernel
    print("tuner", type(tuner).__name__, "best", getattr(tuner, "best_config", None))
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n = launch.m, launch.n

    def args_now(kw: dict | None = None) -> list:
        """A call's arguments: a fresh output and TMA descriptors (boxed for config ``kw``)."""
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        box_a = [kw["BLOCK_M"], kw["BLOCK_K"]] if kw else [16, 16]
        box_b = [kw["BLOCK_N"], kw["BLOCK_K"]] if kw else [16, 16]
        ad = TensorDescriptor.from_tensor(a, box_a)
        bd = TensorDescriptor.from_tensor(b.t(), box_b)
        return [a, b, ad, bd, out, sa.reshape(-1), sb.reshape(-1), bias, out, out, *launch.scalars]


    try:
        best = tuner.best_config
        kw = dict(launch.flags, **best.all_kwargs())
        kw.pop("pre_hook", None)
        jit = tuner.fn
        print("JITFunction, autotuner bypassed: "
              f"{per_call(lambda: jit[launch.grid](*args_now(kw), **kw)):.1f} us")
        args = args_now(kw)
        compiled = jit.run(*args, grid=launch.grid, warmup=True, **kw)
        binder = jit.device_caches[torch.cuda.current_device()][4]
        bound, _, _ = binder(*args, **kw)
        names = list(bound.keys())
        print("bound args", len(names), names[:12])
        grid = launch.grid(bound)
        from triton import knobs
        stream = torch.cuda.current_stream().cuda_stream

        def direct() -> list:
            args = args_now(kw)
            vals = args + [kw[k] for k in names[len(args):]]
            compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                         knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *vals)
            return args
        direct()
        torch.cuda.synchronize()
        ref = g.gemm(*call, fp8=True)
        print(f"CompiledKernel.run directly: {per_call(direct):.1f} us")
        print("  of which torch.empty + 2 TensorDescriptor.from_tensor: "
              f"{per_call(args_now):.1f} us")
        out = direct()[4]
        torch.cuda.synchronize()
        print("direct == gemm():", torch.equal(out, ref))
    except Exception:
        traceback.print_exc()
    scaled_mm_us = per_call(lambda: torch._scaled_mm(a, b, sa, sb, bias=bias,
                                                     out_dtype=torch.bfloat16))
    print(f"torch._scaled_mm: {scaled_mm_us:.1f} us")


if __name__ == "__main__":
    main()
