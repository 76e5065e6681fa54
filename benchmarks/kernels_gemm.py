"""kopt's FP8 GEMM template at the W1/W2 GEMM shapes: plain GEMM vs ``torch._scaled_mm``, and the
fused epilogue (bias + GELU, or bias + gated residual) vs ``_scaled_mm`` + the eager elementwise
ops vs ``torch.compile`` of those same ops.

    python -m benchmarks.kernels_gemm --out gemm.json           # from the repo root, on the GPU
    python -m benchmarks.kernels_gemm --only W1 --bf16 --precise --out gemm.json
    python -m benchmarks.kernels_gemm --sweep --out sweep.json   # every tile config, untuned
    python -m benchmarks.kernels_gemm --blockwise --only W1 --out bw.json

Shapes come from diffusers' transformer_qwenimage.py / transformer_flux2.py at 1024x1024, batch 1:
- W1 Qwen-Image: dim 3072 (24 heads x 128), 4096 image + 128 text tokens, separate image/text
  weights; merged QKV 3072 -> 9216 (bias), out-proj 3072 -> 3072 (bias, then
  ``x + gate * y``), MLP 3072 -> 12288 (bias, GELU tanh) -> 3072 (bias, then ``x + gate * y``),
  modulation ``Linear(3072, 6 * 3072)`` on one row (bias); the 4224 rows of a joint
  image + text GEMM are listed too.
- W2 FLUX.2: dim 6144 (48 x 128), 4096 image + 512 text tokens, no biases; double blocks:
  QKV 6144 -> 18432, out-proj 6144 -> 6144 (gated residual), FF 6144 -> 2 x 18432 (SwiGLU, not
  fused here) -> 6144 (gated residual); single blocks on 4608 tokens: 6144 -> 3 x 6144 +
  2 x 18432 = 55296, out 24576 -> 6144 (gated residual); modulation 6144 -> 36864 / 18432.
- W3 Qwen3-8B decode (``--only W3``): one token through the merged QKV 4096 -> 6144, o_proj,
  merged gate/up 4096 -> 24576 and down 12288 -> 4096, no biases.

``--blockwise``: the blockwise recipe (1x128 activation groups x 128x128 weight blocks): the
template's blockwise GEMM at each of its configs against cuBLAS's (``kopt::fp8_blockwise_mm``,
``F.scaled_mm``); where the GEMM is followed by bias + GELU (the MLP up projection), the GEMM
with the activation and the next GEMM's 1x128 quantization in its epilogue
(``kopt::fp8_blockwise_gemm_act_quant``) against cuBLAS + ``kopt::act_quant_fp8_group``.

Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays (``--no-graph``: plain
launches) of one call per input set; input sets rotate (distinct random operands, like distinct
layers) until they exceed the L2 cache three times. Autotuning happens in the warm-up call,
before timing. Each row also records kopt's error against the fp64 product and _scaled_mm's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kopt.codegen.gemm import gemm, gemm_reference, tuned_configs
from kopt.codegen.kernels.quant_fp8 import quant_fp8_rowwise_reference
from kopt.verify import relative_error

BF16 = torch.bfloat16
L2_BYTES = 50 * 2**20  # H200


@dataclass(frozen=True)
class Case:
    workload: str
    name: str
    m: int
    n: int
    k: int
    bias: bool
    epilogue: str  # "none" | "gelu" (bias + GELU tanh) | "gate_residual" (res + gate * y)


Q, FX = "W1", "W2"
CASES = [
    Case(Q, "img QKV", 4096, 9216, 3072, True, "none"),
    Case(Q, "img out-proj", 4096, 3072, 3072, True, "gate_residual"),
    Case(Q, "img MLP up", 4096, 12288, 3072, True, "gelu"),
    Case(Q, "img MLP down", 4096, 3072, 12288, True, "gate_residual"),
    Case(Q, "txt QKV", 128, 9216, 3072, True, "none"),
    Case(Q, "txt out-proj", 128, 3072, 3072, True, "gate_residual"),
    Case(Q, "txt MLP up", 128, 12288, 3072, True, "gelu"),
    Case(Q, "txt MLP down", 128, 3072, 12288, True, "gate_residual"),
    Case(Q, "joint QKV", 4224, 9216, 3072, True, "none"),
    Case(Q, "joint out-proj", 4224, 3072, 3072, True, "gate_residual"),
    Case(Q, "joint MLP up", 4224, 12288, 3072, True, "gelu"),
    Case(Q, "joint MLP down", 4224, 3072, 12288, True, "gate_residual"),
    Case(Q, "modulation", 1, 18432, 3072, True, "none"),
    Case(FX, "double img QKV", 4096, 18432, 6144, False, "none"),
    Case(FX, "double img out-proj", 4096, 6144, 6144, False, "gate_residual"),
    Case(FX, "double img FF in", 4096, 36864, 6144, False, "none"),
    Case(FX, "double img FF out", 4096, 6144, 18432, False, "gate_residual"),
    Case(FX, "double txt QKV", 512, 18432, 6144, False, "none"),
    Case(FX, "double txt FF out", 512, 6144, 18432, False, "gate_residual"),
    Case(FX, "single QKV+MLP in", 4608, 55296, 6144, False, "none"),
    Case(FX, "single out", 4608, 6144, 24576, False, "gate_residual"),
    Case(FX, "modulation double", 1, 36864, 6144, False, "none"),
    Case(FX, "modulation single", 1, 18432, 6144, False, "none"),
]
# W3 (Qwen3-8B) decode, one token: merged QKV, o_proj, merged gate/up, down (--only W3)
DECODE = [
    Case("W3", "decode QKV", 1, 6144, 4096, False, "none"),
    Case("W3", "decode o_proj", 1, 4096, 4096, False, "none"),
    Case("W3", "decode gate/up", 1, 24576, 4096, False, "none"),
    Case("W3", "decode down", 1, 4096, 12288, False, "none"),
]


@dataclass
class Inputs:
    a: torch.Tensor
    b: torch.Tensor  # [K, N] column-major: the w_q.t() view
    sa: torch.Tensor
    sb: torch.Tensor
    bias: torch.Tensor | None
    gate: torch.Tensor | None  # [1, N]: batch 1
    res: torch.Tensor | None
    x16: torch.Tensor  # the bf16 activation and weight the FP8 operands were quantized from
    w16: torch.Tensor


def make_inputs(c: Case, g: torch.Generator) -> Inputs:
    x = torch.randn(c.m, c.k, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(c.n, c.k, device="cuda", dtype=BF16, generator=g) / c.k**0.5
    a, sa = quant_fp8_rowwise_reference(x)
    wq, sw = quant_fp8_rowwise_reference(w)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=BF16, generator=g)
    gated = c.epilogue == "gate_residual"
    return Inputs(a, wq.t(), sa, sw.t(), rand(c.n) if c.bias else None,
                  rand(1, c.n) if gated else None, rand(c.m, c.n) if gated else None, x, w)


def activation(c: Case) -> str:
    return "gelu_tanh" if c.epilogue == "gelu" else "none"


def unfused(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
            bias: torch.Tensor | None, gate: torch.Tensor | None, res: torch.Tensor | None,
            act: str) -> torch.Tensor:
    """What the graph runs today: ``_scaled_mm`` then the eager elementwise ops (the baseline,
    eager and under torch.compile; gemm_reference computes the same on CUDA)."""
    y = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=BF16)
    if act == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if gate is not None:
        y = res + gate * y
    return y


def time_ms(fn: Callable[[Inputs], object], sets: list[Inputs], graph: bool) -> float:
    """Median ms of one call, over rotating input sets."""
    def run() -> None:
        for s in sets:
            fn(s)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: autotuning, compilation, allocator
        run()
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if not graph:
        return do_bench(run, return_mode="median") / len(sets)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    ms = do_bench(g.replay, return_mode="median") / len(sets)
    del g
    return ms


def n_sets(c: Case) -> int:
    per_set = c.m * c.k + c.n * c.k + 2 * c.m * c.n * (2 if c.epilogue == "gate_residual" else 1)
    return max(1, min(8, math.ceil(3 * L2_BYTES / per_set)))


def bench_case(c: Case, args: argparse.Namespace, g: torch.Generator) -> dict:
    sets = [make_inputs(c, g) for _ in range(n_sets(c))]
    act = activation(c)
    flop = 2 * c.m * c.n * c.k
    tflops = lambda ms: flop / (ms * 1e-3) / 1e12
    row: dict = {**asdict(c), "input_sets": len(sets)}

    kopt = lambda s: torch.ops.kopt.fp8_gemm(s.a, s.b, s.sa, s.sb, s.bias, None, None, "none",
                                             BF16)
    lib = lambda s: torch._scaled_mm(s.a, s.b, s.sa, s.sb, bias=s.bias, out_dtype=BF16)
    row["kopt_ms"] = time_ms(kopt, sets, args.graph)
    row["scaled_mm_ms"] = time_ms(lib, sets, args.graph)
    row["kopt_tflops"] = tflops(row["kopt_ms"])
    row["scaled_mm_tflops"] = tflops(row["scaled_mm_ms"])
    row["kopt_over_scaled_mm"] = row["kopt_ms"] / row["scaled_mm_ms"]
    gbytes = (c.m * c.k + c.n * c.k + 2 * c.m * c.n) / 1e9
    row["kopt_GBps"] = gbytes / (row["kopt_ms"] * 1e-3)
    s = sets[0]
    exact = gemm_reference(s.a, s.b, s.sa, s.sb, s.bias, None, None, upcast=True)
    row["kopt_err"] = relative_error(kopt(s), exact)
    row["scaled_mm_err"] = relative_error(lib(s), exact)
    if args.precise:
        precise = lambda s: gemm(s.a, s.b, s.sa, s.sb, s.bias, fp8_fast_accum=False)
        row["kopt_precise_ms"] = time_ms(precise, sets, args.graph)
        row["kopt_precise_err"] = relative_error(precise(s), exact)
    if args.bf16:
        k16 = lambda s: torch.ops.kopt.bf16_gemm(s.x16, s.w16.t(), s.bias, None, None, "none",
                                                 BF16)
        t16 = lambda s: F.linear(s.x16, s.w16, s.bias)
        row["kopt_bf16_ms"] = time_ms(k16, sets, args.graph)
        row["torch_bf16_ms"] = time_ms(t16, sets, args.graph)
        row["kopt_bf16_tflops"] = tflops(row["kopt_bf16_ms"])
        row["torch_bf16_tflops"] = tflops(row["torch_bf16_ms"])

    if c.epilogue != "none" and args.epilogues:
        fused = lambda s: torch.ops.kopt.fp8_gemm(s.a, s.b, s.sa, s.sb, s.bias, s.gate, s.res,
                                                  act, BF16)
        eager = lambda s: unfused(s.a, s.b, s.sa, s.sb, s.bias, s.gate, s.res, act)
        torch._dynamo.reset()
        compiled_fn = torch.compile(unfused, dynamic=False)
        compiled = lambda s: compiled_fn(s.a, s.b, s.sa, s.sb, s.bias, s.gate, s.res, act)
        row["fused_ms"] = time_ms(fused, sets, args.graph)
        row["eager_ms"] = time_ms(eager, sets, args.graph)
        try:
            row["compiled_ms"] = time_ms(compiled, sets, args.graph)
        except Exception as e:  # noqa: BLE001 -- recorded, the other columns stand
            row["compiled_ms"] = None
            row["compiled_error"] = f"{type(e).__name__}: {e}"[:300]
        row["eager_over_fused"] = row["eager_ms"] / row["fused_ms"]
        if row["compiled_ms"]:
            row["compiled_over_fused"] = row["compiled_ms"] / row["fused_ms"]
        ex = gemm_reference(s.a, s.b, s.sa, s.sb, s.bias, s.gate, s.res, act, upcast=True)
        row["fused_err"] = relative_error(fused(s), ex)
        row["eager_err"] = relative_error(eager(s), ex)
    del sets
    torch.cuda.empty_cache()
    return row


def sweep_configs(m: int) -> list:
    """Every FP8 tile config worth timing at M rows: the default lists of every bucket, each
    also persistent, deeper pipelines for the small tiles, and split-K up to M = 1024."""
    from kopt.codegen.gemm import gemm_config

    base = {(64, 64, 128, 8, 4, 4), (64, 128, 128, 8, 4, 4), (128, 64, 128, 8, 4, 4),
            (128, 128, 128, 8, 4, 8), (64, 256, 128, 8, 4, 4), (128, 256, 128, 8, 3, 8),
            (64, 64, 128, 8, 6, 4), (128, 64, 128, 8, 6, 4), (64, 32, 128, 8, 6, 4),
            (64, 64, 128, 8, 8, 4), (64, 32, 128, 8, 8, 4), (128, 32, 128, 8, 6, 4),
            (128, 32, 128, 8, 8, 4), (128, 64, 128, 8, 8, 4), (128, 128, 128, 8, 5, 8)}
    if m > 1024:
        base = {(128, 256, 128, 8, 3, 8), (128, 256, 128, 8, 4, 8), (256, 128, 128, 8, 3, 8),
                (256, 128, 128, 8, 4, 8), (128, 128, 128, 8, 4, 4), (128, 128, 128, 8, 5, 8),
                (128, 256, 64, 8, 5, 8), (128, 128, 128, 8, 4, 8)}
    elif m <= 64:
        base |= {(64, bn, 128, 1, s, 4) for bn in (32, 64, 128) for s in (4, 6)}
    split = []
    if m <= 1024:  # split-K: more programs over the few row tiles of a skinny GEMM
        split = [gemm_config(bm, bn, 128, 8, stages, warps, split_k=s)
                 for bm, bn, stages, warps in ((64, 64, 6, 4), (64, 128, 4, 4), (128, 64, 4, 4),
                                               (128, 128, 4, 8), (128, 256, 3, 8),
                                               (64, 256, 4, 4))
                 for s in (2, 3, 4, 6)]
    return [gemm_config(*c, persistent=p) for c in sorted(base) for p in (False, True)] + split


def sweep_case(c: Case, g: torch.Generator) -> dict:
    """The plain FP8 GEMM timed at every config of :func:`sweep_configs`, against
    ``_scaled_mm`` in the same process."""
    sets = [make_inputs(c, g) for _ in range(n_sets(c))]
    lib = lambda s: torch._scaled_mm(s.a, s.b, s.sa, s.sb, bias=s.bias, out_dtype=BF16)
    row: dict = {**asdict(c), "input_sets": len(sets), "scaled_mm_ms": time_ms(lib, sets, True)}
    exact = gemm_reference(sets[0].a, sets[0].b, sets[0].sa, sets[0].sb, sets[0].bias, None,
                           None, upcast=True)
    timed = []
    for cfg in sweep_configs(c.m):
        run = lambda s, cfg=cfg: gemm(s.a, s.b, s.sa, s.sb, s.bias, configs=[cfg])
        try:
            ms = time_ms(run, sets, True)
            err = relative_error(run(sets[0]), exact)
        except Exception as e:  # noqa: BLE001 -- a config the compiler refuses: recorded
            timed.append({"config": str(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        timed.append({"config": str(cfg), "ms": ms, "err": err})
    row["configs"] = sorted(timed, key=lambda t: t.get("ms", float("inf")))
    best = row["configs"][0]
    row["best_ms"], row["best_config"] = best.get("ms"), best["config"]
    if row["best_ms"]:
        row["best_over_scaled_mm"] = row["best_ms"] / row["scaled_mm_ms"]
    del sets
    torch.cuda.empty_cache()
    return row


@dataclass
class BlockInputs:
    a: torch.Tensor  # [M, K] e4m3, 1x128 groups
    sa: torch.Tensor  # [M, K / 128], strides (1, M)
    w: torch.Tensor  # [N, K] e4m3, 128x128 blocks
    sw: torch.Tensor  # [N / 128, K / 128]
    bias: torch.Tensor | None


def blockwise_case(c: Case, g: torch.Generator) -> dict:
    """The blockwise recipe's GEMM (and its MLP up projection's act + quant) timed as the
    module docstring says, each template config on its own and autotuned."""
    from kopt.codegen.gemm import QuantOut, _blockwise_configs, m_bucket
    from kopt.codegen.kernels.fp8_blockwise import quant_fp8_block128_reference
    from kopt.codegen.kernels.quant_fp8 import quant_fp8_group_reference

    def inputs() -> BlockInputs:
        x = torch.randn(c.m, c.k, device="cuda", dtype=BF16, generator=g)
        w = torch.randn(c.n, c.k, device="cuda", dtype=BF16, generator=g) / c.k**0.5
        bias = torch.randn(c.n, device="cuda", dtype=BF16, generator=g) if c.bias else None
        return BlockInputs(*quant_fp8_group_reference(x), *quant_fp8_block128_reference(w),
                           bias)

    sets = [inputs() for _ in range(n_sets(c))]
    lib = lambda s: torch.ops.kopt.fp8_blockwise_mm(s.a, s.sa, s.w, s.sw, BF16)
    ours = lambda s: torch.ops.kopt.fp8_blockwise_gemm(s.a, s.sa, s.w, s.sw, None, BF16)
    flop = 2 * c.m * c.n * c.k
    row: dict = {**asdict(c), "input_sets": len(sets), "cublas_ms": time_ms(lib, sets, True),
                 "kopt_ms": time_ms(ours, sets, True)}
    row["cublas_tflops"] = flop / (row["cublas_ms"] * 1e-3) / 1e12
    row["kopt_tflops"] = flop / (row["kopt_ms"] * 1e-3) / 1e12
    row["kopt_over_cublas"] = row["kopt_ms"] / row["cublas_ms"]
    s = sets[0]
    exact = gemm_reference(s.a, s.w.t(), s.sa, s.sw, None, None, None, blockwise=True,
                           upcast=True)
    row["kopt_err"] = relative_error(ours(s), exact)
    row["cublas_err"] = relative_error(lib(s), exact)
    timed = []
    for cfg in _blockwise_configs(m_bucket(c.m), False):
        run = lambda s, cfg=cfg: gemm(s.a, s.w.t(), s.sa, s.sw, blockwise=True, configs=[cfg])
        try:
            timed.append({"config": str(cfg), "ms": time_ms(run, sets, True)})
        except Exception as e:  # noqa: BLE001 -- a config the compiler refuses: recorded
            timed.append({"config": str(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
    row["configs"] = sorted(timed, key=lambda t: t.get("ms", float("inf")))
    if c.epilogue == "gelu":
        act = "gelu_tanh:fast"
        unfused_aq = lambda s: torch.ops.kopt.act_quant_fp8_group(lib(s), None, act, s.bias,
                                                                   None, True)
        fused = lambda s: torch.ops.kopt.fp8_blockwise_gemm_act_quant(s.a, s.sa, s.w, s.sw,
                                                                      s.bias, act, BF16)
        y0 = lib(s)  # act + quant alone, on one GEMM output
        row["act_quant_ms"] = time_ms(
            lambda s: torch.ops.kopt.act_quant_fp8_group(y0, None, act, s.bias, None, True),
            sets[:1], True)
        del y0
        row["unfused_ms"] = time_ms(unfused_aq, sets, True)
        row["fused_ms"] = time_ms(fused, sets, True)
        row["unfused_over_fused"] = row["unfused_ms"] / row["fused_ms"]
        # given the template's own GEMM output, the fused quantization is act + quant's
        y = gemm(s.a, s.w.t(), s.sa, s.sw, blockwise=True)
        q_ref, s_ref = torch.ops.kopt.act_quant_fp8_group(y, None, act, s.bias, None, True)
        q, qs = gemm(s.a, s.w.t(), s.sa, s.sw, blockwise=True, quant=QuantOut(act),
                     quant_bias=s.bias)
        row["fused_q_equal"] = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)))
        row["fused_scale_equal"] = bool(torch.equal(qs, s_ref))
    del sets
    torch.cuda.empty_cache()
    return row


def print_blockwise(rows: list[dict]) -> None:
    print(f"\n{'blockwise case':<26} {'cuBLAS us':>9} {'kopt us':>8} {'ratio':>6} "
          f"{'TF cuBLAS/kopt':>15} {'err k/c':>17}  best config")
    for r in rows:
        best = r["configs"][0]
        print(f"{r['workload'] + ' ' + r['name']:<26} {r['cublas_ms'] * 1e3:9.1f} "
              f"{r['kopt_ms'] * 1e3:8.1f} {r['kopt_over_cublas']:6.3f} "
              f"{r['cublas_tflops']:7.0f}/{r['kopt_tflops']:<7.0f} "
              f"{r['kopt_err']:.1e}/{r['cublas_err']:.1e}  {best.get('ms', 0) * 1e3:.1f} "
              f"{best['config']}")
    for r in rows:
        if "fused_ms" in r:
            print(f"{r['workload'] + ' ' + r['name']}: GEMM + act + quant fused "
                  f"{r['fused_ms'] * 1e3:.1f} us, cuBLAS + act_quant_fp8_group "
                  f"{r['unfused_ms'] * 1e3:.1f} us (act + quant alone "
                  f"{r['act_quant_ms'] * 1e3:.1f}): {r['unfused_over_fused']:.3f}x; q equal "
                  f"{r['fused_q_equal']}, scales equal {r['fused_scale_equal']}")


def print_sweep(rows: list[dict], top: int = 4) -> None:
    for r in rows:
        print(f"\n{r['workload']} {r['name']} ({r['m']} x {r['n']} x {r['k']}): _scaled_mm "
              f"{r['scaled_mm_ms'] * 1e3:.1f} us")
        for t in r["configs"][:top]:
            if "ms" in t:
                print(f"  {t['ms'] * 1e3:8.1f} us  {t['ms'] / r['scaled_mm_ms']:5.3f}x  "
                      f"err {t['err']:.1e}  {t['config']}")
        failed = [t for t in r["configs"] if "error" in t]
        if failed:
            print(f"  {len(failed)} configs failed, e.g. {failed[0]['error']}")
    print(f"\n{'case':<26} {'_s_mm us':>8} {'best us':>8} {'ratio':>6}  best config")
    for r in rows:
        print(f"{r['workload'] + ' ' + r['name']:<26} {r['scaled_mm_ms'] * 1e3:8.1f} "
              f"{(r['best_ms'] or 0) * 1e3:8.1f} {r.get('best_over_scaled_mm', 0):6.3f}  "
              f"{r['best_config']}")


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<26} {'M':>5} {'N':>6} {'K':>6} {'kopt ms':>8} {'_s_mm ms':>8} "
          f"{'ratio':>6} {'kopt TF':>7} {'torch TF':>8} {'err k/t':>17}")
    for r in rows:
        print(f"{r['workload'] + ' ' + r['name']:<26} {r['m']:>5} {r['n']:>6} {r['k']:>6} "
              f"{r['kopt_ms']:8.3f} {r['scaled_mm_ms']:8.3f} {r['kopt_over_scaled_mm']:6.3f} "
              f"{r['kopt_tflops']:7.0f} {r['scaled_mm_tflops']:8.0f} "
              f"{r['kopt_err']:.1e}/{r['scaled_mm_err']:.1e}")
    epi = [r for r in rows if "fused_ms" in r]
    if epi:
        print(f"\n{'fused epilogue':<26} {'epilogue':>13} {'fused ms':>8} {'eager ms':>8} "
              f"{'compile ms':>10} {'eager/fused':>11} {'compile/fused':>13}")
        for r in epi:
            comp = f"{r['compiled_ms']:10.3f}" if r["compiled_ms"] else f"{'error':>10}"
            ratio = f"{r['compiled_over_fused']:13.3f}" if r["compiled_ms"] else f"{'-':>13}"
            print(f"{r['workload'] + ' ' + r['name']:<26} {r['epilogue']:>13} "
                  f"{r['fused_ms']:8.3f} {r['eager_ms']:8.3f} {comp} "
                  f"{r['eager_over_fused']:11.3f} {ratio}")
    if any("kopt_bf16_ms" in r for r in rows):
        print(f"\n{'bf16':<26} {'kopt ms':>8} {'torch ms':>8} {'kopt TF':>7} {'torch TF':>8}")
        for r in rows:
            print(f"{r['workload'] + ' ' + r['name']:<26} {r['kopt_bf16_ms']:8.3f} "
                  f"{r['torch_bf16_ms']:8.3f} {r['kopt_bf16_tflops']:7.0f} "
                  f"{r['torch_bf16_tflops']:8.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the rows, tuned configs and versions as JSON")
    p.add_argument("--only", choices=["W1", "W2", "W3"],
                   help="one workload's shapes (W3, the LLM's decode GEMVs, only so)")
    p.add_argument("--case", action="append", default=[],
                   help="substring of case names to run (repeatable)")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="time plain launches instead of CUDA-graph replays")
    p.add_argument("--bf16", action="store_true", help="also kopt bf16_gemm vs F.linear")
    p.add_argument("--precise", action="store_true",
                   help="also FP8 with per-K-tile fp32 promotion (fp8_fast_accum=False)")
    p.add_argument("--no-epilogues", dest="epilogues", action="store_false",
                   help="time the plain GEMM only (no fused-epilogue columns)")
    p.add_argument("--blockwise", action="store_true",
                   help="the blockwise recipe's GEMM and its act + quant epilogue instead")
    p.add_argument("--sweep", action="store_true",
                   help="time the plain FP8 GEMM at every candidate tile config instead "
                        "(no autotuning; the epilogue columns are skipped)")
    args = p.parse_args()
    cases = [c for c in CASES + DECODE if (args.only or c.workload != "W3")
             and (not args.only or c.workload == args.only)
             and (not args.case or any(s in c.name for s in args.case))]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for c in cases:
        print(f"{c.workload} {c.name} ({c.m} x {c.n} x {c.k}, {c.epilogue}) ...", flush=True)
        if args.blockwise and c.m == 1:
            continue  # (cuBLAS's blockwise GEMM pads M to 16 rows)
        rows.append(blockwise_case(c, g) if args.blockwise else
                    sweep_case(c, g) if args.sweep else bench_case(c, args, g))
    (print_blockwise if args.blockwise else print_sweep if args.sweep else print_table)(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": datetime.date.today().isoformat(),
                       "cuda_graph": args.graph, "rows": rows, "tuned": tuned_configs()},
                      f, indent=1)


if __name__ == "__main__":
    main()
