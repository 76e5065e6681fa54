"""Does a pass's saving depend on whether its two graphs are built alone or held together?

    python -m benchmarks.probes.build_alone --model qwen-image --fp8 --without merge_projections

W1's merge_projections saves 3.25-3.40 ms a call in the ablation's leave-one-out rows (two
runs: each row's graph built, timed at the sustained clock, then freed before the next is
built) and 1.6-1.7 ms where both graphs are built first, held, and timed alternately
(``row_protocol``, ``miss_in_step``; RESULTS.md, 2026-12-03, H200). This times the pair both ways
in one process, round after round (the order reversed every other round):

- ``alone``: each graph built and timed by the ablation's own row function
  (:func:`kopt.ablate._measure`: optimize, time eagerly, run ``--steady`` seconds, time from
  the CUDA graph), then freed (``gc.collect``, ``torch.cuda.empty_cache``) before the next;
- ``together``: then both graphs built and held, each timed as a row times it (``--steady``
  seconds of its steps, then the median of ``--iters`` steps), alternately.

If ``alone`` measures the rows' 3.3 ms and ``together`` 1.7, holding the second graph (its
memory, its weights, its caches) changes what is timed; if both measure the same, the rows'
difference comes from where in the ablation each row runs.
"""

from __future__ import annotations

import gc
import itertools

import torch

from benchmarks.probes.replay_split import order, pair_options, print_differences
from kopt.ablate import Variant, _main, _measure, _off, step_inputs, stepper
from kopt.api import optimize_captured
from kopt.bench import STEADY_S, median_ms, sustain
from kopt.capture import capture_module
from kopt.cudagraphs import CudaGraphRunner
from kopt.models import build
from kopt.passes.config import FP8Config, PassConfig
from kopt.power import ClockSampler
from kopt.verify import VerifyOptions

QUANTITIES = ("graph", "eager", "MHz", "W")


def shown(row: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None)


def free(cuda: bool) -> None:
    """What the ablation does between rows."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    p = pair_options(__doc__)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steady", type=float, default=STEADY_S)
    p.add_argument("--skip-alone", action="store_true", help="only the held pair")
    p.add_argument("--device", default="cuda",
                   help="cpu: eager timings only (a check of the probe, not a measurement)")
    args = p.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    w = build(args.model, device=args.device, dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fuse_allreduce_norm=False)
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    variants = {"all": Variant("all", "all", (), config),
                "without": Variant(f"all - {args.without}", "leave-one-out", (),
                                   config.replace(**{args.without: _off(args.without)}),
                                   args.without)}
    inputs, calls = step_inputs(w), w.calls_per_step
    off = VerifyOptions(enabled=False)
    with torch.no_grad():
        expected = _main(cap.gm(*cap.example_inputs)).detach().clone()
    alone = []
    for r in range(0 if args.skip_alone else args.rounds):
        row = {}
        for name in order(r):
            measured, _ = _measure(variants[name], w, cap, off, None, expected, inputs,
                                   args.iters, args.warmup, steady_s=args.steady)
            row[name] = {"graph": measured.graph_ms, "eager": measured.ms,
                         "MHz": measured.sm_mhz, "W": measured.power_w}
            print(f"alone, round {r} {name}: {shown(row[name])}", flush=True)
            del measured
            free(cuda)
        alone.append(row)
    if alone:
        print_differences(alone, [k for k in QUANTITIES if alone[0]["all"][k] is not None],
                          "built alone, as the ablation's rows")
    together = []
    with torch.no_grad():
        gms = {name: optimize_captured(cap, v.config, off, None, name, 0.0).gm
               for name, v in variants.items()}
        runners = {name: CudaGraphRunner(gm) if cuda else gm for name, gm in gms.items()}
        for r in range(args.rounds):
            row = {}
            for name in order(r):
                step = stepper(itertools.cycle(inputs), calls)
                run = runners[name]
                sustain(lambda st=step, rn=run: st(rn), args.steady, args.device)
                with ClockSampler(args.device) as s:
                    ms = median_ms(lambda st=step, rn=run: st(rn), args.iters, args.warmup,
                                   args.device) / calls
                clocks = s.result
                row[name] = {"graph" if cuda else "eager": ms,
                             "MHz": clocks.sm_mhz if clocks else None,
                             "W": clocks.power_w if clocks else None}
                print(f"together, round {r} {name}: {shown(row[name])}", flush=True)
            together.append(row)
    print_differences(together, [k for k, v in together[0]["all"].items() if v is not None],
                      "built first and held together")


if __name__ == "__main__":
    main()
