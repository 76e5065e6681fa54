"""The ``kopt`` command line.

    kopt optimize [--model qwen-image-tiny|flux2-tiny|llm-tiny|...|module:function] ...
    kopt optimize --rank [--rank-at height=2048,width=2048] ...   # + predicted saving per pass
    kopt profile ...                                            # time per node and category
    kopt ablate [--pass PASS ...] [--md F] [--json F] [--png F]  # each pass, measured

Exit codes: 0 done, 1 the model could not be captured, 2 bad arguments or unknown model.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(Exception):
    """Bad arguments: reported on stderr with exit code 2."""


def _parser() -> argparse.ArgumentParser:
    from kopt.codegen.rowwise import INTERMEDIATES
    from kopt.models import MODEL_NAMES
    from kopt.passes import PassConfig
    from kopt.passes.config import ACCUMULATIONS, ACTIVATION_MATHS, LAYOUTS

    p = argparse.ArgumentParser(prog="kopt", description="Graph-rewriting optimizer for "
                                "PyTorch inference.")
    sub = p.add_subparsers(dest="command", required=True)
    o = argparse.ArgumentParser(add_help=False)  # what optimize and profile share
    defaults = PassConfig()
    off_by_default = [p for p in PassConfig.pass_names() if getattr(defaults, p) is False]
    from kopt.kb import cli as kb_cli

    kb_cli.add_optimize_arguments(o)  # --kb PATH, --no-kb, --retry, --workload NAME
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
    o.add_argument("--enable", action="append", default=[], metavar="PASS",
                   choices=off_by_default,
                   help=f"turn on a pass that is off by default: {', '.join(off_by_default)} "
                   "(repeatable; fp8 has --fp8)")
    o.add_argument("--fp8", action="store_true",
                   help="turn eligible linears into FP8 GEMMs (rowwise scales; lossy, verified "
                   "against a bound)")
    o.add_argument("--fp8-min-features", type=int, default=1024, metavar="N",
                   help="smallest in/out features a linear needs for --fp8 (default: 1024)")
    o.add_argument("--fp8-layout", choices=LAYOUTS, default="rowwise",
                   help="rowwise: per output channel x per token; blockwise: 128x128 weight "
                        "blocks x 1x128 activation groups (default: rowwise)")
    o.add_argument("--fp8-intermediates", choices=INTERMEDIATES, default="fp32",
                   help="the fused norm kernels' order with --fp8: fp32 rounds each output "
                        "once (Inductor's order; lower FP8 error), eager rounds every step "
                        "like the unfused ops (default: fp32)")
    o.add_argument("--fp8-activation-math", choices=ACTIVATION_MATHS, default="fast",
                   help="the fused activation + quantizer's SiLU/GELU(tanh) with --fp8: exact "
                        "as torch computes them, or fast (the GPU's approximate exp and "
                        "division, a few fp32 ulp off; default: fast)")
    o.add_argument("--fp8-accumulate", choices=ACCUMULATIONS, default="fast",
                   help="how the FP8 GEMMs accumulate with --fp8: fast (the tensor cores' "
                        "own accumulator over K, as torchao's default) or exact (fp32 "
                        "promotion, cuBLAS's default); default: fast")
    o.add_argument("--no-verify", action="store_true", help="skip verification (not advised)")
    o.add_argument("--seeds", type=int, default=3, help="verification seeds (default: 3)")
    o.add_argument("--verify-blocks", default="2", metavar="N|all",
                   help="check the passes on the model cut to its first N blocks per repeated "
                        "list, then the whole model end to end (default: 2); all: check every "
                        "pass on the whole model")
    o.add_argument("--explain", metavar="NODE", action="append", default=[],
                   help="say why a node (graph node name or module path such as "
                   "transformer_blocks.0.attn.to_q) was or was not rewritten")
    o.add_argument("--dump", metavar="DIR", help="write the graph before and after each pass")
    o.add_argument("--bench", type=int, default=0, metavar="N",
                   help="also time the model and the optimized module: median of N calls")
    o.add_argument("--cuda-graphs", nargs="?", choices=("auto", "on", "off"), const="on",
                   default="auto",
                   help="replay the optimized forward from a CUDA graph (hoisted work outside "
                   "it): auto = where the inputs are on CUDA and the graph can be captured, "
                   "on = always (a failed capture is an error), off = never (default: auto; "
                   "the bare flag: on)")
    o.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const="off",
                   help="the same as --cuda-graphs off")
    o.add_argument("--verbose", "-v", action="store_true", help="list every rewritten site")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    o.add_argument("--device-model", default="auto", metavar="auto|fit|h200|PATH",
                   help="the cost model's device parameters: fit = profile the captured graph "
                   "on --device and fit them; h200 = the shipped H200 datasheet model; PATH = "
                   "a JSON DeviceModel; auto = the shipped model of the device if there is one, "
                   "else fit (default: %(default)s)")
    op = sub.add_parser("optimize", parents=[o], help="capture a model, run the passes, verify, "
                        "print the report")
    op.add_argument("--rank", action="store_true",
                    help="rank the passes by predicted time saved on this workload and device "
                    "(cost model) and skip those predicted to lose")
    op.add_argument("--rank-at", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="with --rank: also predict each pass's saving at another workload "
                    "shape of a reference model, from symbolic counts (e.g. height=2048,"
                    "width=2048; repeatable)")
    op.add_argument("--min-saving", type=float, default=0.0, metavar="MS",
                    help="with --rank: apply a pass only if predicted to save more than MS ms "
                    "per call (default: 0, skip predicted losers)")
    pr = sub.add_parser("profile", parents=[o], help="optimize, then run the optimized graph "
                        "under torch.profiler and attribute the time to its nodes")
    pr.add_argument("--iters", type=int, default=3, help="profiled calls (default: 3)")
    pr.add_argument("--top", type=int, default=20, help="nodes to list (default: 20)")
    pr.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace here")
    pr.add_argument("--json", metavar="PATH", help="write the attribution as JSON here")
    from kopt.ablate import KINDS
    from kopt.bench import STEADY_S

    ab = sub.add_parser("ablate", parents=[o], help="time the baseline, each pass alone, the "
                        "passes added in rank order and all but one; predicted vs measured")
    ab.add_argument("--pass", dest="passes", action="append", default=[], metavar="PASS",
                    choices=PassConfig.pass_names(),
                    help="ablate only these passes (repeatable; default: every enabled pass)")
    ab.add_argument("--kind", dest="kinds", action="append", default=[], choices=KINDS,
                    help=f"rows to measure (repeatable; default: {', '.join(KINDS)})")
    ab.add_argument("--iters", type=int, default=10, help="timed steps per variant (default: 10)")
    ab.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    ab.add_argument("--paired", action="store_true",
                    help="time the all-passes row again right after every later row (each "
                    "leave-one-out saving from two back-to-back timings)")
    ab.add_argument("--steady", type=float, default=STEADY_S, metavar="S",
                    help="seconds each CUDA graph runs before it is timed: the sustained "
                    f"clock of a GPU at its power cap (default {STEADY_S:g})")
    ab.add_argument("--md", metavar="PATH", help="write the Markdown table here")
    ab.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ab.add_argument("--png", metavar="PATH", help="write the waterfall chart here (matplotlib)")
    kb_cli.add_parser(sub)
    return p


def parse_shape(items: Sequence[str], model: str, option: str = "--shape") -> dict[str, Any]:
    """``KEY=VALUE`` items (``--shape``) as the keyword arguments of ``build(model, ...)``: each
    key one its builder takes, each value of the type the builder takes."""
    from kopt.models import shape_keys

    keys = shape_keys(model)
    valid = f"valid keys: {', '.join(keys)}"
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"{option} expects KEY=VALUE, got {item!r}; {valid}")
        if key not in keys:
            raise UsageError(f"{option}: unknown key {key!r} for model {model}; {valid}")
        accepts = keys[key]
        if accepts is int:
            try:
                out[key] = int(value)
            except ValueError:
                raise UsageError(f"{option} {item}: {key} takes an integer") from None
        elif value in accepts:
            out[key] = value
        else:
            raise UsageError(f"{option} {item}: {key} is one of {', '.join(accepts)}")
    return out


# The least value each numeric option takes (attribute name: least).
_LEAST = {"bench": 0, "seeds": 1, "fp8_min_features": 0, "iters": 1, "top": 1, "warmup": 0,
          "steady": 0}


def _verify_blocks(args: argparse.Namespace) -> int | None:
    value = getattr(args, "verify_blocks", "2")
    if value == "all":
        return None
    try:
        blocks = int(value)
    except ValueError:
        blocks = 0
    if blocks < 1:
        raise UsageError(f"--verify-blocks takes a count of blocks >= 1 or 'all', got {value!r}")
    return blocks


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments of optimize, profile and ablate before any work, each with a
    UsageError naming the option, the problem and what would be valid."""
    from kopt.models import MODEL_NAMES

    _check_device(args.device, args.dtype)
    _verify_blocks(args)
    for name, least in _LEAST.items():
        value = getattr(args, name, None)
        if value is not None and value < least and not (name == "seeds" and args.no_verify):
            raise UsageError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if ":" in args.model:
        if args.shape:
            raise UsageError(f"--shape sets the inputs of {', '.join(MODEL_NAMES)}; "
                             f"{args.model} makes its own")
    elif args.model not in MODEL_NAMES:
        raise UsageError(f"unknown model {args.model!r}; choose one of "
                         f"{', '.join(MODEL_NAMES)} or give module:function")
    else:
        parse_shape(args.shape, args.model)
    for spec in getattr(args, "rank_at", []):
        if not args.rank:
            raise UsageError("--rank-at predicts with the cost model of --rank; add --rank")
        if ":" in args.model:
            raise UsageError("--rank-at needs a reference model (symbolic counts come from its "
                             "builder)")
        _rank_at_values(args, spec)
    _check_device_model(args.device_model)
    if args.kb and not args.no_kb:
        _check_output("--kb", args.kb, make_folders=True)
    _check_output("--dump", args.dump, folder=True)
    for option in ("trace", "json", "md", "png"):
        _check_output(f"--{option}", getattr(args, option, None))
    if getattr(args, "png", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--png needs matplotlib (pip install matplotlib)") from None


def _check_device(device: str, dtype: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r}: not a device; valid: cpu, cuda, cuda:N") \
            from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: kopt runs on cpu or cuda (cuda:N)")
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible"
        raise UsageError(f"--device {device}: CUDA is not available ({why}); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise UsageError(f"--device {device}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    if dtype == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"--dtype bf16: {torch.cuda.get_device_name(dev)} has no bfloat16 "
                         "support; use fp16 or fp32")


def _check_device_model(choice: str) -> None:
    from kopt.cost import DeviceModel, known_device

    if choice in ("auto", "fit") or (choice and not choice.endswith(".json")
                                     and known_device(choice) is not None):
        return
    if not Path(choice).is_file():
        raise UsageError(f"--device-model {choice!r}: not auto, fit, a known device (h200, "
                         "h100) or a JSON file")
    try:
        DeviceModel.load(choice)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--device-model {choice}: not a DeviceModel: {exc}") from None


def _check_output(option: str, path: str | None, *, folder: bool = False,
                  make_folders: bool = False) -> None:
    """Refuse an output path that could not be written, before the work whose result it is.
    ``folder``: the path is a folder (made with its parents); ``make_folders``: a file whose
    missing folders are made."""
    if path is None:
        return
    p = Path(path).expanduser()
    if folder and p.exists() and not p.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a folder")
    if not folder and p.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    parent = p if folder else p.parent
    if folder or make_folders:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.exists():
        raise UsageError(f"{option} {path}: no folder {parent}")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def _load_workload(args: argparse.Namespace) -> tuple[str, torch.nn.Module, tuple, dict]:
    w = _workload(args)
    name = f"{w.name} ({w.description})" if w.description else w.name
    return name, w.model, w.args, w.kwargs


def _workload(args: argparse.Namespace, device: str | None = None):  # noqa: ANN202
    """The kopt.models.Workload of --model (a module:function's (model, args[, kwargs]) as one
    with no step inputs and one call per step); ``device``: build there instead."""
    from kopt.models import Workload, build

    dtype = DTYPES[args.dtype]
    if ":" in args.model:
        made = _load_function(args.model)()
        if isinstance(made, Workload):
            return made
        if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0],
                                                                          torch.nn.Module):
            kwargs = made[2] if len(made) == 3 else {}
            if not isinstance(made[1], tuple | list):
                raise UsageError(f"--model {args.model} returned (model, "
                                 f"{type(made[1]).__name__}, ...): args must be a tuple, e.g. "
                                 "(model, (x,))")
            if not isinstance(kwargs, dict):
                raise UsageError(f"--model {args.model} returned (model, args, "
                                 f"{type(kwargs).__name__}): kwargs must be a dict")
            return Workload(args.model, made[0], tuple(made[1]), dict(kwargs), (), 1, "")
        what = f"a tuple of {len(made)}" if isinstance(made, tuple) else \
            f"a {type(made).__name__}"
        raise UsageError(f"--model {args.model} returned {what}; it must return a "
                         "kopt.models.Workload or (model, args[, kwargs]) with an nn.Module")
    try:
        return build(args.model, device=device or args.device, dtype=dtype, seed=args.seed,
                     **parse_shape(args.shape, args.model))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _load_function(spec: str) -> Any:
    """The callable ``module:function`` names, refused unless it can be called with no
    arguments."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UsageError(f"--model {spec!r}: expected module:function, e.g. "
                         "mypackage.models:make_workload")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load {spec!r}: {exc}") from exc
    if not callable(fn):
        raise UsageError(f"--model {spec}: {module_name}.{fn_name} is a {type(fn).__name__}, "
                         "not a function returning a kopt.models.Workload or "
                         "(model, args[, kwargs])")
    try:
        inspect.signature(fn).bind()
    except TypeError as exc:
        raise UsageError(f"--model {spec}: kopt calls it with no arguments, but {exc}") \
            from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return fn


def _config(args: argparse.Namespace):  # noqa: ANN202
    from kopt.passes import FP8Config, PassConfig

    both = set(args.enable) & set(args.disable)
    if both:
        raise UsageError(f"{', '.join(sorted(both))}: both --enable and --disable")
    config = PassConfig().replace(**{p: False for p in args.disable},
                                  **{p: True for p in args.enable})
    if args.fp8:
        config = config.replace(fp8=FP8Config(layout=args.fp8_layout,
                                              min_features=args.fp8_min_features,
                                              intermediates=args.fp8_intermediates,
                                              activation_math=args.fp8_activation_math,
                                              accumulate=args.fp8_accumulate))
    return config


def _device_model(args: argparse.Namespace, graphs: Sequence[tuple[Any, Sequence[Any]]] = ()):  # noqa: ANN202
    """The DeviceModel --device-model names; ``graphs``: (graph, inputs) to fit it to."""
    from kopt.cost import DeviceModel, calibrate, known_device

    choice = args.device_model
    cuda = str(args.device).startswith("cuda")
    known = known_device(torch.cuda.get_device_name(torch.device(args.device))) if cuda else None
    if choice == "auto":
        if known is not None:
            return known
        choice = "fit"
    if choice == "fit":
        if not graphs:
            raise UsageError("--device-model fit needs a graph to profile")
        print(f"fitting the device model to a profile of {len(graphs)} graph(s) on "
              f"{args.device}", file=sys.stderr, flush=True)
        return calibrate(graphs, base=known)
    named = known_device(choice) if not choice.endswith(".json") else None
    if named is not None:
        return named
    return DeviceModel.load(choice)  # _check_device_model read it


def _calls_per_step(args: argparse.Namespace) -> int:
    return _workload(args, device="meta").calls_per_step if ":" not in args.model else 1


def _rank_at(args: argparse.Namespace, config: Any, cost: Any) -> dict[str, Any]:
    """Predictions per pass at each --rank-at shape, from the symbolic pipeline."""
    from kopt.cost.symbolic import B, symbolic_pipeline

    pipelines: dict[bool, Any] = {}
    out = {}
    for spec in args.rank_at:
        shape, values = _rank_at_values(args, spec)
        batched = values[B] > 1
        if batched not in pipelines:
            print(f"fitting symbolic counts of {args.model} (batch {'>= 2' if batched else 1})",
                  file=sys.stderr, flush=True)
            pipelines[batched] = symbolic_pipeline(args.model, config, device=args.device,
                                                   dtype=DTYPES[args.dtype],
                                                   mode=shape.get("mode"), batch=values[B])
        out[spec] = pipelines[batched].predictions(cost, values)
    return out


def _rank_at_values(args: argparse.Namespace,
                    spec: str) -> tuple[dict[str, Any], dict[Any, int]]:
    """The shape one --rank-at gives (over --shape) and its symbol values."""
    from kopt.cost.symbolic import workload_values

    shape = {**parse_shape(args.shape, args.model),
             **parse_shape(spec.split(","), args.model, "--rank-at")}
    try:
        return shape, workload_values(args.model, **shape)
    except ValueError as exc:
        raise UsageError(f"--rank-at {spec}: {exc}") from exc


def _optimize(args: argparse.Namespace) -> int:
    opt = _optimized(args)
    if opt is None:
        return 1
    if args.command == "profile":
        from kopt.cost import fit
        from kopt.profile import profile_graph

        spec = next(iter(opt._specs.values()))
        attribution = profile_graph(spec.gm, spec.captured.example_inputs, iters=args.iters,
                                    trace=args.trace)
        # ceilings: the device's model, or (fit) the best rates this very trace reached
        ceilings = fit([(spec.gm, attribution)]) if args.device_model in ("auto", "fit") and \
            not str(args.device).startswith("cuda") else _device_model(args)
        print(attribution.format(args.top, ceilings=ceilings))
        if args.trace:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
        if args.json:
            Path(args.json).write_text(attribution.to_json())
    return 0


def _optimized(args: argparse.Namespace):  # noqa: ANN202
    """Optimize inside the knowledge base's scope (configs and verdicts read and recorded)."""
    from kopt.kb import cli as kb_cli

    with kb_cli.optimize_session(args) as kb_session:
        return _optimized_with(args, kb_session)


def _optimized_with(args: argparse.Namespace, kb_session: Any):  # noqa: ANN202
    import kopt
    from kopt.api import optimize
    from kopt.verify import VerifyOptions

    name, model, margs, mkwargs = _load_workload(args)
    config = _config(args)
    verify = VerifyOptions(enabled=not args.no_verify, seeds=tuple(range(args.seeds)),
                           blocks=_verify_blocks(args))
    print(f"kopt {kopt.__version__}: optimizing {name}; torch {torch.__version__}, "
          f"{args.dtype} on {args.device}", flush=True)
    cost = None
    try:
        if getattr(args, "rank", False):
            from kopt.capture import capture_module
            from kopt.cost import CostModel

            cap = capture_module(model, margs, mkwargs) if args.device_model in (
                "auto", "fit") else None
            device = _device_model(args, [(cap.gm, cap.example_inputs)] if cap else ())
            cost = CostModel(device, cuda_graphs=_replays(args),
                             calls_per_step=_calls_per_step(args),
                             min_saving_ms=args.min_saving)
        opt = optimize(model, margs, mkwargs, config, verify=verify, dump_dir=args.dump,
                       cuda_graphs=CUDA_GRAPHS[args.cuda_graphs], cost=cost,
                       keep_original=bool(args.bench))  # --bench times the model too
    except kopt.CaptureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if args.cuda_graphs == "on" and not str(args.device).startswith("cuda"):
        print(f"note: --cuda-graphs has no effect on {args.device} (CUDA graphs need a CUDA "
              "device)", file=sys.stderr)
    report = opt.report
    report.model = name
    print(report.format(verbose=args.verbose))
    if kb_session is not None:
        print(kb_session.summary())
    _check_explain(args.explain, report, opt.captured_graph)
    for node in args.explain:
        print(report.explain(node, opt.captured_graph))
    if cost is not None:
        print(f"device model: {cost.device.describe()}")
        print(report.ranking.format(_rank_at(args, config, cost) if args.rank_at else None))
    if args.bench:
        _bench(args, model, margs, mkwargs, opt, kb_session)
    if args.dump:
        print(f"graphs written to {args.dump}/")
    return opt


CUDA_GRAPHS = {"auto": "auto", "on": True, "off": False}


def _replays(args: argparse.Namespace) -> bool:
    """Whether the optimized module is meant to replay from CUDA graphs (for the cost model's
    predictions and the KB): ``on``, or ``auto`` on a CUDA device."""
    return args.cuda_graphs == "on" or (args.cuda_graphs == "auto"
                                        and str(args.device).startswith("cuda"))


def _bench(args: argparse.Namespace, model: torch.nn.Module, margs: tuple, mkwargs: dict,
           opt: Any, kb_session: Any) -> None:
    """``--bench N``: the median time per call of the model and of the optimized module as
    configured; on CUDA also the model captured by hand in one CUDA graph, and the optimized
    module with the other CUDA-graph setting, so one run has every row a user compares."""
    from kopt.bench import graphed_call, interleaved_ms

    cuda = str(args.device).startswith("cuda")
    configured = CUDA_GRAPHS[args.cuda_graphs]

    def kopt_with(setting: Any) -> Callable[[], object]:
        def call() -> object:
            opt.cuda_graphs = setting
            return opt(*margs, **mkwargs)
        return call

    labels = ["model, eager", f"kopt, --cuda-graphs {args.cuda_graphs}"]
    fns = [lambda: model(*margs, **mkwargs), kopt_with(configured)]
    with torch.no_grad():
        fns[1]()  # the first calls: the report then says how the module runs
        fns[1]()
        lines = [line for line in opt.report.runtime if line.startswith("CUDA graphs")]
        labels[1] += f" ({lines[0]})" if lines else ""
        if cuda:
            try:
                fns.append(graphed_call(lambda: model(*margs, **mkwargs)))
                labels.append("model, captured by hand in a CUDA graph")
            except RuntimeError as e:  # the model itself does not capture: say so
                torch.cuda.synchronize()
                print(f"model, captured by hand in a CUDA graph: the capture failed: "
                      f"{str(e).splitlines()[0][:200]}")
            other = "off" if configured is not False else "auto"
            labels.append(f"kopt, --cuda-graphs {other}")
            fns.append(kopt_with(CUDA_GRAPHS[other]))
        try:
            times = interleaved_ms(fns, args.bench, device=args.device)
        finally:
            opt.cuda_graphs = configured
    base, fast = times[0], times[1]
    rows = list(zip(labels, times, strict=True))
    if kb_session is not None:
        kb_session.record_e2e(base, fast, cuda_graphs=_replays(args))
    print(f"time per call on {args.device}, median of {args.bench} (the rows timed in turn, "
          "call by call):")
    for label, ms in rows:
        print(f"  {label}: {ms:.3f} ms ({ms / base:.3f}x the model's eager time)")


def _check_explain(nodes: Sequence[str], report: Any, graph: torch.fx.GraphModule) -> None:
    """Refuse an --explain name that is no node or module path of the captured graph and no
    site a pass reported: a typo would otherwise read as 'no rewrite looks at this node'."""
    from kopt.graph.query import module_path

    known = {n.name for n in graph.graph.nodes}
    known.update(path for n in graph.graph.nodes if (path := module_path(n)))
    for r in report.passes:
        known.update(r.sites, r.reverted, (rej.node for rej in r.rejections), *r.site_nodes)
    unknown = [n for n in nodes if n not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        raise UsageError(f"--explain {unknown[0]}: no node or module of that name in the "
                         "captured graph; " + (f"close: {', '.join(close)}" if close else
                                               "--dump lists its nodes"))


def _ablate(args: argparse.Namespace) -> int:
    import kopt
    from kopt.ablate import KINDS, ablate
    from kopt.api import optimize_captured
    from kopt.capture import capture_module
    from kopt.cost import CostModel
    from kopt.verify import VerifyOptions

    w = _workload(args)
    config = _config(args)
    off = sorted(set(args.passes) - set(config.enabled()))
    if off:
        raise UsageError(f"--pass {', '.join(off)}: not enabled (fp8 needs --fp8; "
                         "passes off by default need --enable)")
    verify = VerifyOptions(enabled=not args.no_verify, seeds=tuple(range(args.seeds)),
                           blocks=_verify_blocks(args))
    print(f"kopt {kopt.__version__}: ablating {w.name}; torch {torch.__version__}, "
          f"{args.dtype} on {args.device}", file=sys.stderr, flush=True)
    try:
        cap = capture_module(w.model, w.args, w.kwargs)
    except kopt.CaptureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    graphs = []
    if args.device_model in ("auto", "fit"):  # fitted to the graph before and after the passes
        full = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0)
        graphs = [(cap.gm, cap.example_inputs), (full.gm, cap.example_inputs)]
    cost = CostModel(_device_model(args, graphs), calls_per_step=w.calls_per_step)
    del graphs
    result = ablate(w, config, passes=args.passes or None, kinds=args.kinds or KINDS,
                    cost=cost, iters=args.iters, warmup=args.warmup, verify=verify,
                    captured=cap, paired=args.paired, steady_s=args.steady,
                    progress=lambda s: None if args.quiet
                    else print(s, file=sys.stderr, flush=True))
    text = result.markdown()
    print(text)
    _file_ablation(args, result, cap)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(result.to_json())
    if args.png:
        result.waterfall(args.png)
    return 0


def _file_ablation(args: argparse.Namespace, result: Any, cap: Any) -> None:
    """Savings per pass and dead ends (passes that made this workload slower) into the
    knowledge base: the next ``kopt optimize`` of the workload skips the dead ends."""
    from kopt.kb import cli as kb_cli
    from kopt.kb.verdicts import inputs_device, record_ablation, workload_key

    with kb_cli.optimize_session(args) as s:
        if s is None:
            return
        workload = s.workload or workload_key(cap.gm, cap.example_inputs)
        lines = s.guard("recording the ablation", lambda: record_ablation(
            s.kb, result, workload, s.device or inputs_device(cap.example_inputs),
            regime=s.regime), [])
        print(f"knowledge base {s.kb.path} (workload {workload}):\n"
              + ("\n".join(f"  recorded: {line}" for line in lines) or "  recorded: nothing"),
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "kb":
        from kopt.kb import cli as kb_cli

        return kb_cli.run(args)
    # torch's own pytree deprecation notices are not the user's concern here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # progress lines (INFO) unless quiet, on this call's stderr
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s", stream=sys.stderr, force=True)
    try:
        _check_arguments(args)
        if args.command in ("optimize", "profile"):
            return _optimize(args)
        if args.command == "ablate":
            return _ablate(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"kopt: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
