"""Row-wise fused kernels vs the unfused eager ops vs Inductor's fused kernel, at W1/W2 shapes.

    python benchmarks/kernels_rowwise.py --out rowwise.json     # on the GPU; prints a table

Cases (bf16, random non-zero data): LayerNorm + adaLN + FP8 quant, RMSNorm + FP8 quant, gated
residual + LayerNorm + modulation (bf16 out, and + FP8), standalone FP8 (per token, per 1x128
group) and NVFP4 quantization; shapes W1 (Qwen-Image: 4096 image + 128 text tokens, hidden 3072)
and W2 (FLUX.2: 4096 + 512 tokens, hidden 6144).

Each variant computes the same outputs: ``kopt`` the generated kernel (kopt.codegen), ``eager``
the reference function (the unfused aten ops), ``inductor`` ``torch.compile`` of that function.
Device time: ``triton.testing.do_bench`` median of a CUDA graph replaying the variant over
enough rotating input copies that nothing stays in L2 (do_bench flushes L2 before each replay),
divided by the calls in the graph. ``kopt launch`` is do_bench of a plain call (device time plus
host overhead). GB/s counts the bytes the kernel must move (every input read once, every output
written once); ``of copy`` is that over the copy bandwidth measured in the same run
(``torch.empty_like(x).copy_(x)`` on 1 GiB), ``of same`` over that of a copy of the kernel's own
byte count, timed the same way (:func:`same_size_copy_gbps`). ``one tile``: where kopt runs a
row as two power-of-two tiles (``row_split``: 3072 = 2048 + 1024), the same kernel with the row
in one masked tile.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.testing import do_bench

from kopt.codegen.kernels.nvfp4 import quant_nvfp4_reference, quant_nvfp4_triton
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    quant_fp8_group_reference,
    quant_fp8_group_triton,
    quant_fp8_rowwise_reference,
    quant_fp8_rowwise_triton,
)
from kopt.codegen.rowwise import RowwiseSpec, prepare_launch, rowwise_reference, rowwise_triton

WORKLOADS = {"W1": (4096 + 128, 3072), "W2": (4096 + 512, 6144)}
L2_BYTES = 64 << 20  # H200: 50 MiB; rotate through > 4x this per graph
DEVICE = "cuda"


@dataclass
class Case:
    name: str
    spec: RowwiseSpec | None  # None: a standalone quantizer
    kopt: Callable[..., object]
    reference: Callable[..., object]
    inputs: Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]


def near_e4m3_ties(rows: int, cols: int, dtype: torch.dtype, group: int | None = None,
                   seed: int = 0) -> torch.Tensor:
    """Rows whose quotients ``x / scale`` lie on, or a few ulps beside, the midpoints between
    e4m3 values (where a quotient rounded one ulp off changes the e4m3 result): each row (each
    ``group`` of a row) holds its absolute maximum first, the others ``tie * scale`` nudged by
    -2..2 ulps of ``dtype``, with scale = fp32(amax) * fp32(1 / 448) as torch computes it; and
    signed zeros."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    span = group or cols
    amax = (torch.rand(rows, -(-cols // span), device=DEVICE, generator=g) * 8 + 0.01).to(dtype)
    scale = amax.float() * torch.tensor(1 / 448, dtype=torch.float32)
    grid = torch.arange(0, 127, dtype=torch.uint8, device=DEVICE).view(E4M3).double()
    ties = (grid[1:] + grid[:-1]) / 2
    t = ties[torch.randint(0, ties.numel(), (rows, cols), device=DEVICE, generator=g)]
    sign = torch.randint(0, 2, (rows, cols), device=DEVICE, generator=g) * 2 - 1
    span_scale = scale.double().repeat_interleave(span, dim=1)[:, :cols]
    x = (t * span_scale * sign).to(dtype)
    nudge = torch.randint(-2, 3, (rows, cols), device=DEVICE, generator=g)
    bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    x = (bits + nudge.to(bits.dtype)).view(dtype)
    x[:, 1::97], x[:, 2::89] = -0.0, 0.0  # signed zeros keep their sign bit in e4m3
    x[:, ::span] = amax.to(dtype)[:, : x[:, ::span].shape[1]]
    return x


def _bf16(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    # never zero: a zero row would make the quantizers' work trivially smaller
    t = torch.randn(*shape, device=DEVICE, generator=g) * scale
    return torch.where(t == 0, 1e-3, t).to(torch.bfloat16)


def _row_inputs(spec: RowwiseSpec) -> Callable[[int, int, torch.Generator], dict]:
    def make(rows: int, cols: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        full = {
            "x": lambda: _bf16(g, 1, rows, cols), "y": lambda: _bf16(g, 1, rows, cols),
            "gate": lambda: _bf16(g, 1, cols), "scale": lambda: _bf16(g, 1, cols, scale=0.3),
            "shift": lambda: _bf16(g, 1, cols), "weight": lambda: _bf16(g, cols, scale=0.1) + 1,
            "global_scale": lambda: torch.tensor([0.003], device=DEVICE),
        }
        return {n: full[n]() for n in spec.input_names()}
    return make


def _spec_case(name: str, spec: RowwiseSpec) -> Case:
    def kopt(num_warps: int | None = None, rows_per: int | None = None,
             one_tile: bool = False, **ins: torch.Tensor) -> object:
        return rowwise_triton(spec, [ins[n] for n in spec.input_names()], num_warps=num_warps,
                              rows_per=rows_per, one_tile=one_tile)

    def reference(**ins: torch.Tensor) -> object:
        return rowwise_reference(spec, ins)

    return Case(name, spec, kopt, reference, _row_inputs(spec))


def _quant_case(name: str, kopt: Callable, reference: Callable, nvfp4: bool = False) -> Case:
    def make(rows: int, cols: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        ins = {"x": _bf16(g, rows, cols)}
        if nvfp4:
            ins["global_scale"] = torch.tensor([0.003], device=DEVICE)
        return ins

    def k(num_warps: int | None = None, **ins: torch.Tensor) -> object:
        return kopt(*ins.values())

    return Case(name, None, k, lambda **ins: reference(*ins.values()), make)


CASES = [
    _spec_case("layernorm+adaLN+fp8", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, modulation=True, outputs=("fp8_row",))),
    _spec_case("rmsnorm+fp8", RowwiseSpec(
        "bfloat16", norm="rms", eps=1e-6, weight=True, affine_after_round=True,
        outputs=("fp8_row",))),
    _spec_case("rmsnorm", RowwiseSpec(
        "bfloat16", norm="rms", eps=1e-6, weight=True, affine_after_round=True,
        outputs=("out",))),
    _spec_case("gated res+layernorm+mod", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
        outputs=("out", "residual"))),
    _spec_case("gated res+layernorm+mod+fp8", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
        outputs=("residual", "fp8_row"))),
    _spec_case("layernorm+adaLN+fp8, fp32 steps", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, modulation=True, outputs=("fp8_row",),
        intermediates="fp32")),
    _spec_case("gated res+layernorm+mod+fp8, fp32 steps", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
        outputs=("residual", "fp8_row"), intermediates="fp32")),
    _spec_case("layernorm+adaLN+fp8 1x128", RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, modulation=True, outputs=("fp8_group",))),
    _quant_case("quant fp8 per token", quant_fp8_rowwise_triton, quant_fp8_rowwise_reference),
    _quant_case("quant fp8 1x128", quant_fp8_group_triton, quant_fp8_group_reference),
    _quant_case("quant nvfp4", quant_nvfp4_triton, quant_nvfp4_reference, nvfp4=True),
]


def _nbytes(tensors: object) -> int:
    if isinstance(tensors, dict):
        tensors = list(tensors.values())
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[union-attr]


def device_ms(fn: Callable[..., object], input_sets: list[dict]) -> float:
    """Median device time of one call: a CUDA graph of calls over rotating input sets."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for ins in input_sets[:2]:
            fn(**ins)  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for ins in input_sets:
            fn(**ins)
    torch.cuda.synchronize()
    return do_bench(graph.replay, return_mode="median") / len(input_sets)


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    ms = do_bench(lambda: torch.empty_like(x).copy_(x), return_mode="median")
    return 2 * x.numel() / ms / 1e6


def _check(case: Case, ins: dict) -> str:
    """kopt against the reference: 'bitwise' or the relative error of the first float output."""
    got, ref = case.kopt(**ins), case.reference(**ins)
    got_l = list(got.values()) if isinstance(got, dict) else list(got)
    ref_l = list(ref.values()) if isinstance(ref, dict) else list(ref)
    if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
           else torch.equal(a, b) for a, b in zip(got_l, ref_l, strict=True)):
        return "bitwise"
    errs = []
    for a, b in zip(got_l, ref_l, strict=True):
        a64, b64 = a.float().double(), b.float().double()
        errs.append(((a64 - b64).norm() / b64.norm().clamp(min=1e-30)).item())
    return f"rel err <= {max(errs):.1e}"


SWEEP_ROWS = (1, 2, 4)
SWEEP_WARPS = (2, 4, 8, 16)


def same_size_copy_gbps(moved: int) -> float:
    """GB/s of ``dst.copy_(src)`` moving ``moved`` bytes (half read, half written), timed as
    the kernels are: the copy bandwidth a kernel of that size can expect (at tens of MB a copy
    reaches well under the 1 GiB figure: ramp-up and tail of one wave of blocks)."""
    half = max(moved // 2, 1)
    sets = [{"src": torch.empty(half, dtype=torch.uint8, device="cuda").random_(),
             "dst": torch.empty(half, dtype=torch.uint8, device="cuda")}
            for _ in range(max(2, -(-4 * L2_BYTES // moved)))]
    return 2 * half / device_ms(lambda src, dst: dst.copy_(src), sets) / 1e6


def workload_shape(workload: str) -> tuple[int, int]:
    """A named workload's (rows, cols), or ``ROWSxCOLS`` (e.g. 3168x4096: W1's bytes in rows
    of a power-of-two width)."""
    if workload in WORKLOADS:
        return WORKLOADS[workload]
    try:
        rows, cols = (int(v) for v in workload.lower().split("x"))
    except ValueError:
        raise SystemExit(f"unknown workload {workload!r}: {', '.join(WORKLOADS)} or ROWSxCOLS"
                         ) from None
    return rows, cols


def measure(case: Case, workload: str, sweep_warps: bool, copy_gbps: float,
            inductor: bool = True) -> dict:
    rows, cols = workload_shape(workload)
    g = torch.Generator(device="cuda").manual_seed(0)
    one = case.inputs(rows, cols, g)
    moved = _nbytes(one) + _nbytes(case.reference(**one))
    n_sets = max(2, -(-4 * L2_BYTES // moved))
    sets = [one] + [case.inputs(rows, cols, g) for _ in range(n_sets - 1)]
    t_kopt = device_ms(case.kopt, sets)
    t_eager = device_ms(case.reference, sets)
    t_ind = float("nan")
    if inductor:
        torch._dynamo.reset()  # else past the recompile limit (many cases) it runs eager
        t_ind = device_ms(torch.compile(case.reference), sets)
    t_launch = do_bench(lambda: case.kopt(**one), return_mode="median")
    same = same_size_copy_gbps(moved)
    row = {
        "workload": workload, "case": case.name, "rows": rows, "cols": cols, "bytes": moved,
        "kopt_us": t_kopt * 1e3, "eager_us": t_eager * 1e3, "inductor_us": t_ind * 1e3,
        "kopt_launch_us": t_launch * 1e3, "kopt_GBps": moved / t_kopt / 1e6,
        "inductor_GBps": moved / t_ind / 1e6, "kopt_of_copy": moved / t_kopt / 1e6 / copy_gbps,
        "same_size_copy_GBps": same, "kopt_of_same_size_copy": moved / t_kopt / 1e6 / same,
        "kopt_over_inductor": t_kopt / t_ind, "check": _check(case, one),
        "spec": case.spec.to_json() if case.spec is not None else None,
    }
    if case.spec is not None and prepare_launch(
            case.spec, [one[n] for n in case.spec.input_names()]).constexprs["BLOCK2"]:
        # the row runs as two tiles: what one power-of-two tile (masked lanes) took
        row["one_tile_us"] = device_ms(lambda **ins: case.kopt(one_tile=True, **ins),
                                       sets) * 1e3
    if sweep_warps and case.spec is not None:
        # the tiling's candidates: rows per program x warps (keys "rows x warps")
        row["tiling_us"] = {
            f"{r}x{w}": device_ms(lambda r=r, w=w, **ins: case.kopt(num_warps=w, rows_per=r,
                                                                     **ins), sets) * 1e3
            for r in SWEEP_ROWS for w in SWEEP_WARPS
        }
        best = min(row["tiling_us"], key=row["tiling_us"].get)
        row["best_tiling"] = best
        row["best_tiling_of_copy"] = moved / (row["tiling_us"][best] / 1e3) / 1e6 / copy_gbps
    return row


def run(workloads: list[str], cases: list[Case], sweep_warps: bool,
        inductor: bool = True) -> dict:
    copy = copy_gbps()
    rows_out = []
    for workload in workloads:
        for case in cases:
            row = measure(case, workload, sweep_warps, copy, inductor)
            rows_out.append(row)
            print(_fmt(row), flush=True)
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_GBps": copy, "rows": rows_out}


HEADER = (f"{'wl':<9} {'case':<28} {'kopt us':>8} {'eager us':>9} {'ind us':>8} "
          f"{'kopt GB/s':>9} {'of copy':>7} {'of same':>7} {'kopt/ind':>8} {'launch us':>9}  check")


def _fmt(r: dict) -> str:
    return (f"{r['workload']:<9} {r['case']:<28} {r['kopt_us']:8.1f} {r['eager_us']:9.1f} "
            f"{r['inductor_us']:8.1f} {r['kopt_GBps']:9.0f} {r['kopt_of_copy']:7.2f} "
            f"{r['kopt_of_same_size_copy']:7.2f} "
            f"{r['kopt_over_inductor']:8.2f} {r['kopt_launch_us']:9.1f}  {r['check']}"
            + (f"  one tile {r['one_tile_us']:.1f} us" if "one_tile_us" in r else "")
            + (f"  best tiling {r['best_tiling']} (rows x warps): "
               f"{r['tiling_us'][r['best_tiling']]:.1f} us, {r['best_tiling_of_copy']:.2f} of copy"
               if "tiling_us" in r else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--workloads", default="W1,W2",
                   help="comma-separated: W1, W2 or ROWSxCOLS shapes")
    p.add_argument("--cases", default="", help="substring filter on case names")
    p.add_argument("--sweep-warps", action="store_true",
                   help="also time the row-wise kernels at every rows-per-program x warps "
                        "tiling in SWEEP_ROWS x SWEEP_WARPS")
    p.add_argument("--no-inductor", dest="inductor", action="store_false",
                   help="skip Inductor's kernel (its compilation dominates a short run)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels_rowwise.py needs a CUDA device")
    cases = [c for c in CASES if args.cases in c.name]
    print(HEADER)
    result = run(args.workloads.split(","), cases, args.sweep_warps, args.inductor)
    print(f"copy bandwidth: {result['copy_GBps']:.0f} GB/s on {result['device']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
