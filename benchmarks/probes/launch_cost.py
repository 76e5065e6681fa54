"""Where a kopt custom op's host time per launch goes, layer by layer (CUDA).

    python -m benchmarks.probes.launch_cost [--calls 500] [--device cpu]

Takes the first ``kopt::rowwise`` call of qwen-image-tiny optimized with FP8 (its real spec
and inputs) and times, per call (host only: the kernels are a few microseconds, so the device
keeps up), the op through the dispatcher, the CUDA implementation without it
(``rowwise_triton``), kopt's planning and allocation alone (``prepare_launch``), Triton's
launch of a prepared call alone (``kernel[grid](...)``), and the same kernel launched through
its compiled handle (``CompiledKernel[grid]``, bypassing the JIT's argument binding), checked
bitwise against the JIT launch. Also the dispatcher's own cost: the same CUDA implementation
registered as a ``torch.library.custom_op`` (as kopt registered it until 2026-11-30; now
``kopt.codegen.ops``), the op under ``torch.inference_mode`` (no autograd layer), and a custom
op that only allocates its output. On the H200 a kopt launch took 110-255 us in W1's eager
graph (``benchmarks/host_cost.py``) against 38 us for a cuBLAS GEMM (RESULTS.md, 2026-11-30).
``--device cpu`` times the dispatcher rows only, the body being the PyTorch reference
(``_rowwise_reference_op``) there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Interpreter

from kopt.api import optimize_captured
from kopt.bench import per_call_us
from kopt.capture import capture_module
from kopt.codegen import rowwise as rw
from kopt.models import build
from kopt.passes.config import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def first_rowwise_call(device: str) -> tuple[list[torch.Tensor], str]:
    w = build("qwen-image-tiny", device=device, dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fp8=FP8Config(min_features=16))
    gm = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0).gm
    found: list[tuple[list[torch.Tensor], str]] = []

    class Find(Interpreter):
        def run_node(self, n: Any) -> Any:
            out = super().run_node(n)
            if not found and n.target is torch.ops.kopt.rowwise.default:
                found.append(self.fetch_args_kwargs_from_env(n)[0])
            return out

    with torch.no_grad():
        Find(gm).run(*cap.example_inputs)
    if not found:
        raise SystemExit("no kopt::rowwise call in qwen-image-tiny's optimized graph")
    return found[0]


@torch.library.custom_op("kopt_probe::alloc", mutates_args=())
def alloc(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@alloc.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# the same CUDA implementation as a torch.library.custom_op: kopt's registration until
# 2026-11-30 (kopt.codegen.ops now registers it without custom_op's layers)
@torch.library.custom_op("kopt_probe::rowwise", mutates_args=())
def rowwise_custom_op(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    return rw._rowwise_reference_op(inputs, spec)


@rowwise_custom_op.register_kernel("cuda")
def _(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    return list(rw.rowwise_triton(rw._parse_spec(spec), inputs).values())


@rowwise_custom_op.register_fake
def _(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    return rw._rowwise_fake(inputs, spec)


def inference(f: Callable[[], Any]) -> Callable[[], Any]:
    def g() -> Any:
        with torch.inference_mode():
            return f()
    return g


def compiled_runner(launch: rw.Launch) -> Callable[[], None]:
    """The launch through the kernel's compiled handle: every parameter in order."""
    kernel = launch.kernel
    options = {"num_warps": launch.num_warps, "enable_fp_fusion": False}
    compiled = kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs, **options)
    names = kernel.arg_names
    values = list(launch.args) + [launch.constexprs[n] for n in names[len(launch.args):]]
    runner = compiled[(*launch.grid, 1, 1)[:3]]  # the handle reads all three grid dimensions
    return lambda: runner(*values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--device", default="cuda", help="cuda; cpu: the dispatcher rows only")
    args = p.parse_args()
    inputs, spec_text = first_rowwise_call(args.device)
    spec = rw._parse_spec(spec_text)
    n = args.calls
    rows = [("torch.ops.kopt.rowwise (dispatcher + implementation; kopt.codegen.ops "
             "registration)",
             per_call_us(lambda: torch.ops.kopt.rowwise.default(inputs, spec_text), n))]
    if args.device == "cpu":
        rows.append(("the reference body alone (no dispatcher)",
                     per_call_us(lambda: rw._rowwise_reference_op(inputs, spec_text), n)))
    else:
        launch = rw.prepare_launch(spec, inputs)
        rows += [
            ("rowwise_triton (no dispatcher)",
             per_call_us(lambda: rw.rowwise_triton(spec, inputs), n)),
            ("prepare_launch (plan + allocate outputs)",
             per_call_us(lambda: rw.prepare_launch(spec, inputs), n)),
            ("kernel[grid](...) (Triton JIT launch)", per_call_us(lambda: rw._run(launch), n)),
        ]
    rows += [
        ("the same as a torch.library.custom_op (kopt's registration until 2026-11-30)",
         per_call_us(lambda: torch.ops.kopt_probe.rowwise.default(inputs, spec_text), n)),
        ("the same under torch.inference_mode (no autograd key)",
         per_call_us(inference(lambda: torch.ops.kopt.rowwise.default(inputs, spec_text)), n)),
        ("dispatcher: custom op that allocates one tensor",
         per_call_us(lambda: torch.ops.kopt_probe.alloc.default(inputs[0]), n)),
        ("torch.empty_like alone", per_call_us(lambda: torch.empty_like(inputs[0]), n)),
    ]
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
    print(f"kopt::rowwise on {device} (inputs {shapes}; least over 5 rounds of {n} calls, "
          "us per call)")
    if args.device == "cpu":
        for name, us in rows:
            print(f"  {us:8.1f}  {name}")
        return
    try:
        run = compiled_runner(launch)
        rw._run(launch)
        torch.cuda.synchronize()
        expected = {k: v.clone() for k, v in launch.outputs.items()}
        for v in launch.outputs.values():
            v.zero_()
        run()
        torch.cuda.synchronize()
        same = all(torch.equal(expected[k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in launch.outputs.items())
        rows.append((f"CompiledKernel[grid](...) (bitwise equal to the JIT launch: {same})",
                     per_call_us(run, n)))
    except Exception as e:  # noqa: BLE001 -- the probe reports what this Triton does not have
        rows.append((f"CompiledKernel[grid](...): failed ({type(e).__name__}: {e})", float("nan")))
    print(f"  ({len(launch.args)} kernel arguments)")
    for name, us in rows:
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
