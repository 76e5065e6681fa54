"""What the profiler adds to the kernels of a CUDA graph replay, on kernels of known size.

    python -m benchmarks.probes.cupti_overhead

For graphs of N back-to-back kernels of one kind (small element-wise adds, large copies, FP8
GEMMs of W1's text and image QKV shapes, three apart or merged), prints the replay timed with
CUDA events (no profiler), the replay timed with events while the profiler records, and the
profiler's own account of three replays: the kernels' summed time and their span (first start
to last end), and per kernel the span less the timed replay.
"""

from __future__ import annotations

import statistics

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.probes.replay_split import window_kernels
from kopt.bench import median_ms


def graph_of(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def measure(name: str, body, n: int) -> None:
    g = graph_of(body)
    bare = median_ms(g.replay, 20, 5, "cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        g2 = graph_of(body)  # captured under the profiler, so that its replays are traced
        for _ in range(5):
            g2.replay()
        inside = median_ms(g2.replay, 10, 2, "cuda")
        for i in range(3):
            with record_function(f"cupti_replay{i}"):
                g2.replay()
                torch.cuda.synchronize()
    sums, spans, counts = [], [], []
    for ks in window_kernels(prof, "cupti_replay"):
        sums.append(sum(e.duration_ns() for e in ks) / 1e6)
        spans.append((max(e.start_ns() + e.duration_ns() for e in ks)
                      - min(e.start_ns() for e in ks)) / 1e6)
        counts.append(len(ks))
    k, sp = statistics.median(sums), statistics.median(spans)
    print(f"{name}: {n} kernels; timed {bare:.3f} ms ({bare / n * 1e3:.2f} us each), in the "
          f"profile {inside:.3f}; profiled kernels {k:.3f} ({k / n * 1e3:.2f} us each), span "
          f"{sp:.3f}, {statistics.median(counts):.0f} kernels seen; span - timed "
          f"{(sp - inside) / n * 1e3:+.2f} us per kernel, kernels - timed "
          f"{(k - inside) / n * 1e3:+.2f}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    small = torch.randn(2**18, device="cuda")
    measure("add, 1 MiB fp32", lambda: [small.add_(1e-3) for _ in range(2000)], 2000)
    big, dst = torch.randn(2**26, device="cuda"), torch.empty(2**26, device="cuda")
    measure("copy, 256 MiB fp32", lambda: [dst.copy_(big) for _ in range(100)], 100)
    fp8 = torch.float8_e4m3fn
    blocks = 60
    for rows, label in ((128, "text"), (4096, "image")):
        x = torch.randn(rows, 3072, device="cuda").to(fp8)
        sx = torch.rand(rows, 1, device="cuda") + 0.5
        ws = [torch.randn(9216, 3072, device="cuda").to(fp8) for _ in range(blocks)]
        sw = [torch.rand(1, 9216, device="cuda") + 0.5 for _ in range(blocks)]
        bias = [torch.randn(9216, device="cuda", dtype=torch.bfloat16) for _ in range(blocks)]

        def apart(x=x, sx=sx, ws=ws, sw=sw, bias=bias) -> None:
            for w, s, b in zip(ws, sw, bias, strict=True):
                for j in range(3):
                    sl = slice(3072 * j, 3072 * (j + 1))
                    torch._scaled_mm(x, w[sl].t(), sx, s[:, sl], bias=b[sl],
                                     out_dtype=torch.bfloat16)

        def merged(x=x, sx=sx, ws=ws, sw=sw, bias=bias) -> None:
            for w, s, b in zip(ws, sw, bias, strict=True):
                torch._scaled_mm(x, w.t(), sx, s, bias=b, out_dtype=torch.bfloat16)

        measure(f"{label} QKV, three GEMMs x {blocks}", apart, 3 * blocks)
        measure(f"{label} QKV, merged x {blocks}", merged, blocks)
        del ws


if __name__ == "__main__":
    main()
