"""Predicted leave-one-out savings per pass at several shapes of one workload, without a GPU.

    python benchmarks/rank_shapes.py --model qwen-image --fp8 --disable fuse_allreduce_norm \
        --device-model benchmarks/results/2026-11-30-h200-s5/w1_ablate_loo6/device_model.json \
        --at height=512,width=512 --at height=1024,width=1024 --at height=2048,width=2048 \
        --out DIR

The workload is built and captured on the ``meta`` device (shapes only: a 20B-parameter model
costs no memory), optimized with every enabled pass and with all but each one, and each graph's
time per call predicted by the device model (fitted on the GPU by ``benchmarks/ablate.py``):
the ranking the cost model gives at each shape, eager and replayed from a CUDA graph. The same
rows measured on the GPU (``benchmarks/ablate.py --shape ... --kind leave-one-out``) check it.
Writes ``rank_shapes.json`` and ``rank_shapes.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.cli import parse_shape
from kopt.cost import CostModel, DeviceModel, count_graph
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def predicted_loo(model: str, dtype: torch.dtype, shape: dict, config: PassConfig,
                  device: DeviceModel, only: tuple[str, ...] = ()) -> dict:
    """{pass: {"eager": ms saved, "graph": ms saved}} and the all-passes predictions;
    ``only``: leave out only these passes (default: each enabled one)."""
    w = build(model, device="meta", dtype=dtype, **shape)
    cap = capture_module(w.model, w.args, w.kwargs)
    modes = {"eager": CostModel(device, calls_per_step=w.calls_per_step),
             "graph": CostModel(device, cuda_graphs=True, calls_per_step=w.calls_per_step)}

    def predict(cfg: PassConfig) -> tuple[dict[str, float], int]:
        spec = optimize_captured(cap, cfg, VerifyOptions(enabled=False), None, w.name, 0.0)
        counts = count_graph(spec.gm)
        return {m: c.predict(counts).total_ms for m, c in modes.items()}, spec.report.applied

    every, sites = predict(config)
    saved = {}
    for name in config.enabled():
        if only and name not in only:
            continue
        without, s = predict(config.replace(**{name: False}))
        if s == sites:  # rewrote nothing here: the same graph
            continue
        saved[name] = {m: without[m] - every[m] for m in modes}
        print(f"  {shape}: {name} saves {saved[name]['graph']:+.3f} ms graphed, "
              f"{saved[name]['eager']:+.3f} eager (predicted)", flush=True)
    return {"description": w.description, "all_ms": every, "saved": saved}


def markdown(results: dict, mode: str) -> str:
    shapes = list(results)
    names = sorted({p for r in results.values() for p in r["saved"]})
    head = "| pass | " + " | ".join(f"{s}: saved ms (rank)" for s in shapes) + " |"
    lines = [head, "|" + "---|" * (len(shapes) + 1)]
    ranks = {}
    for s, r in results.items():
        order = sorted(r["saved"], key=lambda p: -r["saved"][p][mode])
        ranks[s] = {p: i + 1 for i, p in enumerate(order)}
    for p in names:
        cells = [f"{results[s]['saved'][p][mode]:+.2f} ({ranks[s][p]})"
                 if p in results[s]["saved"] else "-" for s in shapes]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| all passes, ms per call | " + " | ".join(
        f"{results[s]['all_ms'][mode]:.2f}" for s in shapes) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--disable", action="append", default=[], metavar="PASS")
    p.add_argument("--enable", action="append", default=[], metavar="PASS",
                   help="turn on a pass that is off by default (e.g. cat_rows)")
    p.add_argument("--pass", dest="passes", action="append", default=[], metavar="PASS",
                   help="leave out only these passes (default: each enabled one)")
    p.add_argument("--device-model", required=True, metavar="PATH")
    p.add_argument("--at", action="append", required=True, metavar="KEY=VALUE[,KEY=VALUE]")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = PassConfig().replace(**{name: False for name in args.disable},
                                  **{name: True for name in args.enable})
    if args.fp8:
        config = config.replace(fp8=FP8Config(layout="rowwise"))
    device = DeviceModel.load(args.device_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for at in args.at:
        t0 = time.perf_counter()
        shape = parse_shape(at.split(","), args.model, "--at")
        results[at] = predicted_loo(args.model, DTYPES[args.dtype], shape, config, device,
                                    tuple(args.passes))
        print(f"{at}: {time.perf_counter() - t0:.0f} s", flush=True)
    command = "python benchmarks/rank_shapes.py " + " ".join(sys.argv[1:])
    text = (f"`{command}`\n\nPredicted (not measured) ms per call each pass saves on top of "
            f"all the others, {device.name} device model: {device.source}.\n\n"
            + "".join(f"- {at}: {r['description']}\n" for at, r in results.items())
            + "\nReplayed from a CUDA graph:\n\n" + markdown(results, "graph")
            + "\nEager:\n\n" + markdown(results, "eager"))
    (out / "rank_shapes.md").write_text(text)
    (out / "rank_shapes.json").write_text(json.dumps({"command": command, **results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
