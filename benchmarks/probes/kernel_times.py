"""Device time of kopt's memory-bound kernels (act + quant, row-wise FP8 and NVFP4, QK-norm +
RoPE, the 1x128 act + quant, ``cat_rows``) at W1/W2/W3 shapes, each replayed from a CUDA graph
over rotating inputs (``kernels_rowwise.device_ms``), with the
fraction of a same-size copy; the kopt package imported is printed first, so that two versions
can be compared in one device call by running this alternately with different ``PYTHONPATH``s:

    PYTHONPATH=/path/to/old/tree python -m benchmarks.probes.kernel_times --tag old
    python -m benchmarks.probes.kernel_times --tag new

(``python -m`` puts the current directory first on ``sys.path``, so the old tree is given by
running the file from it or with ``python -c``; see ``--help``.) ``--inductor`` adds Inductor's
kernel for each subgraph (``torch.compile`` of the unfused reference), timed the same way.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import kopt
from benchmarks.kernels_rowwise import (
    CASES,
    L2_BYTES,
    _nbytes,
    device_ms,
    same_size_copy_gbps,
    workload_shape,
)
from benchmarks.kernels_specialised import ACT_CASES, act_inputs

ACT = ("W1 image MLP, GELU(tanh) fast", "W1 text MLP, GELU(tanh) fast",
       "W2 image FF, SwiGLU fast", "W2 text FF, SwiGLU fast", "W3 Qwen3-8B prefill, SwiGLU fast")
ROWWISE = ("layernorm+adaLN+fp8, fp32 steps", "rmsnorm+fp8", "quant fp8 per token",
           "quant nvfp4")


def _sets(make, moved: int) -> list:  # noqa: ANN001
    """Enough input sets that the graph's calls do not find their inputs in L2."""
    return [make(seed) for seed in range(max(2, -(-4 * L2_BYTES // moved)))]


def _inductor_us(reference, sets: list) -> float | None:  # noqa: ANN001
    """Inductor's kernel(s) for the same subgraph (``torch.compile`` of the unfused reference),
    timed the same way; None (and the reason printed) where it does not compile."""
    try:
        return 1e3 * device_ms(torch.compile(reference, dynamic=False), sets)
    except Exception as exc:  # noqa: BLE001 -- a baseline that fails is reported, not fatal
        print(f"  inductor failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return None


def act_rows(inductor: bool = False) -> list[dict]:
    from kopt.codegen.kernels.act_quant import (
        act_quant_reference,
        act_quant_triton,
        cat_act_quant_reference,
    )

    rows = []
    for case in (c for c in ACT_CASES if c.name in ACT):
        x, up = act_inputs(case)
        # inputs read once, e4m3 values and fp32 row scales written
        moved = (x.numel() * x.element_size() * (2 if up is not None else 1) + x.numel()
                 + 4 * x.shape[1])
        sets = _sets(lambda s, case=case: dict(
            zip(("x", "up"), act_inputs(case, seed=s), strict=True)), moved)
        ms = device_ms(lambda x, up, a=case.activation: act_quant_triton(x, up, a), sets)
        rows.append({"case": case.name, "us": 1e3 * ms, "moved": moved})
        if inductor:
            rows[-1]["inductor_us"] = _inductor_us(
                lambda x, up, a=case.activation: act_quant_reference(x, up, a), sets)
    # FLUX.2's single-stream tail: quant(cat([attention, silu(gate) * up])), W2 widths
    case = next(c for c in ACT_CASES if c.name == "W2 image FF, SwiGLU fast")

    def make(seed: int) -> dict:
        g = torch.Generator(device="cuda").manual_seed(seed)
        merged = (torch.randn(4608, 2 * 18432, generator=g, device="cuda") * 2).bfloat16()
        attn = (torch.randn(4608, 6144, generator=g, device="cuda") * 3).bfloat16()
        return {"x": merged[:, :18432], "up": merged[:, 18432:], "other": attn}

    moved = 4608 * (2 * 18432 * 2 + 6144 * 2 + 18432 + 6144 + 4)
    sets = _sets(make, moved)
    ms = device_ms(lambda x, up, other: act_quant_triton(x, up, case.activation, other=other),
                   sets)
    rows.append({"case": "W2 single-stream cat(attention, SwiGLU) fast", "us": 1e3 * ms,
                 "moved": moved})
    if inductor:
        rows[-1]["inductor_us"] = _inductor_us(
            lambda x, up, other: cat_act_quant_reference(other, x, up, case.activation, True),
            sets)
    return rows


def rowwise_rows(inductor: bool = False) -> list[dict]:
    rows = []
    for wl in ("W1", "W2"):
        n, cols = workload_shape(wl)
        for case in (c for c in CASES if c.name in ROWWISE):
            g = torch.Generator(device="cuda").manual_seed(0)
            one = case.inputs(n, cols, g)
            moved = _nbytes(one) + _nbytes(case.reference(**one))
            sets = [one] + _sets(lambda s, case=case, g=g, n=n, cols=cols: case.inputs(
                n, cols, g), moved)[1:]
            ms = device_ms(case.kopt, sets)
            rows.append({"case": f"{wl} {case.name}", "us": 1e3 * ms, "moved": moved})
            if inductor:
                rows[-1]["inductor_us"] = _inductor_us(case.reference, sets)
    return rows


def other_rows(inductor: bool = False) -> list[dict]:
    """QK-norm + RoPE, the blockwise recipe's act + quant (1x128 groups, W1's bias before the
    GELU) and the joint-V ``cat_rows`` (bytes as in ``kernels_specialised``/``kernels_cat``)."""
    from benchmarks.kernels_cat import NAMES, joint_v
    from benchmarks.kernels_specialised import GROUP_CASES, QK_CASES, act_bytes, qk_bytes, qk_inputs
    from kopt.codegen.kernels.act_quant import FAST
    from kopt.codegen.kernels.act_quant_group import (
        act_quant_group_reference,
        act_quant_group_triton,
    )
    from kopt.codegen.kernels.cat_rows import cat_rows_triton
    from kopt.codegen.kernels.qk_norm_rope import qk_norm_rope_reference, qk_norm_rope_triton

    rows = []

    def add(name: str, fn, reference, sets: list, moved: int) -> None:  # noqa: ANN001
        rows.append({"case": name, "us": 1e3 * device_ms(fn, sets), "moved": moved})
        if inductor:
            rows[-1]["inductor_us"] = _inductor_us(reference, sets)

    for case in QK_CASES:
        kw = dict(eps=1e-6, norm=case.norm, rope=case.rope)
        moved = qk_bytes(qk_inputs(case))
        add(f"QK-norm + RoPE, {case.name}",
            lambda kw=kw, **ins: qk_norm_rope_triton(**ins, **kw),
            lambda kw=kw, **ins: qk_norm_rope_reference(**ins, **kw),
            _sets(lambda s, case=case: qk_inputs(case, seed=s), moved), moved)
    for case in GROUP_CASES:
        x, up = act_inputs(case)
        bias = None if up is not None else torch.randn(x.shape[-1], device="cuda").to(x.dtype)
        n = x.shape[-1]
        r = x.numel() // n
        moved = act_bytes(x, up) - 4 * r + 4 * r * -(-n // 128) + (
            bias.numel() * 2 if bias is not None else 0)
        sets = _sets(lambda s, case=case, bias=bias: dict(
            zip(("x", "up"), act_inputs(case, seed=s), strict=True), bias=bias), moved)
        exact = case.activation.removesuffix(FAST)  # the unfused ops of a fast case
        add(case.name,
            lambda x, up, bias, a=case.activation: act_quant_group_triton(x, up, a, bias),
            lambda x, up, bias, a=exact: act_quant_group_reference(x, up, a, bias), sets, moved)
    for shape, name in NAMES.items():
        text, image, heads, dim = shape
        moved = 2 * (text + image) * heads * dim * 2
        add(f"cat_rows, {name}", lambda a, b: cat_rows_triton([a, b], 1),
            lambda a, b: torch.cat([a, b], 1),
            _sets(lambda s, shape=shape: dict(zip("ab", joint_v(*shape), strict=True)), moved),
            moved)
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", default="", help="label of this run's rows")
    p.add_argument("--only", choices=["act", "rowwise", "other"], help="one family")
    p.add_argument("--out", help="append the rows as JSON lines here")
    p.add_argument("--inductor", action="store_true",
                   help="also time Inductor's kernel for each subgraph (torch.compile of the "
                        "unfused reference, the same rotating inputs and CUDA graph)")
    args = p.parse_args(argv)
    print(f"kopt from {kopt.__file__} ({args.tag})", flush=True)
    rows = []
    if args.only in (None, "act"):
        rows += act_rows(args.inductor)
    if args.only in (None, "rowwise"):
        rows += rowwise_rows(args.inductor)
    if args.only in (None, "other"):
        rows += other_rows(args.inductor)
    for r in rows:
        copy = same_size_copy_gbps(r["moved"]) if r["moved"] else float("nan")
        r["of_copy"] = r["moved"] / (r["us"] * 1e-6) / 1e9 / copy if r["moved"] else None
        r["tag"] = args.tag
        frac = f"{r['of_copy']:.2f} of a same-size copy" if r["of_copy"] else ""
        ind = r.get("inductor_us")
        ind = f"  Inductor {ind:8.1f} us (kopt {r['us'] / ind:.2f}x)" if ind else ""
        print(f"{args.tag:6s} {r['case']:50s} {r['us']:8.1f} us  {frac}{ind}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
