"""The fingerprint of W1's captured graph (meta device), as the capture registered it (hashed
from the outer trace and the traced block) and node by node (an unregistered copy of it)."""
import time, torch
from kopt.capture import capture_module
from kopt.graph import copy_graph_module
from kopt.graph.serialize import fingerprint
from kopt.models import build

w = build("qwen-image", device="meta", dtype=torch.bfloat16)
cap = capture_module(w.model, w.args, w.kwargs)
copy = copy_graph_module(cap.gm)
for _ in range(3):
    t = time.perf_counter(); fingerprint(cap.gm); a = time.perf_counter() - t
    t = time.perf_counter(); fingerprint(copy); b = time.perf_counter() - t
    print(f"{len(cap.gm.graph.nodes)} nodes: registered {a:.3f} s, node by node {b:.3f} s")
