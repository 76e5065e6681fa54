"""Host time of kopt's optimization of a reference workload, built on the ``meta`` device by
default (no weights, no GPU): what an ablation row's build and a user's ``kopt.optimize`` pay
before any kernel runs. ``--device cuda --verify 1`` times the same on the GPU with real
(seeded random) weights, verifying every pass on one seed, and gives the GPU memory the
optimized module holds once it has moved the weights its graphs no longer read to host memory,
and the time until that module exists (what ``kopt.optimize`` takes: capture, passes, module).

    python -m benchmarks.probes.optimize_time --model qwen-image --fp8 [--whole] [--split]
        [--profile N]

Prints the capture's and the optimization's seconds, the rewrites applied and the nodes left;
``--whole`` first times the capture without repeated blocks (``kopt.repeated``: every block
traced), ``--split`` the whole-model export's steps apart (export, decompositions, the module);
``--profile N`` adds cProfile's N most expensive calls (cumulative) of the optimization.
``--kb PATH`` optimizes inside that knowledge base's scope: the first process records the
optimized graph, a second one with the same arguments restores it (``kopt.warm``); with
``--backend`` too.
``--backend INNER`` times ``torch.compile(model, backend="kopt")`` instead, with that inner
compiler (``inductor``, the default's, or ``eager``), to its first call's return: dynamo's
trace, kopt's capture and passes, the inner compiler and the call, with the peak GPU memory
and what the compiled model holds after the call; ``--live N`` then lists the N largest CUDA
storages alive besides the model's weights and the graphs' constants, with what refers to them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import torch

from kopt.api import OptimizedModule, optimize_captured
from kopt.capture import capture_module
from kopt.kb import KnowledgeBase, using
from kopt.memory import memory_held
from kopt.models import build
from kopt.offload import HostCopies, releasing
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image")
    p.add_argument("--device", default="meta")
    p.add_argument("--verify", type=int, default=0, metavar="SEEDS",
                   help="verify every pass on this many seeds (not on the meta device)")
    p.add_argument("--verify-blocks", default="2", metavar="N|all",
                   help="check the passes on the model cut to N blocks per repeated list "
                        "(VerifyOptions.blocks; the default 2), or on the whole model (all)")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--split", action="store_true",
                   help="also time the whole-model export's steps apart")
    p.add_argument("--whole", action="store_true",
                   help="also time the capture with every repeated block traced")
    p.add_argument("--kb", metavar="PATH",
                   help="optimize in this knowledge base's scope (a second run warm-starts)")
    p.add_argument("--backend", choices=("inductor", "eager"), metavar="INNER",
                   help="time torch.compile(backend='kopt') with this inner compiler")
    p.add_argument("--live", type=int, default=0, metavar="N",
                   help="with --backend: list the N largest CUDA storages held besides the "
                        "weights and the graphs' constants")
    args = p.parse_args()
    s0 = time.perf_counter()
    w = build(args.model, device=args.device, dtype=torch.bfloat16)
    print(f"{w.name}: built on {args.device} in {time.perf_counter() - s0:.1f} s", flush=True)
    weights = sum(t.nbytes for t in (*w.model.parameters(), *w.model.buffers()))
    if args.whole:
        s0 = time.perf_counter()
        whole = capture_module(w.model, w.args, w.kwargs, repeated=False)
        print(f"{w.name}: capture with every block traced {time.perf_counter() - s0:.1f} s "
              f"({len(whole.gm.graph.nodes)} nodes)", flush=True)
        del whole
    if args.split:  # the capture's three steps, timed apart
        s0 = time.perf_counter()
        ep = torch.export.export(w.model, tuple(w.args), dict(sorted(w.kwargs.items())),
                                 strict=False)
        s1 = time.perf_counter()
        ep = ep.run_decompositions({})
        s2 = time.perf_counter()
        ep.module()
        s3 = time.perf_counter()
        print(f"{w.name}: torch.export.export {s1 - s0:.1f} s, run_decompositions {s2 - s1:.1f} "
              f"s, ExportedProgram.module() {s3 - s2:.1f} s")
        del ep
    config = PassConfig(fuse_allreduce_norm=False)
    if args.fp8:
        config = config.replace(fp8=FP8Config())
    verify = VerifyOptions(enabled=args.verify > 0, seeds=tuple(range(max(args.verify, 1))),
                           blocks=None if args.verify_blocks == "all" else int(args.verify_blocks))
    if args.backend:
        with using(KnowledgeBase.open(args.kb)) if args.kb else contextlib.nullcontext():
            compiled_first_call(w, args.backend, config, verify, weights, args.live)
        return
    # as kopt.optimize: the BF16 weights FP8 packs leave for host memory as they are packed,
    # their copies made ahead from the start
    host = HostCopies()
    prof = cProfile.Profile() if args.profile else None
    with using(KnowledgeBase.open(args.kb)) if args.kb else contextlib.nullcontext(), \
            releasing(host, [*w.model.parameters(), *w.model.buffers()],
                      ahead=config.fp8 is not None):
        t0 = time.perf_counter()
        cap = capture_module(w.model, w.args, w.kwargs)
        t1 = time.perf_counter()
        t2 = time.perf_counter()
        if prof is not None:
            prof.enable()
        spec = optimize_captured(cap, config, verify, None, w.name, 0.0)
        if prof is not None:
            prof.disable()
        t3 = time.perf_counter()
    rep = f", {cap.repeated.describe()}" if cap.repeated else ""
    checks = sum(r.check_seconds for r in spec.report.passes)
    print(f"{w.name}: capture {t1 - t0:.1f} s ({len(cap.gm.graph.nodes)} nodes{rep}), optimize "
          f"{t3 - t2:.1f} s ({spec.report.applied} rewrites, {len(spec.gm.graph.nodes)} nodes "
          f"left, {type(spec.gm).__mro__[1].__name__}; verification "
          f"{'on ' + str(args.verify) + ' seeds' if args.verify else 'off'}, "
          f"{'passed' if spec.report.verified else 'FAILED'}"
          f"{f', {checks:.1f} s of checks' if checks else ''})")
    if spec.report.warm:
        print(f"{w.name}: {spec.report.warm}")
    if spec.report.verified_on:
        print(f"{w.name}: {spec.report.verified_on}")
    if args.device != "meta":
        held = memory_held(w.model, [spec.gm], None)
        print(f"{w.name}: {held.describe()}; without the original's own copies "
              f"{held.optimized / 2**30:.2f} GiB")
    if args.device.startswith("cuda"):
        print(f"{w.name}: peak GPU memory allocated {torch.cuda.max_memory_allocated() / 2**30:.2f}"
              f" GiB, the model's weights {weights / 2**30:.2f} GiB")
        s0 = time.perf_counter()
        opt = OptimizedModule(w.model, spec, config, verify, None,  # what kopt.optimize returns
                              host=host)
        torch.cuda.synchronize()
        made = time.perf_counter() - s0
        print(f"{w.name}: the optimized module made in {made:.1f} s; GPU "
              f"memory allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB "
              f"({opt.memory().describe()})")
        # what a user of kopt.optimize waits for: the time figures compare with this line
        print(f"{w.name}: until the optimized module exists: capture {t1 - t0:.1f} + optimize "
              f"{t3 - t2:.1f} + module {made:.1f} = {t1 - t0 + t3 - t2 + made:.1f} s")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


def compiled_first_call(w: object, inner: str, config: PassConfig, verify: VerifyOptions,
                        weights: int, live: int = 0) -> None:
    """``torch.compile(backend="kopt")`` to its first call's return, with kopt's part (capture
    and passes, from the reports) and the inner compiler's timed apart."""
    from kopt import backend

    spent = {"inner_compile": 0.0, "optimize_captured": 0.0}

    def timed(name: str) -> object:
        real = getattr(backend, name)

        def run(*a: object, **k: object) -> object:
            s0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[name] += time.perf_counter() - s0
                if torch.cuda.is_initialized():
                    print(f"{w.name}: after {name}: GPU memory allocated "
                          f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, peak so far "
                          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        return run

    for name in spent:
        setattr(backend, name, timed(name))
    reports: list = []
    compiled = torch.compile(w.model, backend="kopt", dynamic=False, options={
        "inner": inner, "config": config, "verify": verify, "reports": reports})
    cuda = torch.device(w.args[0].device if w.args else "cpu").type == "cuda" or any(
        p.is_cuda for p in w.model.parameters())
    s0 = time.perf_counter()
    with torch.no_grad():
        compiled(*w.args, **w.kwargs)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - s0
    capture = sum(r.capture_seconds for r in reports)
    checked = "off" if not verify.enabled else \
        "passed" if all(r.verified for r in reports) else "FAILED"
    passes, inner_s = spent["optimize_captured"], spent["inner_compile"]
    print(f"{w.name}: torch.compile(backend='kopt', inner={inner}) first call {first:.1f} s: "
          f"{len(reports)} graphs, kopt's capture {capture:.1f} s, passes"
          f"{' with verification' if verify.enabled else ''} {passes:.1f} s, the inner compiler "
          f"{inner_s:.1f} s, the rest (dynamo, the call) {first - capture - passes - inner_s:.1f}"
          f" s; {sum(r.applied for r in reports)} rewrites, verification "
          f"{checked}", flush=True)
    for r in reports:
        if r.warm:
            print(f"{w.name}:   {r.warm}")
        if r.inner:
            print(f"{w.name}:   inner compiler: {r.inner}")
        print("\n".join(f"{w.name}:   {line}" for line in r.runtime))
    if cuda:
        s0 = time.perf_counter()
        with torch.no_grad():
            compiled(*w.args, **w.kwargs)
        torch.cuda.synchronize()
        print(f"{w.name}: second call {time.perf_counter() - s0:.2f} s; peak GPU memory "
              f"allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, held after the "
              f"calls {torch.cuda.memory_allocated() / 2**30:.2f} GiB, the model's weights "
              f"{weights / 2**30:.2f} GiB", flush=True)
        live_storages(w.model, reports, live)


def live_storages(model: torch.nn.Module, reports: list, top: int) -> None:
    """The ``top`` largest CUDA storages alive that are neither the model's weights nor read by
    the optimized graphs, with what refers to them: what else the compiled model holds."""
    import gc

    from kopt.backend import Runner
    from kopt.memory import tensors_read

    if not top:
        return
    gc.collect()
    objects = gc.get_objects()
    graphs = [o.spec.gm for o in objects if type(o) is Runner]
    known = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(),
                                                   *tensors_read(graphs))}
    found: dict[int, tuple[int, torch.Tensor]] = {}
    for o in objects:
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.is_cuda:
            s = o.untyped_storage()
            if s.nbytes() and s._cdata not in known:
                found.setdefault(s._cdata, (s.nbytes(), o))
    print(f"live CUDA storages besides the weights and the graphs' constants: {len(found)}, "
          f"{sum(n for n, _ in found.values()) / 2**30:.2f} GiB (tracked by gc)")
    for n, t in sorted(found.values(), key=lambda e: -e[0])[:top]:
        refs = [type(r).__name__ for r in gc.get_referrers(t) if r is not objects][:4]
        print(f"  {n / 2**20:9.1f} MiB {tuple(t.shape)} {t.dtype} referred by {refs}")


if __name__ == "__main__":
    main()
