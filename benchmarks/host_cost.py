"""Host time per call of each kind of kopt fused op, next to a plain ``torch.add``.

    python benchmarks/host_cost.py [--model qwen-image-tiny] [--calls 2000] [--json PATH]

The model is optimized with FP8 on every linear (``FP8Config(min_features=16)``) and kopt's
Triton GEMM (``triton_gemm``), so that its graph holds one op of every kind: row-wise
(residual + norm + modulation + quantization), act + quant, quant, QK-norm + RoPE, cat and
GEMM. The GEMM row times kopt's template: the per-launch-key choice of cuBLAS where it measures
faster (``kopt.codegen.gemm.LIBRARY_CHOICE``) is turned off, a cuBLAS call not being a kopt
launch. For the first node of each op the script takes the arguments it gets in the optimized
graph, then times back-to-back calls of

- the op through the dispatcher, as the optimized graph calls it (``torch.ops.kopt.*``);
- the op as the execution plan calls it (:class:`kopt.codegen.launch.DirectOp`: its first
  call recorded, then replayed), and whether it is replayed;
- ``torch.add`` of the op's first input with itself.

The tiny model's kernels take the device a few microseconds, so back-to-back calls are bound by
the host: the wall time over ``--calls`` calls is the host time per call (the median of
``--rounds`` rounds, each timing the three in turn). Run it on the machine whose host you want
measured (``--device cpu``: a smoke run; the plan's CPU form inlines the op, so there only the
dispatcher is timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

import kopt
from kopt.capture import flatten_inputs
from kopt.codegen import gemm as gemm_module
from kopt.codegen.launch import DirectOp
from kopt.codegen.ops import CUDA_IMPLS
from kopt.models import build
from kopt.runtime import _positional

ADDABLE = (torch.bfloat16, torch.float16, torch.float32)
KINDS = {  # op name -> the kind the table shows
    "rowwise": "row-wise", "act_quant_fp8_rowwise": "act + quant",
    "cat_act_quant_fp8_rowwise": "cat + act + quant", "act_quant_fp8_group": "act + quant",
    "quant_fp8_rowwise": "quant", "quant_fp8_group": "quant", "qk_norm_rope": "QK-norm + RoPE",
    "cat_rows": "cat", "fp8_gemm": "GEMM", "bf16_gemm": "GEMM", "fused_act": "activation",
}


def first_calls(gm: fx.GraphModule, inputs: list[Any]) -> dict[Any, tuple]:
    """The positional arguments of the first call of each kopt op in ``gm`` (hoisted regions
    included), as the graph passes them."""
    seen: dict[Any, tuple] = {}

    class Record(fx.Interpreter):
        def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
            if getattr(target, "namespace", None) == "kopt" and target not in seen:
                seen[target] = _positional(target, args, kwargs)
            return super().call_function(target, args, kwargs)

        def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
            module = self.module.get_submodule(target)
            region = getattr(module, "region", None)
            if isinstance(region, fx.GraphModule):
                return Record(region).run(*args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Record(gm).run(*inputs)
    return seen


def host_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int,
            cuda: bool) -> dict[str, float]:
    """Per function, the median over ``rounds`` of the wall time per call of ``calls``
    back-to-back calls; every round times each function once, so that the host's drift over
    the run moves all of them alike."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    per: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per[k].append((time.perf_counter() - t0) / calls * 1e6)
            if cuda:
                torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image-tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    w = build(args.model, device=args.device, dtype=torch.bfloat16)
    config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16), triton_gemm=cuda)
    gemm_module.LIBRARY_CHOICE = False
    opt = kopt.optimize(w.model, w.args, w.kwargs, config, cuda_graphs=False,
                        verify=kopt.VerifyOptions(enabled=False))
    flat, _ = flatten_inputs(w.args, w.kwargs)
    calls = first_calls(opt.graph_module, list(flat))
    rows = []
    with torch.no_grad():
        for op, op_args in calls.items():
            name = op._schema.name.split("::")[1]
            first = next((a for a in torch.utils._pytree.tree_leaves(op_args)
                          if isinstance(a, torch.Tensor) and a.dtype in ADDABLE),
                         torch.randn(64, 64, device=args.device))
            row: dict[str, Any] = {"op": f"kopt::{name}", "kind": KINDS.get(name, name)}
            fns: dict[str, Callable[[], object]] = {
                "dispatcher_us": lambda op=op, a=op_args: op(*a),
                "torch_add_us": lambda x=first: torch.add(x, x)}
            if cuda and op in CUDA_IMPLS:
                direct = DirectOp(op, CUDA_IMPLS[op], f"kopt_{name}")
                direct(*op_args)  # recorded
                row["replayed"] = direct.direct
                row["why_not"] = direct.why_not
                fns["plan_us"] = lambda d=direct, a=op_args: d(*a)
            row.update(host_us(fns, args.calls, args.rounds, cuda))
            rows.append(row)
    host = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"host time per call, us (median of {args.rounds} rounds of {args.calls} calls; "
          f"{w.name} in bf16 on {host}, torch {torch.__version__})")
    print(f"{'kind':18s} {'op':34s} {'dispatcher':>10s} {'plan':>8s} {'torch.add':>9s}  replayed")
    for r in sorted(rows, key=lambda r: r["kind"]):
        plan = f"{r['plan_us']:8.1f}" if "plan_us" in r else f"{'-':>8s}"
        replayed = ("yes" if r.get("replayed") else f"no: {r.get('why_not')}") \
            if "replayed" in r else "-"
        print(f"{r['kind']:18s} {r['op']:34s} {r['dispatcher_us']:10.1f} {plan} "
              f"{r['torch_add_us']:9.1f}  {replayed}")
    if args.json:
        args.json.write_text(json.dumps({"device": host, "torch": torch.__version__,
                                         "model": w.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
