"""Where Inductor's time goes on a kopt-optimized graph: a tiny Qwen-Image with N blocks on CPU."""
import cProfile, pstats, sys, time
import torch
from kopt.models import qwen_image
import kopt, kopt.backend as B
from kopt.models import build
n = int(sys.argv[1]); fp8 = len(sys.argv) > 2 and sys.argv[2] == "fp8"
qwen_image.TINY_CONFIG["num_layers"] = n
w = build("qwen-image-tiny", dtype=torch.bfloat16)
prof = cProfile.Profile()
real = B.inner_compile
spent = {}
def timed(inner, gm, ex):
    t = time.perf_counter(); prof.enable()
    try:
        return real(inner, gm, ex)
    finally:
        prof.disable(); spent["inner"] = time.perf_counter() - t
B.inner_compile = timed
cfg = kopt.PassConfig(fp8=kopt.FP8Config() if fp8 else None)
t0 = time.perf_counter()
c = torch.compile(w.model, backend="kopt", dynamic=False, options={"verify": False, "config": cfg})
with torch.no_grad():
    c(*w.args, **w.kwargs)
print(f"first call {time.perf_counter()-t0:.1f} s, inductor {spent['inner']:.1f} s", flush=True)
pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
