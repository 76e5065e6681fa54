"""Probe: which scale layouts does this torch's blockwise FP8 GEMM (F.scaled_mm, BlockWise1x128
activations x BlockWise128x128 weights) accept on this GPU, is it exact against a dequantized
fp64 product, and how fast is it against rowwise _scaled_mm at a W1 shape.

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


if __name__ == "__main__":
    main()
