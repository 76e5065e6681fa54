"""What the profiler records of a CUDA graph replay (kernels, their times and windows):
the diagnosis behind kopt.profile.profile_replay.

    python -m benchmarks.probes.replay_trace
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    x = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")

    def f() -> torch.Tensor:
        return torch.relu(x @ w).sum(0)

    for _ in range(2):
        f()
    torch.cuda.synchronize()
    for when in ("capture inside", "capture before"):
        g = torch.cuda.CUDAGraph()
        if when == "capture before":
            with torch.cuda.graph(g):
                f()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if when == "capture inside":
                with torch.cuda.graph(g):
                    f()
            with record_function("eager"):
                f()
                torch.cuda.synchronize()
            for i in range(2):
                with record_function(f"replay{i}"):
                    g.replay()
                    torch.cuda.synchronize()
        raw = prof.profiler.kineto_results.events()
        print(f"== {when}: {len(raw)} raw events, device types",
              Counter(str(e.device_type()) for e in raw))
        for e in raw:
            if e.name() in ("eager", "replay0", "replay1"):
                print("  window", e.name(), e.start_ns(), e.duration_ns(), e.device_type())
        for e in raw:
            if e.device_type() == torch.autograd.DeviceType.CUDA:
                print("  gpu", e.name()[:60], e.start_ns(), e.duration_ns(),
                      "corr", e.correlation_id(), "linked", e.linked_correlation_id())
        names = Counter(e.name for e in prof.events())
        print("  function events with 'Graph' or 'graph':",
              {k: v for k, v in names.items() if "raph" in k})
        print("  function events on CUDA:",
              sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA")))


if __name__ == "__main__":
    main()
