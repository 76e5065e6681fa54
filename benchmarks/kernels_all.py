"""All of kopt's kernel benchmarks in one run, each in its own process (a failure or an OOM in
one family does not lose the others), results as JSON in one folder.

    python benchmarks/kernels_all.py --out-dir results/kernels [--workload W1] [--only rowwise,gemm]

Families: ``rowwise`` (norm/residual/modulation + quantization template, FP8/NVFP4 producers:
benchmarks/kernels_rowwise.py), ``gemm`` (FP8 GEMM template vs torch._scaled_mm, fused
epilogues: benchmarks/kernels_gemm.py), ``specialised`` (QK-norm+RoPE, activation+quantization:
benchmarks/kernels_specialised.py), ``cat`` (the joint-V concatenation as row copies:
benchmarks/kernels_cat.py). Each compares kopt's kernel with the unfused eager ops and
with Inductor's kernel for the same subgraph; see those files for the method.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("rowwise", "gemm", "specialised", "cat")


def command(family: str, out: Path, workload: str | None) -> list[str]:
    base = [sys.executable, "-m", f"benchmarks.kernels_{family}", "--out", str(out)]
    if workload and family == "rowwise":
        base += ["--workloads", workload]
    if workload and family == "gemm":
        base += ["--only", workload]
    return base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="kernels-out")
    p.add_argument("--workload", choices=["W1", "W2"], help="only this workload's shapes")
    p.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families")
    p.add_argument("--timeout", type=int, default=600, help="seconds per family")
    args = p.parse_args()
    families = args.only.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; valid: {', '.join(FAMILIES)}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for family in families:
        out = out_dir / f"kernels_{family}.json"
        t0 = time.perf_counter()
        print(f"== {family}", flush=True)
        try:
            rc = subprocess.run(command(family, out, args.workload),
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {family}: {'ok' if rc == 0 else f'failed ({rc})'} in "
              f"{time.perf_counter() - t0:.0f} s -> {out}", flush=True)
        if rc != 0:
            failed.append(family)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
