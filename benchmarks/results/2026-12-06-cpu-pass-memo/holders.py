"""Finding the graph modules that hold each packed constant of W1 FP8 (meta device): one scan of
the module tree per constant (before) against one listing (kopt.api._graph_modules, after)."""
import time

import torch
from torch import fx

from kopt.api import _graph_modules, optimize_captured
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions

w = build("qwen-image", device="meta", dtype=torch.bfloat16)
c = capture_module(w.model, w.args, w.kwargs)
spec = optimize_captured(c, PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config()),
                         VerifyOptions(enabled=False), None, "w1", 0.0)
gm = spec.gm
targets = [t for p in spec.programs for t in p.targets]
print(len(targets), "constants;", sum(1 for _ in gm.modules()), "modules")
t0 = time.perf_counter()
before = [[m for m in gm.modules() if isinstance(m, fx.GraphModule) and t in m._buffers]
          for t in targets]
t1 = time.perf_counter()
graphs = _graph_modules(gm)
after = [[m for m in graphs if t in m._buffers] for t in targets]
t2 = time.perf_counter()
print(f"a scan per constant {t1 - t0:.2f} s; one listing {t2 - t1:.3f} s; same holders {before == after}")
