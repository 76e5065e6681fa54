"""The row-wise template and the FP8/NVFP4 producers compiled for the GPU, at W1/W2 shapes.

* producers: bitwise equal to their torch references on CUDA; the hardware and the software e4m3
  roundings both equal torch's cast, ties and subnormals included;
* row-wise specs of the ``exact`` tier (prologue, modulation, exact epilogues): every output
  bitwise equal to the unfused eager ops; specs with a norm: within the tolerance tier against an
  fp64 computation, the residual bitwise, the quantized outputs bitwise the reference quantizers
  of the kernel's own result; the fraction of elements that differ from eager is printed.

    pytest -q -m gpu tests/gpu/test_codegen_rowwise_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from benchmarks.kernels_rowwise import near_e4m3_ties
from kopt.codegen.kernels.nvfp4 import (
    e2m1_codes,
    nvfp4_global_scale,
    quant_nvfp4_reference,
    quant_nvfp4_triton,
)
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    E4M3_MAX,
    e4m3_bits,
    quant_fp8_group_reference,
    quant_fp8_group_triton,
    quant_fp8_rowwise_reference,
    quant_fp8_rowwise_triton,
)
from kopt.codegen.pointwise import Instr, Operand, PointwiseProgram, pw_div_by, pw_recip
from kopt.codegen.rowwise import (
    RowwiseSpec,
    dtype_name,
    rowwise,
    rowwise_reference,
    rowwise_triton,
)
from kopt.verify import relative_error
from tests.cpu.test_codegen_quant import _e2m1_kernel, e2m1_probe_values
from tests.cpu.test_codegen_rowwise import (
    ALL_OUTPUTS,
    _bitwise,
    _fp8_steps_apart,
    _fp64,
    _quantized_from_out,
    _ulps,
    _within_tier,
)

pytestmark = pytest.mark.gpu
BF = torch.bfloat16
# (batch, tokens, hidden): W1 Qwen-Image joint 4096 image + 128 text tokens at 3072, its text
# stream alone; W2 FLUX.2 4096 + 512 tokens at 6144 (its MLP hidden is 3 x 6144 = 18432)
W_SHAPES = [(1, 4096 + 128, 3072), (1, 128, 3072), (1, 4096 + 512, 6144), (2, 257, 3072)]
AWKWARD = [(1, 16), (7, 129), (3, 5, 300), (2, 4000), (4224, 3072), (4608, 6144)]


def _cuda(d: dict) -> dict:
    return {k: v.cuda() for k, v in d.items()}


def _inputs(spec: RowwiseSpec, b: int, t: int, c: int, **extra: torch.Tensor) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, spec.dtype)

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (s * torch.randn(*shape, device="cuda", generator=g)).to(dt)

    make = {"x": lambda: r(b, t, c), "y": lambda: r(b, t, c), "residual_bias": lambda: r(c),
            "gate": lambda: r(b, c), "weight": lambda: (1 + r(c, s=0.1).float()).to(dt),
            "bias": lambda: r(c, s=0.1), "scale": lambda: r(b, 1, c, s=0.3),
            "shift": lambda: r(b, c), "global_scale": lambda: torch.tensor([0.003], device="cuda")}
    return {n: extra[n] if n in extra else make[n]() for n in spec.input_names()}


def _run(spec: RowwiseSpec, ins: dict) -> tuple[dict, dict]:
    got = rowwise_triton(spec, [ins[n] for n in spec.input_names()])
    ref = rowwise_reference(spec, ins)
    for n in spec.output_names():
        assert got[n].shape == ref[n].shape and got[n].stride() == ref[n].stride(), n
    return got, ref


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.view(torch.int16) != ref.view(torch.int16)).float().mean().item()
    print(f"{name}: {diff:.2e} of elements differ from eager, max {int(_ulps(got, ref).max())} "
          "ulp")
    return diff


# -- producers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", AWKWARD)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_producers_bitwise_on_cuda(shape: tuple, dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[-1],
                                                           device="cuda")).to(dtype)
    for triton_fn, ref_fn in [(quant_fp8_rowwise_triton, quant_fp8_rowwise_reference),
                              (quant_fp8_group_triton, quant_fp8_group_reference)]:
        q, s = triton_fn(x)
        qr, sr = ref_fn(x)
        assert s.stride() == sr.stride()
        assert _bitwise(q, qr) and torch.equal(s, sr), triton_fn.__name__


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_producers_bitwise_near_e4m3_ties(dtype: torch.dtype) -> None:
    """The quotient x / scale rounded as a division, one ulp wrong in fp32 at a tie would show:
    an inexact ``x * (1 / scale)`` moves ~1% of these values one e4m3 step (the probe
    benchmarks/probes/quant_variants.py measured 27581 of 13 M)."""
    x = near_e4m3_ties(4224, 3072, dtype)
    q, s = quant_fp8_rowwise_triton(x)
    qr, sr = quant_fp8_rowwise_reference(x)
    assert _bitwise(q, qr) and torch.equal(s, sr)
    xg = near_e4m3_ties(4224, 3072, dtype, group=128, seed=1)
    q, s = quant_fp8_group_triton(xg)
    qr, sr = quant_fp8_group_reference(xg)
    assert _bitwise(q, qr) and torch.equal(s, sr)
    spec = RowwiseSpec(dtype_name(dtype), outputs=("fp8_row", "fp8_group"))
    ins = {"x": x}
    got, ref = _run(spec, ins)
    for n in spec.output_names():
        assert _bitwise(got[n], ref[n]), n


@pytest.mark.parametrize("shape", [(1, 16), (7, 144), (130, 64), (4224, 3072), (4608, 6144)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_producer_bitwise_on_cuda(shape: tuple, dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device="cuda") * torch.logspace(-2, 2, shape[-1],
                                                           device="cuda")).to(dtype)
    g = nvfp4_global_scale(x)
    q, s = quant_nvfp4_triton(x, g)
    qr, sr = quant_nvfp4_reference(x, g)
    assert torch.equal(q, qr) and _bitwise(s, sr)


@pytest.mark.parametrize("offset", [8, 16, 1], ids=lambda o: f"col{o}")
def test_nvfp4_producer_bitwise_on_strided_rows(offset: int) -> None:
    """Rows of a wider tensor (stride 200: not 16-byte vectors as Triton sees it), starting
    16-byte aligned or not: the half-group loads without the paired bf16 widening."""
    wide = torch.randn(37, 200, device="cuda").to(BF)
    x = wide[:, offset:offset + 176]
    g = nvfp4_global_scale(x)
    q, s = quant_nvfp4_triton(x, g)
    qr, sr = quant_nvfp4_reference(x, g)
    assert torch.equal(q, qr) and _bitwise(s, sr)


def test_e2m1_code_compiled_is_the_thresholds() -> None:
    """The E2M1 coding by arithmetic, compiled (denormal products, max.f32 on NaN), against
    the reference's thresholds bit for bit."""
    v = e2m1_probe_values("cuda")
    got = torch.empty(v.numel(), dtype=torch.int32, device="cuda")
    _e2m1_kernel[(1,)](v, got, N=v.numel())
    assert torch.equal(got, e2m1_codes(v).int())


def test_custom_ops_dispatch_to_triton_on_cuda() -> None:
    x = torch.randn(4224, 3072, device="cuda", dtype=BF)
    q, s = torch.ops.kopt.quant_fp8_rowwise(x)
    qt, st = quant_fp8_rowwise_triton(x)
    assert _bitwise(q, qt) and torch.equal(s, st)
    q, s = torch.ops.kopt.quant_fp8_group(x)
    assert s.stride() == (1, 4224)
    g = nvfp4_global_scale(x)
    q, s = torch.ops.kopt.quant_nvfp4(x, g)
    qt, st = quant_nvfp4_triton(x, g)
    assert torch.equal(q, qt) and _bitwise(s, st)


@triton.jit
def _e4m3_kernel(v_ptr, hw_ptr, sw_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m)
    tl.store(hw_ptr + offs, e4m3_bits(v, True), mask=m)
    tl.store(sw_ptr + offs, e4m3_bits(v, False), mask=m)


@triton.jit
def _div_kernel(a_ptr, b_ptr, by_ptr, rn_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    b = tl.load(b_ptr + offs, mask=m, other=1.0)
    tl.store(by_ptr + offs, pw_div_by(a, b, pw_recip(b), True), mask=m)
    tl.store(rn_ptr + offs, tl.math.div_rn(a, b), mask=m)


def test_div_by_reciprocal_is_the_ieee_division() -> None:
    """``pw_div_by`` against ``div_rn`` on 16 M fp32 pairs as the quantizers make them
    (divisors over 1e-15..1e4, quotients within +-448, at e4m3 ties, zeros of both signs):
    bitwise in fp32 wherever |a| >= 2^-100, and the same e4m3 value everywhere."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n = 1 << 24
    b = torch.exp(torch.empty(n, device="cuda").uniform_(-34.5, 9.2, generator=g))
    grid = torch.arange(0, 127, dtype=torch.uint8, device="cuda").view(E4M3).float()
    ties = (grid[1:] + grid[:-1]) / 2
    u = torch.empty(n, device="cuda").uniform_(-448, 448, generator=g)
    pick = torch.randint(0, 4, (n,), device="cuda", generator=g)
    tie = ties[torch.randint(0, ties.numel(), (n,), device="cuda", generator=g)]
    u = torch.where(pick == 0, tie, u)
    u = torch.where(pick == 1, u * 1e-30, u)  # tiny quotients
    a = (u.double() * b.double()).float()
    a[::1001], a[1::1001] = 0.0, -0.0
    by, rn = torch.empty_like(a), torch.empty_like(a)
    _div_kernel[(triton.cdiv(n, 1024),)](a, b, by, rn, n, BLOCK=1024, enable_fp_fusion=False)
    normal = a.abs() >= 2.0**-100
    assert torch.equal(by[normal].view(torch.int32), rn[normal].view(torch.int32))
    assert torch.equal(by.clamp(-448, 448).to(E4M3).view(torch.uint8),
                       rn.clamp(-448, 448).to(E4M3).view(torch.uint8))


def test_e4m3_hardware_and_software_rounding_equal_torch() -> None:
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid) & (grid.abs() <= E4M3_MAX)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    rand = torch.randn(1 << 20) * torch.logspace(-5, 2.6, 1 << 20)
    v = torch.cat([grid, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20), rand.clamp(
        -448, 448), torch.tensor([-0.0])]).cuda()
    hw = torch.empty(v.numel(), dtype=torch.uint8, device="cuda")
    sw = torch.empty_like(hw)
    _e4m3_kernel[(triton.cdiv(v.numel(), 1024),)](v, hw, sw, v.numel(), BLOCK=1024)
    want = v.to(E4M3).view(torch.uint8)
    assert torch.equal(hw, want) and torch.equal(sw, want)


# -- the row-wise template ------------------------------------------------------------------------

@pytest.mark.parametrize("b, t, c", W_SHAPES)
def test_exact_specs_bitwise_at_w_shapes(b: int, t: int, c: int) -> None:
    spec = RowwiseSpec("bfloat16", residual=True, residual_bias=True, gate=True,
                       modulation=True, outputs=ALL_OUTPUTS)
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    for n in spec.output_names():
        assert _bitwise(got[n], ref[n]), n


NORM_SPECS = {
    "layernorm+adaln+fp8": RowwiseSpec("bfloat16", norm="layer", eps=1e-6, modulation=True,
                                       outputs=("out", "fp8_row", "fp8_group")),
    "rmsnorm(w, rounded)+fp8": RowwiseSpec("bfloat16", norm="rms", eps=1e-6, weight=True,
                                           affine_after_round=True, outputs=("out", "fp8_row")),
    "rmsnorm(w, fp32)+fp8": RowwiseSpec("bfloat16", norm="rms", eps=1e-6, weight=True,
                                        outputs=("out", "fp8_group")),
    "gated res+layernorm+adaln+all": RowwiseSpec(
        "bfloat16", norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
        outputs=ALL_OUTPUTS),
}


@pytest.mark.parametrize("name", list(NORM_SPECS))
@pytest.mark.parametrize("b, t, c", W_SHAPES)
def test_norm_specs_within_tier_at_w_shapes(name: str, b: int, t: int, c: int) -> None:
    spec = NORM_SPECS[name]
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    if "residual" in got:
        assert _bitwise(got["residual"], ref["residual"])
    _within_tier(got["out"], ref["out"], _fp64(spec, ins))
    _quantized_from_out(spec, ins, got)
    assert _report(f"{name} {b}x{t}x{c}", got["out"], ref["out"]) <= 1e-2


@pytest.mark.parametrize("b, t, c", W_SHAPES)
def test_fp32_intermediates_at_w_shapes(b: int, t: int, c: int) -> None:
    """``intermediates="fp32"`` (Inductor's order) against its reference, torch's fp32 ops on
    CUDA: the residual bitwise (fp32 arithmetic, one rounding); the modulated output within the
    tolerance tier against fp64, differing from the reference on few elements (the norm's
    last-bit differences, several bf16 ulps where ``(1 + scale) * n + shift`` cancels: the
    H200 run of 2026-11-30 saw 4); the FP8 values at most one e4m3 step apart on few values;
    and closer to fp64 than the eager order."""
    kw = dict(norm="layer", eps=1e-6, residual=True, gate=True, modulation=True,
              outputs=("out", "residual", "fp8_row"))
    spec = RowwiseSpec("bfloat16", **kw, intermediates="fp32")
    ins = _inputs(spec, b, t, c)
    got, ref = _run(spec, ins)
    assert _bitwise(got["residual"], ref["residual"])
    exact64 = _fp64(spec, ins)
    _within_tier(got["out"], ref["out"], exact64)
    assert _report(f"fp32 intermediates {b}x{t}x{c}", got["out"], ref["out"]) <= 1e-2
    apart = _fp8_steps_apart(got, ref)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-2
    eager = rowwise_triton(RowwiseSpec("bfloat16", **kw), [ins[n] for n in spec.input_names()])
    e_fp32, e_eager = (relative_error(r["out"], exact64) for r in (got, eager))
    print(f"fp32 intermediates {b}x{t}x{c}: out error vs fp64 {e_fp32:.3e} (eager order "
          f"{e_eager:.3e})")
    assert e_fp32 < 0.8 * e_eager


def _exact_program() -> PointwiseProgram:
    bf, f32 = "bfloat16", "float32"
    return PointwiseProgram(
        (Operand("x", "tile", bf), Operand("u", "tile", bf), Operand("m", "batch", bf),
         Operand("c", "col", f32)),
        (Instr("mul", ("x", "u"), bf), Instr("div", ("%0", 3.0), bf),  # CUDA: * fp32(1/3)
         Instr("div", ("%1", "m"), bf), Instr("abs", ("%2",), bf), Instr("sqrt", ("%3",), bf),
         Instr("add", ("%4", "c"), f32), Instr("square", ("%5",), f32),
         Instr("cast", ("%6",), bf), Instr("sub", (1.0, "%7"), bf)), ("%8",))


@pytest.mark.parametrize("b, t, c", W_SHAPES)
def test_exact_epilogue_bitwise_at_w_shapes(b: int, t: int, c: int) -> None:
    prog = _exact_program()
    assert prog.tier == "exact"
    spec = RowwiseSpec("bfloat16", residual=True, gate=True, epilogue=prog,
                       outputs=("out", "fp8_row"))
    ins = _inputs(spec, b, t, c, ep_u=torch.randn(b, t, c, device="cuda", dtype=BF),
                  ep_m=(torch.rand(b, 1, c, device="cuda") + 0.5).to(BF),
                  ep_c=torch.randn(c, device="cuda"))
    got, ref = _run(spec, ins)
    for n in spec.output_names():
        assert _bitwise(got[n], ref[n]), n


@pytest.mark.parametrize("op", ["exp", "rsqrt", "sigmoid", "tanh", "silu", "gelu_erf",
                                "gelu_tanh"])
def test_transcendental_epilogues_within_one_ulp_of_eager(op: str) -> None:
    prog = PointwiseProgram((Operand("x", "tile", "bfloat16"),),
                            (Instr(op, ("x",), "bfloat16"),), ("%0",))
    spec = RowwiseSpec("bfloat16", epilogue=prog, outputs=("out", "fp8_row"))
    x = torch.randn(4224, 3072, device="cuda", dtype=BF) * 3
    if op == "rsqrt":
        x = x.abs() + 1e-2
    got = rowwise_triton(spec, [x])
    ref = rowwise_reference(spec, {"x": x})
    close = _ulps(got["out"], ref["out"]) <= 1
    if op.startswith("gelu"):
        close |= (got["out"].float() - ref["out"].float()).abs() <= 2.0**-21 * x.float().abs()
    assert close.all()
    _report(f"epilogue {op}", got["out"], ref["out"])
    _quantized_from_out(spec, {}, got)


def test_rowwise_op_on_cuda_graphs_and_compile() -> None:
    spec = NORM_SPECS["layernorm+adaln+fp8"]
    ins = _inputs(spec, 1, 4224, 3072)
    direct = rowwise_triton(spec, [ins[n] for n in spec.input_names()])
    via_op = rowwise(spec, **ins)
    assert all(_bitwise(direct[n], via_op[n]) for n in direct)
    graph = torch.cuda.CUDAGraph()
    rowwise(spec, **ins)  # warm up (compile) outside the capture
    with torch.cuda.graph(graph):
        captured = rowwise(spec, **ins)
    graph.replay()
    assert all(_bitwise(direct[n], captured[n]) for n in direct)
    compiled = torch.compile(lambda **kw: rowwise(spec, **kw), fullgraph=True)
    again = compiled(**ins)
    assert all(_bitwise(direct[n], again[n]) for n in direct)


def test_aten_rms_norm_applies_its_weight_before_rounding() -> None:
    # which affine_after_round a rewrite of aten.rms_norm must use (False, as on the CPU)
    x = torch.randn(4224, 3072, device="cuda", dtype=BF)
    w = (1 + 0.1 * torch.randn(3072, device="cuda")).to(BF)
    eager = torch.nn.functional.rms_norm(x, [3072], w, 1e-6)
    before = rowwise_reference(RowwiseSpec("bfloat16", norm="rms", weight=True),
                               {"x": x, "weight": w})["out"]
    after = rowwise_reference(RowwiseSpec("bfloat16", norm="rms", weight=True,
                                          affine_after_round=True), {"x": x, "weight": w})["out"]
    d_before = _report("aten.rms_norm vs weight in fp32", before, eager)
    d_after = _report("aten.rms_norm vs weight after rounding", after, eager)
    assert int(_ulps(before, eager).max()) <= 1 and d_before < d_after


def test_cached_launch_plans_give_each_call_its_own_result(monkeypatch) -> None:  # noqa: ANN001
    """The launch plan is cached per (spec, shapes, strides, dtypes): a second call of the same
    key on other data, and a strided input the plan copies, compute what a fresh plan does."""
    import kopt.codegen.rowwise as rw

    monkeypatch.setattr(rw, "_PLANS", {})
    spec = NORM_SPECS["layernorm+adaln+fp8"]
    first = _inputs(spec, 1, 4224, 3072)
    second = {**first, "x": first["x"].flip(1).contiguous()}  # same key, other data
    names = spec.input_names()
    got = [rowwise_triton(spec, [ins[n] for n in names]) for ins in (first, second, first)]
    assert len(rw._PLANS) == 1
    for ins, out in zip((first, second, first), got, strict=True):
        rw._PLANS.clear()
        fresh = rowwise_triton(spec, [ins[n] for n in names])
        assert all(_bitwise(fresh[n], out[n]) for n in fresh)
    assert not all(_bitwise(got[0][n], got[1][n]) for n in got[0])
    # x a strided view of a wider buffer, changed in place between calls
    wide = torch.randn(4224, 2 * 3072, device="cuda", dtype=BF)
    strided = {**first, "x": wide[:, :3072].unsqueeze(0)}
    twice = [rowwise_triton(spec, [strided[n] for n in names]) for _ in range(2)]
    wide[:, :3072].add_(torch.randn_like(wide[:, :3072]))  # the next call reads new values
    third = rowwise_triton(spec, [strided[n] for n in names])
    rw._PLANS.clear()
    fresh = rowwise_triton(spec, [strided[n] for n in names])
    assert all(_bitwise(twice[0][n], twice[1][n]) for n in fresh)
    assert all(_bitwise(fresh[n], third[n]) for n in fresh)
    assert not all(_bitwise(twice[0][n], third[n]) for n in fresh)
