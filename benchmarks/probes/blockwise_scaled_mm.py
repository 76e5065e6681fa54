"""Probe: which scale layouts does this torch's blockwise FP8 GEMM (F.scaled_mm, BlockWise1x128
activations x BlockWise128x128 weights) accept on this GPU, is it exact against a dequantized
fp64 product, and how fast is it against rowwise _scaled_mm at a W1 shape; does it take a bias
(its epilogue adding it, as rowwise _scaled_mm's does); and the two recipes' times at every W1
and W2 GEMM shape.

    python benchmarks/probes/blockwise_scaled_mm.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

E4M3 = torch.float8_e4m3fn


def main() -> None:
    M, K, N = 4224, 3072, 12288
    dev = "cuda"
    a = (torch.randn(M, K, device=dev) * 2).to(E4M3)
    w = (torch.randn(N, K, device=dev) * 2).to(E4M3)
    sa = torch.rand(M, K // 128, device=dev) + 0.5
    sw = torch.rand(N // 128, K // 128, device=dev) + 0.5
    ref = (a.double() * sa.double().repeat_interleave(128, 1)) @ (
        w.double() * sw.double().repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
    layouts_a = {"row-major [M,K/128]": sa.contiguous(),
                 "col-major [M,K/128]": sa.t().contiguous().t()}
    layouts_w = {"row-major [N/128,K/128]": sw.contiguous(),
                 "col-major [N/128,K/128]": sw.t().contiguous().t(),
                 "[K/128,N/128] row-major": sw.t().contiguous(),
                 "[K/128,N/128] = [N/128,K/128].t()": sw.t()}
    for (na, ta), (nw, tw) in itertools.product(layouts_a.items(), layouts_w.items()):
        try:
            out = F.scaled_mm(a, w.t(), ta, F.ScalingType.BlockWise1x128, tw,
                              F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            ms = do_bench(lambda ta=ta, tw=tw: F.scaled_mm(
                a, w.t(), ta, F.ScalingType.BlockWise1x128, tw, F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16))
            print(f"OK   a {na:22s} w {nw:26s} rel err {err:.2e}  {ms:.3f} ms "
                  f"{2 * M * N * K / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # the probe records what is refused
            print(f"FAIL a {na:22s} w {nw:26s} {type(e).__name__}: {str(e)[:120]}")
    sr, swr = torch.rand(M, 1, device=dev), torch.rand(1, N, device=dev)
    ms = do_bench(lambda: torch._scaled_mm(a, w.t(), sr, swr, out_dtype=torch.bfloat16))
    print(f"rowwise _scaled_mm {ms:.3f} ms {2 * M * N * K / ms / 1e9:.0f} TFLOP/s")
    bias = torch.randn(N, device=dev).bfloat16()
    ta, tw = layouts_a["col-major [M,K/128]"], sw.t()
    try:
        out = F.scaled_mm(a, w.t(), ta, F.ScalingType.BlockWise1x128, tw,
                          F.ScalingType.BlockWise128x128, bias=bias, output_dtype=torch.bfloat16)
        err = ((out.double() - ref - bias.double()).norm() / (ref + bias.double()).norm()).item()
        ms = do_bench(lambda: F.scaled_mm(a, w.t(), ta, F.ScalingType.BlockWise1x128, tw,
                                          F.ScalingType.BlockWise128x128, bias=bias,
                                          output_dtype=torch.bfloat16))
        print(f"OK   blockwise with a bf16 bias: rel err {err:.2e}  {ms:.3f} ms")
    except Exception as e:  # the probe records what is refused
        print(f"FAIL blockwise with a bf16 bias: {type(e).__name__}: {str(e)[:300]}")
    shapes(dev)


SHAPES = {  # (M, N, K) of every GEMM the kopt-fp8 graphs run per layer
    "W1 img QKV": (4096, 9216, 3072), "W1 img out": (4096, 3072, 3072),
    "W1 img up": (4096, 12288, 3072), "W1 img down": (4096, 3072, 12288),
    "W1 txt QKV": (128, 9216, 3072), "W1 txt down": (128, 3072, 12288),
    "W2 dbl img QKV": (4096, 18432, 6144), "W2 dbl img up": (4096, 36864, 6144),
    "W2 dbl img down": (4096, 6144, 18432), "W2 dbl txt QKV": (512, 18432, 6144),
    "W2 single in": (4608, 55296, 6144), "W2 single out": (4608, 6144, 24576),
}


def shapes(dev: str) -> None:
    print(f"{'shape':<16} {'M':>5} {'N':>6} {'K':>6} {'rowwise ms':>10} {'blockwise ms':>12} "
          f"{'ratio':>6} {'row TF/s':>8} {'block TF/s':>10}")
    for name, (m, n, k) in SHAPES.items():
        a = (torch.randn(m, k, device=dev) * 2).to(E4M3)
        w = (torch.randn(n, k, device=dev) * 2).to(E4M3)
        sr, swr = torch.rand(m, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
        sa = (torch.rand(m, k // 128, device=dev) + 0.5).t().contiguous().t()
        sw = torch.rand(n // 128, k // 128, device=dev) + 0.5
        row = do_bench(lambda a=a, w=w, sr=sr, swr=swr: torch._scaled_mm(
            a, w.t(), sr, swr, out_dtype=torch.bfloat16), warmup=50, rep=200)
        blk = do_bench(lambda a=a, w=w, sa=sa, sw=sw: F.scaled_mm(
            a, w.t(), sa, F.ScalingType.BlockWise1x128, sw.t(), F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16), warmup=50, rep=200)
        f = 2 * m * n * k / 1e9
        print(f"{name:<16} {m:>5} {n:>6} {k:>6} {row:10.3f} {blk:12.3f} {blk / row:6.2f} "
              f"{f / row:8.0f} {f / blk:10.0f}")
        del a, w


if __name__ == "__main__":
    main()
