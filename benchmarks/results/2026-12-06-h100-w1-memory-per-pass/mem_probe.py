"""GPU memory per pass and per verification of W1 FP8 (dev probe)."""
import sys, time, torch
from kopt.passes import pipeline
from kopt.api import OptimizedModule, optimize_captured
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions

G = 2**30
def mark(what):
    torch.cuda.synchronize()
    print(f"{time.perf_counter()-T0:7.1f}s {what:<40} alloc {torch.cuda.memory_allocated()/G:6.2f} "
          f"peak {torch.cuda.max_memory_allocated()/G:6.2f} GiB", flush=True)
    torch.cuda.reset_peak_memory_stats()

T0 = time.perf_counter()
orig_compare = pipeline.compare
def compare(a, b, *rest, **kw):
    mark("before verify")
    v = orig_compare(a, b, *rest, **kw)
    mark("verify")
    return v
pipeline.compare = compare
orig_build = pipeline.build_passes
def build_passes(config):
    ps = orig_build(config)
    for p in ps:
        run = p.run
        def wrapped(gm, sites=None, _run=run, _name=p.name):
            mark(f"before {_name}")
            r = _run(gm, sites) if sites is not None else _run(gm)
            mark(f"pass {_name}")
            return r
        p.run = wrapped
    return ps
pipeline.build_passes = build_passes
w = build("qwen-image", device="cuda", dtype=torch.bfloat16)
mark("built")
cap = capture_module(w.model, w.args, w.kwargs)
mark("captured")
config = PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config())
verify = VerifyOptions(enabled=len(sys.argv) < 2 or sys.argv[1] != "0", seeds=(0,))
from kopt.offload import HostCopies, releasing
host = HostCopies()
with releasing(host, [*w.model.parameters(), *w.model.buffers()]):
    spec = optimize_captured(cap, config, verify, None, w.name, 0.0)
mark("optimized")
opt = OptimizedModule(w.model, spec, config, verify, None, host=host)
mark("module made")
print(opt.memory().describe())
