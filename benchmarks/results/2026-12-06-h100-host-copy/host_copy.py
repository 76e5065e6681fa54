"""Time moving weight-sized storages GPU -> host: pinned per storage, pageable, one pinned slab."""
import time, torch, sys
G = 2**30
n_total = int(sys.argv[1]) if len(sys.argv) > 1 else 16
shapes = [(3072, 3072)] * 4 + [(12288, 3072), (3072, 12288)]  # one W1-like block, ~170 MB
ws = []
while sum(w.numel() * 2 for w in ws) < n_total * G:
    for s in shapes:
        ws.append(torch.randn(s, device="cuda", dtype=torch.bfloat16))
nb = sum(w.numel() * 2 for w in ws)
print(f"{len(ws)} tensors {nb/G:.2f} GiB", flush=True)
def timed(name, fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"{name:<40} {dt:7.2f} s  {nb/G/dt:6.2f} GiB/s", flush=True)
    return out
def flat(w): return w.view(-1).view(torch.uint8)
def pinned_each():
    out = []
    for w in ws:
        h = torch.empty(w.numel() * 2, dtype=torch.uint8, pin_memory=True); h.copy_(flat(w)); out.append(h)
    return out
def alloc_pinned_each():
    return [torch.empty(w.numel() * 2, dtype=torch.uint8, pin_memory=True) for w in ws]
def pageable_each():
    out = []
    for w in ws:
        h = torch.empty(w.numel() * 2, dtype=torch.uint8); h.copy_(flat(w)); out.append(h)
    return out
def to_cpu(): return [w.to("cpu") for w in ws]
def slab():
    s = torch.empty(nb, dtype=torch.uint8, pin_memory=True); o = 0
    for w in ws:
        k = w.numel() * 2; s[o:o + k].copy_(flat(w), non_blocking=True); o += k
    return s
def staged():  # D2H through two pinned staging buffers into pageable memory
    st = [torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    ev = [torch.cuda.Event(), torch.cuda.Event()]
    out = []
    for w in ws:
        src = flat(w); h = torch.empty(src.numel(), dtype=torch.uint8); out.append(h)
        for j, o in enumerate(range(0, src.numel(), 256 << 20)):
            k = min(256 << 20, src.numel() - o); b = st[j % 2]
            ev[j % 2].synchronize()
            b[:k].copy_(src[o:o + k], non_blocking=True); ev[j % 2].record()
            ev[j % 2].synchronize(); h[o:o + k].copy_(b[:k])
    return out
def prefault_each():
    out = []
    for w in ws:
        h = torch.empty(w.numel() * 2, dtype=torch.uint8); h.zero_(); h.copy_(flat(w)); out.append(h)
    return out
def prefault_all_then_copy():
    hs = [torch.empty(w.numel() * 2, dtype=torch.uint8) for w in ws]
    for h in hs: h.zero_()
    for h, w in zip(hs, ws): h.copy_(flat(w))
    return hs
def registered_slab():
    s = torch.empty(nb, dtype=torch.uint8); s.zero_()
    r = torch.cuda.cudart().cudaHostRegister(s.data_ptr(), nb, 0)
    o = 0
    for w in ws:
        k = w.numel() * 2; s[o:o + k].copy_(flat(w), non_blocking=True); o += k
    torch.cuda.synchronize(); torch.cuda.cudart().cudaHostUnregister(s.data_ptr())
    return s
print("threads", torch.get_num_threads(), flush=True)
for name, fn in [("prefault (zero_) + copy, each", prefault_each),
                 ("prefault all, then copy", prefault_all_then_copy),
                 ("registered slab (zero_ + cudaHostRegister)", registered_slab),
("pageable torch.empty + copy_", pageable_each), ("tensor.to('cpu')", to_cpu),
                 ("pinned alloc only, per storage", alloc_pinned_each),
                 ("pinned per storage + copy_", pinned_each),
                 ("one pinned slab + copies", slab), ("staged via 2x256MB pinned", staged),
                 ("pageable again", pageable_each)]:
    r = timed(name, fn); del r
    torch.cuda.synchronize()
h = pageable_each()
timed("back: pageable -> device copy_", lambda: [flat(w).copy_(x) for w, x in zip(ws, h)])
