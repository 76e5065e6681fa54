"""Without a GPU, Triton kernels run in Triton's interpreter. Triton reads the switch when a kernel
is decorated, so it is set here, before any test module imports kopt's kernels."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
