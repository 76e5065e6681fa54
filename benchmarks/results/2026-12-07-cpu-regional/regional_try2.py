"""Inductor on a kopt-optimized tiny Qwen-Image of N blocks (CPU): the flat graph against the
graph with each kind of block compiled once (kopt.regional), each compile timed, outputs compared."""
import collections, os, sys, time, torch, kopt
from kopt.models import build, qwen_image
n = int(sys.argv[1]); fp8 = "fp8" in sys.argv
qwen_image.TINY_CONFIG["num_layers"] = n
import kopt.backend as B
from kopt.graph.splice import copy_graph_module
from kopt.regional import outline_blocks
got = {}
real = B.inner_compile
def spy(inner, gm, ex, **kw):
    got["gm"] = gm; got["ex"] = ex; return real("eager", gm, ex)
B.inner_compile = spy
w = build("qwen-image-tiny", dtype=torch.bfloat16)
cfg = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16) if fp8 else None)
c = torch.compile(w.model, backend="kopt", dynamic=False, options={"verify": False, "config": cfg})
with torch.no_grad(): c(*w.args, **w.kwargs)
gm, ex = got["gm"], got["ex"]
with torch.no_grad():
    want = gm(*ex)
from torch._inductor.compile_fx import compile_fx
import torch._inductor.config as IC; IC.fx_graph_cache = False
wv = want[0] if isinstance(want, (list, tuple)) else want
with torch.no_grad():
    for rep in range(int(os.environ.get("REP", "1"))):
        t = time.perf_counter(); f = compile_fx(gm, ex); a = time.perf_counter() - t
        o = f(*ex); o = o[0] if isinstance(o, (list, tuple)) else o
        print(f"flat: inductor {a:.1f} s ({len(gm.graph.nodes)} nodes); max diff vs eager {(o.float()-wv.float()).abs().max().item():.3g}", flush=True)
        g2 = copy_graph_module(gm)
        t = time.perf_counter(); kinds = outline_blocks(g2, compile=compile_fx); b = time.perf_counter() - t
        t = time.perf_counter(); f2 = compile_fx(g2, ex); c2 = time.perf_counter() - t
        o = f2(*ex); o = o[0] if isinstance(o, (list, tuple)) else o
        print(f"regional: {sum(k.sites for k in kinds)} sites, {len(kinds)} kinds; outline + block compiles {b:.1f} s, outer {c2:.1f} s ({len(g2.graph.nodes)} nodes), total {b + c2:.1f} s; max diff vs eager {(o.float()-wv.float()).abs().max().item():.3g}", flush=True)
