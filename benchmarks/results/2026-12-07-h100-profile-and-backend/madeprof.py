"""logrun.py with the optimized module's making under cProfile (its 25 costliest calls)."""
import cProfile, logging, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
T0 = time.perf_counter()
class F(logging.Formatter):
    def format(self, r):
        return f"{time.perf_counter() - T0:7.2f} {r.getMessage()[:200]}"
h = logging.StreamHandler(sys.stdout); h.setFormatter(F())
lg = logging.getLogger("kopt"); lg.addHandler(h); lg.setLevel(logging.INFO); lg.propagate = False
from benchmarks.probes import optimize_time
Real = optimize_time.OptimizedModule
def made(*a, **k):
    p = cProfile.Profile(); p.enable()
    try:
        return Real(*a, **k)
    finally:
        p.disable(); pstats.Stats(p, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
optimize_time.OptimizedModule = made
sys.argv = ["optimize_time"] + sys.argv[1:]
optimize_time.main()
print(f"{time.perf_counter() - T0:7.2f} done", flush=True)
