import sys, time, torch
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.models import qwen_image
from kopt.passes import FP8Config, PassConfig
from kopt.verify import VerifyOptions
import kopt
qwen_image.TINY_CONFIG = dict(num_layers=2)
w = qwen_image.build("tiny", device="cpu", dtype=torch.bfloat16, height=256, width=256, text_tokens=32)
cap = capture_module(w.model, w.args, w.kwargs)
config = PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config())
t = time.perf_counter()
spec = optimize_captured(cap, config, VerifyOptions(enabled=True, seeds=(0,)), None, w.name, 0.0)
print(kopt.__file__, f"optimize verified 1 seed: {time.perf_counter()-t:.1f} s; verified {spec.report.verified}")

