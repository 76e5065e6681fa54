"""W1 FP8's passes on the meta device in one process, alternating the remembered fake calls'
outputs made through the fake mode (before) and directly (after); the memo cleared per run."""
import time, torch
import kopt.graph.splice as splice
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import FP8Config, PassConfig, PassManager
from kopt.verify import VerifyOptions

direct = splice.fresh_fake
def dispatched(mode, shape, stride, dtype, device):
    with mode:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

w = build("qwen-image", device="meta", dtype=torch.bfloat16)
cap = capture_module(w.model, w.args, w.kwargs)
config = PassConfig(fp8=FP8Config())
for i in range(4):
    for side, fn in (("before", dispatched), ("after", direct)):
        splice.fresh_fake = fn
        splice._OUTPUTS_BY_MODE.clear()
        t = time.perf_counter()
        PassManager(config, VerifyOptions(enabled=False)).run(cap.gm, cap.example_inputs)
        print(f"{side}: passes {time.perf_counter() - t:.2f} s", flush=True)
