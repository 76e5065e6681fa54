"""The row-wise template: ``kopt::rowwise(Tensor[] inputs, str spec) -> Tensor[]``.

One program owns whole rows of ``x`` ([..., cols], rows = the leading dims flattened) and computes,
each step optional, in the unfused model's order:

    h = x + gate * (y + residual_bias)                    prologue (residual, gated residual, bias)
    n = rms_norm(h) | layer_norm(h)  [* weight] [+ bias]  the norm, reduced in fp32
    n = (1 + scale) * n + shift                           adaLN modulation
    r = epilogue(n, ...)                                  a generated PointwiseProgram
    -> out = r, residual = h, fp8 per token, fp8 per 1x128 group, nvfp4 (any subset)

``gate``, ``scale`` and ``shift`` are per batch item: [B, cols] (or [B, 1, cols]) for x of
[B, T, cols], broadcast over the T tokens of each item (B = 1: one vector for all rows). ``y`` is
a [..., cols] tile; ``residual_bias``, ``weight``, ``bias`` are [cols]. Every elementwise step
rounds to its dtype like the eager op does (x's dtype; the epilogue's own dtypes), so e.g. the
norm output is rounded to bf16, modulated in bf16, and only then quantized from fp32.

A :class:`RowwiseSpec` (JSON on the op) says which steps and outputs exist; the kernel is one
Triton source generated from kopt's template (constexpr flags for the steps, generated lines for
the epilogue), written to a module file keyed by its hash, and compiled per spec and shape class
by Triton's cache. Nothing in a spec is executed: it only selects flags and provides a validated
PointwiseProgram, which is translated by kopt's own code. A row whose width is not a power of
two runs as two power-of-two tiles where the spec quantizes (:func:`row_split`: 3072 = 2048 +
1024; the template emits the per-tile steps once per tile and sums the row reductions): the
quantizers make these kernels bound by instructions per lane, masked lanes included.

Numerics, per feature, against the unfused eager ops on the same device:

* prologue, modulation, output/residual writes: ``exact`` -- fp32 arithmetic on the values of the
  operands and round-to-nearest-even to the dtype after each op, as PyTorch's kernels do.
* norm (RMSNorm / LayerNorm): ``tolerance`` -- the row reduction (sum order, two-pass variance,
  rsqrt implementation) differs from PyTorch's kernels, so the normalised fp32 value can differ in
  its last bits and the rounded bf16/fp16 output by one ulp on a small fraction of elements; the
  steps after it are exact given the norm's output.
* epilogue: the program's tier (:attr:`PointwiseProgram.tier`): exact for arithmetic and casts,
  tolerance (<= 1 ulp of a bf16/fp16 result, rarely) for transcendentals.
* quantized outputs: exact given the result they quantize (the FP8/NVFP4 producers are bitwise
  their references); a result differing by one ulp can move a value to the next FP8/FP4 step.

``intermediates`` picks the order: ``"eager"`` (the above: every step rounded like the eager op)
or ``"fp32"``: the steps run in fp32 with no rounding between them (the epilogue's explicit casts
excepted), and each output is rounded once, the quantized ones quantize the unrounded result --
what Inductor's fused kernels do. The residual stream ``h`` is the one value rounded on the
way (to x's dtype, as the stored stream later blocks read; the norm reads it so, as it does in
Inductor's kernels, which store ``h`` and normalise it in the next kernel). Tier ``tolerance``
either way. Why fp32 is the FP8 default: on W1 and W2 and on CPU Qwen-Image-shaped models its
FP8 output error against eager BF16 is lower (RESULTS.md, 2026-11-30).

:func:`rowwise_reference` is the unfused computation (the CPU implementation and the verifier's
reference); ``affine_after_round`` picks the norm's affine order: False applies weight/bias in
fp32 before the single rounding (``aten.layer_norm``; ``aten.rms_norm`` -- checked on the CPU
with torch 2.13, on CUDA by tests/gpu), True rounds the normalised value first and multiplies in
the input dtype (the Llama/Qwen3/diffusers RMSNorm modules: ``weight * x_normed.to(dtype)``).
"""

from __future__ import annotations

import functools
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton
from torch.multiprocessing.reductions import StorageWeakRef

from kopt.codegen import fp64_reference
from kopt.codegen.kernels.nvfp4 import (
    BLOCK_SIZE,
    nvfp4_launch_rows,
    quant_nvfp4_reference,
    scale_numel,
)
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    MAX_COLS,
    even_tiles,
    group_scale_empty,
    mirror_cuda,
    quant_fp8_group_reference,
    quant_fp8_rowwise_reference,
    row_split,
    row_tiling,
)
from kopt.codegen.launch import launch as triton_launch
from kopt.codegen.ops import define
from kopt.codegen.pointwise import (
    _EVAL,
    DT_CODE,
    DTYPE_NAMES,
    DTYPES,
    TRITON_IMPORTS,
    PointwiseError,
    PointwiseProgram,
)
from kopt.codegen.source import load_generated_module
from kopt.errors import KoptError

SPEC_VERSION = 1
NORMS = ("none", "layer", "rms")
INTERMEDIATES = ("eager", "fp32")  # see the module docstring
# output kinds in their canonical order, and the tensors each returns
OUTPUTS: dict[str, tuple[str, ...]] = {
    "out": ("out",),
    "residual": ("residual",),
    "fp8_row": ("fp8_row", "fp8_row_scale"),
    "fp8_group": ("fp8_group", "fp8_group_scale"),
    "nvfp4": ("nvfp4", "nvfp4_scale"),
}
QUANTIZED = {"fp8_row", "fp8_group", "nvfp4"}  # the outputs that quantize
EPILOGUE_INPUT = "x"  # the epilogue's operand that receives the (normalised, modulated) rows


class RowwiseError(KoptError):
    """A row-wise spec or call kopt cannot run; the message says what is wrong."""


@dataclass(frozen=True)
class RowwiseSpec:
    """What one ``kopt::rowwise`` call computes. Validated on construction."""

    dtype: str  # x's dtype (and y's, gate's, scale's, shift's): bfloat16 | float16 | float32
    norm: str = "none"  # none | layer | rms
    eps: float = 1e-6
    weight: bool = False  # norm affine weight [cols]
    bias: bool = False  # norm affine bias [cols]
    affine_after_round: bool = False  # see the module docstring
    residual: bool = False  # h = x + y
    residual_bias: bool = False  # h = x + (y + residual_bias)
    gate: bool = False  # h = x + gate * y, gate per batch item
    modulation: bool = False  # n = (1 + scale) * n + shift, per batch item
    epilogue: PointwiseProgram | None = None
    outputs: tuple[str, ...] = ("out",)
    intermediates: str = "eager"  # eager | fp32: see the module docstring
    _json: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate_spec(self)
        object.__setattr__(self, "outputs", tuple(k for k in OUTPUTS if k in self.outputs))
        object.__setattr__(self, "_json", json.dumps(self._as_dict(), sort_keys=True,
                                                      separators=(",", ":")))

    # -- names of the op's tensors ----------------------------------------------------------------
    def input_names(self) -> list[str]:
        names = ["x"]
        names += ["y"] if self.residual else []
        names += ["residual_bias"] if self.residual_bias else []
        names += ["gate"] if self.gate else []
        names += ["weight"] if self.weight else []
        names += ["bias"] if self.bias else []
        names += ["scale", "shift"] if self.modulation else []
        names += [f"ep_{o.name}" for o in self.epilogue_operands()]
        names += ["global_scale"] if "nvfp4" in self.outputs else []
        return names

    def output_names(self) -> list[str]:
        return [name for kind in self.outputs for name in OUTPUTS[kind]]

    def epilogue_operands(self) -> list:
        if self.epilogue is None:
            return []
        return [o for o in self.epilogue.operands if o.name != EPILOGUE_INPUT]

    @property
    def result_dtype(self) -> torch.dtype:
        if self.epilogue is not None:
            return self.epilogue.output_dtypes[0]
        return DTYPES[self.dtype]

    @property
    def tier(self) -> str:
        """``exact`` if the fused result is bitwise the unfused eager one, else ``tolerance``."""
        if self.norm != "none" or self.intermediates != "eager":
            return "tolerance"
        return self.epilogue.tier if self.epilogue is not None else "exact"

    # -- serialisation --------------------------------------------------------------------------
    def _as_dict(self) -> dict[str, Any]:
        return {
            "version": SPEC_VERSION, "dtype": self.dtype, "norm": self.norm, "eps": self.eps,
            "weight": self.weight, "bias": self.bias,
            "affine_after_round": self.affine_after_round, "residual": self.residual,
            "residual_bias": self.residual_bias, "gate": self.gate,
            "modulation": self.modulation,
            "epilogue": None if self.epilogue is None else json.loads(self.epilogue.to_json()),
            "outputs": list(self.outputs), "intermediates": self.intermediates,
        }

    def to_json(self) -> str:
        return self._json

    @classmethod
    def from_json(cls, text: str) -> RowwiseSpec:
        return _parse_spec(text)


_SPEC_FIELDS = ("version", "dtype", "norm", "eps", "weight", "bias", "affine_after_round",
                "residual", "residual_bias", "gate", "modulation", "epilogue", "outputs",
                "intermediates")
_FLAGS = ("weight", "bias", "affine_after_round", "residual", "residual_bias", "gate",
          "modulation")


@functools.lru_cache(maxsize=512)
def _parse_spec(text: str) -> RowwiseSpec:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError, TypeError) as exc:
        raise RowwiseError(f"rowwise spec is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RowwiseError("rowwise spec JSON must be an object")
    data.setdefault("intermediates", "eager")  # specs written before the field existed
    if set(data) != set(_SPEC_FIELDS):
        missing, extra = set(_SPEC_FIELDS) - set(data), set(data) - set(_SPEC_FIELDS)
        raise RowwiseError(f"rowwise spec fields: missing {sorted(missing)}, unknown "
                           f"{sorted(extra)}")
    if data["version"] != SPEC_VERSION:
        raise RowwiseError(f"rowwise spec version {data['version']!r} is not {SPEC_VERSION}")
    if not isinstance(data["outputs"], list):
        raise RowwiseError("rowwise spec outputs must be a list")
    try:
        epilogue = (None if data["epilogue"] is None
                    else PointwiseProgram.from_dict(data["epilogue"]))
    except PointwiseError as exc:
        raise RowwiseError(f"rowwise spec epilogue: {exc.reason}") from None
    return RowwiseSpec(
        dtype=data["dtype"], norm=data["norm"], eps=data["eps"],
        **{k: data[k] for k in _FLAGS}, epilogue=epilogue, outputs=tuple(data["outputs"]),
        intermediates=data["intermediates"],
    )


def _validate_spec(s: RowwiseSpec) -> None:
    if s.dtype not in DTYPES:
        raise RowwiseError(f"dtype {s.dtype!r} is not one of {tuple(DTYPES)}")
    if s.norm not in NORMS:
        raise RowwiseError(f"norm {s.norm!r} is not one of {NORMS}")
    if s.intermediates not in INTERMEDIATES:
        raise RowwiseError(f"intermediates {s.intermediates!r} is not one of {INTERMEDIATES}")
    for k in _FLAGS:
        if not isinstance(getattr(s, k), bool):
            raise RowwiseError(f"{k} must be a bool, got {getattr(s, k)!r}")
    if isinstance(s.eps, bool) or not isinstance(s.eps, int | float) or not (
            math.isfinite(s.eps) and s.eps >= 0):
        raise RowwiseError(f"eps must be a finite number >= 0, got {s.eps!r}")
    if s.norm == "none" and (s.weight or s.bias or s.affine_after_round):
        raise RowwiseError("weight, bias and affine_after_round need a norm")
    if (s.gate or s.residual_bias) and not s.residual:
        raise RowwiseError("gate and residual_bias need residual")
    if not isinstance(s.outputs, tuple | list) or not s.outputs:
        raise RowwiseError("outputs must be a non-empty list")
    for k in s.outputs:
        if k not in OUTPUTS:
            raise RowwiseError(f"output {k!r} is not one of {tuple(OUTPUTS)}")
    if len(set(s.outputs)) != len(s.outputs):
        raise RowwiseError(f"outputs {list(s.outputs)} name one twice")
    if "residual" in s.outputs and not s.residual:
        raise RowwiseError("output 'residual' needs residual")
    if s.epilogue is not None:
        ep = s.epilogue
        if not isinstance(ep, PointwiseProgram):
            raise RowwiseError("epilogue must be a PointwiseProgram")
        try:
            x = ep.operand(EPILOGUE_INPUT)
        except PointwiseError:
            raise RowwiseError(f"epilogue has no operand {EPILOGUE_INPUT!r}") from None
        if x.kind != "tile" or x.dtype != s.dtype:
            raise RowwiseError(f"epilogue operand {EPILOGUE_INPUT!r} must be a {s.dtype} tile, "
                               f"is a {x.dtype} {x.kind}")
        if len(ep.outputs) != 1:
            raise RowwiseError(f"epilogue must have one output, has {len(ep.outputs)}")


# ------------------------------------------------------------------------------------------------
# Checking a call's tensors against its spec

@dataclass
class _Call:
    """A call's tensors, reshaped to the kernel's views, and the sizes the kernel needs."""

    spec: RowwiseSpec
    x: torch.Tensor  # [rows, cols], unit column stride
    lead: tuple[int, ...]
    rows: int
    cols: int
    t: dict[str, torch.Tensor]  # every other input, as the kernel reads it
    batch: int  # the largest batch of the per-batch inputs (1 if none)


def _rows_view(t: torch.Tensor, cols: int) -> torch.Tensor:
    t2 = t.reshape(-1, cols)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _check_call(spec: RowwiseSpec, inputs: Sequence[torch.Tensor]) -> _Call:
    names = spec.input_names()
    if len(inputs) != len(names):
        raise RowwiseError(f"spec takes {len(names)} inputs {names}, got {len(inputs)}")
    named = dict(zip(names, inputs, strict=True))
    x = named["x"]
    want = DTYPES[spec.dtype]
    if x.dtype != want:
        raise RowwiseError(f"x is {x.dtype}, the spec says {spec.dtype}")
    if x.dim() == 0:
        raise RowwiseError("x must have at least one dimension")
    cols = x.shape[-1]
    if cols > MAX_COLS:
        raise RowwiseError(f"rows of {cols} values: the template keeps a row in one tile "
                           f"(at most {MAX_COLS})")
    if "nvfp4" in spec.outputs and cols % BLOCK_SIZE:
        raise RowwiseError(f"nvfp4 output needs cols % {BLOCK_SIZE} == 0, got {cols}")
    x2 = _rows_view(x, cols)
    rows = x2.shape[0]
    t: dict[str, torch.Tensor] = {}
    batches: dict[str, int] = {}

    def same_dtype(name: str) -> torch.Tensor:
        v = named[name]
        if v.dtype != want:
            raise RowwiseError(f"{name} is {v.dtype}, the spec's dtype is {spec.dtype} (eager "
                               "would promote the result)")
        return v

    def vec(name: str, v: torch.Tensor) -> torch.Tensor:
        if v.numel() != cols:
            raise RowwiseError(f"{name} has shape {list(v.shape)}, expected [{cols}]")
        return v.reshape(cols).contiguous()

    def per_batch(name: str, v: torch.Tensor) -> torch.Tensor:
        if v.dim() == 0 or v.shape[-1] != cols or (v.dim() >= 2 and math.prod(
                v.shape[1:-1]) != 1):
            raise RowwiseError(f"{name} has shape {list(v.shape)}, expected [B, {cols}] or "
                               f"[B, 1, {cols}]")
        v2 = _rows_view(v, cols)
        if v2.shape[0] == 0 or rows % v2.shape[0]:
            raise RowwiseError(f"{name}: {v2.shape[0]} batch items do not divide {rows} rows")
        batches[name] = v2.shape[0]
        return v2

    for name in spec.input_names()[1:]:
        v = named[name]
        if v.device != x.device:
            raise RowwiseError(f"{name} is on {v.device}, x on {x.device}")
    if spec.residual:
        y = same_dtype("y")
        if y.shape != x.shape:
            raise RowwiseError(f"y has shape {list(y.shape)}, x {list(x.shape)}")
        t["y"] = _rows_view(y, cols)
    if spec.residual_bias:
        t["residual_bias"] = vec("residual_bias", same_dtype("residual_bias"))
    if spec.gate:
        t["gate"] = per_batch("gate", same_dtype("gate"))
    for name in ("weight", "bias"):
        if getattr(spec, name):
            v = named[name]
            if v.dtype not in (want, torch.float32) or (spec.affine_after_round and
                                                        v.dtype != want):
                raise RowwiseError(f"norm {name} is {v.dtype}: expected {spec.dtype}"
                                   + ("" if spec.affine_after_round else " or float32"))
            t[name] = vec(name, v)
    if spec.modulation:
        t["scale"] = per_batch("scale", same_dtype("scale"))
        t["shift"] = per_batch("shift", same_dtype("shift"))
        if t["scale"].shape != t["shift"].shape:
            raise RowwiseError("scale and shift have different batch sizes")
    for o in spec.epilogue_operands():
        name = f"ep_{o.name}"
        v = named[name]
        if v.dtype != DTYPES[o.dtype]:
            raise RowwiseError(f"{name} is {v.dtype}, the epilogue expects {o.dtype}")
        if o.kind == "tile":
            if math.prod(v.shape[:-1]) != rows or v.shape[-1] != cols:
                raise RowwiseError(f"{name} has shape {list(v.shape)}, expected x's")
            t[name] = _rows_view(v, cols)
        elif o.kind == "row":
            if v.numel() != rows:
                raise RowwiseError(f"{name} has {v.numel()} values, expected one per row")
            t[name] = v.reshape(rows).contiguous()
        elif o.kind == "col":
            t[name] = vec(name, v)
        elif o.kind == "batch":
            t[name] = per_batch(name, v)
        else:
            if v.numel() != 1:
                raise RowwiseError(f"{name} has {v.numel()} values, expected one")
            t[name] = v.reshape(1)
    if "nvfp4" in spec.outputs:
        g = named["global_scale"]
        if g.numel() != 1 or g.dtype != torch.float32:
            raise RowwiseError(f"global_scale must be one fp32 value, got {g.dtype} "
                               f"{list(g.shape)}")
        t["global_scale"] = g.reshape(1)
    batch = max([1, *batches.values()])
    for name, b in batches.items():
        if b not in (1, batch):
            raise RowwiseError(f"{name} has {b} batch items, others {batch}")
    return _Call(spec, x2, tuple(x.shape[:-1]), rows, cols, t, batch)


def _allocate(c: _Call) -> dict[str, torch.Tensor]:
    dev, lead, rows, cols = c.x.device, c.lead, c.rows, c.cols
    out: dict[str, torch.Tensor] = {}
    for kind in c.spec.outputs:
        if kind == "out":
            out["out"] = torch.empty((*lead, cols), dtype=c.spec.result_dtype, device=dev)
        elif kind == "residual":
            out["residual"] = torch.empty((*lead, cols), dtype=c.x.dtype, device=dev)
        elif kind == "fp8_row":
            out["fp8_row"] = torch.empty((*lead, cols), dtype=E4M3, device=dev)
            out["fp8_row_scale"] = torch.empty((*lead, 1), dtype=torch.float32, device=dev)
        elif kind == "fp8_group":
            out["fp8_group"] = torch.empty((*lead, cols), dtype=E4M3, device=dev)
            out["fp8_group_scale"] = group_scale_empty(rows, cols, dev)
        else:
            out["nvfp4"] = torch.empty((*lead, cols // 2), dtype=torch.uint8, device=dev)
            out["nvfp4_scale"] = torch.empty(scale_numel(rows, cols), dtype=E4M3, device=dev)
    return out


# ------------------------------------------------------------------------------------------------
# The reference: the unfused eager ops

def rowwise_reference(spec: RowwiseSpec, inputs: Mapping[str, torch.Tensor] | Sequence[
        torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unfused computation of ``spec``, one aten op per step, in the model's order (with
    ``intermediates="fp32"``: the same ops on fp32 values, each output rounded once)."""
    seq = [inputs[n] for n in spec.input_names()] if isinstance(inputs, Mapping) else inputs
    c = _check_call(spec, seq)
    rows, cols, b = c.rows, c.cols, c.batch
    tokens = rows // b
    fp32 = spec.intermediates == "fp32"
    if fp32:  # the epilogue's operands keep their dtypes: its explicit casts read them
        c.x = c.x.float()
        c.t = {k: v if k.startswith("ep_") else v.float() for k, v in c.t.items()}

    def tile(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(b, tokens, cols)

    def per_batch(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(v.shape[0], 1, cols)

    x = tile(c.x)
    h = x
    res: dict[str, torch.Tensor] = {}
    if spec.residual:
        t = tile(c.t["y"])
        if spec.residual_bias:
            t = t + c.t["residual_bias"]
        if spec.gate:
            t = per_batch(c.t["gate"]) * t
        h = (x + t).to(DTYPES[spec.dtype]).to(x.dtype)  # the stream's dtype, in either order
    n = h
    w, bias = c.t.get("weight"), c.t.get("bias")
    if spec.norm == "layer":
        if spec.affine_after_round:
            n = torch.nn.functional.layer_norm(h, [cols], None, None, spec.eps)
        else:
            n = torch.nn.functional.layer_norm(h, [cols], w, bias, spec.eps)
    elif spec.norm == "rms":
        hf = h.float()
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + spec.eps)
        if not spec.affine_after_round:
            n = n * w.float() if w is not None else n
            n = n + bias.float() if bias is not None else n
        n = n.to(h.dtype)
    if spec.norm != "none" and spec.affine_after_round:
        n = n * w if w is not None else n
        n = n + bias if bias is not None else n
    if spec.modulation:
        n = (1 + per_batch(c.t["scale"])) * n + per_batch(c.t["shift"])
    result = n
    if spec.epilogue is not None:
        values = {EPILOGUE_INPUT: n}
        for o in spec.epilogue_operands():
            v = c.t[f"ep_{o.name}"]
            if o.kind == "tile":
                v = tile(v)
            elif o.kind == "row":
                v = v.reshape(b, tokens, 1)
            elif o.kind == "batch":
                v = per_batch(v)
            elif o.kind == "scalar":
                v = v.reshape(())
            values[o.name] = v
        result = spec.epilogue.evaluate(values, fp32=fp32)[0]
    shape = (*c.lead, cols)
    result = result.reshape(shape)
    for kind in spec.outputs:
        if kind == "out":
            res["out"] = result.to(spec.result_dtype)
        elif kind == "residual":
            res["residual"] = h.reshape(shape).to(DTYPES[spec.dtype])
        elif kind == "fp8_row":
            res["fp8_row"], res["fp8_row_scale"] = quant_fp8_rowwise_reference(result)
        elif kind == "fp8_group":
            res["fp8_group"], res["fp8_group_scale"] = quant_fp8_group_reference(result)
        else:
            res["nvfp4"], res["nvfp4_scale"] = quant_nvfp4_reference(result,
                                                                     c.t["global_scale"])
    return res


# ------------------------------------------------------------------------------------------------
# The Triton implementation

_TEMPLATE = '''\
"""Generated by kopt.codegen.rowwise from its template; regenerated when either changes.

Epilogue: {epilogue}
"""
import triton
import triton.language as tl

from kopt.codegen.kernels.nvfp4 import nvfp4_store
from kopt.codegen.kernels.quant_fp8 import (
    fp8_group_store, fp8_rowwise_write, fp8_scale, in_range,
)
{imports}


@triton.jit
def rowwise_kernel(
    x_ptr, y_ptr, rbias_ptr, gate_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, g_ptr,
    out_ptr, res_ptr, q8_ptr, s8_ptr, qg_ptr, sg_ptr, q4_ptr, s4_ptr,{ep_params}
    rows, cols, inv_cols, eps, stride_x, stride_y, stride_gate, tokens_gate,
    stride_scale, stride_shift, tokens_mod,
    XDT: tl.constexpr, RESIDUAL: tl.constexpr, RBIAS: tl.constexpr, GATE: tl.constexpr,
    NORM: tl.constexpr, WEIGHT: tl.constexpr, BIAS: tl.constexpr, AFTER_ROUND: tl.constexpr,
    MODULATION: tl.constexpr, OUT: tl.constexpr, RES_OUT: tl.constexpr,
    FP8_ROW: tl.constexpr, FP8_GROUP: tl.constexpr, NVFP4: tl.constexpr,
    SDT: tl.constexpr, ODT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK2: tl.constexpr, EVEN: tl.constexpr, CUDA: tl.constexpr,
):
    """ROWS rows per program, each row one BLOCK-wide tile in fp32, or two (BLOCK columns,
    then BLOCK2 > 0 more: fewer masked lanes, ``row_split``), whose row reductions are summed;
    NORM: 0 none, 1 layer, 2 rms; XDT: x's dtype; SDT: the dtype every step rounds to (XDT,
    or 0 = fp32: no rounding between steps, the outputs rounded once, to XDT and ODT, the
    result's dtype); dtype codes 0 fp32, 1 bf16, 2 fp16. EVEN: the tiles cover the rows
    exactly (no masks)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = in_range(row, rows, EVEN)
    row64 = row.to(tl.int64)
    col = tl.arange(0, BLOCK)
{pre_a}
    h_a = h
    if BLOCK2 > 0:
        col = BLOCK + tl.arange(0, BLOCK2)
{pre_b}
        h_b = h
    if NORM != 0:
        if NORM == 1:
            total = tl.sum(h_a, axis=1)
            if BLOCK2 > 0:
                total += tl.sum(h_b, axis=1)
            mean = total * inv_cols
            d = tl.where(rmask[:, None] & in_range(tl.arange(0, BLOCK), cols, EVEN)[None, :],
                         h_a - mean[:, None], 0.0)
            squares = tl.sum(d * d, axis=1)
            if BLOCK2 > 0:
                cm = in_range(BLOCK + tl.arange(0, BLOCK2), cols, EVEN)
                d = tl.where(rmask[:, None] & cm[None, :], h_b - mean[:, None], 0.0)
                squares += tl.sum(d * d, axis=1)
        else:
            squares = tl.sum(h_a * h_a, axis=1)
            if BLOCK2 > 0:
                squares += tl.sum(h_b * h_b, axis=1)
        rstd = pw_rsqrt(squares * inv_cols + eps, CUDA)
    col = tl.arange(0, BLOCK)
    h = h_a
{post_a}
    r_a = r
    if BLOCK2 > 0:
        col = BLOCK + tl.arange(0, BLOCK2)
        h = h_b
{post_b}
        r_b = r
    if FP8_ROW:
        amax = tl.max(tl.abs(r_a), axis=1)
        if BLOCK2 > 0:
            amax = tl.maximum(amax, tl.max(tl.abs(r_b), axis=1))
        scale8 = fp8_scale(amax, CUDA)
        fp8_rowwise_write(r_a, scale8, row, rows, tl.arange(0, BLOCK), cols, q8_ptr, EVEN, CUDA)
        if BLOCK2 > 0:
            fp8_rowwise_write(r_b, scale8, row, rows, BLOCK + tl.arange(0, BLOCK2), cols, q8_ptr,
                              EVEN, CUDA)
        tl.store(s8_ptr + row, scale8, mask=rmask)
'''

# One tile of a row, before the norm: x (+ gate * (y + residual bias)) -> h (and the residual
# output). Reads row, rmask, row64, col; defines h, and cmask, mask, out_offs for the tile.
_PRE = """\
cmask = in_range(col, cols, EVEN)
mask = rmask[:, None] & cmask[None, :]
out_offs = row64[:, None] * cols + col[None, :]
h = tl.load(x_ptr + row64[:, None] * stride_x + col[None, :], mask=mask,
            other=0.0).to(tl.float32)
if RESIDUAL:
    t = tl.load(y_ptr + row64[:, None] * stride_y + col[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if RBIAS:
        rb = tl.load(rbias_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        t = pw_round(t + rb[None, :], SDT, CUDA)
    if GATE:
        item = (row // tokens_gate).to(tl.int64)
        gt = tl.load(gate_ptr + item[:, None] * stride_gate + col[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        t = pw_round(gt * t, SDT, CUDA)
    h = pw_round(h + t, SDT, CUDA)
    if SDT != XDT:  # the residual stream is a tensor of x's dtype: the norm reads it so
        h = pw_round(h, XDT, CUDA)
    if RES_OUT:
        tl.store(res_ptr + out_offs, h.to(res_ptr.dtype.element_ty), mask=mask)"""

# One tile after the row's statistics (mean, rstd): the norm's affine, modulation, epilogue,
# and every output but the per-row FP8 one (which needs the whole row's amax); defines r.
_POST = """\
cmask = in_range(col, cols, EVEN)
mask = rmask[:, None] & cmask[None, :]
out_offs = row64[:, None] * cols + col[None, :]
n = h
if NORM != 0:
    if NORM == 1:
        d = tl.where(mask, h - mean[:, None], 0.0)
    else:
        d = h
    n = d * rstd[:, None]
    if AFTER_ROUND:
        n = pw_round(n, SDT, CUDA)
    if WEIGHT:
        w = tl.load(w_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        n = n * w[None, :]
        if AFTER_ROUND:
            n = pw_round(n, SDT, CUDA)
    if BIAS:
        bb = tl.load(b_ptr + col, mask=cmask, other=0.0).to(tl.float32)
        n = n + bb[None, :]
        if AFTER_ROUND:
            n = pw_round(n, SDT, CUDA)
    if not AFTER_ROUND:
        n = pw_round(n, SDT, CUDA)
if MODULATION:
    item = (row // tokens_mod).to(tl.int64)
    sc = tl.load(scale_ptr + item[:, None] * stride_scale + col[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + item[:, None] * stride_shift + col[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    n = pw_round(pw_round(1.0 + sc, SDT, CUDA) * n, SDT, CUDA)
    n = pw_round(n + sh, SDT, CUDA)
{ep_body}
r = tl.where(mask, {result}, 0.0)
if OUT:
    ro = r
    if SDT != XDT and not CUDA:
        ro = pw_round(r, ODT, CUDA)
    tl.store(out_ptr + out_offs, ro.to(out_ptr.dtype.element_ty), mask=mask)
if FP8_GROUP:
    fp8_group_store(r, row, rows, col, cols, qg_ptr, sg_ptr, ROWS, {width}, {c0}, EVEN, CUDA)
if NVFP4:
    nvfp4_store(r, row, rows, col, cols, q4_ptr, s4_ptr, tl.load(g_ptr), ROWS, {width}, {c0},
                EVEN, CUDA)"""

_LOADS = {
    "tile": "tl.load({p}_ptr + row64[:, None] * {p}_stride + col[None, :], mask=mask, "
            "other=0.0).to(tl.float32)",
    "row": "tl.load({p}_ptr + row64, mask=rmask, other=0.0).to(tl.float32)[:, None]",
    "col": "tl.load({p}_ptr + col, mask=cmask, other=0.0).to(tl.float32)[None, :]",
    "batch": "tl.load({p}_ptr + (row // {p}_tokens).to(tl.int64)[:, None] * {p}_stride "
             "+ col[None, :], mask=mask, other=0.0).to(tl.float32)",
    "scalar": "tl.load({p}_ptr).to(tl.float32)",
}


def kernel_source(epilogue: PointwiseProgram | None, round_steps: bool = True) -> str:
    """The generated module for ``epilogue`` (the rest of a spec only sets constexpr flags);
    ``round_steps``: the epilogue rounds after each op (``intermediates="eager"``)."""
    params, body, result = "", [], "n"
    if epilogue is not None:
        names = {EPILOGUE_INPUT: "n"}
        for o in epilogue.operands:
            if o.name == EPILOGUE_INPUT:
                continue
            # parameters ep_<name>_{ptr,stride,tokens}, value ev_<name>: no name can collide
            p = f"ep_{o.name}"
            params += f"\n    {p}_ptr, {p}_stride, {p}_tokens,"
            body.append(f"ev_{o.name} = {_LOADS[o.kind].format(p=p)}")
            names[o.name] = f"ev_{o.name}"
        lines, outs = epilogue.triton_source(names, prefix="e", round_steps=round_steps)
        body += lines
        result = outs[0]
    def post(width: str, c0: str) -> str:
        return _POST.format(ep_body="\n".join(body), result=result, width=width, c0=c0)

    return _TEMPLATE.format(
        epilogue=epilogue.to_json() if epilogue is not None else "none",
        imports=TRITON_IMPORTS, ep_params=params,
        pre_a=textwrap.indent(_PRE, " " * 4), pre_b=textwrap.indent(_PRE, " " * 8),
        post_a=textwrap.indent(post("BLOCK", "0"), " " * 4),
        post_b=textwrap.indent(post("BLOCK2", "BLOCK"), " " * 8),
    )


@functools.lru_cache(maxsize=128)
def _kernel(epilogue_json: str | None, round_steps: bool = True) -> Any:
    ep = None if epilogue_json is None else PointwiseProgram.from_json(epilogue_json)
    source = kernel_source(ep, round_steps)
    return load_generated_module(source, "rowwise").rowwise_kernel


def kernel_for(spec: RowwiseSpec) -> Any:
    """The compiled-on-demand Triton kernel of ``spec`` (shared by specs with one epilogue)."""
    if spec.epilogue is None:
        return _kernel(None)
    return _kernel(spec.epilogue.to_json(), spec.intermediates == "eager")


@dataclass
class Launch:
    """One launch of the generated kernel: what :func:`rowwise_triton` runs (also used to
    compile the kernel ahead of time, e.g. for a target GPU on a machine without one)."""

    kernel: Any
    grid: tuple[int]
    args: list[Any]  # positional, in the kernel's order
    constexprs: dict[str, Any]  # flags, ROWS, BLOCK, BLOCK2, CUDA
    num_warps: int
    outputs: dict[str, torch.Tensor]


class _In(NamedTuple):
    """Where a plan's argument takes the call's input ``name`` (as the kernel views it)."""

    name: str


class _Out(NamedTuple):
    """Where a plan's argument takes the call's output ``name``."""

    name: str


@dataclass(frozen=True)
class _Plan:
    """A launch less the call's tensors: everything fixed by the spec and each input's shape,
    stride, dtype and device, which is all :func:`_check_call` reads -- so a plan made (checks
    included) for one call holds for every call of the same :func:`_plan_key`.

    The kernel reads a tensor argument only as an address and a dtype: an input whose kernel
    view is a view of it (the same address) is passed as it is; one the checks had to copy
    (rows not viewable with unit column stride) is copied again, to the same shape."""

    kernel: Any  # None: nothing to compute (no rows or no columns)
    grid: tuple[int]
    args: tuple[Any, ...]  # the scalars; None where a tensor goes
    input_args: tuple[tuple[int, tuple[int, ...] | None, tuple[int, ...]], ...]
    # ^ (input index, the shape to copy it to or None, the argument positions it fills)
    output_args: tuple[tuple[int, str, bool], ...]  # (argument position, output, as bytes)
    constexprs: dict[str, Any]
    num_warps: int
    allocs: tuple[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    # ^ (output, shape, strides, dtype), in the op's output order
    device: torch.device


def _plan(spec: RowwiseSpec, inputs: Sequence[torch.Tensor],
          rows_per: int | None = None, one_tile: bool = False) -> _Plan:
    """Check the call and work out its launch (``rows_per`` overrides the tiling's choice;
    ``one_tile``: a row in one power-of-two tile even where :func:`row_split` splits it)."""
    c = _check_call(spec, inputs)
    out = _allocate(c)
    allocs = tuple((n, tuple(v.shape), v.stride(), v.dtype) for n, v in out.items())
    rows, cols = c.rows, c.cols
    if rows == 0 or cols == 0:
        return _Plan(None, (0,), (), (), (), {}, 0, allocs, c.x.device)
    min_block = 128 if "fp8_group" in spec.outputs else 64 if "nvfp4" in spec.outputs else 16
    launch_rows = nvfp4_launch_rows(rows) if "nvfp4" in spec.outputs else rows
    _, tiled_rows, warps = row_tiling(cols, launch_rows, min_block)
    block, block2 = row_split(cols, min_block)
    if one_tile or not set(spec.outputs) & QUANTIZED:
        # the split pays off where the quantizers make the kernel instruction-bound; on the
        # H200 (W1/W2 rows; RESULTS.md, 2026-12-01): the FP8-producing specs 10-31% faster
        # split (one, already at copy speed, 1% slower), the bf16-only ones 3% slower to 1% faster
        block, block2 = max(triton.next_power_of_2(cols), min_block), 0
    if block2:
        warps = split_warps(cols * tiled_rows)
    if rows_per is None:
        rows_per = tiled_rows
    elif rows_per < 1 or rows_per & (rows_per - 1):
        raise ValueError(f"rows_per must be a power of two, got {rows_per}")
    kernel = kernel_for(spec)
    x, t = c.x, c.t

    def ptr(name: str) -> _In:
        return _In(name if name in t else "x")  # unused pointers: any tensor

    def o(name: str) -> _Out | _In:
        return _Out(name) if name in out else _In("x")

    ep_args: list[Any] = []
    for op in spec.epilogue_operands():
        v = t[f"ep_{op.name}"]
        stride = v.stride(0) if op.kind in ("tile", "batch") else 0
        tokens = rows // v.shape[0] if op.kind == "batch" else 1
        ep_args += [_In(f"ep_{op.name}"), stride, tokens]
    gate, scale = t.get("gate"), t.get("scale")
    args = [
        _In("x"), ptr("y"), ptr("residual_bias"), ptr("gate"), ptr("weight"), ptr("bias"),
        ptr("scale"), ptr("shift"), ptr("global_scale"),
        o("out"), o("residual"), o("fp8_row"), o("fp8_row_scale"), o("fp8_group"),
        o("fp8_group_scale"), o("nvfp4"), o("nvfp4_scale"), *ep_args,
        rows, cols, 1.0 / cols, float(spec.eps), x.stride(0),
        t["y"].stride(0) if "y" in t else 0,
        gate.stride(0) if gate is not None else 0,
        rows // gate.shape[0] if gate is not None else 1,
        scale.stride(0) if scale is not None else 0,
        t["shift"].stride(0) if "shift" in t else 0,
        rows // scale.shape[0] if scale is not None else 1,
    ]
    constexprs = dict(
        XDT=DT_CODE[spec.dtype], RESIDUAL=spec.residual, RBIAS=spec.residual_bias,
        GATE=spec.gate, NORM=NORMS.index(spec.norm), WEIGHT=spec.weight, BIAS=spec.bias,
        AFTER_ROUND=spec.affine_after_round, MODULATION=spec.modulation,
        OUT="out" in out, RES_OUT="residual" in out, FP8_ROW="fp8_row" in out,
        FP8_GROUP="fp8_group" in out, NVFP4="nvfp4" in out,
        SDT=DT_CODE[spec.dtype] if spec.intermediates == "eager" else 0,
        ODT=DT_CODE[DTYPE_NAMES[spec.result_dtype]], ROWS=rows_per, BLOCK=block,
        BLOCK2=block2,
        EVEN=launch_rows == rows and even_tiles(rows, rows_per, cols, block, block2),
        CUDA=mirror_cuda(kernel, x),
    )
    index = {n: k for k, n in enumerate(spec.input_names())}
    views = {"x": x, **t}
    positions: dict[str, list[int]] = {}
    for i, a in enumerate(args):
        if isinstance(a, _In):
            positions.setdefault(a.name, []).append(i)
    ins = tuple(
        (index[n], None if views[n].data_ptr() == inputs[index[n]].data_ptr()
         else tuple(views[n].shape), tuple(pos))
        for n, pos in positions.items())
    outs = tuple((i, a.name, out[a.name].dtype == E4M3) for i, a in enumerate(args)
                 if isinstance(a, _Out))
    scalars = tuple(None if isinstance(a, _In | _Out) else a for a in args)
    return _Plan(kernel, (triton.cdiv(launch_rows, rows_per),), scalars, ins, outs, constexprs,
                 warps, allocs, x.device)


def split_warps(values: int) -> int:
    """Warps for a program of ``values`` row values held as two tiles: about 48 per thread.
    Swept on the H200 (RESULTS.md, 2026-12-01; LayerNorm + adaLN + FP8 at 12 rows x warps
    tilings, one row per program): W1's 3072-wide rows 22.3 us at 2 warps against 24.4 at the
    one-tile rule's 4, W2's 6144-wide 43.9 us at 4 against 52.0 at 8; the 1x128 variant within
    2% either way."""
    return max(1, min(16, 1 << max(0, (values // (32 * 48)).bit_length() - 1)))


def _plan_key(spec: RowwiseSpec, inputs: Sequence[torch.Tensor]) -> tuple:
    """What a call's plan depends on: the spec and each input's shape, strides, dtype, device."""
    return spec.to_json(), *[(v.shape, v.stride(), v.dtype, v.device) for v in inputs]


# the plans of the calls seen, oldest first; bounded, as dynamic shapes make new keys
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 1024


def _cached_plan(spec: RowwiseSpec, inputs: Sequence[torch.Tensor]) -> _Plan:
    key = _plan_key(spec, inputs)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(spec, inputs)  # raises for a bad call: no key of one is ever stored
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)), None)
        _PLANS[key] = plan
    return plan


def _assemble(plan: _Plan, inputs: Sequence[torch.Tensor], num_warps: int | None) -> Launch:
    """The launch of ``plan`` on this call's tensors, with its outputs freshly allocated."""
    dev = plan.device
    out = {n: torch.empty_strided(shape, strides, dtype=dtype, device=dev)
           for n, shape, strides, dtype in plan.allocs}
    if plan.kernel is None:
        return Launch(None, (0,), [], {}, 0, out)
    args = list(plan.args)
    for k, copy_shape, pos in plan.input_args:
        v = inputs[k] if copy_shape is None else inputs[k].reshape(copy_shape).contiguous()
        for i in pos:
            args[i] = v
    for i, name, as_bytes in plan.output_args:
        args[i] = out[name].view(torch.uint8) if as_bytes else out[name]
    return Launch(plan.kernel, plan.grid, args, dict(plan.constexprs),
                  num_warps or plan.num_warps, out)


def prepare_launch(spec: RowwiseSpec, inputs: Sequence[torch.Tensor], *,
                   num_warps: int | None = None, rows_per: int | None = None,
                   one_tile: bool = False) -> Launch:
    """Check the call, allocate its outputs and build the kernel's arguments (``kernel`` is None
    when there is nothing to compute: no rows or no columns). ``num_warps``, ``rows_per``
    (rows per program, a power of two) and ``one_tile`` (no row split) override the tiling's
    choice (benchmarks sweep them).

    The checks and everything else that depends only on the spec and the inputs' shapes,
    strides, dtypes and devices run once per such key (a :class:`_Plan`, cached); a call of a
    known key only allocates its outputs and places its tensors (eager models launch hundreds
    of these per step and are bound by the host)."""
    plan = (_cached_plan(spec, inputs) if rows_per is None and not one_tile
            else _plan(spec, inputs, rows_per, one_tile))
    return _assemble(plan, inputs, num_warps)


def _run(launch: Launch) -> None:
    # fp fusion off: a * b + c must round twice, as the unfused kernels do
    triton_launch(launch.kernel, launch.grid, *launch.args, **launch.constexprs,
                  num_warps=launch.num_warps, enable_fp_fusion=False)


def rowwise_triton(spec: RowwiseSpec, inputs: Sequence[torch.Tensor], *,
                   num_warps: int | None = None,
                   rows_per: int | None = None, one_tile: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Run ``spec`` with its Triton kernel (on CUDA, or on CPU tensors in the interpreter).
    ``num_warps``, ``rows_per`` and ``one_tile`` override the tiling's choice (for benchmarks
    sweeping it)."""
    launch = prepare_launch(spec, inputs, num_warps=num_warps, rows_per=rows_per,
                            one_tile=one_tile)
    if launch.kernel is None:
        return launch.outputs
    x = launch.args[0]
    # Triton launches on the current device; entering torch.cuda.device costs microseconds
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            _run(launch)
    else:
        _run(launch)
    return launch.outputs


# ------------------------------------------------------------------------------------------------
# The op (kopt.codegen.ops: no custom_op layers on the hot path)

def _rowwise_reference_op(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    s = _parse_spec(spec)
    res = rowwise_reference(s, inputs)
    # an output may be an input itself (no step changed it); an op's outputs must not alias
    # its inputs
    taken = {StorageWeakRef(t.untyped_storage()) for t in inputs if t.numel()}
    outs = [res[n] for n in s.output_names()]
    return [o.clone() if o.numel() and StorageWeakRef(o.untyped_storage()) in taken else o
            for o in outs]


def _rowwise_fake(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    s = _parse_spec(spec)
    c = _check_call(s, inputs)
    out = _allocate(c)
    return [out[n] for n in s.output_names()]


def _rowwise_cuda(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    # the outputs are allocated in the op's output order (:func:`_allocate`)
    return list(rowwise_triton(_parse_spec(spec), inputs).values())


rowwise_op = define("rowwise", "(Tensor[] inputs, str spec) -> Tensor[]", _rowwise_reference_op,
                    fake=_rowwise_fake, cuda=_rowwise_cuda)


@fp64_reference(torch.ops.kopt.rowwise.default)
def _rowwise64(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """The verifier's yardstick: the spec's steps on fp64 inputs with no rounding at all (the
    epilogue's casts are identities, the norm's affine order does not matter); quantized outputs
    quantize the exact result with the reference quantizers, as the unfused graph's fp64 run
    quantizes its fp64 values."""
    s = _parse_spec(spec)
    t = dict(zip(s.input_names(), inputs, strict=True))
    x = t["x"]
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    batched = [t[n] for n in ("gate", "scale", "shift") if n in t] + [
        t[f"ep_{o.name}"] for o in s.epilogue_operands() if o.kind == "batch"]
    b = max([1, *(v.numel() // cols for v in batched)]) if rows else 1

    def tile(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(b, rows // b, cols)

    def per_batch(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(-1, 1, cols)

    h = tile(x)
    if s.residual:
        y = tile(t["y"])
        y = y + t["residual_bias"].reshape(cols) if s.residual_bias else y
        h = h + (per_batch(t["gate"]) * y if s.gate else y)
    n = h
    w = t["weight"].reshape(cols) if s.weight else None
    bias = t["bias"].reshape(cols) if s.bias else None
    if s.norm == "layer":
        n = torch.nn.functional.layer_norm(h, [cols], w, bias, s.eps)
    elif s.norm == "rms":
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + s.eps)
        n = n * w if w is not None else n
        n = n + bias if bias is not None else n
    if s.modulation:
        n = (1 + per_batch(t["scale"])) * n + per_batch(t["shift"])
    result = n
    if s.epilogue is not None:
        env: dict[str, Any] = {EPILOGUE_INPUT: n}
        shapes = {"tile": (b, rows // b, cols), "row": (b, rows // b, 1), "col": (cols,),
                  "batch": (-1, 1, cols), "scalar": ()}
        for o in s.epilogue_operands():
            env[o.name] = t[f"ep_{o.name}"].reshape(shapes[o.kind])
        for i, ins in enumerate(s.epilogue.instrs):
            args = [env[a] if isinstance(a, str) else a for a in ins.args]
            env[f"%{i}"] = args[0] if ins.op == "cast" else _EVAL[ins.op](args, torch.float64)
        result = env[s.epilogue.outputs[0]]
    shape = (*x.shape[:-1], cols)
    result = result.reshape(shape)
    out: dict[str, torch.Tensor] = {"out": result, "residual": h.reshape(shape)}
    if "fp8_row" in s.outputs:
        out["fp8_row"], out["fp8_row_scale"] = quant_fp8_rowwise_reference(result)
    if "fp8_group" in s.outputs:
        out["fp8_group"], out["fp8_group_scale"] = quant_fp8_group_reference(result)
    if "nvfp4" in s.outputs:
        out["nvfp4"], out["nvfp4_scale"] = quant_nvfp4_reference(
            result, t["global_scale"].float())
    return [out[name] for name in s.output_names()]


def rowwise(spec: RowwiseSpec, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Call ``kopt::rowwise`` with named inputs (:meth:`RowwiseSpec.input_names`); returns the
    outputs by name (:meth:`RowwiseSpec.output_names`)."""
    names = spec.input_names()
    missing, extra = set(names) - set(inputs), set(inputs) - set(names)
    if missing or extra:
        raise RowwiseError(f"spec takes inputs {names}: missing {sorted(missing)}, unexpected "
                           f"{sorted(extra)}")
    outs = torch.ops.kopt.rowwise([inputs[n] for n in names], spec.to_json())
    return dict(zip(spec.output_names(), outs, strict=True))


def dtype_name(dtype: torch.dtype) -> str:
    """The spec's name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if dtype not in DTYPE_NAMES:
        raise RowwiseError(f"dtype {dtype} is not one of {tuple(DTYPES)}")
    return DTYPE_NAMES[dtype]
