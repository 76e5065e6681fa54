"""Probe: where the time of the row-wise FP8 quantizer goes (issue 4: the FP8 producers stay at
28-51% of copy bandwidth while the bf16-output row-wise kernel reaches 84%).

Times, at W1/W2 activation shapes, variants of one kernel that each drop one step of
``kopt::quant_fp8_rowwise`` (load row -> amax -> scale -> q = x / scale -> clamp -> e4m3 store):

    exact        the production kernel (IEEE division per element)
    markstein    q = x * r corrected twice by fma, r = RN(1 / scale) once per row, a zero
                 product kept as it is (``pw_div_by``, exact: checked bitwise against the
                 production kernel on the same data, adversarial rows too)
    recip        q = x * r (one multiply; NOT exact: the division's share of the time)
    noamax       scale = 1: load, clamp, e4m3 store (no reduction, no division)
    copy16       load, store bf16 (same reads, twice the writes)
    signed       markstein with negated residuals instead of the select on a zero product:
                 -(q s - x) is -0 where x - q s is +0, so a zero quotient keeps x's sign with
                 no extra live value (exactness checked as for markstein)
    torch copy   ``copy_`` of a tensor of the bytes the quantizer moves (read + write), the
                 same-size copy bandwidth

each at rows per program {1, 2} x warps {2, 4, 8}, CUDA-graph replays over rotating inputs.

    python benchmarks/probes/quant_variants.py
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.kernels_rowwise import copy_gbps as copy_bandwidth
from benchmarks.kernels_rowwise import near_e4m3_ties
from kopt.codegen.kernels.quant_fp8 import e4m3_bits, quant_fp8_rowwise_triton

MODES = ("exact", "markstein", "recip", "noamax", "copy16", "signed")
L2_BYTES = 256 << 20


@triton.jit
def _variant_kernel(x_ptr, q_ptr, s_ptr, rows, cols, MODE: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    rmask = row < rows
    mask = rmask[:, None] & (col < cols)[None, :]
    offs = row.to(tl.int64)[:, None] * cols + col[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if MODE == 4:  # copy16
        tl.store(q_ptr + offs, x, mask=mask)
    else:
        v = x.to(tl.float32)
        if MODE == 3:  # noamax
            q = v
        else:
            amax = tl.max(tl.abs(v), axis=1)
            scale = tl.maximum(amax, 1e-12) * 0.0022321429569274187
            tl.store(s_ptr + row, scale, mask=rmask)
            if MODE == 0:
                q = tl.math.div_rn(v, scale[:, None])
            else:
                r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
                q0 = v * r
                q = q0
                s = scale[:, None]
                if MODE == 1:  # as pw_div_by
                    q = tl.fma(tl.fma(-q0, s, v), r, q0)
                    e = tl.fma(-q, s, v)
                    q = tl.where(e == 0.0, q, tl.fma(e, r, q))
                    q = tl.where(q0 == 0.0, q0, q)
                if MODE == 5:  # negated residuals: -(q s - v) keeps the sign of a zero quotient
                    q = tl.fma(-tl.fma(q0, s, -v), r, q0)
                    e = tl.fma(q, s, -v)
                    q = tl.where(e == 0.0, q, tl.fma(-e, r, q))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(q_ptr + offs, e4m3_bits(q, True), mask=mask)


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, mode: int, rows_per: int,
            warps: int) -> None:
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    _variant_kernel[(triton.cdiv(rows, rows_per),)](
        x, q, s, rows, cols, MODE=mode, ROWS=rows_per, BLOCK=block, num_warps=warps,
        enable_fp_fusion=False)


def _graph_ms(fn, sets: list) -> float:
    for args in sets[:2]:
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in sets:
            fn(*args)
    torch.cuda.synchronize()
    return do_bench(g.replay, return_mode="median") / len(sets)


def main() -> None:
    shapes = {"W1 joint 4224 x 3072": (4224, 3072), "W2 joint 4608 x 6144": (4608, 6144),
              "W1 MLP-down in 4096 x 12288": (4096, 12288)}
    copy_gbps = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "copy_GBps_1GiB": copy_gbps, "shapes": {}}
    print(f"copy bandwidth (1 GiB): {copy_gbps:.0f} GB/s")
    for name, (rows, cols) in shapes.items():
        moved = rows * cols * 3 + rows * 4
        n_sets = max(2, -(-L2_BYTES // moved))
        sets = []
        for _ in range(n_sets):
            x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
            sets.append((x, torch.empty(rows, cols, device="cuda", dtype=torch.uint8),
                         torch.empty(rows, device="cuda", dtype=torch.float32)))
        src = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda").random_()
               for _ in range(n_sets)]
        dst = [torch.empty_like(s) for s in src]
        copy_ms = _graph_ms(lambda s, d: d.copy_(s), list(zip(src, dst, strict=True)))
        same_gbps = moved / copy_ms / 1e6
        res = {"moved_MB": moved / 1e6, "same_size_copy_us": copy_ms * 1e3,
               "same_size_copy_GBps": same_gbps, "variants": {}}
        print(f"\n{name}: {moved / 1e6:.1f} MB moved; same-size copy {copy_ms * 1e3:.1f} us "
              f"({same_gbps:.0f} GB/s, {same_gbps / copy_gbps:.0%} of the 1 GiB copy)")
        prod_ms = _graph_ms(lambda x, q, s: quant_fp8_rowwise_triton(x), sets)
        res["production_us"] = prod_ms * 1e3
        print(f"  production kopt::quant_fp8_rowwise: {prod_ms * 1e3:.1f} us "
              f"({moved / prod_ms / 1e6 / copy_gbps:.0%} of copy, "
              f"{moved / prod_ms / 1e6 / same_gbps:.0%} of same-size copy)")
        for mode, mname in enumerate(MODES):
            for rows_per in (1, 2):
                for warps in (2, 4, 8):
                    q16 = [(x, torch.empty_like(x), s) for x, _, s in sets] if mode == 4 else sets
                    ms = _graph_ms(lambda x, q, s, m=mode, r=rows_per, w=warps:
                                   _launch(x, q, s, m, r, w), q16)
                    res["variants"][f"{mname} r{rows_per} w{warps}"] = ms * 1e3
            best = min((k for k in res["variants"] if k.startswith(mname + " ")),
                       key=res["variants"].get)
            us = res["variants"][best]
            mv = moved + rows * cols if mode == 4 else moved
            print(f"  {mname:>9}: best {best.split(' ', 1)[1]} {us:6.1f} us "
                  f"({mv / us / 1e3 / copy_gbps:.0%} of copy, {mv / us / 1e3 / same_gbps:.0%} "
                  f"of same-size copy)   all: " + " ".join(
                      f"{k.split(' ', 1)[1]}={v:.1f}" for k, v in res["variants"].items()
                      if k.startswith(mname + " ")))
        # exactness of the markstein variant against the production kernel
        checks = {}
        ties = near_e4m3_ties(rows, cols, torch.bfloat16)
        for kind, x in (("randn", sets[0][0]), ("adversarial", ties)):
            q_ref, s_ref = quant_fp8_rowwise_triton(x)
            q = torch.empty(rows, cols, device="cuda", dtype=torch.uint8)
            s = torch.empty(rows, device="cuda", dtype=torch.float32)
            _launch(x, q, s, 1, 1, 4)
            same = torch.equal(q, q_ref.view(torch.uint8)) and torch.equal(s, s_ref.view(-1))
            diff = (q != q_ref.view(torch.uint8)).sum().item()
            _launch(x, q, s, 5, 1, 4)
            diff_signed = (q != q_ref.view(torch.uint8)).sum().item()
            _launch(x, q, s, 2, 1, 4)
            diff_recip = (q != q_ref.view(torch.uint8)).sum().item()
            checks[kind] = {"markstein_bitwise": same, "markstein_diff": diff,
                            "signed_diff": diff_signed, "recip_diff": diff_recip}
            print(f"  {kind}: markstein bitwise {same} ({diff} values differ); signed: "
                  f"{diff_signed} differ; recip: {diff_recip} values differ")
        res["checks"] = checks
        out["shapes"][name] = res
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
