"""A small pointwise IR: the generated prologues and epilogues of kopt's kernel templates.

A :class:`PointwiseProgram` is straight-line SSA over operands that broadcast against a main
``[rows, cols]`` tile (``rows`` = every dim but the last, flattened):

    tile    a full [rows, cols] tensor           (x, the other half of a GLU, a residual)
    row     one value per row, [..., 1]          (a per-token scale)
    col     one value per column, [cols]         (a bias, a norm weight)
    batch   one vector per batch item, [B, cols] (adaLN shift/scale/gate of [B, T, cols] tokens)
    scalar  one value, numel 1

Three things come from one program, and they agree by construction:

* :meth:`PointwiseProgram.evaluate` -- the reference: the same aten ops, in the same order, with
  the same dtypes and Python scalars as the captured subgraph, so on any device it is bitwise the
  unfused eager computation.
* :meth:`PointwiseProgram.triton_source` -- Triton lines for a kernel body. Every value is held in
  fp32 and rounded to its op's result dtype after each op, which is what PyTorch's elementwise
  kernels do (upcast to fp32 "opmath", compute, round): "round to bf16, then multiply" orders
  survive fusion. The emitted code reads a ``CUDA: tl.constexpr`` from the enclosing kernel:
  True mirrors PyTorch's CUDA kernels (division by a Python scalar is a multiplication by its fp32
  reciprocal, libdevice transcendentals, ``a + k * b`` contracted to an fma in gelu-tanh), False
  mirrors its CPU kernels and is what Triton's interpreter runs (it has no libdevice).
* :meth:`PointwiseProgram.to_json` / :meth:`from_json` -- the text a custom op carries. Parsing
  accepts only the op names of :data:`OPS`, references to earlier values and finite numbers;
  nothing read from JSON is ever executed, only kopt's own templates are.

Numerics per op (:attr:`OpSpec.tier`): ``exact`` ops (add, sub, mul, div, neg, abs, relu, square,
reciprocal, sqrt, maximum, minimum, clamps, casts) give bitwise the eager result on the same
device: IEEE fp32 arithmetic (``div_rn``, ``sqrt_rn``; kernels are launched with fp-fusion off so
``a * b + c`` is not contracted) followed by the same round-to-nearest-even. (sqrt is exact
against CUDA's IEEE ``sqrtf``; PyTorch's vectorised CPU sqrt is not correctly rounded, so there
the interpreter's result can differ by one ulp.) ``tolerance`` ops
(exp, rsqrt, sigmoid, tanh, silu, gelu, and ``axpy`` = add/sub with alpha != 1) use a different
fp32 implementation of the transcendental (or of the fma) than PyTorch's kernel: within a few
fp32 ulp before rounding, so at most one ulp of a bf16/fp16 result, on rare elements -- except
where the op's own formula cancels (gelu of negative x, 1 + erf(x) -> 0), where the bound is
absolute, |x| * 2^-21.

:func:`from_fx` builds a program from an aten subgraph as :mod:`kopt.capture` produces it and
raises :class:`PointwiseError` (with ``.reason``) for anything else.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton
import triton.language as tl
from torch import fx
from triton.language.extra import libdevice

from kopt.errors import KoptError

aten = torch.ops.aten
prims = torch.ops.prims

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# The DT argument of pw_round: which dtype a fp32 value is rounded to.
DT_CODE = {"float32": 0, "bfloat16": 1, "float16": 2}
Kind = Literal["tile", "row", "col", "batch", "scalar"]
KINDS: tuple[str, ...] = ("tile", "row", "col", "batch", "scalar")
FORMAT_VERSION = 1


class PointwiseError(KoptError):
    """A pointwise program kopt cannot build, parse or run. ``reason`` is one short line."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class OpSpec:
    arity: int
    tier: Literal["exact", "tolerance"]
    const_args: tuple[int, ...] = ()  # positions that must be numbers
    # positions that may be numbers (a Python scalar of the aten op)
    maybe_const: tuple[int, ...] = ()


# Every op name the IR accepts. Anything else is rejected when parsing or translating.
OPS: dict[str, OpSpec] = {
    "add": OpSpec(2, "exact", maybe_const=(1,)),
    "sub": OpSpec(2, "exact", maybe_const=(0, 1)),  # sub(c, x) is aten.rsub(x, c)
    "mul": OpSpec(2, "exact", maybe_const=(1,)),
    "div": OpSpec(2, "exact", maybe_const=(1,)),
    "axpy": OpSpec(3, "tolerance", const_args=(2,)),  # a + alpha * b (add/sub with alpha)
    "maximum": OpSpec(2, "exact"),
    "minimum": OpSpec(2, "exact"),
    "clamp_min": OpSpec(2, "exact", const_args=(1,)),
    "clamp_max": OpSpec(2, "exact", const_args=(1,)),
    "neg": OpSpec(1, "exact"),
    "abs": OpSpec(1, "exact"),
    "relu": OpSpec(1, "exact"),
    "square": OpSpec(1, "exact"),
    "reciprocal": OpSpec(1, "exact"),
    "sqrt": OpSpec(1, "exact"),
    "cast": OpSpec(1, "exact"),
    "rsqrt": OpSpec(1, "tolerance"),
    "exp": OpSpec(1, "tolerance"),
    "sigmoid": OpSpec(1, "tolerance"),
    "tanh": OpSpec(1, "tolerance"),
    "silu": OpSpec(1, "tolerance"),
    "gelu_erf": OpSpec(1, "tolerance"),
    "gelu_tanh": OpSpec(1, "tolerance"),
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_SSA = re.compile(r"^%(0|[1-9][0-9]*)$")

Arg = str | float


@dataclass(frozen=True)
class Operand:
    name: str
    kind: str
    dtype: str


@dataclass(frozen=True)
class Instr:
    op: str
    args: tuple[Arg, ...]  # operand names, "%i" (result of instruction i), or numbers
    dtype: str  # result dtype


@dataclass(frozen=True)
class PointwiseProgram:
    """Straight-line pointwise code; validated on construction (also when parsed from JSON)."""

    operands: tuple[Operand, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        _validate(self)

    # -- queries -------------------------------------------------------------------------------
    def operand(self, name: str) -> Operand:
        for o in self.operands:
            if o.name == name:
                return o
        raise PointwiseError(f"program has no operand {name!r}")

    def dtype_of(self, ref: str) -> str:
        if ref.startswith("%"):
            return self.instrs[int(ref[1:])].dtype
        return self.operand(ref).dtype

    @property
    def output_dtypes(self) -> list[torch.dtype]:
        return [DTYPES[self.dtype_of(r)] for r in self.outputs]

    @property
    def tier(self) -> Literal["exact", "tolerance"]:
        """``exact`` when every op is bitwise the eager op (see the module docstring)."""
        return "exact" if all(OPS[i.op].tier == "exact" for i in self.instrs) else "tolerance"

    # -- serialisation -------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "version": FORMAT_VERSION,
            "operands": [[o.name, o.kind, o.dtype] for o in self.operands],
            "instrs": [[i.op, list(i.args), i.dtype] for i in self.instrs],
            "outputs": list(self.outputs),
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> PointwiseProgram:
        data = _loads(text) if isinstance(text, str) else text
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> PointwiseProgram:
        if not isinstance(data, Mapping):
            raise PointwiseError("pointwise program JSON must be an object")
        if set(data) != {"version", "operands", "instrs", "outputs"}:
            raise PointwiseError(f"pointwise program keys {sorted(data)} are not "
                                 "['instrs', 'operands', 'outputs', 'version']")
        if data["version"] != FORMAT_VERSION:
            raise PointwiseError(f"pointwise program version {data['version']!r} is not "
                                 f"{FORMAT_VERSION}")
        operands = tuple(Operand(*_triple(o, "operand")) for o in _list(data["operands"]))
        instrs = []
        for raw in _list(data["instrs"]):
            op, args, dtype = _triple(raw, "instruction")
            instrs.append(Instr(op, tuple(_list(args)), dtype))
        outputs = tuple(_list(data["outputs"]))
        return cls(operands, tuple(instrs), outputs)

    # -- the reference -------------------------------------------------------------------------
    def evaluate(self, values: Mapping[str, torch.Tensor], *,
                 fp32: bool = False) -> list[torch.Tensor]:
        """Run the program with the aten ops it was built from (any shapes that broadcast).

        ``fp32``: every op on fp32 values (an operand may also be given in fp32), no rounding
        between ops but the program's explicit casts; the outputs stay fp32 (the caller rounds
        them once). This is the order of :meth:`triton_source` with ``round_steps=False``."""
        env: dict[str, torch.Tensor] = {}
        for o in self.operands:
            if o.name not in values:
                raise PointwiseError(f"no value for operand {o.name!r}")
            t = values[o.name]
            if t.dtype != DTYPES[o.dtype] and not (fp32 and t.dtype == torch.float32):
                raise PointwiseError(f"operand {o.name!r} is {t.dtype}, the program expects "
                                     f"{o.dtype}")
            env[o.name] = t
        for i, ins in enumerate(self.instrs):
            args = [env[a] if isinstance(a, str) else a for a in ins.args]
            if fp32:
                if ins.op == "cast":
                    env[f"%{i}"] = _EVAL["cast"](args, DTYPES[ins.dtype]).float()
                else:
                    env[f"%{i}"] = _EVAL[ins.op](
                        [a.float() if isinstance(a, torch.Tensor) else a for a in args],
                        torch.float32)
                continue
            out = _EVAL[ins.op](args, DTYPES[ins.dtype])
            if out.dtype != DTYPES[ins.dtype]:
                raise PointwiseError(f"instruction %{i} ({ins.op}) gives {out.dtype}, the program "
                                     f"says {ins.dtype}: operand dtypes differ from the capture")
            env[f"%{i}"] = out
        return [env[r] for r in self.outputs]

    # -- Triton --------------------------------------------------------------------------------
    def triton_source(self, names: Mapping[str, str], prefix: str = "pw", *,
                      round_steps: bool = True) -> tuple[list[str], list[str]]:
        """Lines of a Triton kernel body computing the program, and the output expressions.

        ``round_steps=False``: no rounding after each op, only at the program's explicit casts
        (the outputs are then unrounded fp32: :meth:`evaluate` with ``fp32=True``).

        ``names`` maps each operand to a Triton expression holding its value as fp32, shaped to
        broadcast against the tile ([R, C] tile, [R, 1] row and batch-gathered [R, C], [1, C]
        col, 0-d scalar). The lines call the ``pw_*`` helpers of this module (import them with
        :data:`TRITON_IMPORTS`) and read ``CUDA``, a constexpr of the enclosing kernel.
        """
        if not _NAME.match(prefix):
            raise PointwiseError(f"bad prefix {prefix!r}")
        env: dict[str, str] = {}
        for o in self.operands:
            if o.name not in names:
                raise PointwiseError(f"no Triton expression for operand {o.name!r}")
            env[o.name] = f"({names[o.name]})"
        lines = []
        for i, ins in enumerate(self.instrs):
            var = f"{prefix}{i}"
            args = [env[a] if isinstance(a, str) else _lit(a) for a in ins.args]
            expr = _emit(ins, args)
            code = DT_CODE[ins.dtype] if round_steps or ins.op == "cast" else 0
            lines.append(f"{var} = pw_round({expr}, {code}, CUDA)" if code else f"{var} = {expr}")
            env[f"%{i}"] = var
        return lines, [env[r] for r in self.outputs]


# Imports the generated module needs for the lines of triton_source.
TRITON_IMPORTS = (
    "from kopt.codegen.pointwise import (pw_div, pw_div_const, pw_erf, pw_exp, pw_gelu_erf, "
    "pw_gelu_tanh, pw_recip, pw_round, pw_rsqrt, pw_sigmoid, pw_silu, pw_sqrt, pw_tanh)"
)


def fp32(c: float) -> float:
    """``c`` rounded to fp32 (how PyTorch's kernels see a Python scalar), as a Python float."""
    return torch.tensor(c, dtype=torch.float32).item()


def reciprocal_fp32(c: float) -> float:
    """What PyTorch's CUDA ``x / c`` multiplies by: ``float(1.0 / double(c))``."""
    return torch.tensor(1.0 / float(c), dtype=torch.float32).item()


def _lit(c: float) -> str:
    v = fp32(c)
    return f"({v!r})" if v < 0 else repr(v)


def _emit(ins: Instr, a: list[str]) -> str:
    op = ins.op
    if op == "add":
        return f"{a[0]} + {a[1]}"
    if op == "sub":
        return f"{a[0]} - {a[1]}"
    if op == "mul":
        return f"{a[0]} * {a[1]}"
    if op == "div":
        if isinstance(ins.args[1], str):
            return f"pw_div({a[0]}, {a[1]})"
        c = float(ins.args[1])
        return f"pw_div_const({a[0]}, {fp32(c)!r}, {reciprocal_fp32(c)!r}, CUDA)"
    if op == "axpy":  # PyTorch's add kernels compute a + alpha * b as one fma
        return f"tl.fma({a[2]}, {a[1]}, {a[0]})"
    if op in ("maximum", "minimum"):
        return f"tl.{op}({a[0]}, {a[1]})"
    if op == "clamp_min":
        return f"tl.maximum({a[0]}, {a[1]})"
    if op == "clamp_max":
        return f"tl.minimum({a[0]}, {a[1]})"
    if op == "neg":
        return f"-{a[0]}"
    if op == "abs":
        return f"tl.abs({a[0]})"
    if op == "relu":
        return f"tl.maximum({a[0]}, 0.0)"
    if op == "square":
        return f"{a[0]} * {a[0]}"
    if op == "cast":
        return a[0]
    if op == "reciprocal":
        return f"pw_recip({a[0]})"
    return f"pw_{op}({a[0]}, CUDA)"  # sqrt, rsqrt, exp, sigmoid, tanh, silu, gelu_erf, gelu_tanh


# ---------------------------------------------------------------------------------------------
# Device helpers called by generated code. Values are fp32; DT: 0 fp32, 1 bf16, 2 fp16.

@triton.jit
def pw_round(v, DT: tl.constexpr, CUDA: tl.constexpr):
    """Round fp32 ``v`` to bf16/fp16 (nearest even) and widen back: the rounding that a
    PyTorch kernel does when it stores an op's result."""
    if DT == 1:
        if CUDA:
            r = v.to(tl.bfloat16).to(tl.float32)
        else:
            # The interpreter truncates fp32 -> bf16 casts; round on the bits instead.
            u = v.to(tl.int32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            r = tl.where(v != v, v, r)
    elif DT == 2:
        r = v.to(tl.float16).to(tl.float32)
    else:
        r = v
    return r


@triton.jit
def pw_div(a, b):
    """IEEE division (Triton's ``/`` is an approximate division for fp32)."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def pw_div_by(a, b, rb, CUDA: tl.constexpr):
    """``a / b`` rounded as the IEEE division (:func:`pw_div`), given ``b > 0`` and
    ``rb = RN(1 / b)`` (for a divisor shared by many elements, e.g. a row's quantization scale:
    one division per row).

    On CUDA: ``q = RN(a * rb)``, corrected twice as ``q + RN(a - b q) * rb`` with fmas (the
    residual is exact in fp32), ``a - b q`` as ``fma(q, -b, a)`` with -b formed once per
    divisor before broadcasting (Triton 3.6 negates as ``0 - x``: a subtraction per value, 2
    more SASS instructions per value in act + quant, ``benchmarks/probes/ptx_sm90.py``). The
    first correction makes q faithful; the second is then the correctly rounded quotient
    (Markstein's theorem, which needs rb correctly rounded). A zero residual leaves q as it is
    (``q + 0 * rb``), except that the fma sums turn a -0 quotient into +0: the quotient's sign
    bit is then set from a's (b > 0, so a nonzero quotient already has it; a different e4m3
    byte otherwise: measured on the H200; one LOP3 per value in SASS). Computing the residual
    negated to keep the zero's sign instead does not survive Triton 3.6's ``0 - x`` negation
    (measured; RESULTS.md, 2026-12-01). Valid where the residuals
    neither overflow nor underflow: for a quantizer's ``x / scale`` with ``|x| <= amax`` and
    ``scale ~ amax / 448`` it is exact down to |x| ~ 2^-100, below which the quotient is far
    below half the smallest e4m3 subnormal, so the e4m3 value is still exact. A multiply, four
    fmas and one bitwise or against ``div.rn``'s reciprocal refinement and range check: W1's
    per-token quantizer 21.5 -> 17.5 us on the H200 (``benchmarks/probes/quant_variants.py``,
    with two selects instead of the or). The interpreter (no fused multiply-add) divides."""
    if CUDA:
        a, nb = tl.broadcast(a, 0.0 - b)  # b > 0: exact
        a, rb = tl.broadcast(a, rb)
        q = a * rb
        q = tl.fma(tl.fma(q, nb, a), rb, q)
        q = tl.fma(tl.fma(q, nb, a), rb, q)
        sign = a.to(tl.int32, bitcast=True) & -2147483648
        q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        a, b = tl.broadcast(a, b)
        q = tl.math.div_rn(a, b)
    return q


@triton.jit
def pw_div_const(a, C: tl.constexpr, INV: tl.constexpr, CUDA: tl.constexpr):
    """``a / C`` for a Python scalar C: PyTorch's CUDA kernels multiply by the reciprocal."""
    if CUDA:
        r = a * INV
    else:
        r = tl.math.div_rn(a, tl.full(a.shape, C, tl.float32))
    return r


@triton.jit
def pw_recip(a):
    return tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a)


@triton.jit
def pw_sqrt(a, CUDA: tl.constexpr):
    return tl.math.sqrt_rn(a)


@triton.jit
def pw_exp(a, CUDA: tl.constexpr):
    if CUDA:
        r = libdevice.exp(a)  # expf, what PyTorch's CUDA kernels call
    else:
        r = tl.exp(a)
    return r


@triton.jit
def pw_rsqrt(a, CUDA: tl.constexpr):
    if CUDA:
        r = libdevice.rsqrt(a)  # rsqrtf
    else:
        r = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), tl.math.sqrt_rn(a))  # 1 / sqrt
    return r


@triton.jit
def pw_erf(a, CUDA: tl.constexpr):
    if CUDA:
        r = libdevice.erf(a)
    else:
        r = tl.math.erf(a)
    return r


@triton.jit
def pw_tanh(a, CUDA: tl.constexpr):
    if CUDA:
        r = libdevice.tanh(a)
    else:
        # No libdevice in the interpreter: (1 - e) / (1 + e), e = exp(-2|a|), and the odd
        # series below 0.3 where 1 - e would cancel (truncation < 1e-7 relative there).
        ax = tl.abs(a)
        e = tl.exp(-2.0 * ax)
        big = tl.math.div_rn(1.0 - e, 1.0 + e)
        big = tl.where(a < 0, -big, big)
        a2 = a * a
        small = a * (1.0 + a2 * (-0.3333333432674408 + a2 * (0.13333334028720856 + a2 * (
            -0.05396825447678566 + a2 * 0.021869488060474396))))
        r = tl.where(ax < 0.3, small, big)
    return r


@triton.jit
def pw_sigmoid(a, CUDA: tl.constexpr):
    # PyTorch: 1 / (1 + exp(-x)), in fp32
    d = 1.0 + pw_exp(-a, CUDA)
    return tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


@triton.jit
def pw_silu(a, CUDA: tl.constexpr):
    # PyTorch: x / (1 + exp(-x)) -- a division, not x * sigmoid(x)
    d = 1.0 + pw_exp(-a, CUDA)
    a, d = tl.broadcast(a, d)
    return tl.math.div_rn(a, d)


@triton.jit
def pw_gelu_erf(a, CUDA: tl.constexpr):
    # PyTorch: x * 0.5 * (1 + erf(x * M_SQRT1_2))
    return (a * 0.5) * (1.0 + pw_erf(a * 0.7071067690849304, CUDA))


@triton.jit
def pw_gelu_tanh(a, CUDA: tl.constexpr):
    # PyTorch: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3))); nvcc contracts the inner
    # x + kKappa * x^3 to an fma, the CPU's vectorised code does not.
    cube = a * a * a
    if CUDA:
        inner = tl.fma(0.044714998453855515, cube, a)
    else:
        inner = a + 0.044714998453855515 * cube
    inner = 0.7978845834732056 * inner
    return (0.5 * a) * (1.0 + pw_tanh(inner, CUDA))


# ---------------------------------------------------------------------------------------------
# The reference: one aten call per instruction.

def _e_sub(a: list, dt: torch.dtype) -> torch.Tensor:
    if not isinstance(a[0], torch.Tensor):
        return aten.rsub.Scalar(a[1], a[0])
    return aten.sub.Tensor(a[0], a[1])


_EVAL = {
    "add": lambda a, dt: aten.add.Tensor(a[0], a[1]),
    "sub": _e_sub,
    "mul": lambda a, dt: aten.mul.Tensor(a[0], a[1]),
    "div": lambda a, dt: aten.div.Tensor(a[0], a[1]),
    "axpy": lambda a, dt: aten.add.Tensor(a[0], a[1], alpha=a[2]),
    "maximum": lambda a, dt: aten.maximum.default(a[0], a[1]),
    "minimum": lambda a, dt: aten.minimum.default(a[0], a[1]),
    "clamp_min": lambda a, dt: aten.clamp_min.default(a[0], a[1]),
    "clamp_max": lambda a, dt: aten.clamp_max.default(a[0], a[1]),
    "neg": lambda a, dt: aten.neg.default(a[0]),
    "abs": lambda a, dt: aten.abs.default(a[0]),
    "relu": lambda a, dt: aten.relu.default(a[0]),
    "square": lambda a, dt: aten.pow.Tensor_Scalar(a[0], 2),
    "reciprocal": lambda a, dt: aten.reciprocal.default(a[0]),
    "sqrt": lambda a, dt: aten.sqrt.default(a[0]),
    "rsqrt": lambda a, dt: aten.rsqrt.default(a[0]),
    "exp": lambda a, dt: aten.exp.default(a[0]),
    "sigmoid": lambda a, dt: aten.sigmoid.default(a[0]),
    "tanh": lambda a, dt: aten.tanh.default(a[0]),
    "silu": lambda a, dt: aten.silu.default(a[0]),
    "gelu_erf": lambda a, dt: aten.gelu.default(a[0]),
    "gelu_tanh": lambda a, dt: aten.gelu.default(a[0], approximate="tanh"),
    "cast": lambda a, dt: aten._to_copy.default(a[0], dtype=dt),
}
assert set(_EVAL) == set(OPS)


# ---------------------------------------------------------------------------------------------
# Validation and parsing

def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise PointwiseError(f"pointwise program is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> float:
    raise PointwiseError(f"non-finite number {name} in pointwise program JSON")


def _list(x: Any) -> list:
    if not isinstance(x, list | tuple):
        raise PointwiseError(f"expected a list in pointwise program, got {type(x).__name__}")
    return list(x)


def _triple(x: Any, what: str) -> tuple:
    x = _list(x)
    if len(x) != 3:
        raise PointwiseError(f"{what} {x!r} must have 3 fields")
    return tuple(x)


def _validate(p: PointwiseProgram) -> None:
    if not isinstance(p.operands, tuple) or not isinstance(p.instrs, tuple) or not isinstance(
            p.outputs, tuple):
        raise PointwiseError("operands, instrs and outputs must be tuples")
    seen: set[str] = set()
    for o in p.operands:
        if not isinstance(o, Operand):
            raise PointwiseError(f"bad operand {o!r}")
        if not isinstance(o.name, str) or not _NAME.match(o.name) or keyword.iskeyword(o.name):
            raise PointwiseError(f"operand name {o.name!r} is not an identifier")
        if o.name in seen:
            raise PointwiseError(f"operand {o.name!r} is declared twice")
        if o.kind not in KINDS:
            raise PointwiseError(f"operand {o.name!r}: kind {o.kind!r} is not one of {KINDS}")
        if o.dtype not in DTYPES:
            raise PointwiseError(f"operand {o.name!r}: dtype {o.dtype!r} is not one of "
                                 f"{tuple(DTYPES)}")
        seen.add(o.name)
    for i, ins in enumerate(p.instrs):
        if not isinstance(ins, Instr):
            raise PointwiseError(f"bad instruction {ins!r}")
        spec = OPS.get(ins.op) if isinstance(ins.op, str) else None
        if spec is None:
            raise PointwiseError(f"unknown op {ins.op!r} (known: {', '.join(sorted(OPS))})")
        if ins.dtype not in DTYPES:
            raise PointwiseError(f"%{i} ({ins.op}): dtype {ins.dtype!r} is not one of "
                                 f"{tuple(DTYPES)}")
        if not isinstance(ins.args, tuple) or len(ins.args) != spec.arity:
            raise PointwiseError(f"%{i} ({ins.op}) takes {spec.arity} arguments, got "
                                 f"{ins.args!r}")
        n_refs = 0
        for j, a in enumerate(ins.args):
            if isinstance(a, bool):
                raise PointwiseError(f"%{i} ({ins.op}): boolean argument")
            if isinstance(a, int | float):
                if j not in spec.const_args and j not in spec.maybe_const:
                    raise PointwiseError(f"%{i} ({ins.op}): argument {j} must be a value, got "
                                         f"the number {a!r}")
                if not math.isfinite(a):
                    raise PointwiseError(f"%{i} ({ins.op}): non-finite constant {a!r}")
                continue
            if j in spec.const_args:
                raise PointwiseError(f"%{i} ({ins.op}): argument {j} must be a number")
            if not isinstance(a, str):
                raise PointwiseError(f"%{i} ({ins.op}): bad argument {a!r}")
            m = _SSA.match(a)
            if m:
                if int(m.group(1)) >= i:
                    raise PointwiseError(f"%{i} ({ins.op}) reads {a}, which is not computed yet")
            elif a not in seen:
                raise PointwiseError(f"%{i} ({ins.op}) reads unknown value {a!r}")
            n_refs += 1
        if n_refs == 0:
            raise PointwiseError(f"%{i} ({ins.op}) has only constant arguments")
    if not p.outputs:
        raise PointwiseError("program has no outputs")
    for r in p.outputs:
        m = _SSA.match(r) if isinstance(r, str) else None
        if not isinstance(r, str) or (m is None and r not in seen) or (
                m is not None and int(m.group(1)) >= len(p.instrs)):
            raise PointwiseError(f"output {r!r} is not a value of the program")


# ---------------------------------------------------------------------------------------------
# From an FX subgraph

def classify(shape: Sequence[int], main: Sequence[int]) -> Kind | None:
    """How an operand of ``shape`` broadcasts against the main tensor's shape, if it does in one
    of the supported ways. ``main`` is [..., cols]; ``batch`` needs main = [B, ..., cols]."""
    shape, main = list(shape), list(main)
    if len(shape) > len(main):
        if any(s != 1 for s in shape[: len(shape) - len(main)]):
            return None
        shape = shape[len(shape) - len(main):]
    shape = [1] * (len(main) - len(shape)) + shape
    if math.prod(shape) == 1:
        return "scalar"
    if shape == main:
        return "tile"
    if shape[-1] == main[-1] and all(s == 1 for s in shape[:-1]):
        return "col"
    if shape[-1] == 1 and shape[:-1] == main[:-1]:
        return "row"
    if (len(main) >= 3 and shape[0] == main[0] and shape[-1] == main[-1]
            and all(s == 1 for s in shape[1:-1])):
        return "batch"
    return None


def try_from_fx(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node],
                outputs: Sequence[fx.Node] | None = None,
                names: Sequence[str] | None = None) -> PointwiseProgram | str:
    """:func:`from_fx`, returning the reason as a string instead of raising (for guards)."""
    try:
        return from_fx(nodes, inputs, outputs, names)
    except PointwiseError as exc:
        return exc.reason


def from_fx(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node],
            outputs: Sequence[fx.Node] | None = None,
            names: Sequence[str] | None = None) -> PointwiseProgram:
    """Translate the pointwise subgraph ``nodes`` (in topological order) reading ``inputs``.

    Operands are named ``names`` (e.g. ``x`` for a template's main input), by default after the
    input nodes. Outputs are ``outputs`` if given, else every node
    with a user outside ``nodes``, in order. The main shape is the outputs' (all equal); each
    input's broadcast kind is read from its ``meta['val']`` shape against it.
    """
    nodes = list(nodes)
    inside = set(nodes)
    if outputs is None:
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    outputs = list(outputs)
    if not outputs:
        raise PointwiseError("subgraph has no outputs")
    main = _shape(outputs[0])
    for o in outputs:
        if o not in inside:
            raise PointwiseError(f"output {o.name} is not a node of the subgraph")
        if _shape(o) != main:
            raise PointwiseError(f"outputs have different shapes: {list(main)} and "
                                 f"{list(_shape(o))}")
    if not main:
        raise PointwiseError("outputs are 0-d tensors")
    if names is not None and len(names) != len(inputs):
        raise PointwiseError(f"{len(names)} names for {len(inputs)} inputs")
    ref: dict[fx.Node, str] = {}
    operands = []
    for i, n in enumerate(inputs):
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise PointwiseError(f"input {getattr(n, 'name', n)} is not a tensor node")
        if val.dtype not in DTYPE_NAMES:
            raise PointwiseError(f"input {n.name} has dtype {val.dtype}")
        kind = classify(val.shape, main)
        if kind is None:
            raise PointwiseError(f"input {n.name} of shape {list(val.shape)} does not broadcast "
                                 f"as a tile, row, column, batch or scalar against {list(main)}")
        taken = {o.name for o in operands}
        name = names[i] if names is not None else _operand_name(n.name, taken)
        if name in taken:
            raise PointwiseError(f"operand name {name!r} given twice")
        operands.append(Operand(name, kind, DTYPE_NAMES[val.dtype]))
        ref[n] = name
    instrs: list[Instr] = []
    for n in nodes:
        if n in ref:
            raise PointwiseError(f"{n.name} is both an input and a node of the subgraph")
        for a in n.all_input_nodes:
            if a not in ref:
                raise PointwiseError(f"{n.name} reads {a.name}, which is neither an input nor "
                                     "an earlier node of the subgraph")
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in DTYPE_NAMES:
            raise PointwiseError(f"{n.name} ({_target_name(n)}) does not produce a bf16/fp16/"
                                 "fp32 tensor")
        if torch.broadcast_shapes(tuple(val.shape), tuple(main)) != tuple(main):
            raise PointwiseError(f"{n.name} has shape {list(val.shape)}, larger than the "
                                 f"outputs' {list(main)}")
        dtype = DTYPE_NAMES[val.dtype]
        result = _translate(n, dtype, ref, instrs)
        ref[n] = result
    return PointwiseProgram(tuple(operands), tuple(instrs), tuple(ref[o] for o in outputs))


def _shape(n: fx.Node) -> tuple[int, ...]:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise PointwiseError(f"{n.name} has no tensor value")
    return tuple(int(s) for s in val.shape)


def _operand_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_]", "_", name)[:48] or "in"
    if not _NAME.match(base) or keyword.iskeyword(base):
        base = f"in_{base}"
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    return out


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    return str(getattr(t, "__name__", t))


_UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.relu.default: "relu",
    aten.square.default: "square", aten.reciprocal.default: "reciprocal",
    aten.sqrt.default: "sqrt", aten.rsqrt.default: "rsqrt", aten.exp.default: "exp",
    aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh", aten.silu.default: "silu",
}
_BINARY = {
    aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub", aten.mul.Tensor: "mul", aten.mul.Scalar: "mul",
    aten.div.Tensor: "div", aten.div.Scalar: "div", aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}
_POW = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal"}
_IDENTITY = (aten.clone.default, aten.alias.default, aten.detach.default)


def _translate(n: fx.Node, dtype: str, ref: dict[fx.Node, str], instrs: list[Instr]) -> str:
    """Append the instructions computing ``n``; return the reference to its value."""
    if n.op != "call_function":
        raise PointwiseError(f"{n.name} is a {n.op}, not a pointwise op")
    t = n.target
    args, kwargs = list(n.args), dict(n.kwargs)

    def arg(x: Any) -> Arg:
        if isinstance(x, fx.Node):
            return ref[x]
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise PointwiseError(f"{n.name} ({_target_name(n)}): unsupported argument {x!r}")
        if not math.isfinite(x):
            raise PointwiseError(f"{n.name} ({_target_name(n)}): non-finite constant {x!r}")
        return float(x)

    def emit(op: str, *a: Arg, dt: str = dtype) -> str:
        instrs.append(Instr(op, tuple(a), dt))
        return f"%{len(instrs) - 1}"

    def no_kwargs(allowed: tuple[str, ...] = ()) -> None:
        extra = set(kwargs) - set(allowed)
        if extra:
            raise PointwiseError(f"{n.name} ({_target_name(n)}): unsupported arguments "
                                 f"{sorted(extra)}")

    if t in _IDENTITY:
        no_kwargs(("memory_format",))
        return arg(args[0])  # type: ignore[return-value]
    if t in _UNARY:
        no_kwargs()
        return emit(_UNARY[t], arg(args[0]))
    if t is aten.gelu.default:
        no_kwargs(("approximate",))
        approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        if approx not in ("none", "tanh"):
            raise PointwiseError(f"{n.name}: gelu approximate={approx!r}")
        return emit("gelu_tanh" if approx == "tanh" else "gelu_erf", arg(args[0]))
    if t is aten.pow.Tensor_Scalar:
        no_kwargs()
        e = args[1]
        if isinstance(e, bool) or not isinstance(e, int | float) or float(e) not in _POW:
            raise PointwiseError(f"{n.name}: pow with exponent {e!r} (supported: 2, 0.5, -0.5, "
                                 "-1)")
        return emit(_POW[float(e)], arg(args[0]))
    if t in (aten._to_copy.default, aten.to.dtype, prims.convert_element_type.default,
             aten.type_as.default):
        return _translate_cast(n, args, kwargs, ref, emit)
    if t in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        no_kwargs(("min", "max"))
        if t is aten.clamp.default:
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
        elif t is aten.clamp_min.default:
            lo, hi = args[1], None
        else:
            lo, hi = None, args[1]
        if lo is None and hi is None:
            raise PointwiseError(f"{n.name}: clamp without bounds")
        if isinstance(lo, fx.Node) or isinstance(hi, fx.Node):
            raise PointwiseError(f"{n.name}: clamp with tensor bounds")
        v = arg(args[0])
        if lo is not None:
            v = emit("clamp_min", v, arg(lo))
        if hi is not None:
            v = emit("clamp_max", v, arg(hi))
        return v  # type: ignore[return-value]
    if t is aten.rsub.Scalar:
        no_kwargs(("alpha",))
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if alpha != 1:
            raise PointwiseError(f"{n.name}: rsub with alpha={alpha!r}")
        return emit("sub", arg(args[1]), arg(args[0]))
    if t in _BINARY:
        op = _BINARY[t]
        no_kwargs(("alpha",))
        a, b = arg(args[0]), arg(args[1])
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if not isinstance(a, str):
            if op in ("add", "mul") and alpha == 1:
                a, b = b, a  # commutative: PyTorch computes the same product or sum
            else:
                raise PointwiseError(f"{n.name} ({_target_name(n)}): number as first operand")
        if not isinstance(b, str) and op in ("maximum", "minimum"):
            raise PointwiseError(f"{n.name}: {op} with a number")
        if op in ("add", "sub") and alpha != 1:
            if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not isinstance(
                    b, str):
                raise PointwiseError(f"{n.name}: {op} with alpha={alpha!r}")
            return emit("axpy", a, b, float(alpha) if op == "add" else -float(alpha))
        if alpha != 1:
            raise PointwiseError(f"{n.name}: {op} with alpha")
        if not isinstance(b, str) and not isinstance(a, str):
            raise PointwiseError(f"{n.name}: only numbers")
        return emit(op, a, b)
    raise PointwiseError(f"{n.name}: op {_target_name(n)} is not supported by the pointwise "
                         "translator")


def _translate_cast(n: fx.Node, args: list, kwargs: dict, ref: dict[fx.Node, str],
                    emit: Any) -> str:
    t = n.target
    if t is aten.type_as.default:
        src = args[0]
        target = args[1].meta["val"].dtype
    elif t is prims.convert_element_type.default:
        src, target = args[0], args[1]
    elif t is aten.to.dtype:
        src = args[0]
        target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
        if set(kwargs) - {"dtype", "non_blocking", "copy", "memory_format"}:
            raise PointwiseError(f"{n.name}: aten.to with {sorted(kwargs)}")
    else:
        src = args[0]
        allowed = {"dtype", "memory_format", "non_blocking"}
        extra = {k for k, v in kwargs.items() if k not in allowed and v is not None}
        if extra or len(args) > 1:
            raise PointwiseError(f"{n.name}: _to_copy with {sorted(extra) or args[1:]} (only a "
                                 "dtype change is pointwise)")
        target = kwargs.get("dtype")
    if not isinstance(src, fx.Node):
        raise PointwiseError(f"{n.name}: cast of a non-tensor")
    if target is None:
        return ref[src]
    if target not in DTYPE_NAMES:
        raise PointwiseError(f"{n.name}: cast to {target}")
    return emit("cast", ref[src], dt=DTYPE_NAMES[target])
