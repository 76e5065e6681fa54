"""Where a replayed fused-op call spends its host time: the replay's parts timed apart.

    python -m benchmarks.probes.replay_parts [--model qwen-image-tiny] [--calls 1000]

For the first node of every kopt op in the FP8-optimized model (as ``benchmarks/host_cost.py``
builds it), rounds of back-to-back calls, the parts interleaved within each round:

- ``replay``: the :class:`DirectOp` as the plan calls it;
- ``via wrapper``: the same replay calling Triton's Python launcher object instead of its C
  function;
- ``no launch``: the replay with its launches made no-ops (argument reading, guards, output
  allocation);
- ``empty``: one allocation of the op's first output by ``torch.empty_strided``, and
  ``fast``: by the replay's allocator (no dispatcher);
- ``torch.add``: of the op's first floating-point input with itself.

Medians over the rounds, us per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import kopt
from benchmarks.host_cost import ADDABLE, first_calls
from kopt.capture import flatten_inputs
from kopt.codegen import launch as launch_mod
from kopt.codegen.launch import DirectOp, _empty_strided_cuda
from kopt.codegen.ops import CUDA_IMPLS
from kopt.models import build


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def time_parts(direct: DirectOp, wrapped: DirectOp, nolaunch: Callable[..., object],
               first_out: torch.Tensor, x: torch.Tensor, a: tuple,
               args: argparse.Namespace) -> dict[str, float]:
    shape, stride, dtype = tuple(first_out.shape), first_out.stride(), first_out.dtype
    fast_empty = _empty_strided_cuda()
    parts = {
        "replay": lambda: direct(*a),
        "wrapper": lambda: wrapped(*a),
        "nolaunch": lambda: nolaunch(*a),
        "empty": lambda: torch.empty_strided(shape, stride, dtype=dtype, device="cuda"),
        "fast empty": lambda: fast_empty(shape, stride, dtype),
        "add": lambda: torch.add(x, x),
    }
    for fn in parts.values():
        for _ in range(50):
            fn()
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(args.rounds):
        for k, fn in parts.items():
            times[k].append(per_call_us(fn, args.calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image-tiny")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    w = build(args.model, device="cuda", dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), triton_gemm=True)
    opt = kopt.optimize(w.model, w.args, w.kwargs, config, cuda_graphs=False,
                        verify=kopt.VerifyOptions(enabled=False))
    flat, _ = flatten_inputs(w.args, w.kwargs)
    print(f"us per call, median of {args.rounds} rounds of {args.calls} calls "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"{'op':30s} {'replay':>7s} {'wrapper':>7s} {'nolaunch':>8s} {'empty':>6s} "
          f"{'add':>6s}")
    with torch.no_grad():
        for op, a in first_calls(opt.graph_module, list(flat)).items():
            if op not in CUDA_IMPLS:
                continue
            name = op._schema.name.split("::")[1]
            direct = DirectOp(op, CUDA_IMPLS[op], name)
            out = direct(*a)
            if not direct.direct:
                print(f"{name:30s} not replayed: {direct.why_not}")
                continue
            spy = launch_mod._spy
            launch_mod._spy = lambda run, n: None
            try:
                wrapped = DirectOp(op, CUDA_IMPLS[op], name)
                wrapped(*a)
            finally:
                launch_mod._spy = spy
            replay = direct._replay
            glob = replay.__globals__
            stubbed = dict(glob)
            for k in glob:
                if k.startswith(("launch", "run")):
                    stubbed[k] = lambda *x: None
            nolaunch = type(replay)(replay.__code__, stubbed)
            first_out = out[0] if isinstance(out, tuple | list) else out
            x = next((t for t in torch.utils._pytree.tree_leaves(a)
                      if isinstance(t, torch.Tensor) and t.dtype in ADDABLE), first_out)
            med = time_parts(direct, wrapped, nolaunch, first_out, x, a, args)
            print(f"{name:30s} {med['replay']:7.1f} {med['wrapper']:7.1f} "
                  f"{med['nolaunch']:8.1f} {med['empty']:6.1f} {med['fast empty']:6.1f} "
                  f"{med['add']:6.1f}")
            print("    " + replay.source.replace("\n", "\n    "))


if __name__ == "__main__":
    main()
