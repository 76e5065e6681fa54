"""Python's garbage collector during a hoisted step region's miss, on the ``meta`` device.

    python -m benchmarks.probes.gc_miss --model qwen-image --fp8 --without merge_projections

The ablation's rows measure W1's merge_projections at 3.2-3.4 ms a call where both graphs
timed in one process measure 1.6-1.7 (RESULTS.md, 2026-12-03, H200), and the unmerged graph's
miss is host-bound. One candidate: the ablation's process holds more Python objects (every
row's counts), so the collector could cost the miss more there. This builds "all" and "all -
PASS" on the meta device (no GPU: each op dispatches to its meta kernel, so a call is the host
time of the region's Python and dispatch) and times each graph's step region, called directly,
fresh, with 12 rows of counts held as the ablation holds them, and with the collector off;
per setting, the collections by generation and their time.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.probes.replay_split import build_pair, pair_options
from kopt.cost.counts import count_graph, region_kind
from kopt.graph.regions import CachedRegion


class Collections:
    """Every collection's generation and ms while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.events.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def by_generation(self) -> dict[int, tuple[int, float]]:
        return {g: (sum(1 for e in self.events if e[0] == g),
                    sum(ms for k, ms in self.events if k == g)) for g in (0, 1, 2)}


def step_region(gm, flat: list) -> tuple:
    """The graph's step region (keyed on the timestep) and the arguments one call passes it."""
    node = next(n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), CachedRegion)
                and region_kind(gm, n) == "step")
    module, seen = gm.get_submodule(node.target), {}
    forward = CachedRegion.forward

    def recorded(self, *args):
        if self is module:
            seen["args"] = args
            return self.region(*args)
        return forward(self, *args)

    CachedRegion.forward = recorded
    try:
        gm(*flat)
    finally:
        CachedRegion.forward = forward
    return module.region, seen["args"]


def timed(name: str, region, args, collections: Collections, calls: int) -> None:
    collections.events.clear()
    ms = []
    for _ in range(calls):
        t0 = time.perf_counter()
        region(*args)
        ms.append((time.perf_counter() - t0) * 1e3)
    gens = ", ".join(f"gen {g}: {n} ({t:.2f} ms)" for g, (n, t) in
                     collections.by_generation().items())
    print(f"  {name}: median {statistics.median(ms):.2f} ms, max {max(ms):.2f}; "
          f"collections in {calls} calls: {gens}", flush=True)


def main() -> None:
    p = pair_options(__doc__)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    gms, inputs, _ = build_pair(args, device="meta")
    collections = Collections()
    gc.callbacks.append(collections)
    with torch.no_grad():
        regions = {k: step_region(gm, inputs[0]) for k, gm in gms.items()}
        for k, (region, _) in regions.items():
            print(f"{k}: step region of {len(region.graph.nodes)} nodes", flush=True)
        print(f"fresh ({len(gc.get_objects())} objects tracked):")
        for k, (region, a) in regions.items():
            timed(k, region, a, collections, args.calls)
        held = [tuple(count_graph(gms[k])) for k in gms for _ in range(6)]
        print(f"{len(held)} rows of counts held ({len(gc.get_objects())} objects tracked):")
        for k, (region, a) in regions.items():
            timed(k, region, a, collections, args.calls)
        gc.disable()
        print("collector off:")
        for k, (region, a) in regions.items():
            timed(k, region, a, collections, args.calls)
        gc.enable()
    t0 = time.perf_counter()
    gc.collect()
    print(f"one full collection: {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
