"""kopt on models nobody tuned it for (:mod:`kopt.models.zoo`: tiny random-weight configs of
diffusers DiTs and transformers LLMs other than the reference workloads), optimized and
verified on the CPU.

    python benchmarks/generality.py [--dtype bf16] [--fp8] [--only NAME ...] [--json out.json]

Per model: what kopt captured, which passes rewrote how many sites, which were reverted by
verification (and why), and the optimized output's error against the eager model's in the same
dtype (the FP8 rows' error is then the FP8 recipe's). A model kopt cannot capture is reported
with the error kopt raised; the eager model keeps working.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

import kopt
from kopt.models import main_output
from kopt.models.zoo import ZOO, build
from kopt.verify import relative_error


@dataclass
class Outcome:
    model: str
    fp8: bool
    status: str  # optimized | not captured | failed
    nodes: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    reverted: dict[str, str] = field(default_factory=dict)
    error: float | None = None  # the optimized output's relative error vs eager
    seconds: float = 0.0
    detail: str = ""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(name: str, fp8: bool, dtype: torch.dtype = torch.float32) -> Outcome:
    w = build(name, dtype=dtype)
    model, args, kwargs = w.model, w.args, w.kwargs
    with torch.no_grad():
        expected = main_output(model(*args, **kwargs)).clone()
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16)) if fp8 else kopt.PassConfig()
    start = time.perf_counter()
    try:
        opt = kopt.optimize(model, args, kwargs, config, keep_original=True)
    except kopt.CaptureError as exc:
        with torch.no_grad():  # the model itself still runs
            assert torch.equal(main_output(model(*args, **kwargs)), expected)
        return Outcome(name, fp8, "not captured", seconds=time.perf_counter() - start,
                       detail=str(exc).splitlines()[0][:300])
    except Exception as exc:  # noqa: BLE001 -- the sweep reports every failure
        return Outcome(name, fp8, "failed", seconds=time.perf_counter() - start,
                       detail="".join(traceback.format_exception_only(exc)).strip()[:500])
    seconds = time.perf_counter() - start
    with torch.no_grad():
        error = relative_error(main_output(opt(*args, **kwargs)), expected)
    report = opt.report
    applied = {r.name: r.matched for r in report.passes if r.matched}
    reverted = {r.name: f"{len(r.reverted)} sites: {r.verdict}" for r in report.passes
                if r.reverted or (r.verdict is not None and not r.verdict.passed)}
    return Outcome(name, fp8, "optimized", report.nodes_captured, applied, reverted, error,
                   seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fp8", action="store_true", help="also with FP8 (min_features 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--only", nargs="*", choices=sorted(ZOO), default=None)
    p.add_argument("--json", help="write the outcomes here")
    args = p.parse_args()
    outcomes = []
    for name in args.only or ZOO:
        for fp8 in (False, True) if args.fp8 else (False,):
            o = run(name, fp8, DTYPES[args.dtype])
            outcomes.append(o)
            print(f"{o.model}{' fp8' if o.fp8 else ''}: {o.status} in {o.seconds:.1f} s"
                  + (f", {o.nodes} nodes, error {o.error:.2e}" if o.error is not None else "")
                  + (f"\n  applied: {o.applied}" if o.applied else "")
                  + (f"\n  reverted: {o.reverted}" if o.reverted else "")
                  + (f"\n  {o.detail}" if o.detail else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)


if __name__ == "__main__":
    main()
