"""logrun.py with copies ahead switched off for an A/B in one machine: KOPT_AB=old copies each
released weight at its release, in the caller's thread (the code before)."""
import logging, os, sys, time
sys.path.insert(0, os.getcwd())
T0 = time.perf_counter()
class F(logging.Formatter):
    def format(self, r):
        return f"{time.perf_counter() - T0:7.2f} {r.getMessage()[:200]}"
h = logging.StreamHandler(sys.stdout); h.setFormatter(F())
lg = logging.getLogger("kopt"); lg.addHandler(h); lg.setLevel(logging.INFO); lg.propagate = False
if os.environ.get("KOPT_TRITON_LOG"):
    import triton.runtime.jit as _jit
    _real = _jit.compile
    def _timed(src, *a, **k):
        s0 = time.perf_counter()
        try:
            return _real(src, *a, **k)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", "?")
            print(f"{time.perf_counter() - T0:7.2f} triton compile {name} "
                  f"{time.perf_counter() - s0:.2f} s", flush=True)
    _jit.compile = _timed
from kopt import offload
if os.environ.get("KOPT_AB") == "old":
    offload.HostCopies.copy_ahead = lambda self, tensors: None
if os.environ.get("KOPT_FLAT"):
    import kopt.backend
    kopt.backend.outline_blocks = lambda gm: 0
if os.environ.get("KOPT_THREADS"):
    offload.AHEAD_THREADS = int(os.environ["KOPT_THREADS"])
print("variant", os.environ.get("KOPT_AB", "new"), os.environ.get("KOPT_THREADS", ""), "flat" if os.environ.get("KOPT_FLAT") else "", flush=True)
from benchmarks.probes import optimize_time
sys.argv = ["optimize_time"] + sys.argv[1:]
optimize_time.main()
print(f"{time.perf_counter() - T0:7.2f} done", flush=True)
