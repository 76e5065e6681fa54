"""Rewrites: what is equal. One module per rewrite family."""

from kopt.patterns.core import (
    Match,
    Numerics,
    PatternRewrite,
    Rejection,
    Rewrite,
    StructuralRewrite,
    exact,
    tolerance,
)
from kopt.patterns.projections import MERGE_PROJECTIONS

__all__ = [
    "MERGE_PROJECTIONS",
    "Match",
    "Numerics",
    "PatternRewrite",
    "Rejection",
    "Rewrite",
    "StructuralRewrite",
    "exact",
    "tolerance",
]
