"""The physical floor of a forward, which the end-to-end harness (``benchmarks/e2e.py``)
compares each variant with.

    floor = GEMM FLOPs / datasheet peak of the GEMMs' type + attention at SDPA's own rate

The GEMMs' FLOPs come from one eager forward under ``torch.utils.flop_counter`` (``mm``,
``addmm``, ``bmm``, ``_scaled_mm``: the linears); the attention's from each
``F.scaled_dot_product_attention`` call's shapes (``4 B H Sq Sk D``), recorded in the same
forward. An FP8 variant's floor takes every GEMM at the FP8 peak (the few linears under 1024
features that stay BF16 make it a little optimistic: a lower bound). The attention's rate is
measured in the run: SDPA alone on each recorded shape, without a mask, bf16 operands in
``(B, H, S, D)``, as issue 9 defines the floor ("BF16 attention at measured peak").

A GPU at its power cap runs below its highest clock, and its peak with it: the floor at a
variant's clock scales both terms by ``highest clock / the variant's clock`` (the attention
term by the clock SDPA alone ran at over the variant's). On the H200, W2's FP8 graph runs
at 1425-1440 MHz of 1980 (RESULTS.md, 2026-12-02).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from kopt.bench import median_ms
from kopt.cost.device import KNOWN, known_device
from kopt.power import ClockSampler, max_clock_mhz

aten = torch.ops.aten
# the linears' ops (a linear of a non-contiguous 3-D input runs as bmm: FLUX.2's); SDPA's own
# ops are counted apart, from the calls' shapes (its math fallback would count here as bmm)
GEMM_OPS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm)


@dataclass(frozen=True)
class Attention:
    """One distinct SDPA call of the forward: q's and k's shapes, and how often it runs."""

    q: tuple[int, ...]  # (B, H, Sq, D)
    k: tuple[int, ...]  # (B, Hk, Sk, D)
    calls: int
    masked: bool

    @property
    def flops(self) -> float:
        b, h, sq, d = self.q
        return 4.0 * b * h * sq * self.k[2] * d * self.calls  # Q K^T and P V, 2 each


@dataclass
class Work:
    """What one forward computes: its GEMM FLOPs and its attention calls."""

    gemm_flops: float
    attention: list[Attention] = field(default_factory=list)

    @property
    def attention_flops(self) -> float:
        return sum(a.flops for a in self.attention)


class _RecordSdpa(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = dict(zip(("query", "key", "value", "attn_mask"), args, strict=False))
            named |= kwargs
            q, k, mask = named["query"], named["key"], named.get("attn_mask")
            key = (tuple(q.shape), tuple(k.shape), mask is not None)
            self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **kwargs)


def forward_work(model: torch.nn.Module, args: tuple, kwargs: dict) -> Work:
    """GEMM FLOPs and SDPA calls of one eager forward of ``model``."""
    record = _RecordSdpa()
    with torch.no_grad(), FlopCounterMode(display=False) as counter, record:
        model(*args, **kwargs)
    flops = counter.get_flop_counts().get("Global", {})
    gemm = float(sum(v for op, v in flops.items() if op in GEMM_OPS))
    return Work(gemm, [Attention(q, k, n, masked) for (q, k, masked), n in
                       record.calls.items()])


def attention_alone(a: Attention, device: str = "cuda", iters: int = 20) -> tuple[float, float]:
    """(ms per call of SDPA alone on ``a``'s shapes, random bf16, no mask; the SM clock it
    ran at, MHz, or 0 without NVML)."""
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(a.q, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(a.k, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    with ClockSampler(device) as clocks:
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), iters, device=device)
    return ms, clocks.result.sm_mhz if clocks.result is not None else 0.0


@dataclass
class Floor:
    """The floor's two terms at the highest clock (ms per forward) and what they came from."""

    gemm_tflop: float
    attention_tflop: float
    gemm_ms: dict[str, float]  # by the GEMMs' type: "bf16", "fp8"
    attention_ms: float
    attention_tflops: float  # SDPA alone, over all the calls
    max_mhz: float  # 0: unknown (no NVML)

    def gemm(self, fp8: bool) -> float:
        return self.gemm_ms["fp8" if fp8 else "bf16"]

    def scale(self, mhz: float | None) -> float:
        """How much longer the floor is at ``mhz`` than at the highest clock (1 without)."""
        return self.max_mhz / mhz if mhz and self.max_mhz else 1.0

    def at_clock(self, fp8: bool, mhz: float | None) -> float:
        """The floor of a variant whose graph ran at ``mhz`` (its highest clock's without)."""
        return (self.gemm(fp8) + self.attention_ms) * self.scale(mhz)

    def to_json(self) -> dict:
        return asdict(self)


def measure_floor(work: Work, device: str = "cuda") -> Floor:
    """The floor of ``work`` on ``device``: GEMMs at the datasheet peaks of the device's shipped
    model (:func:`kopt.cost.known_device`; an unknown GPU is an error, not an H200's peaks),
    attention at SDPA's rate alone, both at the highest clock."""
    name = torch.cuda.get_device_name(device)
    model = known_device(name)
    if model is None:
        raise ValueError(f"no datasheet peaks for {name!r}: kopt.cost knows "
                         f"{', '.join(d.name for d in KNOWN)}")
    top = max_clock_mhz(device) or 0.0
    attention_ms = 0.0
    for a in work.attention:
        ms, mhz = attention_alone(a, device)
        # back to the highest clock: SDPA alone is short, usually already there
        attention_ms += ms * a.calls * (mhz / top if mhz and top else 1.0)
    peaks = model.peak_tflops
    gemm = {"bf16": work.gemm_flops / (peaks["bfloat16"] * 1e9),
            "fp8": work.gemm_flops / (peaks["float8_e4m3fn"] * 1e9)}
    rate = work.attention_flops / (attention_ms * 1e9) if attention_ms else 0.0
    return Floor(work.gemm_flops / 1e12, work.attention_flops / 1e12, gemm, attention_ms, rate,
                 top)


def floor_lines(rows: dict[str, dict], floor: Floor) -> list[str]:
    """Markdown: each variant's GEMM and attention kernel time and the rest of its forward
    against the floor at the clock its CUDA graph ran at."""
    lines = ["", f"Against the floor: {floor.gemm_tflop:.1f} TFLOP of GEMMs per forward at the "
             f"datasheet peak of their type (BF16 {floor.gemm(False):.2f} ms, FP8 "
             f"{floor.gemm(True):.2f}), {floor.attention_tflop:.1f} TFLOP of attention at "
             f"SDPA's rate alone on the same shapes ({floor.attention_tflops:.0f} TFLOP/s, "
             f"{floor.attention_ms:.2f} ms); at a variant's clock both scale by "
             f"{floor.max_mhz:.0f} MHz / its clock. ms per forward (one call on repeated "
             "inputs, CUDA graph where it captured):", "",
             "| variant | clock MHz | GEMM (floor) | attention (floor) | rest | forward | floor "
             "at its clock | forward / floor |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        b = r.get("graph_breakdown", r.get("breakdown", {}))
        forward = r.get("graph_forward_ms", r["forward_ms"])
        mhz = r.get("graph_sm_mhz")
        fp8 = "fp8" in name
        scale = floor.scale(mhz)
        gemm, attn = b.get("gemm", 0.0), b.get("attention", 0.0)
        at = floor.at_clock(fp8, mhz)
        lines.append(f"| {name} | {f'{mhz:.0f}' if mhz else '-'} | {gemm:.2f} "
                     f"({floor.gemm(fp8) * scale:.2f}) | {attn:.2f} "
                     f"({floor.attention_ms * scale:.2f}) | {forward - gemm - attn:.2f} | "
                     f"{forward:.2f} | {at:.2f} | {forward / at:.2f}x |")
    return lines
