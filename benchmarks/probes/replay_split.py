"""Where a pass's saving in a CUDA graph replay goes: the timed replay against its profile.

    python -m benchmarks.probes.replay_split --model qwen-image --fp8 --without merge_projections

W1's merge_projections saved 1.08 ms per replay (timed, caches hit) where the calibration's
replay profile had its kernels saving 2.05 ms, as the model predicts (RESULTS.md, 2026-12-03,
H200).
This builds "all" and "all - PASS" once and, round after round (the order reversed every other
round), for each graph:

- times the bare replay (``graph.replay()``, CUDA events, no host work around it) with the SM
  clock and power it ran at;
- captures the graph again under the profiler, replays it for a second (the sustained clock)
  and profiles three replays: per replay the kernels' summed time, the span from the first
  kernel's start to the last one's end, and the gaps (span less kernels), and the bare replay
  timed with events inside the profile;
- times one miss of the hoisted regions (prelude host and wall time, synchronized);
- with ``--calibration``, profiles it as the cost model's calibration does
  (:func:`kopt.profile.profile_replay`: its replayed kernels matched to an eager call's nodes).

It then prints, per quantity, the median over rounds of "all - PASS" less "all", and the
kernels whose summed time changed most between the two graphs' profiles.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.probes.hoist_miss import phased, workload
from kopt.ablate import _off
from kopt.api import optimize_captured
from kopt.bench import median_ms
from kopt.cudagraphs import CudaGraphRunner
from kopt.power import ClockSampler
from kopt.profile import profile_graph, profile_replay
from kopt.verify import VerifyOptions

KINDS = (("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|_mm_|matmul", re.I)),
         ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)))
PROFILED = 3


def kind(name: str) -> str:
    return next((k for k, rx in KINDS if rx.search(name)), "other")


def window_kernels(prof: profile, prefix: str) -> list[list]:
    """Per ``record_function`` range whose name starts with ``prefix``: the device events
    launched from inside it (by the correlation id of the launching runtime call), by start."""
    raw = prof.profiler.kineto_results.events()
    cpu = [e for e in raw if e.device_type() != torch.autograd.DeviceType.CUDA]
    gpu = [e for e in raw if e.device_type() == torch.autograd.DeviceType.CUDA]
    launched = {e.correlation_id(): e.start_ns() for e in cpu if e.name().startswith("cu")}
    return [sorted((e for e in gpu if w.start_ns() <= launched.get(e.correlation_id(), -1)
                    <= w.start_ns() + w.duration_ns()), key=lambda e: e.start_ns())
            for w in cpu if w.name().startswith(prefix)]


def pair_options(doc: str) -> argparse.ArgumentParser:
    """The options of a probe that compares "all" with "all - PASS"."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--without", required=True, metavar="PASS")
    p.add_argument("--rounds", type=int, default=4)
    return p


def build_pair(args: argparse.Namespace, device: str = "cuda") -> tuple[dict, list, int]:
    """The optimized "all" and "without" (all - ``args.without``) graphs of the workload on
    ``device``, its steps' inputs and calls per step."""
    cap, config, inputs, calls = workload(args.model, args.fp8, device)
    configs = {"all": config, "without": config.replace(**{args.without: _off(args.without)})}
    with torch.no_grad():
        return {name: optimize_captured(cap, cfg, VerifyOptions(enabled=False), None, name,
                                        0.0).gm for name, cfg in configs.items()}, inputs, calls


def order(r: int) -> tuple[str, str]:
    """The two graphs in round ``r``: reversed every other round, so that neither is always
    timed first."""
    return ("all", "without") if r % 2 == 0 else ("without", "all")


def print_differences(rounds: list[dict], keys, what: str) -> None:
    """Per key, the median over ``rounds`` of "without" less "all", the rounds in brackets."""
    print(f"\n{what}, all - PASS less all (median over {len(rounds)} rounds; rounds in "
          "brackets):")
    for q in keys:
        d = [r["without"].get(q, 0.0) - r["all"].get(q, 0.0) for r in rounds]
        print(f"  {q}: {statistics.median(d):.3f} ({', '.join(f'{x:.3f}' for x in d)})")


def timed(graph: torch.cuda.CUDAGraph) -> tuple[float, object]:
    """Median ms of a bare replay, and the clock it ran at."""
    with ClockSampler("cuda") as s:
        ms = median_ms(graph.replay, 15, 5, "cuda", repeat=3)
    return ms, s.result


def profiled(gm, flat: list) -> dict:
    """A fresh capture of ``gm`` under the profiler: per replay kernels, span, gaps (ms), by
    kind, and by kernel name (us summed over the replay); the replay timed inside the profile."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner = CudaGraphRunner(gm, warmup=2, clone_outputs=False)
        for _ in range(3):
            runner(*flat)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            runner.graph.replay()
            torch.cuda.synchronize()
        inside = median_ms(runner.graph.replay, 5, 1, "cuda")
        for i in range(PROFILED):
            with record_function(f"split_replay{i}"):
                runner.graph.replay()
                torch.cuda.synchronize()
    windows = window_kernels(prof, "split_replay")
    out = defaultdict(list)
    names: dict[str, float] = defaultdict(float)
    for ks in windows:
        if not ks:
            continue
        total = sum(e.duration_ns() for e in ks) / 1e6
        span = (max(e.start_ns() + e.duration_ns() for e in ks) - ks[0].start_ns()) / 1e6
        out["kernels"].append(total)
        out["span"].append(span)
        out["gaps"].append(span - total)
        out["launches"].append(len(ks))
        by = defaultdict(float)
        for e in ks:
            by[kind(e.name())] += e.duration_ns() / 1e6
            names[e.name()[:90]] += e.duration_ns() / 1e3 / len(windows)
        for k, v in by.items():
            out[k].append(v)
    del runner
    torch.cuda.empty_cache()
    res = {k: statistics.median(v) for k, v in out.items()}
    res["in profile"] = inside
    res["names"] = dict(names)
    return res


def main() -> None:
    p = pair_options(__doc__)
    p.add_argument("--calibration", action="store_true",
                   help="also the calibration's replay profile (kopt.profile.profile_replay)")
    args = p.parse_args()
    gms, inputs, _ = build_pair(args)
    runners, eager = {}, {}
    flat = inputs[0]
    with torch.no_grad():
        for name in gms:
            runners[name] = CudaGraphRunner(gms[name], clone_outputs=False)
            for _ in range(3):
                runners[name](*flat)
            torch.cuda.synchronize()
            if args.calibration:
                eager[name] = profile_graph(gms[name], flat, iters=3)
            print(f"{name}: built and captured", flush=True)
        rounds = []
        for r in range(args.rounds):
            row: dict[str, dict] = {}
            for name in order(r):
                ms, clk = timed(runners[name].graph)
                prof = profiled(gms[name], flat)
                if args.calibration:
                    replayed, _ = profile_replay(gms[name], flat, eager[name])
                    prof["calibration"] = replayed.attributed_ms if replayed else float("nan")
                    torch.cuda.empty_cache()
                miss = [phased(runners[name], flat, miss=True) for _ in range(3)]
                row[name] = {"timed": ms, **prof,
                             "miss host": statistics.median(m["prelude host"] for m in miss),
                             "miss wall": statistics.median(m["prelude wall"] for m in miss),
                             "mhz": clk.sm_mhz if clk else float("nan"),
                             "w": clk.power_w if clk else float("nan")}
                v = row[name]
                print(f"round {r} {name}: timed {v['timed']:.3f} ms ({v['mhz']:.0f} MHz, "
                      f"{v['w']:.0f} W); profiled span {v['span']:.3f}, kernels "
                      f"{v['kernels']:.3f}, gaps {v['gaps']:.3f} ({v['launches']:.0f} "
                      f"kernels), timed in the profile {v['in profile']:.3f}; gemm "
                      f"{v.get('gemm', 0):.3f}, attention {v.get('attention', 0):.3f}, other "
                      f"{v.get('other', 0):.3f}; calibration's kernels "
                      f"{v.get('calibration', 0):.3f}; miss prelude host {v['miss host']:.3f}, "
                      f"wall {v['miss wall']:.3f}", flush=True)
            rounds.append(row)
    print_differences(rounds, ("timed", "in profile", "calibration", "span", "kernels", "gaps",
                               "launches", "gemm", "attention", "other", "miss host",
                               "miss wall", "mhz", "w"), "ms per replay")
    names = defaultdict(lambda: [0.0, 0.0])
    for r in rounds:
        for i, g in enumerate(("all", "without")):
            for n, us in r[g]["names"].items():
                names[n][i] += us / len(rounds)
    print("\nkernels by name, us per replay (all, without, difference), largest changes:")
    for n, (a, b) in sorted(names.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:25]:
        print(f"  {b - a:+9.1f}  {a:9.1f}  {b:9.1f}  {n}")


if __name__ == "__main__":
    main()
