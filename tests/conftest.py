"""Without a GPU, Triton kernels run in Triton's interpreter. Triton reads the switch when a kernel
is decorated, so it is set here, before any test module imports kopt's kernels.

A pass that raises fails the test (``KOPT_STRICT``); a user's optimization leaves it out and
reports why.

The tests write no knowledge base into the user's cache: ``KOPT_CACHE_DIR`` points at a
temporary folder for the session (tests that need a particular file pass ``--kb PATH``)."""

from __future__ import annotations

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ["KOPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="kopt-tests-")
os.environ["KOPT_STRICT"] = "1"
