"""Where each pass's check goes: timers (CUDA-synchronized) around the graph runs, fp64 runs,
local-check references, graph copies, code generation and Triton compiles, per pass.
python dev/checkprof.py OUTFILE -- optimize_time args"""
import logging, os, sys, time, collections, re
sys.path.insert(0, os.getcwd())
import torch
from torch import fx

out_path = sys.argv[1]
sys.argv = ["optimize_time"] + sys.argv[3:]
T0 = time.perf_counter()
acc = collections.defaultdict(lambda: [0.0, 0])
cur = ["capture"]
depth = [0]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(key, fn):
    def wrapper(*a, **k):
        sync()
        t = time.perf_counter()
        depth[0] += 1
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            sync()
            e = acc[(cur[0], key)]
            e[0] += time.perf_counter() - t
            e[1] += 1
    return wrapper


class H(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        g = re.search(r"\[(\d+)/\d+\] (\w+)", m)
        if g:
            cur[0] = g.group(2)
        print(f"{time.perf_counter() - T0:7.2f} {m[:160]}", flush=True)


lg = logging.getLogger("kopt"); lg.addHandler(H()); lg.setLevel(logging.INFO); lg.propagate = False

import kopt.verify as V
import kopt.passes.pipeline as P
import kopt.graph.splice as S
V.run_flat = timed("run_flat", V.run_flat)
V.run_fp64 = timed("run_fp64", V.run_fp64)
_cmp = timed("compare", P.compare)
def _cmp_print(*a, **k):
    v = _cmp(*a, **k)
    print(f"{time.perf_counter() - T0:7.2f}   verdict {cur[0]}: {v.passed} {v.detail[:220]}", flush=True)
    return v
P.compare = _cmp_print
P.copy_graph_module = timed("copy_graph", P.copy_graph_module)
V.random_inputs = timed("random_inputs", V.random_inputs)
V.relative_error = timed("relative_error", V.relative_error)
orig_local_run = V._LocalCheck.run
V._LocalCheck.run = timed("local_run", orig_local_run)
V._to64 = timed("to64", V._to64)
for name, fn in list(V._BLOCKED_REFERENCES.items()):
    V._BLOCKED_REFERENCES[name] = timed("blocked_ref", fn)
fx.GraphModule.recompile = timed("recompile", fx.GraphModule.recompile)
try:
    import triton.compiler.compiler as TC
    TC.compile = timed("triton_compile", TC.compile)
    import triton.runtime.jit as TJ
    TJ.compile = TC.compile if hasattr(TJ, "compile") else None
except Exception as e:  # noqa
    print("no triton patch", e)
# local references: time the reference functions (marked in node meta) via run_node
orig_run_node = V._LocalCheck.run_node


def run_node(self, n):
    ref = n.meta.get(V.LOCAL_REFERENCE)
    if ref is None:
        return orig_run_node(self, n)
    sync(); t = time.perf_counter()
    r = orig_run_node(self, n)
    sync()
    e = acc[(cur[0], "site_node+ref")]; e[0] += time.perf_counter() - t; e[1] += 1
    return r


V._LocalCheck.run_node = run_node
from benchmarks.probes import optimize_time
try:
    optimize_time.main()
finally:
    lines = [f"total {time.perf_counter() - T0:.2f} s"]
    passes = list(dict.fromkeys(p for p, _ in acc))
    keys = sorted({k for _, k in acc})
    for p in passes:
        parts = ", ".join(f"{k} {acc[(p, k)][0]:.2f}s/{acc[(p, k)][1]}" for k in keys if (p, k) in acc)
        lines.append(f"{p}: {parts}")
    for k in keys:
        lines.append(f"ALL {k}: {sum(v[0] for (p, kk), v in acc.items() if kk == k):.2f} s")
    open(out_path, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
