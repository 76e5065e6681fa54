"""logrun.py with the host moves switched back for an A/B in one machine: KOPT_AB=old copies each
released weight in the caller's thread into torch's own host allocation (the code before)."""
import logging, os, sys, time
sys.path.insert(0, os.getcwd())
T0 = time.perf_counter()
class F(logging.Formatter):
    def format(self, r):
        return f"{time.perf_counter() - T0:7.2f} {r.getMessage()[:200]}"
h = logging.StreamHandler(sys.stdout); h.setFormatter(F())
lg = logging.getLogger("kopt"); lg.addHandler(h); lg.setLevel(logging.INFO); lg.propagate = False
from kopt import offload
if os.environ.get("KOPT_AB") == "old":
    offload.HUGE_BYTES = 1 << 62
    real = offload.HostCopies.move
    offload.HostCopies.move = lambda self, t, quiet=False, background=False: real(self, t, quiet)
print("variant", os.environ.get("KOPT_AB", "new"), flush=True)
from benchmarks.probes import optimize_time
sys.argv = ["optimize_time"] + sys.argv[1:]
optimize_time.main()
print(f"{time.perf_counter() - T0:7.2f} done", flush=True)
