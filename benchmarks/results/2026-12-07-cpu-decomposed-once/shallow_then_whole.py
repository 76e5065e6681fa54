import time, torch, sys
from kopt.models import build
from kopt.capture import capture_module
import kopt
w = build("qwen-image", device="meta", dtype=torch.bfloat16)
cap = capture_module(w.model, w.args, w.kwargs)
t1 = time.perf_counter(); sh = cap.shallow(2); t2 = time.perf_counter(); gm = cap.gm; t3 = time.perf_counter()
print(f"{sys.argv[1]} {kopt.__file__}: shallow {t2-t1:.2f} s, whole graph made {t3-t2:.2f} s, together {t3-t1:.2f} s")
