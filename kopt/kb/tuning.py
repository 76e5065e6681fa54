"""Autotuning that starts from the knowledge base.

A kernel launcher that autotunes (``kopt/codegen/gemm.py``) asks :func:`configs_for` before it
creates its autotuner: on a hit for (template, generated source, shape bucket, dtype, device,
torch/triton versions) it gets the one stored config and Triton runs no sweep; on a miss it gets
its own sweep. After the launch, :func:`record_winner` files what the sweep chose, with its time
and the time of the sweep's first config (the untuned default) as a micro measurement; during a
pass-manager run, only once that run's verification has passed.
Nothing here runs without an active :func:`kopt.kb.using` scope.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kopt.kb.configs import TEMPLATES, format_config
from kopt.kb.session import Session, active

__all__ = ["TuningKey", "config_params", "configs_for", "record_winner"]


@dataclass(frozen=True)
class TuningKey:
    """What a tuned config is valid for (torch/triton versions are added by the store)."""

    template: str  # kopt's template: "gemm_fp8", "gemm_bf16", ...
    source_hash: str  # of the source kopt generated from it (never the source)
    bucket: str  # the tuning key's shape bucket, e.g. "m=4096 n=3072 k=3072 act=none"
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"{self.template} [{self.bucket}] {self.dtype} on {self.device}"


def config_params(template: str, config: Any) -> dict[str, int]:
    """A ``triton.Config``'s tunables as the template's plain parameters."""
    every = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    return {k: every[k] for k in TEMPLATES[template].params if k in every}


# Configs taken from a knowledge base in this process, by key: launches after the scope (the
# optimized model running) keep them instead of sweeping again.
_REUSED: dict[TuningKey, dict[str, int]] = {}


def configs_for(key: TuningKey, sweep: Sequence[Any],
                make: Callable[[Mapping[str, int]], Any]) -> list[Any]:
    """``[make(stored winner)]`` when the active knowledge base knows ``key`` (or one did
    earlier in this process), else ``sweep``. ``make`` builds the launcher's config from
    validated integers (kopt's own template and hooks; nothing read from the file is
    executed). Looked up once per key and scope."""
    s = active()
    if s is not None and key not in s.lookups:
        rec = s.guard("looking up a tuned config", lambda: s.kb.best_config(
            key.template, key.bucket, key.device, source_hash=key.source_hash,
            dtype=key.dtype), None)
        s.lookups[key] = rec
        if rec is not None:
            _REUSED[key] = rec.config
            best = f", {rec.best_ms:.4f} ms" if rec.best_ms is not None else ""
            s.used.append(f"{rec.entry_id} config of {key} ({format_config(rec.config)}"
                          f"{best}): sweep of {len(sweep)} configs skipped")
    known = _REUSED.get(key)
    return [make(known)] if known is not None else list(sweep)


def record_winner(key: TuningKey, tuner: Any) -> None:
    """File the config ``tuner`` (a ``triton.runtime.Autotuner`` dedicated to ``key``) chose
    after its sweep; does nothing without a sweep (one config: a hit, or nothing to tune) or
    when already filed in this scope."""
    s = active()
    if s is None or key in s.filed or s.lookups.get(key) is not None:
        return
    if len(getattr(tuner, "configs", ())) < 2 or getattr(tuner, "best_config", None) is None:
        return
    s.filed.add(key)
    _file(s, key, tuner)


def _file(s: Session, key: TuningKey, tuner: Any) -> None:
    best = tuner.best_config
    params = config_params(key.template, best)
    timings = getattr(tuner, "configs_timings", None) or {}

    def write() -> str:
        kid = s.kb.record_kernel_config(key.template, key.source_hash, params, key.bucket,
                                        key.dtype, key.device)
        if best in timings:
            first = timings.get(tuner.configs[0])
            s.kb.record_measurement(
                "micro", key.bucket, key.device, first[0] if first else None, timings[best][0],
                kernel_id=kid, note=f"autotune winner of {len(timings)} configs; baseline: "
                                    "the sweep's first config")
        return f"K{kid}: {key} -> {format_config(params)}"

    if s.in_pipeline:  # kept only if the run's verification passes (see kopt.kb.verdicts)
        s.pending.append(write)
        return
    line = s.guard("recording a tuned config", write, None)
    if line is not None:
        s.recorded.append(line)
