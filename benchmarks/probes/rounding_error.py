"""Does rounding to bf16 between fused ops (eager's order, which kopt's exact kernels keep)
change the FP8 output error? One layer on the CPU, in fp64 apart from the roundings under test:

    LayerNorm -> adaLN (1 + scale) x + shift -> per-token FP8 -> GEMM with per-channel FP8 weights
    GELU(tanh) -> per-token FP8 -> GEMM

each with the bf16 roundings between the ops (eager) or without them (fp32 intermediates, as
Inductor's fused kernels compute), against the fp64 result and against eager bf16's.

    python benchmarks/probes/rounding_error.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn


def quant_act(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 e4m3 (fp32 scale = amax / 448), dequantized to fp64."""
    x = x.float()
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448
    return (x / s).clamp(-448, 448).to(E4M3).double() * s.double()


def quant_weight(w: torch.Tensor) -> torch.Tensor:
    s = w.float().abs().amax(-1, keepdim=True) / 448
    return (w.float() / s).to(E4M3).double() * s.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    g = torch.Generator().manual_seed(0)
    m, k, n, hidden = 1024, 3072, 3072, 4096
    x = (torch.randn(m, k, generator=g) * 2 + torch.randn(1, k, generator=g)).bfloat16()
    scale = (torch.randn(1, k, generator=g) * 0.5).bfloat16()
    shift = (torch.randn(1, k, generator=g) * 0.5).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()

    def modulated(round_bf16: bool) -> torch.Tensor:
        def r(t: torch.Tensor) -> torch.Tensor:
            return t.bfloat16().float() if round_bf16 else t
        y = r(F.layer_norm(x.float(), (k,), eps=1e-6))
        return r(r(r(1 + scale.float()) * y) + shift.float())

    exact = (F.layer_norm(x.double(), (k,), eps=1e-6) * (1 + scale.double())
             + shift.double()) @ w.double().t()
    eager = modulated(True).bfloat16().double() @ w.double().t()
    print("LayerNorm + adaLN + FP8 GEMM, 1024 x 3072 x 3072: relative error")
    for name, round_bf16 in (("bf16 between the ops (eager)", True),
                             ("fp32 intermediates", False)):
        y = quant_act(modulated(round_bf16)) @ quant_weight(w).t()
        print(f"  {name:30s} vs fp64 {rel(y, exact):.5e}   vs eager bf16 {rel(y, eager):.5e}")

    u = (torch.randn(m, hidden, generator=g) * 1.5).bfloat16()
    w2 = (torch.randn(k, hidden, generator=g) / hidden ** 0.5).bfloat16()
    exact2 = F.gelu(u.double(), approximate="tanh") @ w2.double().t()
    eager2 = F.gelu(u, approximate="tanh").double() @ w2.double().t()
    print("GELU(tanh) + FP8 GEMM, 1024 x 4096 x 3072: relative error")
    for name, round_bf16 in (("bf16 between the ops (eager)", True),
                             ("fp32 intermediates", False)):
        a = F.gelu(u.float(), approximate="tanh")
        a = a.bfloat16().float() if round_bf16 else a
        y = quant_act(a) @ quant_weight(w2).t()
        print(f"  {name:30s} vs fp64 {rel(y, exact2):.5e}   vs eager bf16 {rel(y, eager2):.5e}")


if __name__ == "__main__":
    main()
