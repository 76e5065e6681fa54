"""kopt.floor on CUDA: SDPA alone timed on the forward's attention shapes, NVML's clock.

    pytest -q tests/gpu/test_floor_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from kopt.floor import forward_work, measure_floor
from kopt.models import build

pytestmark = pytest.mark.gpu


def test_the_floor_of_a_tiny_dit_on_cuda() -> None:
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    work = forward_work(w.model, w.args, w.kwargs)
    floor = measure_floor(work)
    print(floor)
    assert floor.max_mhz > 300, "NVML's highest SM clock"
    assert floor.attention_ms > 0 and 0 < floor.attention_tflops < 2000
    assert floor.gemm(True) == pytest.approx(floor.gemm(False) / 2, rel=1e-3)  # 1979 vs 989
    assert floor.at_clock(True, floor.max_mhz / 2) == pytest.approx(
        2 * (floor.gemm(True) + floor.attention_ms))
