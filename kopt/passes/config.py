"""PassConfig: one field per pass, passed explicitly. Ablation is flipping fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LAYOUTS = ("rowwise", "blockwise")
ACTIVATION_MATHS = ("exact", "fast")
ACCUMULATIONS = ("fast", "exact")


@dataclass(frozen=True)
class FP8Config:
    """How the fp8 pass quantizes: which layout, and which linears are large enough to gain."""

    layout: str = "rowwise"
    """``rowwise``: weights per output channel, activations per token (``torch._scaled_mm``).
    ``blockwise``: weights in 128x128 blocks, activations in 1x128 groups (``F.scaled_mm``'s
    blockwise recipe on CUDA); linears whose features are not multiples of 128 stay as they
    are, with that reason. Blockwise gives an output error below naive FP8's on W1 and W2,
    where rowwise's is above it, at 0.92-0.97x of naive FP8's time against rowwise's 0.86-0.95x
    (its GEMMs are slower, and its GEMM adds no bias: the fused kernels after it do; RESULTS.md,
    2026-11-30, H200)."""

    min_features: int = 1024
    """Linears with fewer input or output features stay as they are (the naive FP8 recipe's
    threshold: below it quantizing costs more than the faster GEMM saves)."""

    intermediates: str = "fp32"
    """How the fused norm kernels (``rowwise_fusion``) compute: ``fp32`` from the residual
    update to the quantizer, each output rounded once (Inductor's order; a lower FP8 output
    error against eager BF16 on W1 and W2: RESULTS.md, 2026-11-30, H200); ``eager``: every
    step rounded to the model's dtype as the unfused ops do (the FP8 values bitwise those of
    the unfused graph, given the norm). See :mod:`kopt.codegen.rowwise`."""

    activation_math: str = "fast"
    """How the fused activation + quantizer (``fuse_act_quant``) computes SiLU and GELU(tanh):
    ``fast``: ``x * sigmoid(v)`` with the GPU's approximate exp and reciprocal, a few fp32 ulp
    from exact, and the quotient by the FP8 scale as a product with its reciprocal (tolerance
    tier; the kernel 1.17-1.65x faster at the W1/W2/W3 image-token shapes, then 1.50-1.65x
    faster again at half the instructions in one pass, with the same output error on W1 and
    W2: RESULTS.md, 2026-11-30 and 2026-12-01, H200); ``exact``: as
    torch's CUDA kernels do (libdevice expf/tanhf, IEEE division; the FP8 values bitwise those
    of the unfused graph). See :mod:`kopt.codegen.kernels.act_quant`."""

    accumulate: str = "fast"
    """How the rowwise FP8 GEMMs accumulate over K: ``fast`` in the tensor cores' own
    accumulator for the whole K loop (``torch._scaled_mm(use_fast_accum=True)``, the recipe
    torchao uses by default; kopt's GEMM template accumulates so too); ``exact``: each partial
    product promoted into an fp32 accumulator (cuBLAS's default; the opt-in template passes
    ``gemm_epilogue`` and ``triton_gemm`` then leave the GEMMs to cuBLAS). Either is checked in
    the bounded tier against the fp64 product (the FP8 rounding of the operands dominates both).
    The default is the one whose end-to-end output error and speed RESULTS.md records; the
    ``blockwise`` layout's GEMM (cuBLAS's 1x128 x 128x128 recipe) accumulates exactly either
    way."""

    def __post_init__(self) -> None:
        if self.accumulate not in ACCUMULATIONS:
            raise ValueError(f"unknown fp8 accumulate {self.accumulate!r}; valid: "
                             f"{', '.join(ACCUMULATIONS)}")
        if self.activation_math not in ACTIVATION_MATHS:
            raise ValueError(f"unknown fp8 activation_math {self.activation_math!r}; valid: "
                             f"{', '.join(ACTIVATION_MATHS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown fp8 layout {self.layout!r}; layouts: {', '.join(LAYOUTS)}")
        from kopt.codegen.rowwise import INTERMEDIATES  # noqa: PLC0415 -- config stays light

        if self.intermediates not in INTERMEDIATES:
            raise ValueError(f"unknown fp8 intermediates {self.intermediates!r}; valid: "
                             f"{', '.join(INTERMEDIATES)}")


@dataclass(frozen=True)
class PassConfig:
    """Which passes run. Every field is a pass of the pipeline in :mod:`kopt.passes.pipeline`."""

    remove_noops: bool = True
    """Drop copies a functional graph has and eager mode does not (eval-mode dropout)."""

    reinplace: bool = True
    """A KV-cache update the capture made functional (a new cache, copied back into the
    buffer) writes into the buffer again, as eager mode does."""

    cse: bool = True
    """Common-subexpression elimination: one node per distinct pure computation."""

    merge_projections: bool = True
    """N >= 2 projections of one activation -> one GEMM over weights concatenated at load. With
    a ``torch.export`` capture the concatenation is packed before the pass is checked: one
    buffer its parameters view, so no check concatenates weights per call (W1's 121
    modulation weights: 12.7 GiB each time) and the FP8 pass quantizes the packed buffer."""

    fp8: FP8Config | None = None
    """Linears -> FP8 GEMMs (lossy: off unless asked for, e.g. ``fp8=FP8Config()``)."""

    fold_weights: bool = True
    """With ``fp8``: the weights' quantization and scale packing evaluated at load right after
    the fp8 pass (``fold_constants``'s work on them), one weight at a time, each BF16 weight
    moved to host memory as soon as its packed copy is stored (``kopt.offload``). The passes
    after it check a graph that reads the packed weights, and the optimization's peak stays
    near the BF16 model's size instead of the model plus its packed copy. Exact: the same ops
    on the same weights (the graph is the one ``fold_constants`` alone would leave)."""

    fp8_large: bool = True
    """With ``fp8``: the linears whose weights are over 1 GiB (W1's 121 modulation weights
    merged: 12.7 GiB) made FP8 in a second round, after ``fold_weights``. Until the weights
    are packed, a check quantizes each weight per call; the FP8 copy of such a weight (6.3 GiB)
    would otherwise sit beside every BF16 weight. Off: those linears stay in the model's
    dtype."""

    absorb_bias: bool = True
    """A bias add after a GEMM (the FP8 linears') moves into the GEMM's epilogue."""

    gemm_epilogue: bool = False
    """The (gated) residual add after an FP8 GEMM runs in kopt's GEMM epilogue. Off until the
    Triton GEMM is measured at parity with cuBLAS on the target shapes (benchmarks/RESULTS.md)."""

    fuse_qk_norm_rope: bool = True
    """q/k RMSNorm + RoPE (+ the text/image concatenation) in one kernel that reads q and k
    strided out of the (merged) projection output."""

    fold_gqa: bool = True
    """Grouped-query attention whose K/V are repeated per query head (``repeat_kv``) -> the
    query heads that share a K/V head folded into its query rows: no copies of K and V."""

    fuse_act_quant: bool = True
    """SwiGLU / GELU(tanh) + the FP8 per-token quantization of the next GEMM's input in one
    kernel (only with ``fp8``)."""

    fuse_act: bool = True
    """SwiGLU (``silu(g) * u``) in one kernel instead of two, and an activation concatenated
    with another tensor (FLUX.2's single-stream blocks, BF16) written beside it with no copy;
    what ``fuse_act_quant`` leaves (no FP8 quantizer after it). Exact. W2 in BF16 on the H200:
    444.0 ms per forward with it, 468.7 without (two runs; RESULTS.md, 2026-11-30)."""

    fuse_allreduce_norm: bool = True
    """Tensor-parallel graphs: the all-reduce of a row-parallel GEMM's partial sums, the
    residual add and the norm after it (+ modulation, FP8 quantization) -> one
    ``kopt::allreduce_residual_norm`` call (symmetric-memory all-reduce on CUDA)."""

    rowwise_fusion: bool = True
    """A norm with the (gated) residual add before it and its adaLN modulation / pointwise ops
    and the next GEMM's FP8 quantization after it -> one ``kopt::rowwise`` kernel."""

    fold_constants: bool = True
    """Evaluate every parameter-only subgraph once at load time (weight pre-packing)."""

    cat_rows: bool = True
    """A concatenation of strided views (the V slices of a merged QKV output joined [text;
    image]) -> ``kopt::cat_rows``, whole-row vector copies instead of ATen's element-wise
    copy (~560 GB/s). Exact. W1 on the H200: 4.4 and 2.0 ms per call saved under CUDA graphs in
    two paired leave-one-out runs (RESULTS.md, 2026-11-30)."""

    gemm_act_quant: bool = False
    """Blockwise FP8 (``FP8Config(layout="blockwise")``): the bias + GELU + 1x128-group
    quantization after a blockwise GEMM (``kopt::act_quant_fp8_group``, the MLP's up
    projection) runs in the epilogue of kopt's blockwise GEMM template, so the GEMM's output is
    never written in bf16 (``kopt::fp8_blockwise_gemm_act_quant``). Off: on the H200, W1's
    image MLP up projection fused took 456.4 us against 332.5 for cuBLAS's blockwise GEMM + the
    separate kernel, the template's blockwise GEMM being 1.36x cuBLAS's time
    (RESULTS.md, 2026-12-03, H200)."""

    triton_gemm: bool = False
    """Every FP8 GEMM left to cuBLAS (rowwise, and blockwise: ``kopt::fp8_blockwise_gemm``)
    runs kopt's autotuned Triton template instead
    (its GEMMs 2.0-2.6% less kernel time than cuBLAS's in W1/W2 replayed from a CUDA graph;
    its accumulation error grows with K, so W2's output error rises from 1.225e-1 to 1.235e-1).
    Replayed from a CUDA graph W1 took 85.5 ms per forward with it, 89.0 without; eager, 123.4
    against 111.3 (two runs on one H200): its launch still costs ~38 us of host time against
    cuBLAS's ~15, so it is off by default (RESULTS.md, 2026-12-01, H200)."""

    hoist: bool | tuple[str, ...] = True
    """Cache work that depends only on conditioning inputs (timestep modulation across a CFG
    pair); found automatically, or a tuple of input names to treat as conditioning too."""

    def replace(self, **changes: object) -> PassConfig:
        unknown = set(changes) - set(self.pass_names())
        if unknown:
            raise ValueError(
                f"unknown pass {sorted(unknown)}; passes are {', '.join(self.pass_names())}"
            )
        return dataclasses.replace(self, **changes)

    @classmethod
    def pass_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def enabled(self) -> tuple[str, ...]:
        return tuple(name for name in self.pass_names() if getattr(self, name))
