"""What running a double-stream block's text branch on a second CUDA stream could save: W1's
per-layer FP8 GEMMs (and same-size copies standing in for its memory-bound kernels), replayed
from one CUDA graph, the text branch after the image branch on one stream against the text
branch forked onto a side stream and joined before the next layer.

    python -m benchmarks.probes.stream_overlap [--layers 20] [--rounds 5]

Per layer, image rows (4096): QKV 3072 -> 9216, out-proj 3072 -> 3072, MLP 3072 -> 12288 ->
3072, each ``_scaled_mm`` with row-wise scales, a bias and fast accumulation, as kopt-fp8 runs
them; text rows (128): the same four with their own weights. ``--copies`` adds, per branch and
layer, four copies of the GEMM outputs' size (the norm, act + quant and residual kernels are
memory-bound at 0.8-0.9 of a copy). Every layer has its own weights (the L2 does not hold them
across layers, as in the model). Prints per layer: image alone, text alone, serial, two streams,
and what the second stream saved as a fraction of the text branch's time alone. Rounds
alternate the variants; medians of CUDA-event timings of whole-graph replays.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from kopt.cudagraphs import capture_graph

E4M3 = torch.float8_e4m3fn
SHAPES = ((9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288))  # (N, K) per GEMM


def _layer(m: int, g: torch.Generator, copies: bool) -> list:
    """One branch of one layer: a list of zero-argument callables (GEMMs, then copies)."""
    ops = []
    for n, k in SHAPES:
        a = (torch.randn(m, k, device="cuda", generator=g) * 0.5).to(E4M3)
        b = (torch.randn(n, k, device="cuda", generator=g) * 0.5).to(E4M3).t()
        sa = torch.rand(m, 1, device="cuda", generator=g) + 0.5
        sb = torch.rand(1, n, device="cuda", generator=g) + 0.5
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        ops.append(lambda a=a, b=b, sa=sa, sb=sb, bias=bias: torch._scaled_mm(
            a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True))
        if copies:
            src = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
            dst = torch.empty_like(src)
            ops.append(lambda s=src, d=dst: d.copy_(s))
    return ops


def _graph(layers: list, mode: str, side: torch.cuda.Stream, graph: bool) -> Any:

    def body() -> None:
        for img, txt in layers:
            main = torch.cuda.current_stream()
            if mode in ("img", "serial", "streams"):
                if mode == "streams":
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        for f in txt:
                            f()
                for f in img:
                    f()
            if mode in ("txt", "serial"):
                for f in txt:
                    f()
            if mode == "streams":
                main.wait_stream(side)

    body()  # eager first, on the caller's stream, as kopt's runner does
    torch.cuda.synchronize()
    if not graph:
        return _Eager(body)
    return capture_graph(body)[0]


class _Eager:
    """The body launched from the host at each replay (the GPU-bound case: the GEMMs take far
    longer than their launches)."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.replay = body


def _time(g: Any, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--copies", action="store_true")
    p.add_argument("--eager", dest="graph", action="store_false",
                   help="launch from the host each time instead of replaying a CUDA graph")
    p.add_argument("--priority", type=int, default=0, help="the side stream's (-1: high)")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [(_layer(4096, g, args.copies), _layer(128, g, args.copies))
              for _ in range(args.layers)]
    modes = ("img", "txt", "serial", "streams")
    side = torch.cuda.Stream(priority=args.priority)
    graphs = {m: _graph(layers, m, side, args.graph) for m in modes}
    for m in modes:
        graphs[m].replay()
    torch.cuda.synchronize()
    got: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            got[m].append(_time(graphs[m], args.reps) / args.layers * 1e3)
    med = {m: statistics.median(v) for m, v in got.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} layers, "
          f"copies={args.copies}, side priority {args.priority}, "
          f"{'CUDA graph' if args.graph else 'eager'}; us per layer, median of {args.rounds} "
          "rounds")
    for m in modes:
        print(f"  {m:8s} {med[m]:8.1f}   rounds " + " ".join(f"{v:.1f}" for v in got[m]))
    saved = med["serial"] - med["streams"]
    print(f"  second stream saves {saved:.1f} us a layer = {saved / med['txt']:.2f} of the text "
          f"branch alone; serial / streams = {med['serial'] / med['streams']:.3f}")


if __name__ == "__main__":
    main()
