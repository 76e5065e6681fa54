"""All-reduce + gated residual + norm (+ modulation, + FP8) of a TP block, unfused vs fused, at W2.

    torchrun --nproc-per-node 2 benchmarks/tp_allreduce_norm.py --json tp.json [--block]

W2 (FLUX.2-dev, 1024x1024): 4096 image + 512 text tokens, hidden 6144, bf16, W2 sharded two ways:
each rank holds a [1, 4608, 6144] partial sum from its row-parallel GEMM. Cases, each computing
the same outputs from the same inputs:

* ``adaln``: ``h = x + g * all_reduce(p)``; ``out = (1 + s) * layer_norm(h) + t``; outputs
  ``out`` and ``h`` (FLUX.2's residual -> norm2 -> modulation between attention and MLP);
* ``adaln_fp8``: the same with the next GEMM's FP8 per-token quantization instead of ``out``;
* ``rms``: ``h = x + all_reduce(p)``; ``out = rms_norm(h) * w`` (an LLM decoder's).

Variants: ``eager`` (functional all_reduce on NCCL + the eager aten ops), ``nccl+rowwise``
(NCCL all_reduce + kopt's row-wise Triton kernel: what kopt runs without the
``fuse_allreduce_norm`` pass), ``fused`` (``kopt::allreduce_residual_norm``: symmetric-memory
all-reduce + the row-wise kernel, the op's automatic choice), ``fused_one_shot`` /
``fused_two_shot`` (the same with the algorithm forced). Each is checked against ``eager``
first (the residual bitwise, the rest within 2x eager's error vs fp64).

Timing: CUDA events around ``--iters`` back-to-back calls after ``--warmup`` calls, ranks
aligned by a barrier before each measurement; the figure is the median over ``--repeats``
measurements of the slowest rank's mean per call. ``--block`` also times a whole sharded W2
DiT block (kopt.models.tp.W2_DIT, one layer) optimized by kopt with and without the pass.

NVLink multicast: nothing here sets NCCL_NVLS_ENABLE or any other NCCL variable; the header
prints what the machine set, for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from kopt.codegen.kernels.allreduce_norm import (
    symm_mem_all_reduce,
    symm_mem_available,
)
from kopt.codegen.rowwise import RowwiseSpec, rowwise_reference
from kopt.verify import relative_error

TOKENS, HIDDEN = 4096 + 512, 6144
BF16 = torch.bfloat16

SPECS = {
    "adaln": RowwiseSpec(dtype="bfloat16", norm="layer", eps=1e-6, residual=True, gate=True,
                         modulation=True, outputs=("out", "residual")),
    "adaln_fp8": RowwiseSpec(dtype="bfloat16", norm="layer", eps=1e-6, residual=True, gate=True,
                             modulation=True, outputs=("residual", "fp8_row")),
    "rms": RowwiseSpec(dtype="bfloat16", norm="rms", eps=1e-6, weight=True, residual=True,
                       outputs=("out", "residual")),
}


def _inputs(spec: RowwiseSpec, rank: int, dev: torch.device) -> dict[str, torch.Tensor]:
    own = torch.Generator(dev).manual_seed(1000 + rank)  # partial sums differ by rank
    shared = torch.Generator(dev).manual_seed(0)  # everything else is replicated
    ins = {"x": torch.randn(1, TOKENS, HIDDEN, generator=shared, device=dev).to(BF16),
           "y": (torch.randn(1, TOKENS, HIDDEN, generator=own, device=dev) * 0.5).to(BF16)}
    for name in spec.input_names():
        if name in ("gate", "scale", "shift"):
            ins[name] = (torch.randn(1, HIDDEN, generator=shared, device=dev) * 0.1).to(BF16)
        elif name == "weight":
            ins[name] = (1 + 0.1 * torch.randn(HIDDEN, generator=shared, device=dev)).to(BF16)
    return ins


def _nccl_sum(y: torch.Tensor, group: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", group))


def variants(spec: RowwiseSpec, group: str) -> dict[str, Callable[..., list[torch.Tensor]]]:
    names = spec.input_names()

    def with_y(ins: dict[str, torch.Tensor], y: torch.Tensor) -> list[torch.Tensor]:
        return [y if n == "y" else ins[n] for n in names]

    def eager(ins: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = rowwise_reference(spec, with_y(ins, _nccl_sum(ins["y"], group)))
        return [out[n] for n in spec.output_names()]

    def nccl_rowwise(ins: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return torch.ops.kopt.rowwise(with_y(ins, _nccl_sum(ins["y"], group)), spec.to_json())

    def fused(ins: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return torch.ops.kopt.allreduce_residual_norm(with_y(ins, ins["y"]), spec.to_json(),
                                                      group)

    def forced(algorithm: str) -> Callable[..., list[torch.Tensor]]:
        def run(ins: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            summed = symm_mem_all_reduce(ins["y"], group, algorithm)
            return torch.ops.kopt.rowwise(with_y(ins, summed), spec.to_json())
        return run

    return {"eager": eager, "nccl+rowwise": nccl_rowwise, "fused": fused,
            "fused_one_shot": forced("one_shot"), "fused_two_shot": forced("two_shot")}


def _check(spec: RowwiseSpec, got: list[torch.Tensor], want: list[torch.Tensor],
           ref64: dict[str, torch.Tensor]) -> str:
    for name, g, w in zip(spec.output_names(), got, want, strict=True):
        if name == "residual" and not torch.equal(g, w):
            return "residual differs from eager"
        if g.dtype in (BF16, torch.float32) and name != "residual":
            limit = 2 * max(relative_error(w, ref64[name]), 1.6e-2)
            if relative_error(g, ref64[name]) > limit:
                return f"{name}: error {relative_error(g, ref64[name]):.3g} > {limit:.3g}"
    return "ok"


def _reference64(spec: RowwiseSpec, ins: dict[str, torch.Tensor],
                 group: str) -> dict[str, torch.Tensor]:
    from kopt.codegen import FP64_REFERENCES

    summed = _nccl_sum(ins["y"].double(), group)
    args = [summed if n == "y" else ins[n].double() for n in spec.input_names()]
    outs = FP64_REFERENCES[torch.ops.kopt.rowwise.default](args, spec.to_json())
    return dict(zip(spec.output_names(), outs, strict=True))


def time_ms(fn: Callable[[], object], warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's mean milliseconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        samples.append(ms.item())
    return statistics.median(samples)


def bench_block(rank: int, world: int, group: str, args: argparse.Namespace) -> dict:
    """One sharded W2 DiT block: kopt with and without fuse_allreduce_norm, eager and replayed
    from CUDA graphs. The variants are timed in turns (one measurement of each per round, the
    median over ``--repeats`` rounds), so clock drift over the run affects them alike."""
    import kopt
    from kopt.models.tp import W2_DIT, build_shard

    local, _ = build_shard(W2_DIT, rank, world, group, device="cuda", dtype=BF16)
    out: dict[str, dict] = {}
    runs: dict[str, Callable[[], object]] = {}
    for name, config in (("kopt, unfused", kopt.PassConfig(fuse_allreduce_norm=False)),
                         ("kopt, fused", kopt.PassConfig())):
        for graphs in (False, True):
            label = name + (", CUDA graph" if graphs else "")
            try:
                opt = kopt.optimize(local.model, local.args, local.kwargs, config,
                                    cuda_graphs=graphs, keep_original=True)
            except Exception as exc:  # noqa: BLE001 -- reported in the results, the rest runs
                out[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            fused = opt.report.result("fuse_allreduce_norm").matched \
                if config.fuse_allreduce_norm else 0
            out[label] = {"fused_sites": fused, "verified": opt.report.verified}
            runs[label] = lambda opt=opt: opt(*local.args)
    samples: dict[str, list[float]] = {label: [] for label in runs}
    with torch.no_grad():
        for fn in runs.values():
            time_ms(fn, args.warmup, args.iters, 1)
        for _ in range(args.repeats):
            for label, fn in runs.items():
                samples[label].append(time_ms(fn, 2, args.iters, 1))
    for label, fn in runs.items():
        out[label]["ms"] = statistics.median(samples[label])
        if args.profile and "CUDA graph" not in label:
            out[label]["kernels"] = _top_kernels(fn)
    return out


def _top_kernels(fn: Callable[[], object], calls: int = 5, top: int = 15) -> list[dict]:
    """The kernels of ``calls`` calls by total GPU time (this rank), per call."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    rows = [{"name": e.key[:120], "us_per_call": e.device_time_total / calls,
             "count_per_call": e.count / calls}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_call"])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(SPECS))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--block", action="store_true", help="also time a sharded W2 DiT block")
    p.add_argument("--profile", action="store_true",
                   help="with --block: also list each variant's top kernels (no CUDA graph)")
    p.add_argument("--only-block", action="store_true", help="skip the cases, time the block")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD.group_name
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))}
    results: dict = {"device": torch.cuda.get_device_name(dev), "world": world,
                     "torch": torch.__version__, "env": env,
                     "symm_mem": symm_mem_available(group), "shape": [1, TOKENS, HIDDEN],
                     "cases": {}}
    if rank == 0:
        print(f"{results['device']} x {world}, torch {torch.__version__}, symmetric memory "
              f"{'available' if results['symm_mem'] else 'UNAVAILABLE (fused = NCCL fallback)'}"
              f"; env {env}")
    with torch.no_grad():
        for case in ([] if args.only_block else args.cases.split(",")):
            spec = SPECS[case]
            ins = _inputs(spec, rank, dev)
            fns = variants(spec, group)
            want = fns["eager"](ins)
            ref64 = _reference64(spec, ins, group)
            rows = {}
            for name, fn in fns.items():
                check = _check(spec, fn(ins), want, ref64)
                ms = time_ms(lambda fn=fn, ins=ins: fn(ins), args.warmup, args.iters, args.repeats)
                rows[name] = {"ms": ms, "check": check}
            results["cases"][case] = rows
            if rank == 0:
                base = rows["nccl+rowwise"]["ms"]
                for name, r in rows.items():
                    print(f"{case:<10} {name:<16} {r['ms']:8.3f} ms  x{base / r['ms']:.2f} vs "
                          f"nccl+rowwise  {r['check']}")
    if args.block:
        results["block"] = bench_block(rank, world, group, args)
        if rank == 0:
            for name, r in results["block"].items():
                print(f"W2 block   {name:<28} " + (r["error"] if "error" in r else
                      f"{r['ms']:8.3f} ms  fused sites {r['fused_sites']}, verified "
                      f"{r['verified']}"), flush=True)
                for k in r.get("kernels", ()):
                    print(f"    {k['us_per_call']:9.1f} us  x{k['count_per_call']:<4g} {k['name']}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
