"""FP8 (e4m3) quantization with one scale per row: ``kopt::quant_fp8_rowwise``.

    scale[r] = max(|x[r, :]|) / 448          (fp32; 448 is e4m3's largest finite value)
    q[r, k]  = e4m3(x[r, k] / scale[r])      (round to nearest even, |q| <= 448)

Per token for activations ([tokens, K]), per output channel for weights ([N, K]): the scales
``torch._scaled_mm`` takes with rowwise scaling. The op stays a node of its own in the graph so
that a later fusion pass can pull it into the kernel that produces ``x`` (a norm, an activation);
applied to a weight it depends only on parameters and is evaluated once, at load.

Only the PyTorch reference is implemented so far; it runs on any device. The Triton producer and
its fusions come with the codegen work.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# A row of zeros gets this scale instead of 0, so that x / scale stays 0 rather than NaN.
MIN_AMAX = 1e-12


def quant_fp8_rowwise_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: ``(q, scale)`` with ``q * scale ~= x``, scale shaped [..., 1]."""
    # The division and the clamp happen in fp32: a bf16 quotient would round twice.
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    scale = amax / E4M3_MAX
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


@torch.library.custom_op("kopt::quant_fp8_rowwise", mutates_args=())
def quant_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_fp8_rowwise_reference(x)


@quant_fp8_rowwise.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    return q, scale
