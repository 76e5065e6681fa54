"""The time per call of a model compiled by ``torch.compile(backend="kopt")`` with Inductor, with
each kind of repeated block compiled once (``regional=True``, the default: :mod:`kopt.regional`)
against the optimized graph compiled flat (``regional=False``). Outlining a block gives up
Inductor's fusions across its edges and adds a ``kopt::block`` call per site; this measures what
that costs a call, beside what it saves the compile.

    python -m benchmarks.probes.regional_speed --model qwen-image --blocks 12 --fp8 --device cuda

Two models built from the same seed, one compiled each way with the backend's other defaults
(CUDA graphs "auto" on CUDA), verification off; each is called 4 times first. Then ``--rounds``
rounds alternate the two, each round the median of ``--iters`` calls (CUDA events on CUDA, the
host clock on the CPU). Prints each first call's time and the report's ``inner compiler:`` line,
the two outputs' difference, every round, and the ratio regional / flat per round.
``--blocks N`` sets the model's number of repeated blocks (Qwen-Image and its tiny variant).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kopt.models import build, main_output, qwen_image
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def timed_calls(call: Callable[[], object], iters: int, cuda: bool) -> float:
    """The median milliseconds of ``iters`` calls."""
    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--device", default="cuda")
    p.add_argument("--blocks", type=int, default=0, help="repeated blocks (0: the model's own)")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if args.blocks:
        qwen_image.FULL_CONFIG["num_layers"] = args.blocks
        qwen_image.TINY_CONFIG["num_layers"] = args.blocks
    cuda = args.device.startswith("cuda")
    config = PassConfig(fuse_allreduce_norm=False)
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    compiled: dict[str, tuple[Callable[[], object], torch.Tensor]] = {}
    for name, regional in (("regional", True), ("flat", False)):
        w = build(args.model, device=args.device, dtype=torch.bfloat16)
        reports: list = []
        f = torch.compile(w.model, backend="kopt", dynamic=False, options={
            "config": config, "verify": VerifyOptions(enabled=False), "reports": reports,
            "regional": regional})

        def call(f=f, w=w) -> object:  # noqa: ANN001
            with torch.no_grad():
                return f(*w.args, **w.kwargs)

        t0 = time.perf_counter()
        out = main_output(call()).clone()
        if cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(3):
            call()
        print(f"{name}: first call {first:.1f} s; inner compiler: "
              f"{'; '.join(str(r.inner) for r in reports)}", flush=True)
        compiled[name] = (call, out)
    a, b = (compiled[k][1].float() for k in ("regional", "flat"))
    print(f"outputs: max |regional - flat| {(a - b).abs().max().item():.3g}, relative "
          f"{((a - b).norm() / b.norm()).item():.3g}", flush=True)
    ms: dict[str, list[float]] = {k: [] for k in compiled}
    for r in range(args.rounds):
        for name, (call, _) in compiled.items():
            ms[name].append(timed_calls(call, args.iters, cuda))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in ms.items()),
              flush=True)
    ratios = [x / y for x, y in zip(ms["regional"], ms["flat"], strict=True)]
    print(f"regional / flat per round: {', '.join(f'{x:.4f}' for x in ratios)}; median "
          f"{statistics.median(ratios):.4f}", flush=True)


if __name__ == "__main__":
    main()
