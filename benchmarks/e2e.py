"""End-to-end speed of a reference workload: eager, Inductor, naive FP8 + Inductor, and kopt.

    python benchmarks/e2e.py --model qwen-image --out-dir results/e2e-w1
    python benchmarks/e2e.py --model flux2 --variants eager-bf16,naive-fp8-inductor,kopt-fp8

Variants (each with and without a CUDA graph of the whole forward, where it captures):

- ``eager-bf16``: the model as built (``kopt.models``).
- ``inductor-bf16``: regional compilation: every repeated block (a ``ModuleList`` of modules of
  one class) wrapped in ``torch.compile`` (default mode), the rest eager.
- ``naive-fp8-inductor``: ARCHITECTURE.md's baseline: every ``nn.Linear`` with in and out
  features >= 1024 replaced by a per-output-channel FP8 weight (quantized once) and a per-token
  activation quantization in plain torch ops, ``torch._scaled_mm`` with rowwise scales; then the
  same regional compilation.
- ``torchao-fp8`` (on request; torchao is an optional benchmark extra): the library users
  pick, ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``
  on the Linears the naive baseline quantizes, then the same regional compilation. It
  quantizes the model in place, so it runs last.
- ``kopt-bf16`` / ``kopt-fp8``: ``kopt.optimize`` of the whole forward (FP8: ``FP8Config()``),
  two rows from one optimization: ``..., default arguments`` (what a user gets: CUDA graphs
  "auto", the execution plan) and ``..., cuda_graphs=False`` (eager, the execution plan).
- ``kopt-bf16-inductor`` / ``kopt-fp8-inductor`` (on request): ``torch.compile(backend="kopt")``
  with Inductor compiling what kopt's passes leave (hoisting is off under Inductor).

Per variant: median ms per forward (one call, its inputs repeated: kopt's hoisted timestep work
is cached after the first) and per denoise step (``calls_per_step`` calls: W1's cond and uncond
call share the timestep tensor and the latents, differ in the text states; each step a new
timestep, as a pipeline's loop runs them, 4 steps back to back without a synchronization); the
table's ratio compares each variant's best ms per step over its calls (its forward in a
loop), the output's relative error against eager-bf16 (cond call; on ``--error-inputs``
inputs, 3 by default: the workload's, and latents and text drawn again like them), the GPU
kernel time by category from torch.profiler (with the launch gaps: forward time minus busy
kernel time), and for kopt the verification verdict. Writes ``e2e.json``, ``e2e.md`` and
``e2e.png`` into ``--out-dir``.
Medians of CUDA-event timings after warm-up, random weights and inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import kopt
from kopt.ablate import STEPS, step_kwargs
from kopt.bench import median_ms
from kopt.codegen.rowwise import INTERMEDIATES
from kopt.floor import Floor, floor_lines, forward_work, measure_floor
from kopt.kb.store import KnowledgeBase
from kopt.models import Workload, build, main_output
from kopt.passes.config import ACCUMULATIONS, ACTIVATION_MATHS, LAYOUTS
from kopt.power import ClockSampler
from kopt.verify import VerifyOptions, relative_error

VARIANTS = ("eager-bf16", "inductor-bf16", "naive-fp8-inductor", "kopt-bf16", "kopt-fp8")
# also available, not run by default: kopt's passes inside torch.compile with Inductor after
# them, over the whole forward (one graph: long to compile at full size); torchao's float8
EXTRA_VARIANTS = ("kopt-bf16-inductor", "kopt-fp8-inductor", "torchao-fp8")
DEFAULT_ROW, EAGER_ROW = "default arguments", "cuda_graphs=False"
TOP_KERNELS = 25  # kernels listed per variant (by time per forward)
TOP_NAME_CHARS = 110
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max

# Kernel name -> category, first match wins. Names as cuBLAS/cuDNN/Triton/ATen report them.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|sdpa|cudnn_generated_fort_native_sdpa|sm90_xmma_.*f16f16"
                  r"_f16f32_bf16|_attn"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|scaled_mm|matmul|_mm_|wgmma|sm90_|splitK"),
    ("quantization", r"quant|fp8|e4m3|float8"),
    ("copies", r"copy|memcpy|memset|cat_|CatArray|index|gather|scatter"),
    ("norm/elementwise", r"norm|elementwise|vectorized|reduce|triton_|softmax|silu|gelu|mul|add"),
)


class NaiveFP8Linear(nn.Module):
    """What a user writes by hand: weight quantized per output channel once, activation per
    token at every call, ``torch._scaled_mm`` with rowwise scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        self.register_buffer("w_q", (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3))
        self.register_buffer("w_scale", scale.t().contiguous())  # [1, N]
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
        q = (x2.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        y = torch._scaled_mm(q, self.w_q.t(), scale, self.w_scale, bias=self.bias,
                             out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def swapped(model: nn.Module, make: Callable[[str, nn.Module], nn.Module | None]) -> Iterator[int]:
    """Replace every submodule for which ``make(path, module)`` returns a module; restore on
    exit. Yields the number replaced."""
    done: list[tuple[nn.Module, str, nn.Module]] = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            new = make(f"{path}.{name}" if path else name, child)
            if new is not None:
                done.append((module, name, child))
                setattr(module, name, new)
    try:
        yield len(done)
    finally:
        for module, name, child in reversed(done):
            setattr(module, name, child)


def naive_fp8(path: str, m: nn.Module) -> nn.Module | None:
    if isinstance(m, nn.Linear) and min(m.in_features, m.out_features) >= 1024:
        return NaiveFP8Linear(m)
    return None


def repeated_blocks(model: nn.Module) -> set[nn.Module]:
    """Children of a ``ModuleList`` whose members all share one class: the unit of regional
    compilation (one compile, reused by every block)."""
    blocks: set[nn.Module] = set()
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            blocks.update(m)
    return blocks


def torchao_fp8(model: nn.Module) -> int:
    """torchao's float8 rowwise recipe on the Linears :func:`naive_fp8` takes (in place); the
    number quantized."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    chosen = {id(m) for path, m in model.named_modules() if naive_fp8(path, m) is not None}
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda m, _fqn: id(m) in chosen)
    return len(chosen)


def regional_compile(model: nn.Module):  # noqa: ANN201
    blocks = repeated_blocks(model)
    return swapped(model, lambda _, m: torch.compile(m) if m in blocks else None)


def kernel_breakdown(fn: Callable[[], object], forward_ms: float,
                     cuda: bool = True) -> dict:
    """Kernel ms per forward by category, plus the launch gaps (forward - busy time), and under
    ``"top"`` the longest kernels as ``[category: name, ms per forward, launches per
    forward]``. On the CPU (smoke runs) the "kernels" are the aten ops' self time."""
    fn()
    _sync(cuda)
    iters = 2
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        _sync(cuda)
    out: dict[str, float] = defaultdict(float)
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])  # name -> [ms, launches]
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not e.name.startswith(("aten::", "kopt::")):
            continue
        cat = next((c for c, rx in CATEGORIES if re.search(rx, e.name, re.I)), "other")
        ms = (e.device_time if cuda else e.self_cpu_time_total) / 1e3 / iters
        out[cat] += ms
        k = kernels[f"{cat}: {e.name[:TOP_NAME_CHARS]}"]
        k[0] += ms
        k[1] += 1
    busy = sum(out.values())
    out["launch gaps"] = max(forward_ms - busy, 0.0)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    cats = {k: round(v, 3) for k, v in out.items()}
    cats["top"] = [[name, round(ms, 3), n // iters] for name, (ms, n) in top]
    return cats


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class CudaGraphForward:
    """One forward captured in a CUDA graph; ``__call__`` copies new inputs in and replays."""

    def __init__(self, fn: Callable[..., object], kwargs: dict) -> None:
        self.static = {k: v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                fn(**self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.out = main_output(fn(**self.static))

    def __call__(self, **kwargs: object) -> torch.Tensor:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and v is not self.static[k]:
                self.static[k].copy_(v)
        self.graph.replay()
        return self.out


def measure(name: str, fn: Callable[..., object], w: Workload, uncond: dict,
            refs: list[tuple[dict, torch.Tensor]], iters: int, graphs: bool, device: str,
            graphed: Callable[[], Callable[..., torch.Tensor]] | None = None) -> dict:
    """Time ``fn``; with ``graphs`` also its CUDA-graph form: ``graphed()`` where the variant
    has its own (kopt: hoisted regions outside the graph), else a capture of the whole call.
    ``refs``: (keyword inputs, eager-bf16 output) pairs, the workload's own inputs first: the
    output error is measured on each."""
    row: dict = {"calls_per_step": w.calls_per_step}
    cond = w.kwargs
    ref = refs[0][1]
    # a denoising loop's steps: each a new timestep (and guidance), which the step's cond and
    # uncond calls share as one tensor, as a pipeline passes it; timed back to back
    conds = step_kwargs(w, STEPS)
    text = {k: v for k, v in uncond.items() if v is not cond.get(k)}
    unconds = [dict(c, **text) for c in conds]
    steps = itertools.cycle(range(STEPS))

    def step(f: Callable[..., object]) -> None:
        s = next(steps)
        with torch.no_grad():
            f(*w.args, **conds[s])
            if w.calls_per_step > 1:
                f(*w.args, **unconds[s])

    with torch.no_grad():
        errors = [relative_error(main_output(fn(*w.args, **kw)), want) for kw, want in refs]
    row["rel_err_vs_eager"] = errors[0]
    row["rel_err_inputs"] = errors
    row["forward_ms"] = median_ms(lambda: step_one(fn, w), iters, device=device)
    row["step_ms"] = median_ms(lambda: step(fn), iters, device=device, repeat=STEPS)
    row["breakdown"] = kernel_breakdown(lambda: step_one(fn, w), row["forward_ms"],
                                        cuda=device == "cuda")
    print(f"{name}: {row['forward_ms']:.2f} ms/forward, {row['step_ms']:.2f} ms/step, "
          f"err {row['rel_err_vs_eager']:.2e}", flush=True)
    if graphs:
        try:
            if graphed is not None:
                g = graphed()
                for _ in range(3):  # warm-up, then capture
                    g(**cond)
            else:
                g = CudaGraphForward(lambda **kw: fn(*w.args, **kw), cond)
        except Exception as e:  # the result to record is that it does not capture, and why
            row["cuda_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name} + CUDA graph: capture failed: {row['cuda_graph_error']}", flush=True)
            torch.cuda.synchronize()
            return row
        row["graph_rel_err_vs_eager"] = relative_error(g(**cond), ref)
        with ClockSampler("cuda") as clocks:  # at the power cap the clock is the graph's
            row["graph_forward_ms"] = median_ms(lambda: g(**cond), iters, device="cuda")
        if clocks.result is not None:
            row["graph_sm_mhz"] = clocks.result.sm_mhz
            row["graph_power_w"] = clocks.result.power_w

        def graph_step() -> None:
            s = next(steps)
            g(**conds[s])
            if w.calls_per_step > 1:
                g(**unconds[s])

        row["graph_step_ms"] = median_ms(graph_step, iters, device="cuda", repeat=STEPS)
        row["graph_breakdown"] = kernel_breakdown(lambda: g(**cond), row["graph_forward_ms"])
        print(f"{name} + CUDA graph: {row['graph_forward_ms']:.2f} ms/forward, "
              f"{row['graph_step_ms']:.2f} ms/step"
              + (f", SM {row['graph_sm_mhz']:.0f} MHz, {row['graph_power_w']:.0f} W"
                 if "graph_sm_mhz" in row else ""), flush=True)
        del g
    return row


def step_one(fn: Callable[..., object], w: Workload) -> None:
    with torch.no_grad():
        fn(*w.args, **w.kwargs)


def run_variant(name: str, w: Workload, uncond: dict, refs: list[tuple[dict, torch.Tensor]],
                args) -> dict:  # noqa: ANN001
    t0 = time.perf_counter()
    row: dict = {}
    if name == "eager-bf16":
        return measure(name, w.model, w, uncond, refs, args.iters, args.cuda_graphs, args.device)
    if name in ("inductor-bf16", "naive-fp8-inductor", "torchao-fp8"):
        torch._dynamo.reset()
        quant = (swapped(w.model, naive_fp8) if name.startswith("naive") else
                 contextlib.nullcontext(torchao_fp8(w.model)) if name.startswith("torchao")
                 else contextlib.nullcontext(0))
        with quant as n_fp8, regional_compile(w.model) as n_blocks:
            with torch.no_grad():
                w.model(*w.args, **w.kwargs)  # compile
            row = {"fp8_linears": n_fp8, "compiled_blocks": n_blocks,
                   "prepare_s": time.perf_counter() - t0}
            row.update(measure(name, w.model, w, uncond, refs, args.iters, args.cuda_graphs,
                               args.device))
        torch._dynamo.reset()
        return row
    fp8 = kopt.FP8Config(layout=args.fp8_layout, intermediates=args.fp8_intermediates,
                         activation_math=args.fp8_activation_math,
                         accumulate=args.fp8_accumulate)
    config = kopt.PassConfig(fp8=fp8 if name.startswith("kopt-fp8") else None).replace(
        **{p: True for p in args.enable})
    if name.endswith("-inductor"):
        torch._dynamo.reset()
        reports: list = []
        compiled = torch.compile(w.model, backend="kopt", options={
            "inner": "inductor", "config": config, "reports": reports,
            "keep_original": True})  # the other variants run the same model
        with torch.no_grad():
            compiled(*w.args, **w.kwargs)  # capture, passes, Inductor
        row = {"prepare_s": time.perf_counter() - t0, "graphs": len(reports),
               "verified": all(r.verified for r in reports),
               "passes": {r.name: r.matched for rep in reports for r in rep.passes}}
        row.update(measure(name, compiled, w, uncond, refs, args.iters, args.cuda_graphs,
                           args.device))
        torch._dynamo.reset()
        return row
    verify = VerifyOptions(enabled=args.seeds > 0, seeds=tuple(range(max(args.seeds, 1))))
    opt = kopt.optimize(w.model, w.args, w.kwargs, config, verify=verify,
                        keep_original=True)  # the other variants run the same model
    base = {"prepare_s": time.perf_counter() - t0,
            "verified": opt.report.verified if verify.enabled else None,
            "passes": {r.name: r.matched for r in opt.report.passes}}
    print(opt.report, flush=True)
    rows = {}
    for label, mode in ((EAGER_ROW, False), (DEFAULT_ROW, "auto")):
        opt.cuda_graphs = mode
        row = dict(base)
        row.update(measure(f"{name}, {label}", opt, w, uncond, refs, args.iters, False,
                           args.device))
        rows[label] = row
    spec = opt._specs[opt._first_key]
    rows[DEFAULT_ROW]["runtime"] = spec.report.runtime
    rows[DEFAULT_ROW]["replayed_from_graph"] = spec.runner is not None and \
        spec.runner.graph is not None
    print("\n".join(spec.report.runtime), flush=True)
    return rows


def best_forward_ms(row: dict) -> float:
    """A variant's ms per forward in a denoising loop at its best, with a CUDA graph or
    without: its step's time over the step's calls (a new timestep each step, so kopt's
    hoisted timestep work runs once a step, as in a pipeline; a single repeated call would
    find it cached)."""
    step = min(row.get("graph_step_ms", float("inf")), row["step_ms"])
    return step / row.get("calls_per_step", 1)


def error_cell(row: dict) -> str:
    """The output error on the workload's inputs, and its mean and range over all the inputs
    drawn where there were more: a gap between two variants' errors is then told from how
    much the error moves from one input to the next."""
    errors = row.get("rel_err_inputs", [row["rel_err_vs_eager"]])
    if len(errors) < 2:
        return f"{errors[0]:.2e}"
    return (f"{errors[0]:.2e}; mean {statistics.mean(errors):.3e} over {len(errors)} inputs "
            f"({min(errors):.3e}-{max(errors):.3e})")


def redrawn_inputs(w: Workload, seed: int) -> dict:
    """``w``'s keyword inputs with every floating-point tensor of two or more dims (latents,
    text embeddings) drawn again with the same shape, mean and std; the rest (timesteps,
    positions, masks) kept: another input of the same workload, for the output error."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for k, v in w.kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
            f = v.float()
            r = torch.randn(v.shape, generator=g).to(v.device)
            v = (r * f.std() + f.mean()).to(v.dtype)
        out[k] = v
    return out


def write_outputs(rows: dict[str, dict], meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "e2e.json").write_text(json.dumps({"meta": meta, "variants": rows}, indent=1))
    naive = rows.get("naive-fp8-inductor")
    # each variant at its best (with or without a CUDA graph) against the baseline at its best
    base = best_forward_ms(naive) if naive else None
    lines = [f"{meta['description']} — {meta['device']}, torch {meta['torch']}, {meta['date']}",
             "", "ms/forward: one call, the same inputs again (kopt's hoisted timestep work "
             f"cached); ms/step: the step's calls, each step a new timestep, {STEPS} steps back "
             "to back; in a loop: the best ms/step over its calls, which the ratio compares.",
             "",
             "| variant | ms/forward | ms/step | + CUDA graph ms/forward | ms/step "
             "| in a loop, ms/forward | vs naive-fp8+Inductor | rel. error vs eager |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ratio = f"{best_forward_ms(r) / base:.3f}x" if base else "—"
        if "graph_forward_ms" in r:
            clock = (f" ({r['graph_sm_mhz']:.0f} MHz, {r['graph_power_w']:.0f} W)"
                     if "graph_sm_mhz" in r else "")
            graph = f"{r['graph_forward_ms']:.2f}{clock} | {r['graph_step_ms']:.2f}"
        elif "cuda_graph_error" in r:
            graph = f"capture fails: {r['cuda_graph_error']} | —"
        else:
            graph = "not run | —"
        lines.append(f"| {name} | {r['forward_ms']:.2f} | {r['step_ms']:.2f} | {graph} "
                     f"| {best_forward_ms(r):.2f} | {ratio} | {error_cell(r)} |")
    lines += ["", "Kernel time per forward by category (ms; one call on repeated inputs, CUDA "
              "graph where it captured):", ""]
    cats = sorted({c for r in rows.values() for c in r.get("graph_breakdown", r["breakdown"])
                   if c != "top"})
    lines += ["| variant | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, r in rows.items():
        b = r.get("graph_breakdown", r["breakdown"])
        lines.append(f"| {name} | " + " | ".join(f"{b.get(c, 0.0):.2f}" for c in cats) + " |")
    if meta.get("floor"):
        lines += floor_lines(rows, Floor(**meta["floor"]))
    for name, r in rows.items():
        b = r.get("graph_breakdown", r["breakdown"])
        lines += ["", f"Longest kernels of {name} (ms per forward, launches per forward):", "",
                  "| kernel | ms | launches |", "|---|---|---|"]
        lines += [f"| `{k}` | {ms:.3f} | {n} |" for k, ms, n in b.get("top", [])]
    (out_dir / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(rows)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [rows[n]["forward_ms"] for n in names], 0.4, label="no graph")
    ax.bar([x + 0.2 for x in xs], [rows[n].get("graph_forward_ms", 0) for n in names], 0.4,
           label="CUDA graph")
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_ylabel("ms / forward")
    ax.set_title(meta["description"][:80], fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "e2e.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seeds", type=int, default=1, help="kopt verification seeds (0: off)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run of the harness on a tiny model (no CUDA graphs)")
    p.add_argument("--out-dir", default="e2e-out")
    p.add_argument("--error-inputs", type=int, default=3, metavar="N",
                   help="measure the output error on N inputs: the workload's, and N - 1 drawn "
                        "again (same shapes and scale); the table shows their mean and range")
    p.add_argument("--fp8-layout", choices=LAYOUTS, default="rowwise",
                   help="kopt-fp8's scale layout (kopt.FP8Config.layout)")
    p.add_argument("--fp8-intermediates", choices=INTERMEDIATES, default="fp32",
                   help="kopt-fp8's fused norm + quantizer order (kopt.FP8Config.intermediates)")
    p.add_argument("--fp8-activation-math", choices=ACTIVATION_MATHS, default="fast",
                   help="kopt-fp8's fused activation + quantizer math "
                        "(kopt.FP8Config.activation_math)")
    p.add_argument("--fp8-accumulate", choices=ACCUMULATIONS,
                   default=kopt.FP8Config().accumulate,
                   help="kopt-fp8's GEMM accumulation (kopt.FP8Config.accumulate)")
    p.add_argument("--enable", action="append", default=[], metavar="PASS",
                   help="turn on a pass that is off by default in the kopt variants")
    p.add_argument("--kb", type=Path, metavar="PATH",
                   help="record kopt-fp8's error and speed against naive FP8 in this knowledge "
                        "base, as a lesson on its FP8Config (the evidence for its defaults)")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS) - set(EXTRA_VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    if args.device == "cpu":
        args.cuda_graphs = False
    w = build(args.model, device=args.device, dtype=torch.bfloat16)
    text = next(k for k in ("encoder_hidden_states",) if k in w.kwargs)
    uncond = dict(w.kwargs, **{text: torch.randn_like(w.kwargs[text])})
    meta = {"model": args.model, "description": w.description,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "iters": args.iters,
            "fp8_layout": args.fp8_layout, "fp8_intermediates": args.fp8_intermediates,
            "fp8_activation_math": args.fp8_activation_math,
            "fp8_accumulate": args.fp8_accumulate}
    print(w.description, flush=True)
    ref = w.run()
    refs = [(w.kwargs, ref)]
    for i in range(1, args.error_inputs):
        kw = redrawn_inputs(w, seed=i)
        with torch.no_grad():
            refs.append((kw, main_output(w.model(*w.args, **kw))))
    meta["error_inputs"] = len(refs)
    work = forward_work(w.model, w.args, w.kwargs)
    meta["work"] = {"gemm_tflop": work.gemm_flops / 1e12,
                    "attention_tflop": work.attention_flops / 1e12,
                    "attention_calls": [[list(a.q), list(a.k), a.calls, a.masked]
                                        for a in work.attention]}
    if args.device == "cuda":
        try:
            meta["floor"] = measure_floor(work).to_json()
            print(f"floor: {meta['floor']}", flush=True)
        except ValueError as e:  # a GPU without shipped datasheet peaks: no floor table
            print(f"no floor: {e}", flush=True)
    rows: dict[str, dict] = {}
    for name in sorted(names, key=lambda n: n == "torchao-fp8"):  # torchao's changes the model
        result = run_variant(name, w, uncond, refs, args)
        if name.startswith("kopt-") and not name.endswith("-inductor"):
            rows.update({f"{name}, {label}": row for label, row in result.items()})
        else:
            rows[name] = result
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        write_outputs(rows, meta, Path(args.out_dir))
    if args.device == "cuda":
        meta["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    write_outputs(rows, meta, Path(args.out_dir))
    if args.kb is not None:
        lesson = fp8_lesson(rows, meta)
        if lesson is not None:
            with KnowledgeBase.open(args.kb) as kb:
                kb.add_lesson(lesson, ["numerics"], rewrite="fp8", device=meta["device"])
            print(f"recorded in {args.kb}: {lesson}")


def fp8_lesson(rows: dict[str, dict], meta: dict) -> str | None:
    """One line on kopt-fp8's FP8Config against naive FP8 in this run: output error and time
    as ratios of the baseline's (None without both rows)."""
    naive = rows.get("naive-fp8-inductor")
    kopt_row = next((r for k, r in rows.items() if k.startswith("kopt-fp8, default")), None) \
        or rows.get("kopt-fp8")
    if naive is None or kopt_row is None:
        return None
    return (f"FP8Config(layout={meta['fp8_layout']!r}, accumulate={meta['fp8_accumulate']!r}, "
            f"activation_math={meta['fp8_activation_math']!r}) on {meta['model']}, "
            f"{meta['date']}: output error {kopt_row['rel_err_vs_eager']:.3e} = "
            f"{kopt_row['rel_err_vs_eager'] / naive['rel_err_vs_eager']:.3f}x naive FP8's, "
            f"time {best_forward_ms(kopt_row) / best_forward_ms(naive):.3f}x naive FP8 + "
            "Inductor's")


if __name__ == "__main__":
    main()
