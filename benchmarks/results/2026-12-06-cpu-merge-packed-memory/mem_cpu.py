"""Peak RSS per pass of a 4-layer full-width Qwen-Image in FP8 on the CPU (dev probe)."""
import os, sys, time, torch
from kopt.passes import pipeline
from kopt.api import OptimizedModule, optimize_captured
from kopt.capture import capture_module
from kopt.models import qwen_image
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions

G = 2**30
def rss():
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024
def mark(what):
    now, peak = rss()
    print(f"{time.perf_counter()-T0:7.1f}s {what:<34} rss {now/G:6.2f} peak {peak/G:6.2f} GiB", flush=True)
    open("/proc/self/clear_refs", "w").write("5")
T0 = time.perf_counter()
orig_compare = pipeline.compare
def compare(a, b, *rest, **kw):
    mark("  before verify")
    v = orig_compare(a, b, *rest, **kw)
    mark("  verify")
    return v
pipeline.compare = compare
import kopt.verify as V
for name in ("run_flat", "run_fp64"):
    def w(*a, _f=getattr(V, name), _n=name, **k):
        r = _f(*a, **k); mark(f"    {_n}"); return r
    setattr(V, name, w)
_lc = V._LocalCheck.run
def lcrun(self, *a, **k):
    r = _lc(self, *a, **k); mark("    local check"); return r
V._LocalCheck.run = lcrun
STOP = os.environ.get("STOP")
orig_build = pipeline.build_passes
def build_passes(config):
    ps = orig_build(config)
    for p in ps:
        def wrapped(gm, sites=None, _run=p.run, _name=p.name):
            mark(f"before {_name}")
            r = _run(gm, sites) if sites is not None else _run(gm)
            mark(f"pass {_name}")
            if _name == STOP: raise SystemExit
            return r
        p.run = wrapped
    return ps
pipeline.build_passes = build_passes
qwen_image.TINY_CONFIG = dict(num_layers=int(sys.argv[1]) if len(sys.argv) > 1 else 4)
w = qwen_image.build("tiny", device="cpu", dtype=torch.bfloat16, height=256, width=256, text_tokens=32)
weights = sum(t.nbytes for t in w.model.parameters())
mark(f"built ({weights/G:.2f} GiB weights)")
cap = capture_module(w.model, w.args, w.kwargs)
mark("captured")
config = PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config())
spec = optimize_captured(cap, config, VerifyOptions(enabled=True, seeds=(0,)), None, w.name, 0.0)
mark("optimized")
