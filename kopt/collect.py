"""The garbage collector around kopt's long phases (capture, passes, a warm start's restore)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_skips_what_lives_already() -> Iterator[None]:
    """Keep the objects alive before a phase (the model, the captured graph: W1's 11650 nodes
    and their metadata) out of the garbage collector's full passes while the phase makes many
    objects: 10-20% of W1's pass time and 0.45 of its 3.2 s capture on the CPU (RESULTS.md,
    2026-12-05). Garbage made during the phase is collected as usual. Left alone where the
    caller froze objects itself (``gc.freeze`` before a fork), or in an enclosing phase."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
