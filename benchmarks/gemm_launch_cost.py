"""Host time per call of kopt's GEMM launcher (``kopt::fp8_gemm``), layer by layer.

    python -m benchmarks.gemm_launch_cost [--calls 500] [--device cpu]

On the H200 a ``kopt::fp8_gemm`` call in W1's graph took ~240 us of host time against 38 us
for a cuBLAS ``_scaled_mm``, and a ``gemm()`` call still ~38 us against ~15 with the direct
launch (RESULTS.md, 2026-12-01), which keeps ``triton_gemm`` off by default. This times,
per call, on a W1 text-token shape (128 x 3072 @ 3072 x 3072, e4m3, rowwise scales, bias):

* CUDA: the op through the dispatcher, :func:`kopt.codegen.gemm.gemm` without it, and
  ``torch._scaled_mm`` for comparison (host-bound: a few microseconds of device time each, so
  the device keeps up and the times are the host's);
* CPU (``--device cpu``; ``TRITON_INTERPRET=1`` is set here, as the launcher needs it for CPU
  tensors): kopt's own launcher code up to Triton's launch with the GPU's config list, the
  launch replaced by a no-op (the interpreter would run the kernel), with the TMA descriptors
  the GPU path builds and without;
  and the dispatcher's cost: the op running its reference against the reference called
  directly, on 8 x 16 @ 16 x 16 operands.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

if "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from kopt.bench import per_call_us  # noqa: E402
from kopt.codegen import gemm as g  # noqa: E402

E4M3 = torch.float8_e4m3fn


def operands(device: str, m: int = 128, n: int = 3072, k: int = 3072) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=gen).to(E4M3)
    b = torch.randn(n, k, device=device, generator=gen).to(E4M3).t()  # K-major, as weights
    sa = torch.rand(m, 1, device=device, generator=gen) + 0.5
    sb = torch.rand(1, n, device=device, generator=gen) + 0.5
    bias = torch.randn(n, device=device, generator=gen).bfloat16()
    return a, b, sa, sb, bias


# the op as kopt registered it until 2026-12-01: a torch.library.custom_op (same reference)
@torch.library.custom_op("kopt_probe::fp8_gemm", mutates_args=())
def fp8_gemm_custom_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, bias: torch.Tensor | None,
                       gate: torch.Tensor | None, residual: torch.Tensor | None,
                       activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    return g.gemm_reference(a, b, scale_a, scale_b, bias, gate, residual, activation,
                            out_dtype, fp8=True)


class _NoLaunch:
    """Stands in for the autotuned kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--device", default="cuda", help="cuda; cpu: kopt's launcher code only")
    args = p.parse_args()
    a, b, sa, sb, bias = operands(args.device)
    n = args.calls
    op = torch.ops.kopt.fp8_gemm.default
    call = (a, b, sa, sb, bias, None, None, "none", torch.bfloat16)
    rows: list[tuple[str, float]] = []
    if args.device == "cpu":
        import triton

        # the autotuner kopt builds (once per key) launches nothing; kopt's code runs as is,
        # with the GPU's config list (the interpreter's has one config)
        triton.autotune = lambda **kw: (lambda fn: _NoLaunch())
        cuda_configs = g.gemm_configs
        g.gemm_configs = lambda m, n, k, fp8, interpreted=False, **kw: \
            cuda_configs(m, n, k, fp8, **kw)
        for tma in (False, True):
            rows.append((f"gemm() launcher code, Triton launch stubbed, TMA descriptors {tma}",
                         per_call_us(lambda tma=tma: g.gemm(*call, fp8=True, use_tma=tma), n)))
        small = (*operands("cpu", 8, 16, 16), None, None, "none", torch.bfloat16)
        rows += [  # 8 x 16 @ 16 x 16: the reference's arithmetic is negligible
            ("torch.ops.kopt.fp8_gemm (dispatcher + CPU reference), 8 x 16 @ 16 x 16",
             per_call_us(lambda: op(*small), n)),
            ("the same as a torch.library.custom_op (kopt's registration until 2026-12-01)",
             per_call_us(lambda: torch.ops.kopt_probe.fp8_gemm.default(*small), n)),
            ("the CPU reference alone (no dispatcher), 8 x 16 @ 16 x 16",
             per_call_us(lambda: g.gemm_reference(*small, fp8=True), n)),
        ]
    else:
        rows += [
            ("torch.ops.kopt.fp8_gemm (dispatcher + launcher + Triton launch)",
             per_call_us(lambda: op(*call), n)),
            ("gemm() (launcher + Triton launch, no dispatcher)",
             per_call_us(lambda: g.gemm(*call, fp8=True), n)),
            ("torch._scaled_mm (cuBLAS)", per_call_us(lambda: torch._scaled_mm(
                a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16), n)),
        ]
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"kopt::fp8_gemm {tuple(a.shape)} @ {tuple(b.shape)} on {device}, torch "
          f"{torch.__version__} (least over 5 rounds of {n} calls, us per call)")
    for name, us in rows:
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
