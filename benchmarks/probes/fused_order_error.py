"""Where kopt-fp8's output error against eager BF16 differs from naive FP8 + Inductor's: the
rounding order of the fused kernels, on a Qwen-Image-shaped model small enough for the CPU.

    python benchmarks/probes/fused_order_error.py [--layers 30] [--inputs 6] [VARIANT ...]
    python benchmarks/probes/fused_order_error.py --model qwen-image --device cuda --inputs 3 ...

The model (CPU default): Qwen-Image's structure at hidden 1024 (8 heads x 128), 256x256 px
(256 image + 32 text tokens), random weights, BF16; ``--model`` builds a workload at its full
size instead (W1: ``qwen-image`` on ``--device cuda``). Every variant's relative error against
the eager BF16 output is printed per input (the workload's and ``--inputs - 1`` drawn again)
and as a mean.
Variants (all by default):

* ``naive-eager``, ``naive-inductor``, ``naive-inductor-emulate``: e2e.py's naive FP8 recipe,
  eager, with regional Inductor, and with Inductor rounding like eager
  (``emulate_precision_casts``);
* ``naive-inductor-eager:MODS``: Inductor, but the blocks' submodules ``MODS`` (comma-separated
  attribute names: ``attn``, ``img_mlp,txt_mlp``) run eagerly;
* ``kopt-eager``, ``kopt-fp32``: kopt's FP8 with ``FP8Config(intermediates=...)``;
* ``kopt-structural-inductor[:FUSIONS]``: kopt's structural passes (merge, FP8, bias
  absorption, ...) with its fusions off but ``FUSIONS`` (comma-separated pass names), compiled
  whole by Inductor (``torch.compile(backend="kopt")``): kopt's graph with Inductor's fused
  kernels, or with some of kopt's own;
* ``kopt-fp32-without:PASSES``: kopt-fp32 with the passes ``PASSES`` (comma-separated) off:
  which of kopt's rewrites moves the error;
* ``kopt-fp32+unrounded:OPS``: kopt-fp32 with the fused ops ``OPS`` (comma-separated:
  ``qk_norm_rope``, ``act_quant_fp8_rowwise``, ``cat_act_quant_fp8_rowwise``, ``rowwise``)
  computed with no rounding at all (their fp64 functions on upcast inputs, the outputs cast
  back): what removing every rounding inside them would give;
* ``kopt-fp32+reference:OPS``: kopt-fp32 with the fused ops ``OPS`` run as their PyTorch
  references (the CPU path) on the device: on a GPU, whether a Triton kernel's rounding differs
  from its reference's where it matters.

The ``+unrounded`` and ``+reference`` kernels stay registered for the rest of the run: list
those variants last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import e2e  # noqa: E402

import kopt  # noqa: E402
from kopt.codegen import FP64_REFERENCES  # noqa: E402
from kopt.codegen.ops import _LIB  # noqa: E402
from kopt.models import build, main_output, qwen_image  # noqa: E402
from kopt.verify import VerifyOptions, relative_error  # noqa: E402

DEFAULT = ("naive-eager", "naive-inductor", "naive-inductor-emulate", "kopt-eager", "kopt-fp32")


def _override(name: str, fn: object, key: str) -> None:
    """``fn`` as kopt::name's kernel for dispatch key ``key``, over the one registered."""
    try:
        _LIB.impl(name, fn, key, allow_override=True)
    except TypeError:  # a torch without allow_override
        torch.library._impls.discard(f"kopt/{name}/{key}")
        _LIB.impl(name, fn, key)


def _reference(ops: list[str], key: str) -> None:
    """Register, for each op, its PyTorch reference as the kernel for dispatch key ``key``."""
    for name, orig in _references().items():
        if name in ops:
            _override(name, orig, key)


def _references() -> dict:
    import kopt.codegen.kernels.act_quant as aq
    import kopt.codegen.kernels.qk_norm_rope as qk
    import kopt.codegen.rowwise as rw

    return {"rowwise": rw._rowwise_reference_op, "qk_norm_rope": qk._qk_norm_rope_reference,
            "act_quant_fp8_rowwise": aq._act_quant_fp8_rowwise_reference,
            "cat_act_quant_fp8_rowwise": aq._cat_act_quant_fp8_rowwise_reference}


def _unrounded(ops: list[str], key: str) -> None:
    """Register, for each op, a kernel (dispatch key ``key``) that runs its fp64 function on
    upcast inputs."""
    originals = _references()

    def up(a: object) -> object:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype.itemsize >= 2:
            return a.double()
        return [up(x) for x in a] if isinstance(a, list | tuple) else a

    def make(name: str):  # noqa: ANN202
        orig, fn = originals[name], FP64_REFERENCES[getattr(torch.ops.kopt, name).default]

        def impl(*args: object) -> object:
            ref, res = orig(*args), fn(*[up(a) for a in args])  # ref: the output dtypes
            single = isinstance(ref, torch.Tensor)
            refs, ress = ([ref], [res]) if single else (list(ref), list(res))
            outs = [b.to(a.dtype) if a.is_floating_point() and a.dtype.itemsize >= 2 else b
                    for a, b in zip(refs, ress, strict=True)]
            return outs[0] if single else (outs if isinstance(ref, list) else tuple(outs))
        return impl

    for name in ops:
        _override(name, make(name), key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--inputs", type=int, default=6)
    p.add_argument("--model", default="qwen-image-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="the weights' (and inputs') seed")
    p.add_argument("variants", nargs="*", default=list(DEFAULT))
    args = p.parse_args()
    if args.model == "qwen-image-tiny":
        qwen_image.TINY_CONFIG = dict(num_layers=args.layers, attention_head_dim=128,
                                      num_attention_heads=8, joint_attention_dim=1024)
        w = build(args.model, device=args.device, dtype=torch.bfloat16, height=256, width=256,
                  text_tokens=32, seed=args.seed)
    else:
        w = build(args.model, device=args.device, dtype=torch.bfloat16, seed=args.seed)
    key = "CUDA" if torch.device(args.device).type == "cuda" else "CPU"
    print(w.description, flush=True)
    inputs = [w.kwargs] + [e2e.redrawn_inputs(w, seed=i) for i in range(1, args.inputs)]

    def run(fn) -> list[torch.Tensor]:  # noqa: ANN001
        with torch.no_grad():
            return [main_output(fn(*w.args, **kw)).float() for kw in inputs]

    ref = run(w.model)
    for v in args.variants:
        name, _, arg = v.partition(":")
        torch._dynamo.reset()
        if name.startswith("naive"):
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = name == "naive-inductor-emulate"
            saved = []
            if name == "naive-inductor-eager":
                for blk in w.model.transformer_blocks:
                    for m in (getattr(blk, a) for a in arg.split(",")):
                        saved.append((m, m.forward))
                        m.forward = torch.compiler.disable(m.forward)
            with e2e.swapped(w.model, e2e.naive_fp8):
                if name == "naive-eager":
                    outs = run(w.model)
                else:
                    with e2e.regional_compile(w.model):
                        outs = run(w.model)
            for m, f in saved:
                m.forward = f
        elif name == "kopt-structural-inductor":
            fusions = ("rowwise_fusion", "fuse_qk_norm_rope", "fuse_act_quant", "fuse_act",
                       "cat_rows", "hoist")
            config = kopt.PassConfig(fp8=kopt.FP8Config()).replace(
                **{f: f in arg.split(",") for f in fusions})
            if "kopt" not in torch._dynamo.list_backends():  # no entry points (not installed)
                from kopt.backend import kopt_backend

                torch._dynamo.register_backend(kopt_backend, "kopt")
            compiled = torch.compile(w.model, backend="kopt", options={
                "inner": "inductor", "config": config, "reports": []})
            outs = run(compiled)
        else:
            order = "eager" if name == "kopt-eager" else "fp32"
            if name == "kopt-fp32+unrounded":
                _unrounded(arg.split(","), key)
            elif name == "kopt-fp32+reference":
                _reference(arg.split(","), key)
            config = kopt.PassConfig(fp8=kopt.FP8Config(intermediates=order))
            if name == "kopt-fp32-without":
                config = config.replace(**dict.fromkeys(arg.split(","), False))
            opt = kopt.optimize(w.model, w.args, w.kwargs, config,
                                verify=VerifyOptions(enabled=False), keep_original=True)
            outs = run(lambda *a, **k: opt(*a, **k))  # noqa: B023
            del opt  # its packed FP8 weights
        errs = [relative_error(o, r) for o, r in zip(outs, ref, strict=True)]
        print(f"{v:44s} " + " ".join(f"{e:.4e}" for e in errs)
              + f"  mean {sum(errs) / len(errs):.4e}", flush=True)


if __name__ == "__main__":
    main()
