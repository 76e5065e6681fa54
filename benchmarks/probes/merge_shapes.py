"""Separate projections vs one merged GEMM at the W1/W2 shapes merge_projections produces.

    python -m benchmarks.probes.merge_shapes  # on the GPU; prints a table, --out writes JSON

Each case times N F.linear calls on one activation against one F.linear over the concatenated
weight (the split into views costs nothing), bf16, triton.testing.do_bench medians.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

# (name, rows, in_features, [out_features...]) -- from the reports of kopt optimize on W1/W2
CASES = [
    ("W1 image QKV", 4096, 3072, [3072] * 3),
    ("W1 text QKV", 128, 3072, [3072] * 3),
    ("W1 modulation, 2 blocks", 1, 3072, [18432] * 2),
    ("W1 modulation, all 60 blocks + norm_out", 1, 3072, [18432] * 120 + [6144]),
    ("W2 image QKV", 4096, 6144, [6144] * 3),
    ("W2 text QKV", 512, 6144, [6144] * 3),
    ("LLM-8B prefill QKV", 2048, 4096, [4096, 1024, 1024]),
    ("LLM-8B decode gate/up", 64, 4096, [12288, 12288]),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, m, k, ns in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
              for n in ns]
        w_cat = torch.cat(ws)
        sep = do_bench(lambda x=x, ws=ws: [F.linear(x, w) for w in ws], return_mode="median")
        mer = do_bench(lambda x=x, w=w_cat, ns=ns: F.linear(x, w).split(ns, -1),
                       return_mode="median")
        gbytes = (w_cat.numel() + x.numel() + m * sum(ns)) * 2 / 1e9
        rows.append({"case": name, "M": m, "K": k, "N": ns if len(ns) < 5 else f"{len(ns)} x",
                     "separate_ms": sep, "merged_ms": mer, "merged_over_separate": mer / sep,
                     "merged_GBps": gbytes / (mer / 1e3)})
        del ws, w_cat
    print(f"{'case':<42} {'separate ms':>12} {'merged ms':>10} {'ratio':>7} {'GB/s':>7}")
    for r in rows:
        print(f"{r['case']:<42} {r['separate_ms']:12.3f} {r['merged_ms']:10.3f} "
              f"{r['merged_over_separate']:7.3f} {r['merged_GBps']:7.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
