"""``kopt::cat_rows`` at the W1/W2 joint-V shapes against ATen's ``cat`` and Inductor's kernel
for the same cat (issue 4's bar for a memory-bound kernel: >= 80% of the copy bandwidth on the
bytes it moves, and at least as fast as Inductor).

    python benchmarks/kernels_cat.py [--out rows.json]

Each input is the V view of a merged QKV output (``[1, S, 3 H D]`` -> ``[1, S, H, D]``,
strided), the two joined [text; image] along the sequence. Times are ``do_bench`` medians of
CUDA-graph replays over input sets rotating through more than L2 (``kernels_rowwise``'s
method); bytes moved = the inputs read + the output written.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from benchmarks.kernels_rowwise import L2_BYTES, copy_gbps, device_ms
from kopt.codegen.kernels.cat_rows import cat_rows_triton

# (text tokens, image tokens, heads, head dim): W1 Qwen-Image, W2 FLUX.2, an odd one
SHAPES = [(128, 4096, 24, 128), (512, 4096, 48, 128), (7, 33, 3, 40)]


def joint_v(text: int, image: int, heads: int, dim: int, dtype: torch.dtype = torch.bfloat16,
            batch: int = 1) -> list[torch.Tensor]:
    """The V views of two merged QKV outputs ``[B, S, 3 H D]``: ``[B, S, H, D]``, strided."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for s in (text, image):
        qkv = torch.randn(batch, s, 3 * heads * dim, device="cuda", generator=g).to(dtype)
        out.append(qkv[..., 2 * heads * dim:].unflatten(-1, (heads, dim)))
    return out


NAMES = {SHAPES[0]: "W1 Qwen-Image joint V", SHAPES[1]: "W2 FLUX.2 joint V"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    copy = copy_gbps()
    compiled = torch.compile(lambda a, b: torch.cat([a, b], 1), dynamic=False)
    rows = []
    for shape, name in NAMES.items():
        text, image, heads, dim = shape
        moved = 2 * (text + image) * heads * dim * 2  # bf16 read + written
        sets = [dict(zip("ab", joint_v(*shape), strict=True))
                for _ in range(max(2, -(-L2_BYTES // moved)))]
        ms = {"aten": device_ms(lambda a, b: torch.cat([a, b], 1), sets),
              "kopt": device_ms(lambda a, b: cat_rows_triton([a, b], 1), sets),
              "inductor": device_ms(compiled, sets)}
        a, b = sets[0]["a"], sets[0]["b"]
        bitwise = torch.equal(cat_rows_triton([a, b], 1), torch.cat([a, b], 1))
        row = {"case": name, "shape": shape, "MB": moved / 1e6, "bitwise": bitwise,
               **{f"{k}_us": v * 1e3 for k, v in ms.items()},
               "kopt_of_copy": moved / ms["kopt"] / 1e6 / copy}
        rows.append(row)
        print(f"{name:24} {moved / 1e6:6.1f} MB  aten {row['aten_us']:7.1f} us  kopt "
              f"{row['kopt_us']:7.1f} us ({row['kopt_of_copy']:.0%} of copy)  inductor "
              f"{row['inductor_us']:7.1f} us  bitwise {bitwise}")
    print(f"copy bandwidth: {copy:.0f} GB/s on {torch.cuda.get_device_name()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "copy_GBps": copy, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
