"""optimize_time's run with GPU memory marks around restore, load programs, graph runs (dev probe)."""
import sys, time, torch
G = 2**30
T0 = time.perf_counter()
def mark(what):
    torch.cuda.synchronize()
    print(f"  [{time.perf_counter()-T0:6.1f}s] {what:<28} alloc {torch.cuda.memory_allocated()/G:6.2f} peak {torch.cuda.max_memory_allocated()/G:6.2f}", flush=True)
def wrap(mod, name, label):
    real = getattr(mod, name)
    def f(*a, **k):
        mark(label + " <"); r = real(*a, **k); mark(label + " >"); return r
    setattr(mod, name, f)
import kopt.warm as warm, kopt.verify as verify, kopt.passes.pipeline as pipeline
from kopt.passes.fold import LoadProgram
wrap(warm, "restore", "restore")
wrap(verify, "run_flat", "run_flat")
wrap(pipeline, "compare", "compare")
wrap(LoadProgram, "run", "program")
from benchmarks.probes import optimize_time
sys.argv = ["optimize_time", *sys.argv[1:]]
optimize_time.main()
