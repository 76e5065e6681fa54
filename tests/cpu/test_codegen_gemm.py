"""The GEMM template under the Triton interpreter: FP8 and BF16, TMA and pointer paths, every
epilogue flag, generated epilogues, on awkward shapes (one row, M and N not multiples of the tile,
K not a multiple of BLOCK_K), against the reference; bad inputs give clear errors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kopt.codegen.gemm import (
    EpilogueOperand,
    GemmEpilogue,
    GemmInputError,
    define_gemm_op,
    gemm,
    gemm_config,
    gemm_configs,
    gemm_reference,
    load_generated_module,
    m_bucket,
    render_kernel_source,
)
from kopt.codegen.kernels.quant_fp8 import quant_fp8_rowwise_reference
from kopt.verify import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")
BF16 = torch.bfloat16

# (M, N, K): one row; M, N not multiples of the 16x32 interpreter tile; K = 1.5 and 2.5 tiles
SHAPES = [(1, 48, 48), (37, 48, 80), (36, 64, 48)]


def fp8_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """e4m3 activation [M, K] and weight.t() [K, N] with their rowwise scales, outputs ~ 1."""
    a, sa = quant_fp8_rowwise_reference(torch.randn(m, k))
    wq, sw = quant_fp8_rowwise_reference(torch.randn(n, k) / k**0.5)
    return a, wq.t(), sa, sw.t()


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a bf16 rounding of the reference, and bitwise equal almost everywhere: the fused
    kernel rounds where the unfused ops do (a flip needs an fp32 accumulation-order tie)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-6)
    assert (out == ref).float().mean().item() >= 0.97


EPILOGUES = {
    # name: (bias dtype | None, activation, gate rows "group" | "full" | None, residual)
    "plain": (None, "none", None, False),
    "bias": (BF16, "none", None, False),
    "bias_fp32_gelu": (torch.float32, "gelu_tanh", None, False),
    "silu": (None, "silu", None, False),
    "gate_residual": (None, "none", "group", True),
    "gate_full": (None, "none", "full", False),
    "residual": (BF16, "none", None, True),
    "all": (BF16, "gelu_tanh", "group", True),
}


def epilogue_operands(m: int, n: int, spec: tuple) -> tuple:
    bias_dtype, act, gate_kind, has_res = spec
    bias = torch.randn(n).to(bias_dtype) if bias_dtype else None
    groups = 3 if m % 3 == 0 else 1
    gate = None
    if gate_kind == "group":
        gate = torch.randn(groups, 1, n, dtype=BF16)  # the model's [B, 1, N]
    elif gate_kind == "full":
        gate = torch.randn(m, n, dtype=BF16)
    residual = torch.randn(m, n, dtype=BF16) if has_res else None
    return bias, gate, residual, act


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("epi", list(EPILOGUES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_epilogues_match_the_reference(shape: tuple, epi: str, use_tma: bool) -> None:
    m, n, k = shape
    a, b, sa, sb = fp8_operands(m, n, k)
    bias, gate, residual, act = epilogue_operands(m, n, EPILOGUES[epi])
    out = gemm(a, b, sa, sb, bias, gate, residual, act, BF16, use_tma=use_tma)
    assert_matches(out, gemm_reference(a, b, sa, sb, bias, gate, residual, act, BF16))
    exact = gemm_reference(a, b, sa, sb, bias, gate, residual, act, BF16, upcast=True)
    assert exact.dtype == torch.float64
    assert relative_error(out, exact) < 2**-7  # bf16 roundings only


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_fp8_gemm_other_output_dtypes(out_dtype: torch.dtype) -> None:
    a, b, sa, sb = fp8_operands(37, 48, 80)
    res = torch.randn(37, 48, dtype=out_dtype)
    out = gemm(a, b, sa, sb, None, None, res, "silu", out_dtype)
    ref = gemm_reference(a, b, sa, sb, None, None, res, "silu", out_dtype)
    torch.testing.assert_close(out, ref, rtol=2**-10, atol=2**-9)


def test_fp8_gemm_tensorwise_scales_and_precise_accumulation() -> None:
    a, b, _, _ = fp8_operands(37, 48, 80)
    sa, sb = torch.tensor(0.5), torch.tensor([[0.25]])
    out = gemm(a, b, sa, sb, fp8_fast_accum=False)
    assert_matches(out, gemm_reference(a, b, sa, sb, None, None, None))


@pytest.mark.parametrize("layout", ["col_tma", "col_pointer", "row_pointer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gemm_matches_the_reference(dtype: torch.dtype, layout: str) -> None:
    m, n, k = 37, 48, 80
    a = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = w.t() if layout.startswith("col") else w.t().contiguous()
    bias = torch.randn(n, dtype=dtype)
    gate, res = torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype)
    out = gemm(a, b, None, None, bias, gate, res, "gelu_tanh", dtype,
               use_tma=layout == "col_tma")
    ref = gemm_reference(a, b, None, None, bias, gate, res, "gelu_tanh", dtype)
    if dtype == BF16:
        assert_matches(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=2**-9, atol=2**-9)


# opcheck's schema test compares fp8 tensors with a multiply that CPU fp8 lacks
FP8_OPCHECK = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_ops_on_cpu_run_the_reference_and_pass_opcheck() -> None:
    a, b, sa, sb = fp8_operands(36, 48, 48)
    bias, gate, res = torch.randn(48, dtype=BF16), torch.randn(3, 48, dtype=BF16), None
    args = (a, b, sa, sb, bias, gate, res, "gelu_tanh", BF16)
    out = torch.ops.kopt.fp8_gemm(*args)
    assert torch.equal(out, gemm_reference(*args))
    torch.library.opcheck(torch.ops.kopt.fp8_gemm.default, args, test_utils=FP8_OPCHECK)
    x, w = torch.randn(36, 48, dtype=BF16), torch.randn(48, 64, dtype=BF16)
    args16 = (x, w, None, None, torch.randn(36, 64, dtype=BF16), "none", BF16)
    assert torch.equal(torch.ops.kopt.bf16_gemm(*args16),
                       gemm_reference(x, w, None, None, *args16[2:]))
    torch.library.opcheck(torch.ops.kopt.bf16_gemm.default, args16)


# y * scale[n] + shift[m, n] (rounded after each op, as eager bf16), then * a per-row value,
# a per-sequence value and a scalar: every operand kind
EPILOGUE = GemmEpilogue(
    lines=(
        "ep_t = _round(y * col_scale, OUT_TY)",
        "ep_t = _round(ep_t + shift, OUT_TY)",
        "ep_t = _round(ep_t * row_w, OUT_TY)",
        "ep_t = _round(ep_t * seq_w, OUT_TY)",
        "y = _round(ep_t * alpha, OUT_TY)",
    ),
    operands=(EpilogueOperand("col_scale", "col"), EpilogueOperand("shift", "full"),
              EpilogueOperand("row_w", "row"), EpilogueOperand("seq_w", "group"),
              EpilogueOperand("alpha", "scalar")),
)


def epilogue_reference(y: torch.Tensor, col_scale: torch.Tensor, shift: torch.Tensor,
                       row_w: torch.Tensor, seq_w: torch.Tensor,
                       alpha: torch.Tensor) -> torch.Tensor:
    return (y * col_scale + shift) * row_w * seq_w * alpha


def epilogue_extra(m: int, n: int) -> list[torch.Tensor]:
    return [torch.randn(n, dtype=BF16), torch.randn(m, n, dtype=BF16),
            torch.randn(m, dtype=BF16), torch.randn(3, n, dtype=BF16),
            torch.tensor([1.5], dtype=BF16)]


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_generated_epilogue_lines_are_spliced_and_match_their_reference(use_tma: bool) -> None:
    m, n, k = 36, 48, 80
    a, b, sa, sb = fp8_operands(m, n, k)
    extra = epilogue_extra(m, n)
    res = torch.randn(m, n, dtype=BF16)
    out = gemm(a, b, sa, sb, None, None, res, "silu", BF16, epilogue=EPILOGUE, extra=extra,
               use_tma=use_tma)
    ref = gemm_reference(a, b, sa, sb, None, None, res, "silu", BF16, epilogue=EPILOGUE,
                         extra=extra, epilogue_reference=epilogue_reference)
    assert_matches(out, ref)


def test_a_repeated_call_reuses_its_launch_and_reads_this_calls_tensors() -> None:
    """The second call of the same shapes takes the cached launch (no checks, no config list):
    it must still read its own operands, including a generated epilogue's; a call whose
    operand differs in dtype, shape or device is checked again."""
    from kopt.codegen import gemm as g

    m, n, k = 36, 48, 80
    g._LAUNCHES.clear()
    outs = []
    for _ in range(2):
        a, b, sa, sb = fp8_operands(m, n, k)
        extra = epilogue_extra(m, n)
        bias, gate, res, act = epilogue_operands(m, n, EPILOGUES["all"])
        out = gemm(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE, extra=extra)
        outs.append(out)
        assert_matches(out, gemm_reference(a, b, sa, sb, bias, gate, res, act, BF16,
                                           epilogue=EPILOGUE, extra=extra,
                                           epilogue_reference=epilogue_reference))
        assert len(g._LAUNCHES) == 1  # made by the first call, reused by the second
    assert not torch.equal(outs[0], outs[1])
    assert next(iter(g._LAUNCHES.values())).direct is None  # the interpreter: Triton's path
    with pytest.raises(GemmInputError, match="bias must be"):
        gemm(a, b, sa, sb, bias.half(), gate, res, act, BF16, epilogue=EPILOGUE, extra=extra)
    with pytest.raises(GemmInputError, match="residual has shape"):
        gemm(a, b, sa, sb, bias, gate, res[:-1], act, BF16, epilogue=EPILOGUE, extra=extra)
    with pytest.raises(GemmInputError, match="is on meta"):
        gemm(a, b, sa, sb, bias.to("meta"), gate, res, act, BF16, epilogue=EPILOGUE,
             extra=extra)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: its launcher writes ``value`` into the output."""

    function, packed_metadata = "fn", b"meta"

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, []

    @property
    def run(self):  # noqa: ANN202 -- like Triton's: a property returning the launcher
        def launch(gx, gy, gz, stream, function, metadata, launch_meta, enter, exit_, *values):
            self.calls.append(((gx, gy, gz), values))
            values[4].fill_(self.value)
        return launch

    def launch_metadata(self, grid, stream, *values):  # noqa: ANN001, ANN201
        return None


@pytest.mark.parametrize("agrees", [True, False], ids=["same-output", "other-output"])
def test_the_direct_launch_is_kept_only_if_it_reproduces_the_tuned_call(
        agrees: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """After a tuned call, gemm() launches the tuned config's compiled kernel directly (CUDA
    only; faked here): its constexprs in the kernel's argument order after the positional ones,
    the grid of the tuned tile, and only if one launch reproduces the tuned call's output."""
    from types import SimpleNamespace

    from kopt.codegen import gemm as g

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    config = SimpleNamespace(all_kwargs=lambda: dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128,
                                                     GROUP_M=8, PERSISTENT=0, num_warps=4))
    names = ["a", "b", "a_desc", "b_desc", "out", "M", "BLOCK_M", "BLOCK_N", "BLOCK_K",
             "GROUP_M", "PERSISTENT", "HAS_BIAS"]
    tuner = SimpleNamespace(best_config=config, fn=SimpleNamespace(arg_names=names))
    launch = g._Launch(100, 70, False, tuner, None,
                       lambda meta: (-(-100 // meta["BLOCK_M"]) * -(-70 // meta["BLOCK_N"]),),
                       (100,), {"HAS_BIAS": True})
    out = torch.full((100, 70), 3.0)
    args = [torch.zeros(1), torch.zeros(1), None, None, out, 100]
    compiled = _FakeCompiled(3.0 if agrees else 4.0)
    direct = g._direct_launch(launch, compiled, args)
    (grid, values), = compiled.calls  # launched once, into an output of its own
    assert values[4] is not out and grid == (2 * 3, 1, 1)
    assert values[6:] == (64, 32, 128, 8, 0, True)
    if not agrees:
        assert direct is None  # the autotuner's path stays, and the log says why
        assert "gave other values than Triton's launch" in caplog.text
        return
    assert direct is not None and direct.grid == (6, 1, 1) and direct.boxes == ([64, 128],
                                                                                [32, 128])
    fresh = torch.empty(100, 70)
    direct([*args[:4], fresh, 100])
    assert (fresh == 3.0).all()


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_persistent_programs_walk_every_tile(use_tma: bool) -> None:
    """3 programs (the interpreter's 'SMs') over 3 x 2 tiles of 16 x 32 (partial ones in both
    directions): every tile written once, with its own epilogue operands."""
    m, n, k = 36, 48, 80
    a, b, sa, sb = fp8_operands(m, n, k)
    extra = epilogue_extra(m, n)
    bias, gate, res, act = epilogue_operands(m, n, EPILOGUES["all"])
    persistent = [gemm_config(16, 32, 32, 2, 1, 4, persistent=True)]
    out = gemm(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE, extra=extra,
               use_tma=use_tma, configs=persistent)
    ref = gemm_reference(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE,
                         extra=extra, epilogue_reference=epilogue_reference)
    assert_matches(out, ref)
    one_tile = gemm(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE, extra=extra,
                    use_tma=use_tma, configs=[gemm_config(16, 32, 32, 2, 1, 4)])
    assert torch.equal(out, one_tile)  # the same tile arithmetic, only scheduled differently


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_split_k_adds_the_partials_once_per_tile_in_a_fixed_order(use_tma: bool,
                                                                  split_k: int) -> None:
    """K = 80 is three 32-wide K tiles: split 2 gives ranges of 2 and 1, split 4 one empty
    range. Only each tile's last split runs the epilogue (every operand, a generated one
    included); the counters are back at zero after the launch, so a second call (and a CUDA
    graph's replay) finds them ready and gives the same bits."""
    from kopt.codegen import gemm as g

    m, n, k = 36, 48, 80
    a, b, sa, sb = fp8_operands(m, n, k)
    extra = epilogue_extra(m, n)
    bias, gate, res, act = epilogue_operands(m, n, EPILOGUES["all"])
    split = [gemm_config(16, 32, 32, 2, 1, 4, split_k=split_k)]
    run = lambda: gemm(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE,  # noqa: E731
                       extra=extra, use_tma=use_tma, configs=split)
    out = run()
    ref = gemm_reference(a, b, sa, sb, bias, gate, res, act, BF16, epilogue=EPILOGUE,
                         extra=extra, epilogue_reference=epilogue_reference)
    assert_matches(out, ref)
    assert torch.equal(run(), out)
    launch = g._plan_launch("kopt::fp8_gemm", a, b, sa, sb, bias, gate, res, act, BF16,
                            EPILOGUE, extra, use_tma, True, split, None, True)
    tiles = 3 * 2  # 36 rows in 16s (a partial tile), 48 columns in 32s
    assert launch.grid(split[0].kwargs) == (tiles * split_k,)
    assert (launch.split_tiles, launch.split_values) == (tiles, tiles * split_k * 16 * 32)
    ws, lock = launch.workspace(a.device)
    assert launch.workspace(a.device)[1] is lock and not lock.any()
    # the tensors of the call above: every tile's counter reset by its last split
    for planned in g._LAUNCHES.values():
        for _, counters in planned.workspaces.values():
            assert not counters.any()


@pytest.mark.parametrize("epi", list(EPILOGUES))
def test_calls_cublas_computes_are_recognised_and_routed_there_once_measured_faster(
        epi: str) -> None:
    """A call ``torch._scaled_mm`` computes too (rowwise scales, at most a bf16 bias, bf16
    out) may run there once cuBLAS is measured faster for its launch key (CUDA only; set by
    hand here): the call then returns _scaled_mm's bits."""
    from kopt.codegen import gemm as g

    m, n, k = 36, 48, 80
    a, b, sa, sb = fp8_operands(m, n, k)
    bias, gate, res, act = epilogue_operands(m, n, EPILOGUES[epi])
    library = epi in ("plain", "bias")
    launch = g._plan_launch("kopt::fp8_gemm", a, b, sa, sb, bias, gate, res, act, BF16, None,
                            (), None, True, None, None, True)
    assert launch.library_form == library
    generated = g._plan_launch("kopt::fp8_gemm", a, b, sa, sb, bias, gate, res, act, BF16,
                               EPILOGUE, epilogue_extra(m, n), None, True, None, None, True)
    assert not generated.library_form
    tensorwise = g._plan_launch("kopt::fp8_gemm", a, b, sa.amax().reshape(1),
                                sb.amax().reshape(1), bias, gate, res, act, BF16, None, (), None,
                                True, None, None, True)
    assert tensorwise.library_form == library
    if not library:
        return
    g._LAUNCHES.clear()
    template = gemm(a, b, sa, sb, bias)
    (planned,) = g._LAUNCHES.values()
    planned.library = True
    routed = gemm(a, b, sa, sb, bias)
    assert torch.equal(routed, torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=BF16))
    assert_matches(template, routed)
    g._LAUNCHES.clear()


def test_split_k_needs_one_program_per_tile() -> None:
    with pytest.raises(ValueError, match="split-K takes one program per tile"):
        gemm_config(64, 64, 128, 8, 4, 4, persistent=True, split_k=2)
    with pytest.raises(ValueError, match="split_k >= 1"):
        gemm_config(64, 64, 128, split_k=0)


def test_define_gemm_op_for_a_generated_epilogue() -> None:
    op = define_gemm_op("kopt_test::gemm_scale_shift", EPILOGUE, epilogue_reference)
    assert define_gemm_op("kopt_test::gemm_scale_shift", EPILOGUE, epilogue_reference) is op
    with pytest.raises(GemmInputError, match="another epilogue"):
        define_gemm_op("kopt_test::gemm_scale_shift", GemmEpilogue(), epilogue_reference)
    m, n, k = 36, 48, 48
    a, b, sa, sb = fp8_operands(m, n, k)
    args = (a, b, sa, sb, None, None, None, "none", BF16, epilogue_extra(m, n))
    out = torch.ops.kopt_test.gemm_scale_shift(*args)
    triton_out = gemm(*args[:-1], epilogue=EPILOGUE, extra=args[-1])
    assert_matches(triton_out, out)
    torch.library.opcheck(torch.ops.kopt_test.gemm_scale_shift.default, args,
                          test_utils=FP8_OPCHECK)


def test_generated_source_is_cached_by_its_hash(tmp_path) -> None:  # noqa: ANN001
    src = render_kernel_source(EPILOGUE)
    assert "ep_t = _round(y * col_scale, OUT_TY)" in src
    assert "col_scale_ptr, col_scale_stride, col_scale_group," in src
    assert src == render_kernel_source(EPILOGUE)
    mod = load_generated_module(src, "gemm_test", tmp_path)
    assert load_generated_module(src, "gemm_test", tmp_path) is mod
    files = list(tmp_path.glob("kopt_gemm_test_*.py"))
    assert len(files) == 1 and files[0].read_text() == src


def test_m_bucket_and_configs() -> None:
    assert [m_bucket(m) for m in (1, 2, 3, 128, 129, 4096, 4224, 4608)] == \
        [1, 2, 4, 128, 256, 4096, 4352, 4608]
    for m in (1, 128, 4224):
        for fp8 in (True, False):
            configs = gemm_configs(m_bucket(m), 3072, 3072, fp8)
            assert configs
            for c in configs:  # 128 bytes of K per tile row, or 64
                assert c.kwargs["BLOCK_K"] * (1 if fp8 else 2) in (64, 128)
                assert c.kwargs["PERSISTENT"] in (0, 1)
    # split-K only where few column tiles run a long K (a decode down projection)
    assert any(c.kwargs["SPLIT_K"] > 1 for c in gemm_configs(1, 4096, 12288, True))
    for m, n, k in ((1, 18432, 3072), (1, 4096, 4096), (128, 4096, 12288)):
        assert all(c.kwargs["SPLIT_K"] == 1 for c in gemm_configs(m, n, k, True))


# --- bad inputs -----------------------------------------------------------------------------

def _fp8_args(**change: object) -> dict:
    a, b, sa, sb = fp8_operands(36, 48, 48)
    args = dict(a=a, b=b, scale_a=sa, scale_b=sb, bias=None, gate=None, residual=None,
                activation="none", out_dtype=BF16)
    args.update(change)
    return args


BAD = {
    "wrong dtype": (dict(a=torch.randn(36, 48, dtype=BF16)), "float8_e4m3fn"),
    "misaligned K": (dict(a=fp8_operands(36, 48, 40)[0], b=fp8_operands(36, 48, 40)[1]),
                     "misaligned K = 40"),
    "shape mismatch": (dict(b=fp8_operands(36, 48, 64)[1]), "shape mismatch"),
    "row-major b": (dict(b=fp8_operands(36, 48, 48)[1].contiguous()), "column-major"),
    "scale size": (dict(scale_a=torch.ones(5, 1)), "scale_a has shape"),
    "scale dtype": (dict(scale_b=torch.ones(1, 48, dtype=BF16)), "scale_b must be float32"),
    "gate dtype": (dict(gate=torch.randn(1, 48)), "gate must have the output dtype"),
    "gate rows": (dict(gate=torch.randn(5, 48, dtype=BF16)), "must divide M = 36"),
    "residual shape": (dict(residual=torch.randn(35, 48, dtype=BF16)), "residual has shape"),
    "bias shape": (dict(bias=torch.randn(47, dtype=BF16)), "bias must have shape"),
    "activation": (dict(activation="relu"), "activation must be one of"),
    "out dtype": (dict(out_dtype=torch.int32), "out_dtype must be one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_give_clear_errors(case: str) -> None:
    change, message = BAD[case]
    args = _fp8_args(**change)
    with pytest.raises(GemmInputError, match=message):
        torch.ops.kopt.fp8_gemm(**args)
    with pytest.raises(GemmInputError, match=message):  # and the Triton launcher says the same
        gemm(**args)


def test_bad_inputs_fail_at_trace_time_too() -> None:
    args = _fp8_args(a=fp8_operands(36, 48, 40)[0], b=fp8_operands(36, 48, 40)[1])
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(GemmInputError, match="misaligned K"):
            torch.ops.kopt.fp8_gemm(**{k: v for k, v in args.items()})


def test_bf16_gemm_rejects_fp8_and_scales() -> None:
    a, b, sa, sb = fp8_operands(36, 48, 48)
    with pytest.raises(GemmInputError, match="bfloat16 or both float16"):
        torch.ops.kopt.bf16_gemm(a, b, None, None, None, "none", BF16)
    x, w = torch.randn(4, 48, dtype=BF16), torch.randn(48, 16, dtype=torch.float16)
    with pytest.raises(GemmInputError, match="bfloat16 or both float16"):
        torch.ops.kopt.bf16_gemm(x, w, None, None, None, "none", BF16)


def test_bad_generated_epilogues_are_rejected() -> None:
    with pytest.raises(GemmInputError, match="do not parse"):
        GemmEpilogue(lines=("y = (",))
    with pytest.raises(GemmInputError, match="used by the template"):
        GemmEpilogue(operands=(EpilogueOperand("acc", "full"),))
    with pytest.raises(GemmInputError, match="used by the template"):
        GemmEpilogue(operands=(EpilogueOperand("gate", "col"),))  # gate_ptr is a parameter
    with pytest.raises(GemmInputError, match="unknown kind"):
        GemmEpilogue(operands=(EpilogueOperand("z", "diagonal"),))  # type: ignore[arg-type]
    a, b, sa, sb = fp8_operands(36, 48, 48)
    with pytest.raises(GemmInputError, match="reads 5 operands; got 0"):
        gemm(a, b, sa, sb, epilogue=EPILOGUE)
