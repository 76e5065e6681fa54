"""D2H staged copy into fresh pageable memory: torch.empty against an mmap advised for huge pages."""
import mmap, time, torch
import kopt.offload as O
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
      open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip(), flush=True)
n = 256 << 20
srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for _ in range(16)]  # 4 GiB
def huge(k):
    m = mmap.mmap(-1, k, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)
real_empty = torch.empty
for label in ("empty", "thp", "empty", "thp"):
    if label == "thp":
        O.torch.empty = lambda k, dtype=None, **kw: huge(k) if dtype is torch.uint8 and not kw and k >= 1 << 20 else real_empty(k, dtype=dtype, **kw)
    else:
        O.torch.empty = real_empty
    torch.cuda.synchronize(); t = time.perf_counter()
    outs = [O._to_host(s) for s in srcs]
    dt = time.perf_counter() - t
    O.torch.empty = real_empty
    ok = all(torch.equal(o[:1000], s[:1000].cpu()) for o, s in zip(outs, srcs))
    print(f"{label}: 4 GiB in {dt:.3f} s = {4/dt:.2f} GiB/s, equal {ok}", flush=True)
    del outs
