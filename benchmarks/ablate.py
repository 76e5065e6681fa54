"""Pass-by-pass ablation on the GPU, and the cost model's predictions held against it.

    python benchmarks/ablate.py --model qwen-image --out-dir benchmarks/results/DATE/ablate-w1
    python benchmarks/ablate.py --model qwen-image --shape height=512 --shape width=512 \
        --out-dir ...
    python benchmarks/ablate.py --model flux2 --fp8 --out-dir ...
    python benchmarks/ablate.py --model llm --shape mode=decode --out-dir ...

1. Build the workload on CUDA, capture it once, optimize it with every pass (no verification).
2. Fit the device model to profiles of the captured and the optimized graph (base: the shipped
   H200 model: its peaks, bandwidth and CUDA-graph launch cost) -> ``device_model.json``.
3. Ablate with that model ranking the passes: baseline, each pass alone, cumulative in rank
   order, leave-one-out; eager and CUDA-graph times; numerics verdict per row (``--seeds 0``:
   not verified) -> ``ablation.md``, ``ablation.json``, ``waterfall.png``.
4. Compare predicted and measured ms saved per pass (alone, leave-one-out, and the ranking's
   in-pipeline prediction against leave-one-out): share within +-30 %, Spearman rank
   correlation -> ``comparison.json``, appended to ``ablation.md``.

The fit uses the same workload it then predicts (a calibration run); hold it against another
shape with ``--device-model PATH`` (a ``device_model.json`` from an earlier run).

What the fit and the predictions are made of is kept: ``calibration.json.gz`` (the profiled
graphs' counts and times, wall times) and ``rows.jsonl.gz`` (each row as it is measured, with
its graph's counts; a run cut short keeps the rows it finished). Fit and predict again on any
machine, without the GPU:

    python benchmarks/ablate.py --replay DIR [--device-model fit|h200|PATH] [--out-dir OUT]

``--profile-rows N`` also profiles every row (N calls): ``ablation.md`` then shows, per pass,
the ops its saving is made of, predicted against measured kernel time -- where a miss comes from.

``--paired`` times the all-passes row again right after every later row, so each leave-one-out
saving is a difference of two back-to-back timings and the GPU's drift between rows stays out
of it (the same W1 row measured about +-2 ms apart across runs of a 103 ms call);
``ablation.md`` gives the all-passes row's spread over the run.

Each CUDA graph runs its steps for ``--steady`` seconds before it is timed: a GPU at its
power cap reaches its sustained clock only after some seconds of load, and a row timed at once
after its build measures a clock its graph does not sustain (``kopt.bench.STEADY_S``).

``--calibrate-only`` stops after the fit: a new calibration of the same workload, checked
against an earlier run's rows with ``--replay OLD --device-model NEW/device_model.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import sys
import time
from pathlib import Path

import torch

from kopt.ablate import (
    KINDS,
    Ablation,
    RowLog,
    ablate,
    baseline_config,
    load_rows,
    op_deltas,
    repredict,
    spearman,
)
from kopt.api import optimize_captured
from kopt.bench import STEADY_S
from kopt.capture import capture_module
from kopt.cli import parse_shape
from kopt.codegen.rowwise import INTERMEDIATES
from kopt.cost import H200, Calibration, CostModel, DeviceModel, known_device, measure
from kopt.kb.verdicts import inputs_device, workload_key
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.passes.config import ACTIVATION_MATHS, LAYOUTS
from kopt.verify import VerifyOptions

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = 0.30  # the bound on |predicted - measured| / |measured|


def compare(result: Ablation) -> dict:
    """Predicted vs measured ms saved per pass, for each kind and execution mode measured."""
    out: dict = {}
    graphs = [False] + ([True] if any(r.graph_ms is not None for r in result.rows) else [])
    loo = {}
    for g in graphs:
        mode = "graph" if g else "eager"
        loo[mode] = result.savings("leave-one-out", graphs=g)
        pairs = {f"{kind}/{mode}": result.savings(kind, graphs=g)
                 for kind in ("alone", "leave-one-out")}
        if result.ranking is not None and not g:  # the ranking's in-pipeline prediction
            # (eager) vs all-but-this-pass measured
            pairs[f"ranking-vs-leave-one-out/{mode}"] = {
                p.name: (p.saved_ms, loo[mode][p.name][1]) for p in result.ranking.passes
                if p.name in loo[mode]}
        for key, s in pairs.items():
            rows = {name: {"predicted_ms": p, "measured_ms": m,
                           "relative_error": None if p is None or m == 0 else (p - m) / abs(m),
                           "within": p is not None and abs(p - m) <= TOLERANCE * abs(m)}
                    for name, (p, m) in s.items()}
            both = [(r["predicted_ms"], r["measured_ms"]) for r in rows.values()
                    if r["predicted_ms"] is not None]
            out[key] = {
                "passes": rows,
                "within_30pct": sum(r["within"] for r in rows.values()),
                "of": len(rows),
                "spearman": spearman(*zip(*both, strict=True)) if len(both) >= 2 else None,
            }
    return out


def format_comparison(c: dict) -> str:
    lines = ["", "### Cost model vs measurement", "",
             "| comparison | passes within +-30% | Spearman |", "|---|---|---|"]
    for key, v in c.items():
        rho = "-" if v["spearman"] is None else f"{v['spearman']:.2f}"
        lines.append(f"| {key} | {v['within_30pct']} / {v['of']} | {rho} |")
    return "\n".join(lines) + "\n"


def format_op_deltas(result: Ablation, cost: CostModel, top: int = 6) -> str:
    """Per pass whose rows were profiled: the ops its saving is made of, predicted vs
    measured kernel time (where a miss comes from)."""
    parts = []
    for kind in ("leave-one-out", "alone"):
        for r in (r for r in result.rows if r.kind == kind):
            other = result.every_pass if kind == "leave-one-out" else result.baseline
            if r.same_graph(other):  # rewrote nothing here
                continue
            try:
                deltas = op_deltas(result, cost, r.subject, kind)
            except (KeyError, ValueError):
                continue
            lines = [f"| {op} | {p:+.3f} | {m:+.3f} |" for op, p, m in deltas[:top]
                     if abs(p) > 1e-3 or abs(m) > 1e-3]
            parts.append(f"\n{r.variant} vs {'all' if kind == 'leave-one-out' else 'baseline'}:"
                         "\n\n| op | predicted kernel ms | measured kernel ms |\n|---|---|---|\n"
                         + "\n".join(lines) + "\n")
    if not parts:
        return ""
    return ("\n### Kernel time by op (profiled rows, eager, hoisted regions hit)\n"
            + "".join(parts))


def write(result: Ablation, out: Path, command: str, description: str,
          cost: CostModel | None = None) -> str:
    """ablation.md, ablation.json, comparison.json and waterfall.png; returns the Markdown."""
    comparison = compare(result)
    text = (f"`{command}`: {description}\n\n" + result.markdown() + "\n"
            + format_comparison(comparison)
            + (format_op_deltas(result, cost) if cost is not None else ""))
    (out / "ablation.md").write_text(text)
    (out / "ablation.json").write_text(result.to_json())
    (out / "comparison.json").write_text(json.dumps({"command": command, **comparison},
                                                    indent=1))
    try:
        result.waterfall(out / "waterfall.png")
    except ImportError:
        print("no matplotlib: waterfall.png not written (pip install matplotlib)")
    return text


def replay(args: argparse.Namespace) -> None:
    """Fit and predict again from a run's saved rows and calibration."""
    src = Path(args.replay)
    out = Path(args.out_dir or src)
    out.mkdir(parents=True, exist_ok=True)
    result = load_rows(src / "rows.jsonl.gz")
    run = json.loads((src / "run.json").read_text()) if (src / "run.json").exists() else {}
    cuda = result.device.startswith("cuda") or any(r.graph_ms is not None for r in result.rows)
    result.device = run.get("device_name", result.device)
    if args.device_model == "fit":
        cal = Calibration.from_json(gzip.decompress((src / "calibration.json.gz").read_bytes())
                                    .decode())
        if args.power:  # a calibration saved before it read the GPU's power
            cal = dataclasses.replace(cal, power=args.power)
        device = cal.fit(H200 if cuda else None, source=args.fit_source,
                         power=not args.no_power)
    elif args.device_model == "h200":
        device = H200
    else:
        device = DeviceModel.load(args.device_model)
    device.save(out / "device_model.json")
    print(f"device model: {device.describe()}")
    cost = CostModel(device, calls_per_step=result.calls_per_step)
    result = repredict(result, cost)
    command = "python benchmarks/ablate.py " + " ".join(sys.argv[1:])
    print(write(result, out, command, f"{result.model}, {len(result.rows)} rows of {src} "
                "predicted again", cost))
    if args.kb:
        if "workload" not in run:
            sys.exit(f"--kb: {src}/run.json does not name the workload")
        record(args.kb, result, run["workload"], run["device"])
    print(f"written to {out}/")


def record(path: str, result: Ablation, workload: str, device: str) -> None:
    from kopt.kb import KnowledgeBase
    from kopt.kb.verdicts import record_ablation

    with KnowledgeBase.open(path) as kb:
        lines = record_ablation(kb, result, workload, device)
    print(f"knowledge base {path}:\n" + "\n".join(f"  recorded: {x}" for x in lines))


def _power(text: str) -> tuple[float, float, float]:
    try:
        cap, copy, mhz = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CAP_W,COPY_W,MAX_MHZ, "
                                         "e.g. 700,469,1980") from None
    return cap, copy, mhz


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu: a smoke run")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--fp8", action="store_true", help="FP8 linears (rowwise unless --fp8-layout)")
    p.add_argument("--fp8-layout", choices=LAYOUTS, default="rowwise")
    p.add_argument("--fp8-intermediates", choices=INTERMEDIATES, default="fp32")
    p.add_argument("--fp8-activation-math", choices=ACTIVATION_MATHS, default="fast")
    p.add_argument("--disable", action="append", default=[], metavar="PASS")
    p.add_argument("--enable", action="append", default=[], metavar="PASS",
                   help="turn on a pass that is off by default (e.g. cat_rows)")
    p.add_argument("--pass", dest="passes", action="append", default=[], metavar="PASS",
                   help="ablate only these passes (default: every enabled one)")
    p.add_argument("--kind", dest="kinds", action="append", default=[], choices=KINDS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seeds", type=int, default=1, help="verification seeds (0: none)")
    p.add_argument("--device-model", default="fit", metavar="fit|h200|PATH")
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--fit-source", choices=("replay", "eager"), default="replay",
                   help="fit the kernels' rates to their times replayed from a CUDA graph "
                   "(default, where the calibration has them) or to the eager profile")
    p.add_argument("--no-power", action="store_true", help="no power model: every kernel at "
                   "its fitted rate whatever the clock its graph's mix leaves it")
    p.add_argument("--power", type=_power, metavar="CAP_W,COPY_W,MAX_MHZ",
                   help="with --replay: the GPU's power cap, a copy's power and its highest "
                   "SM clock, for a calibration saved without them")
    p.add_argument("--profile-rows", type=int, default=0, metavar="N",
                   help="also profile every row over N calls: its kernel time by op, held "
                   "against the predicted per pass in ablation.md (where a miss comes from)")
    p.add_argument("--paired", action="store_true",
                   help="time the all-passes row again right after every later row: each "
                   "leave-one-out saving is then a difference of two back-to-back timings "
                   "(the run's drift left out; holds a second variant in memory)")
    p.add_argument("--steady", type=float, default=STEADY_S, metavar="S",
                   help="seconds each CUDA graph runs its steps before it is timed, so that "
                   f"every row is timed at the GPU's sustained clock (default {STEADY_S:g})")
    p.add_argument("--out-dir", help="where the results go (required unless --replay)")
    p.add_argument("--calibrate-only", action="store_true", help="stop after the fit "
                   "(calibration.json.gz, device_model.json): check it with --replay on the rows "
                   "of an earlier run")
    p.add_argument("--replay", metavar="DIR", help="no measuring: fit (--device-model) and "
                   "predict again from DIR's rows.jsonl.gz and calibration.json.gz")
    p.add_argument("--kb", metavar="PATH", help="also file the savings and the dead ends (passes "
                   "measured slower) in this knowledge base (with --replay: the replayed rows)")
    args = p.parse_args()
    if args.replay:
        replay(args)
        return
    if not args.out_dir:
        p.error("--out-dir is required")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    both = set(args.enable) & set(args.disable)
    if both:
        p.error(f"{', '.join(sorted(both))}: both --enable and --disable")
    config = PassConfig().replace(**{name: False for name in args.disable},
                                  **{name: True for name in args.enable})
    if args.fp8:
        config = config.replace(fp8=FP8Config(layout=args.fp8_layout,
                                              intermediates=args.fp8_intermediates,
                                              activation_math=args.fp8_activation_math))
    t0 = time.perf_counter()
    w = build(args.model, device=args.device, dtype=DTYPES[args.dtype],
              **parse_shape(args.shape, args.model))
    print(f"{w.description}; built in {time.perf_counter() - t0:.1f} s", flush=True)
    cap = capture_module(w.model, w.args, w.kwargs)
    print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)

    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    run = {"workload": workload_key(cap.gm, cap.example_inputs),
           "device": inputs_device(cap.example_inputs), "device_name": name,
           "command": "python benchmarks/ablate.py " + " ".join(sys.argv[1:])}
    (out / "run.json").write_text(json.dumps(run, indent=1))  # for --replay (and --kb there)
    base = (known_device(name) or H200) if cuda else None  # the CPU: measured ceilings
    if args.device_model == "fit":
        # the two ends of the ablation: its baseline row's graph (the passes not ablated stay
        # on: fold_constants there takes the host-to-device copies out of Qwen-Image's captured
        # graph, which a CUDA graph cannot capture) and the all-passes graph
        off = VerifyOptions(enabled=False)
        base_cfg = baseline_config(config, args.passes or None)
        first = (optimize_captured(cap, base_cfg, off, None, w.name, 0.0).gm
                 if base_cfg.enabled() else cap.gm)
        full = optimize_captured(cap, config, off, None, w.name, 0.0)
        cal = measure([(first, cap.example_inputs), (full.gm, cap.example_inputs)],
                      iters=args.profile_iters)
        (out / "calibration.json.gz").write_bytes(gzip.compress(cal.to_json().encode()))
        for i, note in enumerate(cal.notes):
            miss = cal.miss_ms[i] if i < len(cal.miss_ms) else None
            walls = f"; {cal.graphs[i][2]:.4g} ms per call" + (
                "" if miss is None else f", {miss:.4g} with its hoisted regions missing")
            print(f"calibration graph {i + 1}: {note or 'eager profile only'}{walls}",
                  flush=True)
        device = cal.fit(base, source=args.fit_source, power=not args.no_power)
        del full, first
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    elif args.device_model == "h200":
        device = H200
    else:
        device = DeviceModel.load(args.device_model)
    device.save(out / "device_model.json")
    print(f"device model: {device.describe()}", flush=True)
    if args.calibrate_only:
        print(f"written to {out}/")
        return

    cost = CostModel(device, calls_per_step=w.calls_per_step)
    result = ablate(w, config, passes=args.passes or None, kinds=args.kinds or KINDS,
                    cost=cost, iters=args.iters, profile_rows=args.profile_rows,
                    paired=args.paired, steady_s=args.steady,
                    warmup=args.warmup, captured=cap,
                    verify=VerifyOptions(enabled=args.seeds > 0, seeds=tuple(range(args.seeds))),
                    progress=lambda s: print(s, flush=True),
                    on_row=RowLog(out / "rows.jsonl.gz"))
    result.device = name
    command = "python benchmarks/ablate.py " + " ".join(sys.argv[1:])
    text = write(result, out, command, w.description, cost)
    if args.kb:
        record(args.kb, result, run["workload"], run["device"])
    print(text)
    print(f"written to {out}/")


if __name__ == "__main__":
    main()
