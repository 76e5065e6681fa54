"""SDPA at the W1/W2 attention shapes with the operand layouts a graph can hand it.

    python -m benchmarks.probes.attention_layout --json attention_layout.json

Issue 9's attention lever: cuDNN attention is fastest on (B, H, S, D)-contiguous operands, the
DiTs hand it permuted (B, S, H, D) tensors, and V can be a strided slice of a merged projection's
output. One row per layout, each timed with ``triton.testing.do_bench`` (median, after warm-up,
on random data) with the cuDNN backend forced, and checked against the contiguous layout's
output (the same values up to the kernel's own rounding order):

* ``bhsd``: q, k, v contiguous in (B, H, S, D) (what a kernel writing its output there gives);
* ``bshd``: q, k, v contiguous in (B, S, H, D), permuted (the diffusers models' layout);
* ``bshd, v from merged qkv``: q, k as in ``bshd``; v a column slice of a (B, S, 3 H D) GEMM
  output, permuted (kopt's merged projections; q, k come out of its QK-norm + RoPE kernel);
* ``bhsd q k, v from merged qkv``: q, k contiguous (B, H, S, D), v as above.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, heads, tokens, head dim): W1 = Qwen-Image 1024x1024 (4096 image + 128 text
# tokens), W2 = FLUX.2 1024x1024 (4096 + 512)
SHAPES = (("W1", 1, 24, 4224, 128), ("W2", 1, 48, 4608, 128))


def layouts(b: int, h: int, s: int, d: int) -> dict[str, tuple[torch.Tensor, ...]]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    q, k, v = (rand(b, s, h, d) for _ in range(3))  # the model's values, (B, S, H, D)
    merged = rand(b, s, 3 * h * d)
    merged[..., 2 * h * d:] = v.reshape(b, s, h * d)
    v_merged = merged[..., 2 * h * d:].unflatten(-1, (h, d)).transpose(1, 2)
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    return {
        "bhsd": tuple(bhsd),
        "bshd": tuple(bshd),
        "bshd, v from merged qkv": (bshd[0], bshd[1], v_merged),
        "bhsd q k, v from merged qkv": (bhsd[0], bhsd[1], v_merged),
    }


def main() -> None:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    rows = []
    for name, b, h, s, d in SHAPES:
        ops = layouts(b, h, s, d)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            want = F.scaled_dot_product_attention(*ops["bhsd"])
            flops = 4 * b * h * s * s * d
            for layout, (q, k, v) in ops.items():
                out = F.scaled_dot_product_attention(q, k, v)
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                ms = triton.testing.do_bench(
                    lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
                    warmup=50, rep=300, return_mode="median")
                rows.append({"shape": name, "layout": layout, "ms": ms,
                             "tflops": flops / ms / 1e9, "rel_error_vs_bhsd": err,
                             "strides": [list(t.stride()) for t in (q, k, v)]})
                print(f"{name} {layout:<30} {ms:.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                      f"rel. error vs bhsd {err:.1e}", flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
