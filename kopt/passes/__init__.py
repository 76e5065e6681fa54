"""Passes: configuration, results, the pass manager and the pipeline."""

from kopt.passes.base import Pass, PassResult, RewritePass, Verdict
from kopt.passes.config import PassConfig
from kopt.passes.pipeline import PIPELINE, PassManager, build_passes

__all__ = [
    "PIPELINE",
    "Pass",
    "PassConfig",
    "PassManager",
    "PassResult",
    "RewritePass",
    "Verdict",
    "build_passes",
]
