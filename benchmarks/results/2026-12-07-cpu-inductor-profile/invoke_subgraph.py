"""Inductor on 40 identical blocks: one flat graph against an outer graph calling one block graph
through torch's invoke_subgraph (its weights as operands), each compiled twice in turn."""
import time, torch
from torch import fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch._inductor.compile_fx import compile_fx
N, D = 40, 64
def block_fn(x, w1, w2):
    h = torch.nn.functional.gelu(x @ w1.t())
    return x + (h @ w2.t()) * 0.5 + torch.sin(x)
class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(D, D) / 8) for _ in range(2 * N)])
    def forward(self, x):
        for i in range(N):
            x = block_fn(x, self.w[2*i], self.w[2*i+1])
        return x
m = Flat().eval(); x = torch.randn(16, D)
from torch.fx.experimental.proxy_tensor import make_fx
sub = make_fx(lambda x, a, b: (block_fn(x, a, b),))(x, m.w[0].detach(), m.w[1].detach())
# build outer graph by hand
g = fx.Graph(); xin = g.placeholder("x")
root = torch.nn.Module(); root.sub = sub
for i in range(2*N): root.register_parameter(f"w{i}", m.w[i])
cur = xin
subn = g.get_attr("sub")
for i in range(N):
    out = g.call_function(invoke_subgraph, (subn, "blk", cur, g.get_attr(f"w{2*i}"), g.get_attr(f"w{2*i+1}")))
    cur = g.call_function(__import__("operator").getitem, (out, 0))
g.output(cur)
outer = fx.GraphModule(root, g)
# sub must return a tuple
flat = make_fx(lambda x: m(x))(x)
with torch.no_grad():
    want = m(x)
    for rep in range(2):
        t = time.perf_counter(); co = compile_fx(outer, [x]); b = time.perf_counter() - t
        t = time.perf_counter(); cf = compile_fx(flat, [x]); a = time.perf_counter() - t
        o = co(x); o = o[0] if isinstance(o, (list, tuple)) else o
        f = cf(x); f = f[0] if isinstance(f, (list, tuple)) else f
        print(f"outlined {b:.1f} s, flat {a:.1f} s; max diff outlined {(o - want).abs().max():.3g}, flat {(f - want).abs().max():.3g}, outlined vs flat {(o - f).abs().max():.3g}", flush=True)
