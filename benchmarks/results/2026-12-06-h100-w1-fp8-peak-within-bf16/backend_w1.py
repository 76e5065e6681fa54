"""W1 FP8 through torch.compile(backend="kopt"): time to the first call's return, peak, held (dev probe)."""
import sys, time, torch
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
G = 2**30
inner = sys.argv[1] if len(sys.argv) > 1 else "inductor"
t0 = time.perf_counter()
w = build("qwen-image", device="cuda", dtype=torch.bfloat16)
weights = sum(t.nbytes for t in (*w.model.parameters(), *w.model.buffers()))
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
print(f"built {time.perf_counter()-t0:.1f}s weights {weights/G:.2f} GiB alloc {torch.cuda.memory_allocated()/G:.2f}", flush=True)
reports = []
c = torch.compile(w.model, backend="kopt", options={"inner": inner, "config": {"fp8": FP8Config()}, "reports": reports})
t1 = time.perf_counter()
with torch.no_grad():
    out = c(*w.args, **w.kwargs)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"first call {t2-t1:.1f}s peak {torch.cuda.max_memory_allocated()/G:.2f} GiB held {torch.cuda.memory_allocated()/G:.2f} GiB graphs {len(reports)}", flush=True)
for r in reports:
    print(r, flush=True)
with torch.no_grad():
    c(*w.args, **w.kwargs)
torch.cuda.synchronize()
print(f"second call {time.perf_counter()-t2:.1f}s peak {torch.cuda.max_memory_allocated()/G:.2f} held {torch.cuda.memory_allocated()/G:.2f}", flush=True)
