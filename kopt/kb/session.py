"""The knowledge base an optimization run reads and writes: an explicit scope, not a global.

    with kopt.kb.using(kb, workload="W1") as session:
        opt = kopt.optimize(model, args)
    print(session.summary())            # what came from the knowledge base, what was recorded

Inside the scope, GEMM autotuning starts from the stored winner (:mod:`kopt.kb.tuning`) and the
pass manager skips recorded dead ends and records verdicts (:mod:`kopt.kb.verdicts`). Outside
it nothing reads or writes a knowledge base. A write that fails (locked past the timeout, disk
full) is logged, turns the knowledge base off for the rest of the scope, and never stops the
optimization.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kopt.kb.store import KnowledgeBase, KnowledgeBaseError

log = logging.getLogger("kopt")
T = TypeVar("T")

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("kopt_kb", default=None)


@dataclass
class Session:
    """One scope of use of a knowledge base.

    ``workload``: the key verdicts and measurements are filed under (default: derived from the
    captured graph and its input shapes, see :func:`kopt.kb.verdicts.workload_key`);
    ``regime``: a named shape regime whose dead ends also apply; ``retry``: run recorded dead
    ends anyway; ``device``: the device name to file under (default: the inputs' device)."""

    kb: KnowledgeBase
    workload: str | None = None
    regime: str | None = None
    retry: bool = False
    device: str | None = None
    used: list[str] = field(default_factory=list)  # what came from the KB, one line each
    recorded: list[str] = field(default_factory=list)  # what this scope wrote
    failed: str | None = None  # why the KB was turned off mid-scope
    last_workload: str | None = None  # the workload key of the latest pipeline run
    last_device: str | None = None
    lookups: dict[Any, Any] = field(default_factory=dict, repr=False)  # tuning key -> hit|None
    filed: set[Any] = field(default_factory=set, repr=False)  # tuning keys whose sweep is filed
    # inside a pass-manager run, tuned configs wait for its verification before being written
    in_pipeline: bool = False
    pending: list[Callable[[], str]] = field(default_factory=list, repr=False)

    @property
    def enabled(self) -> bool:
        return self.failed is None

    def guard(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` when the knowledge base fails (logged; the KB is off for
        the rest of the scope, the run goes on)."""
        if not self.enabled:
            return default
        try:
            return fn()
        except KnowledgeBaseError as e:
            self.failed = f"{what}: {e}"
            log.warning("kopt: knowledge base off for the rest of this run (%s)", self.failed)
            return default

    def record_e2e(self, baseline_ms: float, candidate_ms: float, *, cuda_graphs: bool,
                   note: str = "") -> None:
        """File an end-to-end timing of the latest optimized workload (e.g. ``--bench``)."""
        if self.last_workload is None or self.last_device is None:
            return
        mid = self.guard("recording a measurement", lambda: self.kb.record_measurement(
            "e2e", self.last_workload, self.last_device, baseline_ms, candidate_ms,
            cuda_graphs=cuda_graphs, note=note), None)
        if mid is not None:
            self.recorded.append(f"M{mid}: end to end {baseline_ms:.3f} -> {candidate_ms:.3f} ms "
                                 f"(CUDA graphs {'on' if cuda_graphs else 'off'})")

    def summary(self) -> str:
        """The report's knowledge-base section."""
        lines = [f"knowledge base {self.kb.path}"
                 + (f" (workload {self.last_workload} on {self.last_device})"
                    if self.last_workload else "") + ":"]
        lines += [f"  from the KB: {u}" for u in self.used] or ["  from the KB: nothing yet"]
        lines += [f"  recorded: {r}" for r in self.recorded]
        if self.failed:
            lines.append(f"  turned off: {self.failed}")
        return "\n".join(lines)


def active() -> Session | None:
    """The session of the innermost :func:`using` scope, if any (and still working)."""
    s = _ACTIVE.get()
    return s if s is not None and s.enabled else None


@contextlib.contextmanager
def using(kb: KnowledgeBase | Session | None, **options: Any) -> Iterator[Session | None]:
    """Make ``kb`` the knowledge base of the code inside the scope (None: none, e.g. when
    :func:`kopt.kb.safe_open` could not open the file). ``options``: :class:`Session` fields."""
    session = kb if isinstance(kb, Session) or kb is None else Session(kb, **options)
    token = _ACTIVE.set(session)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)


@functools.lru_cache(maxsize=64)
def device_name(device: Any) -> str:
    """The name results are filed under: the GPU's name (``NVIDIA H200``), or ``cpu-<arch>``."""
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"{d.type}-{platform.machine() or 'unknown'}"
