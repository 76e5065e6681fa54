"""The device model: how long a graph's counted work takes on one device.

Per node, a roofline scaled by a fitted efficiency, plus fixed costs per launch::

    kernel_ms = launches x fixed_us[kind] + roofline / efficiency[kind]
    roofline  = max(flops / peak[dtype], bytes / bandwidth)
    host_ms   = node_us + launches x launch_us  (an op that launches nothing: + view_us;
                                               Python such as getitem: 0)

and per call, by how the host and the device overlap:

    CPU (synchronous)        total = sum(kernel_ms) + sum(host_ms)
    CUDA, eager              total = max(sum(kernel_ms) + launches x graph_launch_us, sum(host_ms))
    CUDA, CUDA graph replay  total = sum(kernel_ms) + launches x graph_launch_us

The eager form says that a launch-bound graph (decode, small token counts) runs at the host's
pace and a compute-bound one at the device's: a fusion that saves launches then saves time only
in the first case, and a rewrite that adds a kernel to save bytes only in the second.

``efficiency`` and ``fixed_us`` are keyed by op (``aten::_scaled_mm``, ``kopt::rowwise``) where
a trace had enough of it, else by category (``gemm``, ``attention``, ``quantization``,
``elementwise``); ``kernel_us`` is the fixed cost of anything else.
A GPU at its power cap clocks down, and how far depends on the graph's mix: memory-bound
kernels draw less than the cap (a copy on the H200: 469 W of its 700 W), so a graph with
more memory-bound time leaves more power to its compute-bound kernels, which then run at a
higher clock. With the cap and the memory-bound power known (``power_cap_w``,
``memory_power_w``), a compute-bound kernel's time is its rate's (fitted at the reference
clock of a graph of compute-bound kernels only) times the graph's clock factor::

    power left to compute   P_c(s) = (P_cap - s x P_mem) / (1 - s)     s: memory-bound share
    clock factor            m(s)   = (P_c(s) / P_cap) ^ (-1 / clock_exponent)   (m(0) = 1)

(dynamic power grows as the cube of the clock, the voltage rising with it), no lower than
``1 / max_boost``. Measured on the H200 (RESULTS.md, 2026-12-02): FLUX.2's FP8 graph without
the QK-norm + RoPE fusion adds 96 ms of memory-bound kernels per call, and its unchanged FP8
GEMMs then run 4% faster, its attention 5%.

The shipped :data:`H200` parameters are datasheet peaks, the measured copy bandwidth and launch
costs, with efficiencies from the GEMM measurements in ARCHITECTURE.md; :func:`kopt.cost.fit`
replaces the efficiencies and fixed costs by least squares on a profiler trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from kopt.cost.counts import OpCount


@dataclass(frozen=True)
class Prediction:
    """Modelled time of one call of a graph, and what it is made of."""

    total_ms: float
    device_ms: float  # sum of kernel times
    host_ms: float  # sum of dispatch times
    kernels: float  # launches per call
    flops: float
    bytes: float
    by_category: Mapping[str, float] = field(default_factory=dict)  # kernel ms per category


# Time of a GEMM with a bias epilogue over the same GEMM without (rate key ``op[bias]``, see
# :func:`kopt.cost.counts.layout`). H200, cuBLAS FP8 at W1's four GEMM shapes (4096 x {9216,
# 3072, 12288, 3072} x {3072, 3072, 3072, 12288}): 799.8 us with a bias, 774.3 without
# (benchmarks/probes/bias_add.py; RESULTS.md, 2026-11-30). Without it, what absorbing the biases
# saves was overpredicted by the whole epilogue's cost.
EPILOGUE_SLOWDOWN: dict[str, float] = {"aten::_scaled_mm": 1.033}

# Time of an FP8 GEMM accumulating exactly over the same GEMM accumulating fast (rate key
# ``op[fast]``: ``torch._scaled_mm(use_fast_accum=True)``, ``FP8Config(accumulate="fast")``).
# H200, W1's FP8 GEMMs replayed from a CUDA graph: 51.00 ms a forward exact, 44.38 fast (two
# runs of benchmarks/e2e.py, RESULTS.md, 2026-12-04); W2, at the power cap, 203.15 / 188.88.
FAST_ACCUM_SPEEDUP: dict[str, float] = {"aten::_scaled_mm": 51.00 / 44.38}


def layout_factor(c: OpCount) -> float:
    """Time of ``c``'s kernel over its op's at the op's rate, for a GEMM whose layout runs at
    another speed (a bias epilogue, fast accumulation); 1 for every other op."""
    layout = c.layout.split(",")
    factor = EPILOGUE_SLOWDOWN.get(c.op, 1.0) if "bias" in layout else 1.0
    if "fast" in layout:
        factor /= FAST_ACCUM_SPEEDUP.get(c.op, 1.0)
    return factor


@dataclass(frozen=True)
class DeviceModel:
    name: str
    peak_tflops: Mapping[str, float]  # dense peak by GEMM operand dtype ("bfloat16", ...)
    bandwidth_gbs: float
    launch_us: float = 4.0  # host time per launch in eager mode (on a CPU: per op)
    host_us: Mapping[str, float] = field(default_factory=dict)  # op: launch_us where it differs
    view_us: float = 0.0  # host time of an aten op that launches nothing (a view)
    node_us: float = 0.0  # host time of every node on top: the graph's own Python
    # the same for a hoisted region's nodes, from its measured miss (None: node_us): they are
    # mostly views of one merged GEMM, far cheaper than the average node of the graph
    region_node_us: float | None = None
    graph_launch_us: float | None = 1.0  # per launch in a CUDA graph replay; None: no graphs
    kernel_us: float = 0.0  # device time every kernel takes on top of its roofline time
    fixed_us: Mapping[str, float] = field(default_factory=dict)  # op or category: kernel_us
    efficiency: Mapping[str, float] = field(default_factory=dict)  # op or category -> fraction
    kernels_per_op: Mapping[str, float] = field(default_factory=dict)  # where not 1
    asynchronous: bool = True  # host launches overlap device work (CUDA)
    source: str = ""
    # the power model (module docstring); off where either is None
    power_cap_w: float | None = None
    memory_power_w: float | None = None
    clock_exponent: float = 3.0
    max_boost: float = 1.0  # the highest clock over the reference clock

    @property
    def power_limited(self) -> bool:
        return bool(self.power_cap_w and self.memory_power_w is not None)

    def compute_bound(self, c: OpCount) -> bool:
        """Whether the kernel's roofline time is its FLOPs' (what a lower clock slows)."""
        return bool(c.kernel and c.flops and
                    c.flops / (self.peak(c.dtype) * 1e9) > c.bytes / (self.bandwidth_gbs * 1e6))

    def clock_factor(self, memory_share: float) -> float:
        """Compute-bound kernel time in a graph whose kernel time is ``memory_share``
        memory-bound, over its time at the reference clock (1 without the power model)."""
        if not self.power_limited:
            return 1.0
        s = min(max(memory_share, 0.0), 0.99)
        rho = self.memory_power_w / self.power_cap_w
        m = ((1 - rho * s) / (1 - s)) ** (-1 / self.clock_exponent)
        return max(m, 1 / self.max_boost)

    def kernel_times(self, counts: Sequence[OpCount],
                     weights: Sequence[float] | None = None) -> list[float]:
        """Each node's kernel time (ms) in the graph of ``counts``, the compute-bound ones at
        the clock the graph's mix leaves them (:meth:`clock_factor`)."""
        base = [self.kernel_ms(c) for c in counts]
        if not self.power_limited:
            return base
        w = weights if weights is not None else [1.0] * len(counts)
        bound = [self.compute_bound(c) for c in counts]
        compute = sum(f * t for t, b, f in zip(base, bound, w, strict=True) if b)
        memory = sum(f * t for t, b, f in zip(base, bound, w, strict=True) if not b)
        factor = 1.0
        for _ in range(50):  # the share depends on the factor: its fixed point
            total = factor * compute + memory
            new = self.clock_factor(memory / total if total > 0 else 0.0)
            if abs(new - factor) < 1e-12:
                break
            factor = new
        return [t * factor if b else t for t, b in zip(base, bound, strict=True)]

    def peak(self, dtype: str) -> float:
        """TFLOP/s for GEMM operands of ``dtype``; the lowest known peak for others."""
        return self.peak_tflops.get(dtype) or min(self.peak_tflops.values())

    def roofline_ms(self, flops: float, nbytes: float, dtype: str) -> float:
        """Time at the device's ceilings (peak rate for ``dtype``, bandwidth)."""
        return max(flops / (self.peak(dtype) * 1e9), nbytes / (self.bandwidth_gbs * 1e6))

    def efficiency_of(self, c: OpCount) -> float:
        """By op, operand layout and element type (``aten::add[broadcast]@bfloat16``), else
        op and layout (``aten::add[broadcast]``), else op, else category, else
        ``*`` (every other kernel), else 1. A GEMM without a rate of its own layout runs at its
        op's rate, :data:`EPILOGUE_SLOWDOWN` slower with a bias epilogue (``[bias]``) and
        :data:`FAST_ACCUM_SPEEDUP` faster accumulating fast (``[fast]``)."""
        for key in (c.dtype_key, c.rate_key, c.op, c.category, "*"):
            if key in self.efficiency:
                rate = self.efficiency[key]
                if key not in (c.dtype_key, c.rate_key):
                    rate /= layout_factor(c)
                return rate
        return 1.0

    def fixed_of(self, c: OpCount) -> float:
        """Device time (us) a kernel of ``c``'s op takes on top of its roofline time."""
        for key in (c.op, c.category):
            if key in self.fixed_us:
                return self.fixed_us[key]
        return self.kernel_us

    def launches(self, c: OpCount) -> float:
        return self.kernels_per_op.get(c.op, 1.0) if c.kernel else 0.0

    def kernel_ms(self, c: OpCount) -> float:
        if not c.kernel:
            return 0.0
        return (self.launches(c) * self.fixed_of(c) / 1e3
                + self.roofline_ms(c.flops, c.bytes, c.dtype) / self.efficiency_of(c))

    def host_ms(self, c: OpCount) -> float:
        """Host time of the node: ``node_us`` for the graph's Python around an op call, and
        the op's dispatch and launches. A node that dispatches nothing (``operator.getitem``
        of a split's tuple: a tuple index, tens of ns) costs nothing: charged ``node_us``,
        the 1082 getitems of W1's hoisted modulation region made its predicted miss 13 ms
        slower (RESULTS.md, 2026-12-02, H200)."""
        if not c.dispatched:
            return 0.0
        op = self.launches(c) * self.host_us.get(c.op, self.launch_us) if c.kernel else \
            self.view_us
        return (self.node_cost_us(c) + op) / 1e3

    def node_cost_us(self, c: OpCount) -> float:
        """The graph's Python around the node's op call: ``region_node_us`` in a hoisted
        region where it was measured, else ``node_us``."""
        if c.cached is not None and self.region_node_us is not None:
            return self.region_node_us
        return self.node_us

    def op_host_ms(self, c: OpCount) -> float:
        """The op's own host time, without the graph's Python around it (``node_us``)."""
        return self.host_ms(c) - (self.node_cost_us(c) / 1e3 if c.dispatched else 0.0)

    def predict(self, counts: Iterable[OpCount], *, cuda_graphs: bool = False,
                weights: Sequence[float] | None = None) -> Prediction:
        """Time per call of the nodes ``counts``; ``weights``: the fraction of calls each runs
        in (a hoisted region's nodes run only when its cache misses).

        Eager (asynchronous device): the host's launches and the device's kernels overlap, so a
        call takes the longer of the two. Replayed from a CUDA graph: the graph's kernels back
        to back, each with its in-graph launch gap, no host time -- except the hoisted regions,
        which run eagerly before the replay (a graph would replay one timestep's values for
        every later one, :mod:`kopt.cudagraphs`): on a miss their launches and kernels are paid
        like an eager call's, in series with the replay; their trailing views
        (``OpCount.replayed``) the replay computes for free."""
        counts = list(counts)
        w = weights if weights is not None else [1.0] * len(counts)
        graphs = cuda_graphs and self.graph_launch_us is not None
        parts = {"body": [0.0, 0.0, 0.0], "prelude": [0.0, 0.0, 0.0]}  # device, host, kernels
        flops = nbytes = 0.0
        by_category: dict[str, float] = {}
        times = self.kernel_times(counts, w)
        for c, f, t in zip(counts, w, times, strict=True):
            if f == 0:
                continue
            k = f * t
            part = parts["prelude" if graphs and c.cached is not None and not c.replayed
                         else "body"]
            part[0] += k
            part[1] += f * self.host_ms(c)
            part[2] += f * self.launches(c)
            flops += f * c.flops
            nbytes += f * c.bytes
            by_category[c.category] = by_category.get(c.category, 0.0) + k

        def eager(device: float, host: float, kernels: float) -> float:
            gap = (self.graph_launch_us or 0.0) * kernels / 1e3
            return max(device + gap, host) if self.asynchronous else device + host

        device, host, kernels = (sum(v) for v in zip(*parts.values(), strict=True))
        if graphs:
            body, prelude = parts["body"], parts["prelude"]
            total = body[0] + self.graph_launch_us * body[2] / 1e3 + eager(*prelude)
            host = prelude[1]
        else:
            total = eager(device, host, kernels)
        return Prediction(total, device, host, kernels, flops, nbytes, by_category)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DeviceModel:
        """The model ``to_json`` wrote; ValueError names what is wrong with any other text."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a DeviceModel is a JSON object, got a {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls)
                    if f.default is MISSING and f.default_factory is MISSING}
        problems = []
        if data.keys() - known:
            problems.append(f"unknown fields {', '.join(sorted(data.keys() - known))}")
        if required - data.keys():
            problems.append(f"missing fields {', '.join(sorted(required - data.keys()))}")
        if problems:
            raise ValueError(f"{'; '.join(problems)} (a DeviceModel has "
                             f"{', '.join(sorted(known))})")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> DeviceModel:
        return cls.from_json(Path(path).read_text())

    def with_(self, **changes: object) -> DeviceModel:
        return replace(self, **changes)

    def describe(self) -> str:
        peaks = ", ".join(f"{k} {v:g}" for k, v in sorted(self.peak_tflops.items()))
        eff = ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.efficiency.items()))
        fixed = "".join(f", {k} {v:.2f}" for k, v in sorted(self.fixed_us.items()))
        host = "".join(f", {k} {v:.0f}" for k, v in sorted(self.host_us.items()))
        graph = "-" if self.graph_launch_us is None else f"{self.graph_launch_us:.2f}"
        region = "" if self.region_node_us is None else \
            f", hoisted region node {self.region_node_us:.2f}"
        power = (f"; power cap {self.power_cap_w:.0f} W, memory-bound kernels "
                 f"{self.memory_power_w:.0f} W, clock up to {self.max_boost:.2f}x"
                 if self.power_limited else "")
        return (f"{self.name}: peak TFLOP/s {peaks}; {self.bandwidth_gbs:g} GB/s; launch "
                f"{self.launch_us:.2f} us (view {self.view_us:.2f}, node {self.node_us:.2f}"
                f"{region}, "
                f"graph {graph}{host}); kernel fixed us {self.kernel_us:.2f}{fixed}; efficiency "
                f"{eff or '1.0'}{power}"
                + (f" [{self.source}]" if self.source else ""))


# Datasheet dense peaks (FP8/BF16 tensor cores; FP32 without TF32: torch's default matmul
# precision), the measured copy bandwidth and launch costs; efficiencies from the measured GEMMs
# (BF16 ~790 TFLOP/s, the FP8 GEMMs 1030-1270 on W1/W2 shapes); attention and element-wise
# efficiencies are first guesses that the fit to an H200 trace replaces.
H200 = DeviceModel(
    name="NVIDIA H200",
    peak_tflops={"float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0, "bfloat16": 989.0,
                 "float16": 989.0, "float32": 67.0},
    bandwidth_gbs=4247.0,
    launch_us=4.0,
    # kopt's autotuned Triton GEMM through its custom op: the W1 ablation of the GEMM epilogue
    # measured 55.5 ms per call more host time for its 238 launches than for the _scaled_mm +
    # add it replaced (RESULTS.md, 2026-11-30; the BF16 GEMM has the same launcher: assumed the
    # same).
    # Measured before the direct launch (which took the op's host time 122 -> 52 us against
    # _scaled_mm's 15-17 in a microbenchmark; RESULTS.md, 2026-12-01); not refitted since: a
    # trace's fit replaces it
    host_us={"kopt::fp8_gemm": 240.0, "kopt::bf16_gemm": 240.0},
    view_us=1.0,
    graph_launch_us=1.0,
    kernel_us=1.5,
    # kopt::fp8_gemm: W1's 478 GEMMs replayed from a CUDA graph took 48.87-48.99 ms of kernel
    # time against cuBLAS's 49.89 (persistent configs; RESULTS.md, 2026-12-01): 0.98x
    # _scaled_mm's time
    # aten::cat[strided]: ATen's cat of strided row slices (the joint [text; image] V out of
    # merged QKV outputs), 81.3 us for W1's 51.9 MB (benchmarks/kernels_cat.py; RESULTS.md,
    # 2026-11-30): 0.15 of the copy bandwidth. Traces of kopt's own graphs rarely hold one (cat_rows
    # replaces it), and the fit would cost it at the contiguous cats' rate.
    efficiency={"gemm": 0.8, "aten::_scaled_mm": 0.58, "kopt::fp8_gemm": 0.59,
                "kopt::fp8_blockwise_mm": 0.55, "attention": 0.55, "elementwise": 0.75,
                "quantization": 0.6, "aten::cat[strided]": 0.15},
    asynchronous=True,
    source="datasheet peaks, measured copy bandwidth and GEMM rates; not fitted",
)

# The H100 SXM (80 GB HBM3; the device machine lends one at times): the H200's Hopper die with
# the same tensor-core peaks and power cap, and 3.35 TB/s of HBM3 against the H200's 4.8. Its
# copy bandwidth is the datasheet's times the fraction the H200 reaches of its own (4247 / 4800),
# not measured on an H100; a fit to an H100 trace replaces it and the efficiencies.
H100 = H200.with_(name="NVIDIA H100 80GB HBM3", bandwidth_gbs=round(3350.0 * 4247.0 / 4800.0),
                  source="the H200's model with the H100 SXM's datasheet bandwidth; not fitted")

KNOWN: tuple[DeviceModel, ...] = (H200, H100)


def known_device(name: str) -> DeviceModel | None:
    """The shipped model of a device by its name (``torch.cuda.get_device_name()``)."""
    for d in KNOWN:
        if d.name.lower() in name.lower() or name.lower() in d.name.lower():
            return d
    return None
