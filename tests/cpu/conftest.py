"""Shared fixtures: small modules that exercise one rewrite each, and the tiny reference models."""

from __future__ import annotations

import pytest
import torch

from kopt.models import Workload, build


@pytest.fixture(scope="session")
def tiny() -> dict[str, Workload]:
    """The three tiny reference workloads, fp32, built once per test session."""
    return {name: build(name) for name in ("qwen-image-tiny", "flux2-tiny", "llm-tiny")}


@pytest.fixture(autouse=True)
def _fresh() -> None:
    """Every test starts seeded and with dynamo's caches empty (automatic dynamic shapes would
    otherwise carry over from an earlier test's compile of the same forward)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
