"""The ``kopt`` command line.

    kopt optimize [--model qwen-image-tiny|flux2-tiny|llm-tiny|...|module:function] ...

Exit codes: 0 done, 1 the model could not be captured, 2 bad arguments or unknown model.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(Exception):
    """Bad arguments: reported on stderr with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    from kopt.models import MODEL_NAMES
    from kopt.passes import PassConfig
    from kopt.passes.config import LAYOUTS

    p = argparse.ArgumentParser(prog="kopt", description="Graph-rewriting optimizer for "
                                "PyTorch inference.")
    sub = p.add_subparsers(dest="command", required=True)
    o = argparse.ArgumentParser(add_help=False)  # what optimize and profile share
    o.add_argument("--model", default="qwen-image-tiny",
                   help=f"one of {', '.join(MODEL_NAMES)}, or module:function returning a "
                   "kopt.models.Workload or (model, args[, kwargs]) (default: %(default)s)")
    o.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    o.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    o.add_argument("--seed", type=int, default=0, help="weights and inputs seed")
    o.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE",
                   help="workload shape, e.g. --shape height=512 --shape text_tokens=64")
    o.add_argument("--disable", action="append", default=[], metavar="PASS",
                   choices=PassConfig.pass_names(), help="turn a pass off (repeatable)")
    o.add_argument("--fp8", action="store_true",
                   help="turn eligible linears into FP8 GEMMs (rowwise scales; lossy, verified "
                   "against a bound)")
    o.add_argument("--fp8-min-features", type=int, default=1024, metavar="N",
                   help="smallest in/out features a linear needs for --fp8 (default: 1024)")
    o.add_argument("--fp8-layout", choices=LAYOUTS, default="rowwise",
                   help="rowwise: per output channel x per token; blockwise: 128x128 weight "
                        "blocks x 1x128 activation groups (default: rowwise)")
    o.add_argument("--no-verify", action="store_true", help="skip verification (not advised)")
    o.add_argument("--seeds", type=int, default=3, help="verification seeds (default: 3)")
    o.add_argument("--explain", metavar="NODE", action="append", default=[],
                   help="say why a node (graph node name or module path such as "
                   "transformer_blocks.0.attn.to_q) was or was not rewritten")
    o.add_argument("--dump", metavar="DIR", help="write the graph before and after each pass")
    o.add_argument("--bench", type=int, default=0, metavar="N",
                   help="also time the model and the optimized module: median of N calls")
    o.add_argument("--cuda-graphs", action="store_true",
                   help="replay the optimized forward from a CUDA graph (hoisted work outside "
                   "it; CUDA devices only), e.g. with --bench")
    o.add_argument("--verbose", "-v", action="store_true", help="list every rewritten site")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    sub.add_parser("optimize", parents=[o], help="capture a model, run the passes, verify, "
                   "print the report")
    pr = sub.add_parser("profile", parents=[o], help="optimize, then run the optimized graph "
                        "under torch.profiler and attribute the time to its nodes")
    pr.add_argument("--iters", type=int, default=3, help="profiled calls (default: 3)")
    pr.add_argument("--top", type=int, default=20, help="nodes to list (default: 20)")
    pr.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace here")
    pr.add_argument("--json", metavar="PATH", help="write the attribution as JSON here")
    return p


def _parse_shape(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--shape expects KEY=VALUE, got {item!r}")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def _load_workload(args: argparse.Namespace) -> tuple[str, torch.nn.Module, tuple, dict]:
    from kopt.models import MODEL_NAMES, Workload, build

    dtype = DTYPES[args.dtype]
    if ":" in args.model:
        module_name, _, fn_name = args.model.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot load {args.model!r}: {exc}") from exc
        made = fn()
        if isinstance(made, Workload):
            return made.name, made.model, made.args, made.kwargs
        if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0],
                                                                          torch.nn.Module):
            kwargs = made[2] if len(made) == 3 else {}
            return args.model, made[0], tuple(made[1]), dict(kwargs)
        raise UsageError(f"{args.model} must return a kopt.models.Workload or "
                         "(model, args[, kwargs])")
    if args.model not in MODEL_NAMES:
        raise UsageError(f"unknown model {args.model!r}; choose one of "
                         f"{', '.join(MODEL_NAMES)} or give module:function")
    try:
        w = build(args.model, device=args.device, dtype=dtype, seed=args.seed,
                  **_parse_shape(args.shape))
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    return f"{w.name} ({w.description})", w.model, w.args, w.kwargs


def _optimize(args: argparse.Namespace) -> int:
    opt = _optimized(args)
    if opt is None:
        return 1
    if args.command == "profile":
        from kopt.profile import profile_graph

        spec = next(iter(opt._specs.values()))
        attribution = profile_graph(spec.gm, spec.captured.example_inputs, iters=args.iters,
                                    trace=args.trace)
        print(attribution.format(args.top))
        if args.trace:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
        if args.json:
            Path(args.json).write_text(attribution.to_json())
    return 0


def _optimized(args: argparse.Namespace):  # noqa: ANN202
    import kopt
    from kopt.api import optimize
    from kopt.passes import PassConfig
    from kopt.verify import VerifyOptions

    name, model, margs, mkwargs = _load_workload(args)
    from kopt.passes import FP8Config

    config = PassConfig().replace(**{p: False for p in args.disable})
    if args.fp8:
        config = config.replace(fp8=FP8Config(layout=args.fp8_layout,
                                              min_features=args.fp8_min_features))
    verify = VerifyOptions(enabled=not args.no_verify, seeds=tuple(range(args.seeds)))
    print(f"kopt {kopt.__version__}: optimizing {name}; torch {torch.__version__}, "
          f"{args.dtype} on {args.device}", flush=True)
    try:
        opt = optimize(model, margs, mkwargs, config, verify=verify, dump_dir=args.dump,
                       cuda_graphs=args.cuda_graphs)
    except kopt.CaptureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        print(f"note: --cuda-graphs has no effect on {args.device} (CUDA graphs need a CUDA "
              "device)", file=sys.stderr)
    report = opt.report
    report.model = name
    print(report.format(verbose=args.verbose))
    for node in args.explain:
        print(report.explain(node, opt.captured_graph))
    if args.bench:
        from kopt.bench import median_ms

        with torch.no_grad():
            base = median_ms(lambda: model(*margs, **mkwargs), args.bench, device=args.device)
            fast = median_ms(lambda: opt(*margs, **mkwargs), args.bench, device=args.device)
        how = "CUDA graph" if args.cuda_graphs and str(args.device).startswith("cuda") else \
            "eager execution, no CUDA graphs"
        print(f"time per call on {args.device}, median of {args.bench}: model {base:.3f} ms, "
              f"kopt {fast:.3f} ms ({fast / base:.3f}x; {how})")
    if args.dump:
        print(f"graphs written to {args.dump}/")
    return opt


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # torch's own pytree deprecation notices are not the user's concern here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command in ("optimize", "profile"):
            return _optimize(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"kopt: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
