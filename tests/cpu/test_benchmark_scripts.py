"""Benchmark scripts: ``benchmarks/*.py`` reproduce the README's and RESULTS.md's claims,
``benchmarks/probes/`` holds one-off probes. Every one imports on the CPU without running.

``python benchmarks/X.py`` puts ``benchmarks/`` first on ``sys.path``: a script named like a
top-level module shadows that module for every library the script imports. transformers 5.25
installs Hugging Face's ``kernels``, which diffusers then imports; ``benchmarks/kernels.py``
made every benchmark script fail to import diffusers (CI on the CPU, 2026-12-03)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# top-level modules of packages kopt's dependencies import optionally: they shadow whether or
# not they are installed here
OPTIONAL = {"kernels", "peft", "accelerate", "bitsandbytes", "safetensors", "sentencepiece",
            "triton", "flash_attn", "xformers", "sglang", "vllm", "matplotlib", "rich", "tqdm"}


def _scripts() -> list[Path]:
    return sorted(p for d in ("benchmarks", "benchmarks/probes") for p in (ROOT / d).glob("*.py")
                  if p.stem != "__init__")


def test_no_benchmark_script_shadows_a_module() -> None:
    installed = set(importlib.metadata.packages_distributions())
    taken = installed | set(sys.stdlib_module_names) | OPTIONAL
    scripts = _scripts()
    assert len(scripts) > 20  # the glob found them
    clashes = sorted(str(p.relative_to(ROOT)) for p in scripts if p.stem in taken)
    assert not clashes, f"scripts named like an importable module: {clashes}"


def test_every_benchmark_script_imports_without_running() -> None:
    """Scripts and probes run only on the GPU machine, and many import kopt's private helpers
    (``kopt.ablate._measure``): a rename in kopt breaks them with nothing on CPU to say so.
    Each must import here, and do its work only under ``if __name__ == "__main__"`` (a probe
    that ran at import touched CUDA: 2026-12-03, CPU)."""
    failed = {}
    for p in _scripts():
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- every script's failure, named
            failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        assert '__name__ == "__main__"' in p.read_text(), f"{name} has no main guard"
    assert not failed, failed


def test_user_facing_scripts_import_no_probe() -> None:
    """A probe may use a script's shapes and timers, not the other way: a probe is deleted once
    its finding is in RESULTS.md, and a script that reproduces a claim must outlive it."""
    uses = {}
    for p in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "benchmarks.probes" or n.startswith("benchmarks.probes.") for n in names):
                uses.setdefault(p.name, []).append(node.lineno)
    assert not uses, f"scripts importing a probe (file: lines): {uses}"
