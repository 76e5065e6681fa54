"""What a bias add costs at W1's GEMM outputs, against the rates the cost model fits.

    python benchmarks/probes/bias_add.py [--json OUT]

On the GPU, random bf16 data, ``triton.testing.do_bench`` medians (us):

* ATen's broadcast add of a bias ``[N]`` to a GEMM output ``[4096, N]`` (what ``absorb_bias``
  removes), a same-shape add, and the adaLN forms of W1's baseline graph (``x * (1 + scale)``,
  ``+ shift`` with ``scale``/``shift`` chunks of the modulation output), as fractions of the
  1 GiB copy bandwidth: the fitted ``aten::add[broadcast]`` rate comes from the latter;
* ``torch._scaled_mm`` at W1's FP8 GEMM shapes with and without its bias epilogue (what the
  pass moves the add into).
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

M = 4096
SHAPES = [(9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288)]  # (N, K): QKV, out, fc1, fc2
E4M3 = torch.float8_e4m3fn


def us(fn) -> float:  # noqa: ANN001
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbps() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / us(lambda: dst.copy_(src)) / 1e3


def gemm_times(n: int, k: int) -> tuple[float, float, float]:
    """us of the FP8 GEMM [M, K] x [K, N] alone, with its bias epilogue, and of a separate
    bias add on its output."""
    a = torch.randn(M, k, device="cuda").to(E4M3)
    w = torch.randn(n, k, device="cuda").to(E4M3)
    sa = torch.rand(M, 1, device="cuda") + 0.5
    sw = torch.rand(1, n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    plain = us(lambda: torch._scaled_mm(a, w.t(), sa, sw, out_dtype=torch.bfloat16))
    with_bias = us(lambda: torch._scaled_mm(a, w.t(), sa, sw, bias=bias,
                                            out_dtype=torch.bfloat16))
    y = torch._scaled_mm(a, w.t(), sa, sw, out_dtype=torch.bfloat16)
    return plain, with_bias, us(lambda: y + bias)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    torch.manual_seed(0)
    bw = copy_gbps()
    rows = []

    def row(name: str, t: float, nbytes: int) -> None:
        gbps = nbytes / t / 1e3
        rows.append({"case": name, "us": t, "GBps": gbps, "of_copy": gbps / bw})
        print(f"{name:44s} {t:8.1f} us {gbps:7.0f} GB/s {gbps / bw:5.2f} of copy", flush=True)

    for n, _ in SHAPES[:3]:
        y = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        z = torch.randn_like(y)
        row(f"bias add [{M}, {n}] + [{n}]", us(lambda y=y, b=b: y + b), 2 * y.nbytes + b.nbytes)
        row(f"same-shape add [{M}, {n}]", us(lambda y=y, z=z: y + z), 3 * y.nbytes)
    c = 3072
    x = torch.randn(1, M, c, device="cuda", dtype=torch.bfloat16)
    mod = torch.randn(1, 6 * c, device="cuda", dtype=torch.bfloat16)
    shift, scale = mod[:, :c].unsqueeze(1), mod[:, c:2 * c].unsqueeze(1)
    one_plus = 1 + scale
    row("adaLN x * (1 + scale)", us(lambda: x * one_plus), 2 * x.nbytes)
    row("adaLN + shift (chunk view)", us(lambda: x + shift), 2 * x.nbytes)
    row("gate * x (chunk view)", us(lambda: scale * x), 2 * x.nbytes)
    for n, k in SHAPES:
        plain, with_bias, add = gemm_times(n, k)
        rows.append({"case": f"scaled_mm {M}x{n}x{k}", "plain_us": plain, "bias_us": with_bias,
                     "separate_add_us": add})
        print(f"scaled_mm {M}x{n}x{k}: {plain:.1f} us, with bias {with_bias:.1f} "
              f"(+{with_bias - plain:.1f}), separate add {add:.1f}", flush=True)
    print(f"copy bandwidth {bw:.0f} GB/s on {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
