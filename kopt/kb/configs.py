"""What a stored kernel config may contain: an allowlist per kernel template.

The knowledge base never stores kernel source and never runs anything it reads: a config is a
JSON object of plain integers, checked here against its template's parameters on every read,
and the kernel is regenerated from kopt's own template with those integers. A row that is not
exactly that (a string, a pickle, a nested object, an unknown or missing key, a value out of
range) is refused with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kopt.errors import KoptError

# Longest config text read at all: a real one is under 200 characters.
MAX_CONFIG_CHARS = 1024
# Hopper's shared memory per block (227 KiB): a GEMM tile pipeline needing more never compiles.
SMEM_BYTES = 227 * 1024


class ConfigRejected(KoptError, ValueError):
    """A stored config that is not a plain, in-range config of its template."""


def _pow2(lo: int, hi: int) -> frozenset[int]:
    return frozenset(1 << i for i in range(lo.bit_length() - 1, hi.bit_length()))


@dataclass(frozen=True)
class TemplateSchema:
    """The parameters of one kernel template: name -> allowed integer values, plus a check
    across parameters (None, or the reason the combination cannot be right)."""

    params: Mapping[str, frozenset[int]]
    check: Callable[[Mapping[str, int]], str | None] = lambda c: None
    # parameters added to a template later: what a config stored before them meant
    defaults: Mapping[str, int] = field(default_factory=dict)


def _gemm_smem(element_bytes: int) -> Callable[[Mapping[str, int]], str | None]:
    def check(c: Mapping[str, int]) -> str | None:
        if c["SPLIT_K"] > 1 and c["PERSISTENT"]:
            return "split-K takes one program per tile (PERSISTENT must be 0)"
        need = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * element_bytes
        if need > SMEM_BYTES:
            return (f"{c['num_stages']} stages of {c['BLOCK_M']}x{c['BLOCK_K']} + "
                    f"{c['BLOCK_N']}x{c['BLOCK_K']} tiles need {need} bytes of shared memory "
                    f"(at most {SMEM_BYTES})")
        return None
    return check


_GEMM = {
    "BLOCK_M": _pow2(16, 256), "BLOCK_N": _pow2(16, 256), "BLOCK_K": _pow2(16, 256),
    "GROUP_M": frozenset(range(1, 33)), "num_warps": _pow2(1, 16),
    "num_stages": frozenset(range(1, 9)), "PERSISTENT": frozenset((0, 1)),
    "SPLIT_K": frozenset(range(1, 17)),
}

TEMPLATES: dict[str, TemplateSchema] = {
    "gemm_fp8": TemplateSchema(_GEMM, _gemm_smem(1), {"PERSISTENT": 0, "SPLIT_K": 1}),
    "gemm_bf16": TemplateSchema(_GEMM, _gemm_smem(2), {"PERSISTENT": 0, "SPLIT_K": 1}),
    "rowwise": TemplateSchema({"ROWS": _pow2(1, 32), "num_warps": _pow2(1, 32)}),
}


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigRejected(f"key {_short(k)} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> object:
    raise ConfigRejected(f"{name} is not a config value")


def _short(text: str) -> str:
    """A stored string as it may appear in a message: never long enough to carry a payload."""
    r = repr(text)
    return r if len(r) <= 24 else r[:20] + "...'"


def validate_config(template: str, raw: object) -> dict[str, int]:
    """The config ``raw`` (JSON text as stored, or an already decoded mapping) as a plain
    ``{name: int}`` of ``template``'s parameters; raises :class:`ConfigRejected` otherwise."""
    schema = TEMPLATES.get(template) if isinstance(template, str) else None
    if schema is None:
        raise ConfigRejected(f"unknown kernel template {_short(str(template))}; kopt "
                             "regenerates kernels only from its own templates: "
                             f"{', '.join(sorted(TEMPLATES))}")
    if isinstance(raw, str):
        if len(raw) > MAX_CONFIG_CHARS:
            raise ConfigRejected(f"config text of {len(raw)} characters (at most "
                                 f"{MAX_CONFIG_CHARS})")
        try:
            value = json.loads(raw, object_pairs_hook=_no_duplicates,
                               parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise ConfigRejected(f"config is not JSON: {e}") from None
    elif isinstance(raw, Mapping):
        value = dict(raw)
    else:
        raise ConfigRejected(f"config is stored as {type(raw).__name__}, not JSON text")
    if not isinstance(value, dict):
        raise ConfigRejected(f"config is a JSON {type(value).__name__}, not an object of "
                             "integers")
    value = {**schema.defaults, **value}
    unknown = sorted(set(value) - set(schema.params))
    missing = sorted(set(schema.params) - set(value))
    if unknown or missing:
        raise ConfigRejected(f"{template} config keys: unknown "
                             f"[{', '.join(_short(k) for k in unknown[:4])}], missing {missing}")
    out: dict[str, int] = {}
    for name, allowed in schema.params.items():
        v = value[name]
        if type(v) is not int:  # bool, float, str, list, object: all refused (not echoed)
            raise ConfigRejected(f"{name} is a {type(v).__name__}, not an integer")
        if v not in allowed:
            raise ConfigRejected(f"{name} = {v} is outside {template}'s allowed values "
                                 f"{sorted(allowed)}")
        out[name] = v
    why = schema.check(out)
    if why is not None:
        raise ConfigRejected(f"{template} config {out}: {why}")
    return out


def config_text(template: str, config: Mapping[str, object]) -> str:
    """The canonical JSON of a config, validated first (what is written is what is read)."""
    return json.dumps(validate_config(template, config), sort_keys=True,
                      separators=(",", ":"))


def format_config(config: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())
