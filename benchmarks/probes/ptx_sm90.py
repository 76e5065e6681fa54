"""Compile kopt's Triton kernels for sm_90 on a machine without a GPU, specialised the way
Triton's JIT specialises a real launch, and count the PTX instructions of each loop body.

    python -m benchmarks.probes.ptx_sm90 [act|nvfp4|all]

:func:`capture_launch` runs kopt's own launcher on CPU tensors with the kernel's ``run``
replaced, so the arguments, constexprs and ``num_warps`` are the ones a GPU launch would use;
:func:`compile_sm90` then applies the JIT's specialisation (an integer equal to 1 becomes a
constant, pointers and integers divisible by 16 get the divisibility attribute that lets loads
and stores vectorise) before compiling with Triton's bundled ptxas. Without that, a stride of 1
stays a runtime value and every load is a scalar 16-bit one: the first PTX counts for act +
quant were of such a kernel (RESULTS.md, 2026-12-01).

Counts are PTX, not SASS (ptxas schedules and may merge or expand), and count what one thread
executes per loop iteration: divide by the values a thread holds per iteration.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

SM90 = GPUTarget("cuda", 90, 32)


@dataclass
class Launch:
    kernel: object
    args: dict[str, object]  # every parameter, by name (constexprs included)
    num_warps: int
    options: dict[str, object]


@contextlib.contextmanager
def capture_launch(kernel: object) -> Iterator[list[Launch]]:
    """Within the block, launches of ``kernel`` are recorded instead of run."""
    launches: list[Launch] = []
    jit = kernel
    while not isinstance(jit, triton.runtime.JITFunction):
        jit = jit.fn  # an autotuner or heuristics wraps the JIT function
    names = jit.arg_names

    def run(*args, grid, warmup=False, **kwargs):
        bound = dict(zip(names, args, strict=False))
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
        bound.update(kwargs)
        launches.append(Launch(jit, bound, options.pop("num_warps", 4), options))

    saved = jit.run
    jit.run = run
    try:
        yield launches
    finally:
        jit.run = saved


def compile_sm90(launch: Launch, **constexprs: object) -> dict[str, object]:
    """The compiled ``launch`` for sm_90 (``constexprs`` override recorded ones, e.g.
    NATIVE=True): Triton's ``asm`` dict (``ptx``, ``cubin``, ...)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    backend = make_backend(SM90)
    jit = launch.kernel
    values = dict(launch.args, **constexprs)
    signature, consts, attrs = {}, {}, {}
    for i, p in enumerate(jit.params):
        value = values[p.name] if p.name in values or not p.has_default else p.default
        if p.is_constexpr:
            signature[p.name], consts[p.name] = "constexpr", value
            continue
        ty, key = native_specialize_impl(CUDABackend, value, False, True, True)
        signature[p.name] = ty
        if ty == "constexpr":
            consts[p.name] = key
        elif isinstance(key, str) and key:
            attrs[(i,)] = backend.parse_attr(key)
    options = {"num_warps": launch.num_warps, **launch.options}
    src = ASTSource(jit, signature, consts, attrs)
    return triton.compile(src, target=SM90, options=options).asm


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS, by Triton's bundled ``cuobjdump``."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text):
        out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def sass_loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """Instructions of each loop of the SASS: from a backward branch's target to the branch."""
    bodies = []
    for addr, ins in code:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            bodies.append([i for a, i in code if start <= a <= addr])
    return bodies


def sass_opcode(ins: str) -> str:
    """``@P0 FFMA.FTZ R1, ...`` -> ``FFMA``."""
    parts = ins.split()
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


_LABEL = re.compile(r"^\$?[\w.]+:$")


def instructions(ptx: str) -> list[str]:
    """The instruction lines of a PTX function body (no directives, labels or braces)."""
    out = []
    for line in ptx.split("\n"):
        s = line.split("//")[0].strip()
        if not s or s.startswith((".", "{", "}", ")")) or _LABEL.match(s):
            continue
        out.append(s)
    return out


def opcode(line: str) -> str:
    """``@%p1 ld.global.v4.b32 ...`` -> ``ld.global.v4.b32``."""
    parts = line.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def loops(ptx: str) -> list[list[str]]:
    """Instructions of each innermost loop: from a label to the backward branch to it."""
    lines = [ln.split("//")[0].strip() for ln in ptx.split("\n")]
    bodies, seen = [], {}
    for i, s in enumerate(lines):
        m = _LABEL.match(s)
        if m:
            seen[m.group(0)[:-1]] = i
        elif "bra" in s:
            target = s.rstrip(";").split()[-1]
            if target in seen and seen[target] < i:
                bodies.append(instructions("\n".join(lines[seen[target]:i + 1])))
    return bodies


def histogram(lines: list[str], depth: int = 1) -> collections.Counter:
    return collections.Counter(".".join(opcode(ln).split(".")[:depth]) for ln in lines)


def report(name: str, asm: dict[str, object], values_per_iteration: float | None = None) -> None:
    code = sass(asm["cubin"])
    per = f", {len(code) / values_per_iteration:.1f} per value if straight-line" \
        if values_per_iteration else ""
    print(f"== {name}: {len(code)} SASS instructions{per}")
    print("    ", dict(collections.Counter(sass_opcode(i) for _, i in code).most_common(30)))
    for j, loop in enumerate(sass_loops(code)):
        per = f", {len(loop) / values_per_iteration:.1f} per value" if values_per_iteration \
            else ""
        ops = collections.Counter(sass_opcode(i) for i in loop)
        if values_per_iteration and ops["STG"] > 1:  # ptxas unrolled the chunk loop
            per += f" if not unrolled ({ops['STG']} stores: / {ops['STG']} if unrolled)"
        print(f"   SASS loop {j}: {len(loop)} instructions{per}")
        print("     ", dict(ops.most_common(30)))
    ptx = asm["ptx"]
    body = instructions(ptx)
    print(f"   {len(body)} PTX instructions")
    print("   ", dict(histogram(body).most_common(24)))
    for j, loop in enumerate(loops(ptx)):
        per = f", {len(loop) / values_per_iteration:.1f} per value" if values_per_iteration \
            else ""
        print(f"   PTX loop {j}: {len(loop)} instructions{per}")
        print("     ", dict(histogram(loop, 3).most_common(30)))


# --------------------------------------------------------------------------------------------
def _act() -> None:
    from kopt.codegen.kernels import act_quant as aq

    cases = [("W1 image GELU(tanh) fast", 4096, 12288, "gelu_tanh:fast"),
             ("W2 image SwiGLU fast", 4096, 18432, "silu_mul:fast")]
    for name, rows, n, act in cases:
        x = torch.randn(rows, n, dtype=torch.bfloat16)
        up = torch.randn_like(x) if act.startswith("silu") else None
        for form, config in (("default", None), ("two-pass stash", aq._config(n))):
            with capture_launch(aq._act_quant_kernel) as launches:
                aq.act_quant_triton(x, up, act, config=config)
            launch = launches[0]
            a = launch.args
            # a one-pass row is straight-line code: per value over the row; a loop: per chunk
            values = (a["BLOCK"] + a["BLOCK2"]) if a["ONE_PASS"] else a["BLOCK"]
            report(f"{name}, {form}", compile_sm90(launch, NATIVE=True),
                   values / (32 * launch.num_warps))


def _nvfp4() -> None:
    from kopt.codegen.kernels import nvfp4 as nv

    for name, rows, n in [("W1 rows", 4224, 3072), ("W2 rows", 4608, 6144)]:
        x = torch.randn(rows, n, dtype=torch.bfloat16)
        supported, nv.triton_supported = nv.triton_supported, lambda t: None  # CPU tensors
        try:
            with capture_launch(nv._quant_nvfp4_kernel) as launches:
                nv.quant_nvfp4_triton(x, torch.tensor([1.0]))
        finally:
            nv.triton_supported = supported
        launch = launches[0]
        ptx = compile_sm90(launch, CUDA=True)
        per = launch.args.get("ROWS", 1) * (launch.args["BLOCK"] + launch.args.get("BLOCK2", 0))
        report(f"NVFP4 {name}", ptx, per / (32 * launch.num_warps))


def _rowwise() -> None:
    from kopt.codegen import rowwise as rw

    spec = rw.RowwiseSpec("bfloat16", norm="layer", eps=1e-6, modulation=True,
                          outputs=("fp8_row",), intermediates="fp32")
    for name, rows, cols in [("W1 rows", 4224, 3072), ("W2 rows", 4608, 6144)]:
        x = torch.randn(1, rows, cols, dtype=torch.bfloat16)
        ins = {"x": x, "scale": torch.randn(1, cols).bfloat16(),
               "shift": torch.randn(1, cols).bfloat16()}
        launch = rw.prepare_launch(spec, [ins[n] for n in spec.input_names()])
        rec = Launch(launch.kernel, dict(zip(launch.kernel.arg_names, launch.args, strict=False)),
                     launch.num_warps, {"enable_fp_fusion": False})
        rec.args.update(launch.constexprs)
        c = launch.constexprs
        per = c["ROWS"] * (c["BLOCK"] + c["BLOCK2"]) / (32 * launch.num_warps)
        report(f"LayerNorm + adaLN + FP8 (fp32 steps) {name}", compile_sm90(rec, CUDA=True), per)


PROBES: dict[str, Callable[[], None]] = {"act": _act, "nvfp4": _nvfp4, "rowwise": _rowwise}


def main(argv: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the kernels for sm_90")
    which = argv[0] if argv else "all"
    for name, probe in PROBES.items():
        if which in (name, "all"):
            probe()


if __name__ == "__main__":
    main(sys.argv[1:])
