"""The FP8 error check the CPU and GPU zoo tests share."""

from __future__ import annotations

import statistics

import torch

import kopt
from benchmarks.e2e import redrawn_inputs
from kopt.capture import capture_module, flatten_inputs
from kopt.models import Workload, main_output
from kopt.verify import relative_error, run_fp64

# inputs each error is averaged over: one input's ratio of kopt's error to the recipe's moves
# by about a tenth on the tiny zoo models, their means over four inputs far less (RESULTS.md,
# 2026-12-04, CPU: benchmarks/probes/zoo_fp8_error.py)
INPUTS = 4


def per_input_errors(w: Workload, opt: kopt.OptimizedModule, fp8: kopt.FP8Config,
                     inputs: int = INPUTS) -> list[tuple[float, float]]:
    """Per input (the workload's, then others drawn like it), ``(kopt's, the FP8 recipe's)``
    relative error against the fp64 model: ``opt`` against the model with the fp8 pass alone
    (same ``FP8Config``, every other pass off)."""
    alone = kopt.PassConfig().replace(**{p: False for p in kopt.PassConfig().enabled()},
                                      fp8=fp8)
    recipe = kopt.optimize(w.model, w.args, w.kwargs, alone,
                           verify=kopt.VerifyOptions(enabled=False), cuda_graphs=False)
    gm = capture_module(w.model, w.args, w.kwargs).gm
    errors: list[tuple[float, float]] = []
    for seed in range(inputs):
        kwargs = w.kwargs if seed == 0 else redrawn_inputs(w, seed)
        flat, _ = flatten_inputs(w.args, kwargs)
        ref = main_output(run_fp64(gm, flat))
        with torch.no_grad():
            errors.append((relative_error(main_output(opt(*w.args, **kwargs)), ref),
                           relative_error(main_output(recipe(*w.args, **kwargs)), ref)))
    return errors


def fp8_errors(w: Workload, opt: kopt.OptimizedModule, fp8: kopt.FP8Config
               ) -> tuple[float, float]:
    """``(kopt's, the FP8 recipe's)`` relative error against the fp64 model, each the mean over
    :data:`INPUTS` inputs (:func:`per_input_errors`)."""
    errors = per_input_errors(w, opt, fp8)
    return statistics.mean(a for a, _ in errors), statistics.mean(r for _, r in errors)
