"""Time to an optimized model, first run against a run that starts from the knowledge base.

    python benchmarks/kb_reuse.py --model qwen-image --fp8 --enable gemm_epilogue \
        --kb /tmp/kb.sqlite --runs 2 --json kb_reuse.json

Each run is a fresh process (nothing cached in memory: Triton's on-disk cache is moved to a
folder per run, so a compiled kernel is not reused either) that builds the workload on CUDA,
then, inside the knowledge base's scope, times ``kopt.optimize`` (capture, passes,
verification) and the optimized model's first call (where an autotuned kernel sweeps its
configs unless the knowledge base gave it one). The first run fills the knowledge base; the
later runs read it. Printed and written: seconds per phase and what came from the knowledge
base, per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    import kopt
    from kopt.kb import safe_open, using
    from kopt.models import build
    from kopt.passes import FP8Config, PassConfig
    from kopt.verify import VerifyOptions

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    t = time.perf_counter()
    w = build(args.model, device=args.device, dtype=dtype, seed=0)
    built = time.perf_counter() - t
    config = PassConfig().replace(**{p: True for p in args.enable})
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    verify = VerifyOptions(enabled=args.seeds > 0, seeds=tuple(range(args.seeds)))
    kb = safe_open(args.kb)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad(), using(kb) as s:
        sync()
        t0 = time.perf_counter()
        opt = kopt.optimize(w.model, w.args, w.kwargs, config, verify=verify,
                            keep_original=True)
        sync()
        t1 = time.perf_counter()
        opt(*w.args, **w.kwargs)
        sync()
        t2 = time.perf_counter()
        opt(*w.args, **w.kwargs)
        sync()
        t3 = time.perf_counter()
        summary = s.summary() if s is not None else "no knowledge base"
    report = opt.report
    return {"build_s": built, "optimize_s": t1 - t0, "first_call_s": t2 - t1,
            "second_call_s": t3 - t2, "to_optimized_s": t2 - t0,
            "passes": {r.name: {"matched": r.matched, "seconds": r.seconds,
                                "verdict": None if r.verdict is None else str(r.verdict),
                                "reverted": len(r.reverted), "notes": list(r.notes)}
                       for r in report.passes},
            "kb": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--enable", action="append", default=[], metavar="PASS")
    p.add_argument("--seeds", type=int, default=1, help="verification seeds (0: off)")
    p.add_argument("--kb", required=True, help="knowledge base file (start from a new one)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(child(args)))
        return
    cuda = args.device.startswith("cuda")
    meta = {"model": args.model, "fp8": args.fp8, "enable": args.enable, "seeds": args.seeds,
            "device": torch.cuda.get_device_name() if cuda else args.device,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            env = {**os.environ, "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(out)]
            t = time.perf_counter()
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            run = json.loads(out.read_text())
            run["process_s"] = time.perf_counter() - t
        runs.append(run)
        print(f"run {i + 1}: optimize {run['optimize_s']:.1f} s + first call "
              f"{run['first_call_s']:.1f} s = {run['to_optimized_s']:.1f} s to the optimized "
              f"model (second call {run['second_call_s'] * 1e3:.1f} ms; build "
              f"{run['build_s']:.1f} s)\n{run['kb']}", flush=True)
        if args.json:  # after every run: a run cut short keeps the ones before it
            Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
