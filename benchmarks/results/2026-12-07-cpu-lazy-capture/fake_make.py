"""One fake tensor of a W1-block-sized activation's metadata, made by torch.empty_strided under
the fake mode (as the passes' remembered fake calls did) and directly from a meta tensor (as
kopt.graph.splice.fresh_fake does), microseconds each over 5000; then how many the W1 FP8 passes
make on the meta device."""
import time, torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
import kopt.graph.splice as splice
from kopt.capture import capture_module
from kopt.models import build
from kopt.passes import FP8Config, PassConfig, PassManager
from kopt.verify import VerifyOptions

mode = FakeTensorMode()
shape, stride, n = (4224, 3072), (3072, 1), 5000
for _ in range(3):
    t = time.perf_counter()
    with mode:
        for _ in range(n):
            torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="cpu")
    a = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        FakeTensor(mode, torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta"),
                   torch.device("cpu"))
    b = (time.perf_counter() - t) / n * 1e6
    print(f"under the mode {a:.1f} us, directly {b:.1f} us", flush=True)
made = [0]
real = splice.fresh_fake
def counted(*a):
    made[0] += 1
    return real(*a)
splice.fresh_fake = counted
w = build("qwen-image", device="meta", dtype=torch.bfloat16)
cap = capture_module(w.model, w.args, w.kwargs)
PassManager(PassConfig(fp8=FP8Config()), VerifyOptions(enabled=False)).run(cap.gm, cap.example_inputs)
print(f"W1 FP8 passes: {made[0]} fake tensors made from remembered calls")
