"""Passes: configuration, results, the pass manager and the pipeline."""

from kopt.passes.base import Pass, PassResult, RewritePass, Verdict
from kopt.passes.config import FP8Config, PassConfig
from kopt.passes.pipeline import PIPELINE, PassManager, build_passes

__all__ = [
    "FP8Config",
    "PIPELINE",
    "Pass",
    "PassConfig",
    "PassManager",
    "PassResult",
    "RewritePass",
    "Verdict",
    "build_passes",
]
