"""The optimize_time probe with kopt's INFO log, each line stamped with seconds since start."""
import logging, os, sys, time
sys.path.insert(0, os.getcwd())
T0 = time.perf_counter()
class F(logging.Formatter):
    def format(self, r):
        return f"{time.perf_counter() - T0:7.2f} {r.getMessage()[:200]}"
h = logging.StreamHandler(sys.stdout); h.setFormatter(F())
lg = logging.getLogger("kopt"); lg.addHandler(h); lg.setLevel(logging.INFO); lg.propagate = False
from benchmarks.probes import optimize_time
sys.argv = ["optimize_time"] + sys.argv[1:]
optimize_time.main()
print(f"{time.perf_counter() - T0:7.2f} done", flush=True)
