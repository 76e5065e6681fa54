"""GPU tests run on the device machine: without CUDA they fail loudly instead of skipping."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu need a CUDA device; run them on the GPU machine")
    torch.manual_seed(0)
    torch._dynamo.reset()
