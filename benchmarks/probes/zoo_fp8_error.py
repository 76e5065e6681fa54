"""kopt's FP8 output error against that of the fp8 pass alone, input by input, on zoo models.

    python -m benchmarks.probes.zoo_fp8_error sd3.5 flux1 [--device cuda] [--inputs 4]

Per model (bf16, ``FP8Config(min_features=16)``): for the workload's input and others drawn like
it (``benchmarks.e2e.redrawn_inputs``), the ratio of kopt's relative error against the fp64
model to the recipe's (the fp8 pass alone, every other pass off), and the ratio of their means:
how much one input's ratio moves, which a test's bound on it must allow for.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch

import kopt
from kopt.models.zoo import build
from tests.zoo_errors import per_input_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--device", default="cpu")
    p.add_argument("--inputs", type=int, default=4)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for name in args.models:
        w = build(name, device=args.device, dtype=torch.bfloat16)
        fp8 = kopt.FP8Config(min_features=16)
        opt = kopt.optimize(w.model, w.args, w.kwargs, kopt.PassConfig(fp8=fp8),
                            verify=kopt.VerifyOptions(enabled=False), keep_original=True)
        errors = per_input_errors(w, opt, fp8, args.inputs)
        ratios = " ".join(f"{a / r:.3f}" for a, r in errors)
        mean = sum(a for a, _ in errors) / sum(r for _, r in errors)
        print(f"{name}: kopt / recipe per input {ratios}; of the means {mean:.3f}")


if __name__ == "__main__":
    main()
