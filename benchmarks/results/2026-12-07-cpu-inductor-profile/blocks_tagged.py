import collections, torch, kopt
from kopt.models import build, qwen_image
qwen_image.TINY_CONFIG["num_layers"] = 6  # a 6-block tiny model
import kopt.backend as B
got = {}
real = B.inner_compile
def spy(inner, gm, ex):
    got["gm"] = gm; return real("eager", gm, ex)
B.inner_compile = spy
w = build("qwen-image-tiny", dtype=torch.bfloat16)
c = torch.compile(w.model, backend="kopt", dynamic=False, options={"verify": False, "config": kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))})
with torch.no_grad(): c(*w.args, **w.kwargs)
gm = got["gm"]
cnt = collections.Counter(); none = []
for n in gm.graph.nodes:
    st = n.meta.get("nn_module_stack")
    if n.op in ("placeholder", "output", "get_attr"): continue
    key = None
    if st:
        for path, _ in st.values():
            if "transformer_blocks" in str(path): key = str(path); break
    cnt[key] += 1
    if key is None: none.append((n.name, str(n.target)[:60]))
print(len(gm.graph.nodes), cnt.most_common(12))
