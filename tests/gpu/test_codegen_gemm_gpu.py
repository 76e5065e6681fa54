"""The GEMM template on the H200: FP8 against ``torch._scaled_mm`` and BF16 against ``torch.mm``,
both measured against the fp64 product of the same operands, at the W1 (Qwen-Image) GEMM shapes;
fused epilogues against the unfused eager ops; TMA and pointer paths; CUDA graphs, torch.compile.

    pytest -q -m gpu tests/gpu/test_codegen_gemm_gpu.py -s     # -s prints the error table
"""

from __future__ import annotations

import pytest
import torch

from kopt.codegen.gemm import (
    FP8_GEMM_BOUND,
    EpilogueOperand,
    GemmEpilogue,
    gemm,
    gemm_config,
    gemm_reference,
)
from kopt.codegen.kernels.quant_fp8 import quant_fp8_rowwise_reference
from kopt.verify import relative_error

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# one config for numerics-only tests (autotuning every epilogue variant would take minutes)
ONE = [gemm_config(128, 256, 128, 8, 3, 8)]
ONE_BF16 = [gemm_config(128, 256, 64, 8, 3, 8)]
# precise fp8 accumulation keeps a second accumulator: a 128x128 tile leaves registers for it
PRECISE = [gemm_config(128, 128, 128, 8, 3, 8)]

# (M, N, K, bias): W1 image QKV, MLP up, MLP down, joint out-proj, text QKV, modulation GEMV
W1 = [(4096, 9216, 3072, True), (4096, 12288, 3072, True), (4096, 3072, 12288, True),
      (4224, 3072, 3072, False), (128, 9216, 3072, True), (1, 18432, 3072, True)]


def fp8_operands(m: int, n: int, k: int, bias: bool = False, seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=BF16, generator=g) / k**0.5
    a, sa = quant_fp8_rowwise_reference(x)
    wq, sw = quant_fp8_rowwise_reference(w)
    b_ = torch.randn(n, device="cuda", dtype=BF16, generator=g) if bias else None
    return a, wq.t(), sa, sw.t(), b_


def ids(case: tuple) -> str:
    return "x".join(map(str, case[:3])) + ("+bias" if case[3] else "")


@pytest.mark.parametrize("case", W1, ids=ids)
def test_fp8_gemm_matches_scaled_mm_at_w1_shapes(case: tuple,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kopt.codegen import gemm as g

    monkeypatch.setattr(g, "LIBRARY_CHOICE", False)  # the template, not cuBLAS where faster
    m, n, k, has_bias = case
    a, b, sa, sb, bias = fp8_operands(m, n, k, has_bias)
    out = torch.ops.kopt.fp8_gemm(a, b, sa, sb, bias, None, None, "none", BF16)  # autotuned
    lib = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=BF16)
    exact = gemm_reference(a, b, sa, sb, bias, None, None, upcast=True)
    err, err_lib = relative_error(out, exact), relative_error(lib, exact)
    precise = gemm(a, b, sa, sb, bias, fp8_fast_accum=False, configs=PRECISE)
    err_precise = relative_error(precise, exact)
    print(f"\n{ids(case)}: kopt {err:.2e} (precise acc {err_precise:.2e}), "
          f"_scaled_mm {err_lib:.2e} vs fp64")
    assert err <= FP8_GEMM_BOUND
    # promoting each K tile to fp32 is what _scaled_mm(use_fast_accum=False) does
    assert err_precise <= 1.1 * err_lib + 1e-4


def test_fp8_tma_and_pointer_paths_agree() -> None:
    m, n, k = 1000, 1040, 1024  # M, N not multiples of any tile
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    exact = gemm_reference(a, b, sa, sb, bias, None, None, upcast=True)
    for use_tma in (True, False):
        out = gemm(a, b, sa, sb, bias, use_tma=use_tma, configs=ONE)
        assert relative_error(out, exact) <= FP8_GEMM_BOUND, use_tma


@pytest.mark.parametrize("tile", [(128, 256, 128, 8, 3, 8), (64, 64, 128, 8, 4, 4)],
                         ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", [(1000, 1040, 1024), (4224, 3072, 3072), (128, 9216, 3072)],
                         ids=lambda c: "x".join(map(str, c)))
def test_persistent_tiles_equal_one_program_per_tile(shape: tuple, tile: tuple) -> None:
    """The persistent loop computes each tile as the one-tile kernel does (same K order):
    bitwise equal outputs, with the gated residual epilogue, on more tiles than SMs."""
    m, n, k = shape
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda", dtype=BF16)
    one = gemm(a, b, sa, sb, bias, gate, res, configs=[gemm_config(*tile)])
    walked = gemm(a, b, sa, sb, bias, gate, res, configs=[gemm_config(*tile, persistent=True)])
    assert torch.equal(one, walked)


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("tile", [(128, 64, 128, 8, 4, 4), (64, 128, 128, 8, 4, 4)],
                         ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", [(128, 9216, 3072), (1, 18432, 3072), (1000, 1040, 1024)],
                         ids=lambda c: "x".join(map(str, c)))
def test_split_k_is_deterministic_and_within_the_bound(shape: tuple, tile: tuple,
                                                       split_k: int) -> None:
    """Split-K on the GPU: each tile's last split adds the partials in split order, so the
    bits do not depend on which split finishes last (20 launches back to back, each tile's
    counter reset by the one before); the gated residual epilogue runs once per tile; the
    error against fp64 stays within the template's bound, like one program per tile."""
    m, n, k = shape
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda", dtype=BF16)
    configs = [gemm_config(*tile, split_k=split_k)]
    first = gemm(a, b, sa, sb, bias, gate, res, configs=configs)
    outs = [gemm(a, b, sa, sb, bias, gate, res, configs=configs) for _ in range(20)]
    assert all(torch.equal(o, first) for o in outs)
    exact = gemm_reference(a, b, sa, sb, bias, gate, res, upcast=True)
    one = gemm(a, b, sa, sb, bias, gate, res, configs=[gemm_config(*tile)])
    err, err_one = relative_error(first, exact), relative_error(one, exact)
    assert err <= FP8_GEMM_BOUND and err <= 1.5 * err_one + 1e-4, (err, err_one)


def test_split_k_replays_in_a_cuda_graph() -> None:
    """Captured, the split-K launch keeps its workspace and counters: replays on new data
    give what an eager launch gives, bit for bit, replay after replay."""
    m, n, k = 128, 9216, 3072
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    configs = [gemm_config(128, 64, 128, 8, 4, 4, split_k=4)]
    f = lambda: gemm(a, b, sa, sb, bias, configs=configs)  # noqa: E731
    f()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    for seed in (1, 2, 3):
        a2, _, sa2, _, _ = fp8_operands(m, n, k, seed=seed)
        a.copy_(a2)
        sa.copy_(sa2)
        graph.replay()
        torch.testing.assert_close(out, f(), rtol=0, atol=0)


# (bias, activation, gate: "batch" [B, 1, N] | "full" | None, residual)
EPILOGUES = {
    "bias_gelu": (True, "gelu_tanh", None, False),  # Qwen-Image MLP up
    "bias_gate_residual": (True, "none", "batch", True),  # Qwen-Image out-proj / MLP down
    "gate_residual": (False, "none", "batch", True),  # FLUX.2 out-proj / FF down
    "silu_full_gate": (False, "silu", "full", False),
    "all": (True, "gelu_tanh", "batch", True),
}


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_fp8_fused_epilogue_vs_unfused_eager_ops(name: str) -> None:
    has_bias, act, gate_kind, has_res = EPILOGUES[name]
    m, n, k = 2 * 2112, 3072, 3072  # two sequences of 4096 + 128 tokens / 2
    a, b, sa, sb, bias = fp8_operands(m, n, k, has_bias)
    gate = res = None
    if gate_kind == "batch":
        gate = torch.randn(2, 1, n, device="cuda", dtype=BF16)
    elif gate_kind == "full":
        gate = torch.randn(m, n, device="cuda", dtype=BF16)
    if has_res:
        res = torch.randn(m, n, device="cuda", dtype=BF16)
    out = gemm(a, b, sa, sb, bias, gate, res, act, BF16, configs=ONE)
    unfused = gemm_reference(a, b, sa, sb, bias, gate, res, act, BF16)  # _scaled_mm + eager
    exact = gemm_reference(a, b, sa, sb, bias, gate, res, act, BF16, upcast=True)
    err, err_unfused = relative_error(out, exact), relative_error(unfused, exact)
    same = (out == unfused).float().mean().item()
    print(f"\n{name}: fused {err:.2e}, unfused {err_unfused:.2e} vs fp64; "
          f"{same:.1%} bitwise equal to unfused")
    assert err <= 2 * err_unfused + 2**-9


@pytest.mark.parametrize("case", [(4224, 3072, 3072), (128, 12288, 3072), (1, 18432, 3072)],
                         ids=lambda c: "x".join(map(str, c)))
def test_bf16_gemm_matches_torch_mm(case: tuple) -> None:
    m, n, k = case
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=BF16)
    out = torch.ops.kopt.bf16_gemm(x, w.t(), bias, None, None, "none", BF16)
    lib = torch.addmm(bias, x, w.t())
    exact = gemm_reference(x, w.t(), None, None, bias, None, None, upcast=True)
    err, err_lib = relative_error(out, exact), relative_error(lib, exact)
    print(f"\nbf16 {case}: kopt {err:.2e}, torch {err_lib:.2e} vs fp64")
    assert err <= 1.25 * err_lib + 1e-4


def test_bf16_gemm_row_major_b_takes_the_pointer_path() -> None:
    m, n, k = 1000, 1040, 1000
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(k, n, device="cuda", dtype=BF16) / k**0.5  # [K, N] row-major
    res = torch.randn(m, n, device="cuda", dtype=BF16)
    out = gemm(x, w, None, None, None, None, res, "silu", BF16, configs=ONE_BF16)
    exact = gemm_reference(x, w, None, None, None, None, res, "silu", BF16, upcast=True)
    unfused = gemm_reference(x, w, None, None, None, None, res, "silu", BF16)
    assert relative_error(out, exact) <= 2 * relative_error(unfused, exact) + 2**-9


def test_generated_epilogue_on_gpu() -> None:
    ep = GemmEpilogue(lines=("y = _round(_round(y * scale, OUT_TY) + shift, OUT_TY)",),
                      operands=(EpilogueOperand("scale", "col"), EpilogueOperand("shift", "group")))
    m, n, k = 4224, 3072, 3072
    a, b, sa, sb, _ = fp8_operands(m, n, k)
    extra = [torch.randn(n, device="cuda", dtype=BF16),
             torch.randn(2, n, device="cuda", dtype=BF16)]
    out = gemm(a, b, sa, sb, epilogue=ep, extra=extra, configs=ONE)
    kw = dict(epilogue=ep, extra=extra, epilogue_reference=lambda y, s, t: y * s + t)
    exact = gemm_reference(a, b, sa, sb, None, None, None, upcast=True, **kw)
    unfused = gemm_reference(a, b, sa, sb, None, None, None, **kw)
    assert relative_error(out, exact) <= 2 * relative_error(unfused, exact) + 2**-9


def test_fp8_gemm_replays_in_a_cuda_graph_and_compiles() -> None:
    m, n, k = 256, 3072, 3072
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda", dtype=BF16)

    def f(a: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
        return torch.ops.kopt.fp8_gemm(a, b, sa, sb, bias, gate, res, "none", BF16)

    f(a, sa)  # autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(a, sa)
    a2, _, sa2, _, _ = fp8_operands(m, n, k, seed=1)
    a.copy_(a2)
    sa.copy_(sa2)
    graph.replay()
    torch.testing.assert_close(out, f(a2, sa2), rtol=0, atol=0)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(a2, sa2), f(a2, sa2), rtol=0, atol=0)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_direct_launch_equals_the_autotuned_launch(use_tma: bool) -> None:
    """After a shape's first (tuned) call, gemm() launches the tuned kernel directly; on new
    data it computes bit for bit what the autotuner's path computes with that config."""
    from kopt.codegen import gemm as g

    m, n, k = 384, 1536, 1024
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda", dtype=BF16)
    g._LAUNCHES.clear()
    gemm(a, b, sa, sb, bias, gate, res, use_tma=use_tma)
    (launch,) = g._LAUNCHES.values()
    assert launch.direct is not None
    assert launch.use_tma == use_tma
    a2, _, sa2, _, _ = fp8_operands(m, n, k, seed=1)
    direct = gemm(a2, b, sa2, sb, bias, gate, res, use_tma=use_tma)
    tuned = gemm(a2, b, sa2, sb, bias, gate, res, use_tma=use_tma,
                 configs=[launch.kernel.best_config])
    torch.testing.assert_close(direct, tuned, rtol=0, atol=0)
    exact = gemm_reference(a2, b, sa2, sb, bias, gate, res, upcast=True)
    assert relative_error(direct, exact) <= FP8_GEMM_BOUND


@pytest.mark.parametrize("shape", [(128, 9216, 3072), (4096, 9216, 3072)],
                         ids=lambda c: "x".join(map(str, c)))
def test_cublas_runs_a_launch_key_only_where_measured_faster(
        shape: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """A plain (+ bias) FP8 call's launch key times the tuned template against cuBLAS once;
    later calls run the faster one: _scaled_mm's bits where it won, the template's where it
    lost. A gated residual epilogue (no cuBLAS form) always runs the template."""
    from kopt.codegen import gemm as g

    caplog.set_level("INFO", logger="kopt")
    m, n, k = shape
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    g._LAUNCHES.clear()
    gemm(a, b, sa, sb, bias)
    (launch,) = g._LAUNCHES.values()
    assert launch.library_form and launch.direct is not None
    a2, _, sa2, _, _ = fp8_operands(m, n, k, seed=1)
    out = gemm(a2, b, sa2, sb, bias)
    lib = torch._scaled_mm(a2, b, sa2, sb, bias=bias, out_dtype=BF16)
    template = gemm(a2, b, sa2, sb, bias, configs=[launch.kernel.best_config])
    print(f"\n{m}x{n}x{k}: {'cuBLAS' if launch.library else 'template'}; "
          + "; ".join(r.getMessage() for r in caplog.records if "cuBLAS" in r.getMessage()))
    assert torch.equal(out, lib if launch.library else template)
    g._LAUNCHES.clear()
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    gemm(a, b, sa, sb, bias, gate, torch.randn(m, n, device="cuda", dtype=BF16))
    (gated,) = g._LAUNCHES.values()
    assert not gated.library_form and not gated.library


def test_the_tma_template_is_replayed_bitwise_with_its_descriptors_rebuilt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An execution plan's GEMM call replays the tuned template's TMA launch (its host
    descriptors rebuilt around each call's operands), bit for bit the Python launch, on
    operands at other addresses than the recorded call's."""
    from kopt.codegen import gemm as g
    from kopt.codegen.launch import DirectOp
    from kopt.codegen.ops import CUDA_IMPLS

    monkeypatch.setattr(g, "LIBRARY_CHOICE", False)
    m, n, k = 256, 384, 512
    a, b, sa, sb, bias = fp8_operands(m, n, k, True)
    gate = torch.randn(1, n, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda", dtype=BF16)
    op = torch.ops.kopt.fp8_gemm.default
    g._LAUNCHES.clear()
    gemm(a, b, sa, sb, bias, gate, res, fp8=True)  # tunes the launch key
    (launch,) = g._LAUNCHES.values()
    assert launch.use_tma and launch.direct is not None
    direct = DirectOp(op, CUDA_IMPLS[op], "kopt_gemm")
    direct(a, b, sa, sb, bias, gate, res, "none", BF16)
    assert direct.direct, direct.why_not
    # the descriptors' encoding kept per address: b's (a weight) is encoded once
    assert "memo0_0.get" in direct._replay.source, direct._replay.source
    for seed in (1, 2):
        a2, _, sa2, _, _ = fp8_operands(m, n, k, seed=seed)
        res2 = torch.randn(m, n, device="cuda", dtype=BF16)
        got = direct(a2, b, sa2, sb, bias, gate, res2, "none", BF16)
        want = gemm(a2, b, sa2, sb, bias, gate, res2, fp8=True)
        assert torch.equal(got, want)
    memos = [v for k, v in direct._replay.__globals__.items() if k.startswith("memo0_")]
    assert len(memos) == 2 and min(len(m) for m in memos) == 1  # b's: one address
