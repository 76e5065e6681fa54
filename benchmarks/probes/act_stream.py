"""act + FP8 quant with its stash: the activation's inputs loaded with L2's evict-first policy
(``STREAM``, the SwiGLUs' default) or the default policy, timed alternately in
one process at W1/W2/LLM shapes.

    python -m benchmarks.probes.act_stream
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from benchmarks.kernels_specialised import ACT_CASES, act_inputs
from kopt.codegen.kernels.act_quant import _config, act_quant_triton

CASES = ("W1 image MLP, GELU(tanh) fast", "W2 image FF, SwiGLU fast",
         "W3 Qwen3-8B prefill, SwiGLU fast")


def main() -> None:
    for case in (c for c in ACT_CASES if c.name in CASES):
        x, up = act_inputs(case)
        base = _config(case.features)
        configs = {"default": dict(base, STREAM=False), "stream": dict(base, STREAM=True)}
        outs = {k: act_quant_triton(x, up, case.activation, config=c) for k, c in configs.items()}
        (q0, s0), (q1, s1) = outs["default"], outs["stream"]
        same = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
        times: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(4):
            for k, c in configs.items():
                times[k].append(1e3 * do_bench(
                    lambda c=c, x=x, up=up, a=case.activation: act_quant_triton(
                        x, up, a, config=c),
                    warmup=25, rep=100, return_mode="median"))
        cells = ", ".join(f"{k} {sorted(v)[1]:.1f}-{sorted(v)[2]:.1f} us" for k, v in times.items())
        print(f"{case.name}: {cells}; bitwise equal: {same}", flush=True)


if __name__ == "__main__":
    main()
