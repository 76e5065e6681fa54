"""kopt.streams: which nodes of a graph go to a side stream, and the waits that keep every
cross-stream read ordered after its producer (checked here by an independent walk of the
rewritten graph and by running it; the CUDA streams themselves in tests/gpu)."""

from __future__ import annotations

import operator
import weakref

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kopt import streams
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.models import build
from kopt.models.zoo import ZOO
from kopt.models.zoo import build as zoo_build
from kopt.passes.config import FP8Config, PassConfig
from kopt.verify import VerifyOptions


class TwoStream(nn.Module):
    """A double-stream block, twice: image and text rows through their own projections, a
    joint product of the two, split back; ``third`` adds a third independent branch."""

    def __init__(self, dim: int = 32, third: bool = False) -> None:
        super().__init__()
        self.img = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.txt = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.third = nn.Linear(dim, dim) if third else None

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        extra = self.third(img * 2) if self.third is not None else None
        for layer in range(2):
            i = torch.relu(self.img[2 * layer](img))
            t = torch.relu(self.txt[2 * layer](txt)) * 0.5
            joint = torch.cat([t, i])
            mixed = joint @ joint.t() @ joint  # the joint step: both branches meet
            t, i = mixed[: txt.shape[0]], mixed[txt.shape[0]:]
            img = img + self.img[2 * layer + 1](i)
            txt = txt + self.txt[2 * layer + 1](t)
        return (img, txt) if extra is None else (img, txt, extra)


class Chain(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def _traced(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    with torch.no_grad():
        return make_fx(model)(*inputs)


class Recorder(TorchDispatchMode):
    """A stand-in for BranchStreams on the CPU that checks, under a dispatch mode, every op's
    storages for the races two CUDA streams could run into, from the tensors alone (not from
    the graph, so it does not share the rewrite's idea of which nodes are views):

    - a read of a storage the other stream wrote, not covered by a wait of the reading stream
      (read after write);
    - a storage freed (its last tensor gone) after the other stream read it, before the stream
      that allocated it waited for that read: the caching allocator would hand the block to that
      stream's next allocation while the read may still run (write after read)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.stream = streams.MAIN
        self.seq = [0, 0]  # ops launched per stream
        self.waited = [0, 0]  # how many of the other stream's ops each has waited for
        self.written: dict[int, tuple[int, int]] = {}  # storage -> (stream, op)
        self.live: dict[int, tuple[int, list, dict]] = {}  # storage -> (stream, refs, reads)
        self.races: list[str] = []

    def main_waits(self, *held: object) -> None:
        self.log.append("main_waits")
        self.waited[streams.MAIN] = self.seq[streams.SIDE]

    def side_waits(self, *held: object) -> None:
        self.log.append("side_waits")
        self.waited[streams.SIDE] = self.seq[streams.MAIN]

    def on_side(self, fn, args, kwargs):  # noqa: ANN001, ANN201
        self.log.append("side")
        self.stream = streams.SIDE
        try:
            return fn(*args, **kwargs)
        finally:
            self.stream = streams.MAIN

    def _freed(self, op: str) -> None:
        for ptr, (alloc, refs, reads) in list(self.live.items()):
            if all(r() is None for r in refs):
                del self.live[ptr]
                self.races += [f"write after read: freed before {op}" for c, at in reads.items()
                               if c != alloc and self.waited[alloc] < at]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._freed(str(func))
        sources = {t.untyped_storage().data_ptr() for t in ins}
        for o in outs:  # views keep their storage alive too
            if o.untyped_storage().data_ptr() in self.live:
                self.live[o.untyped_storage().data_ptr()][1].append(weakref.ref(o))
        if all(o.untyped_storage().data_ptr() in sources for o in outs) \
                and not func._schema.is_mutable:
            return out  # an alias: no read, no write
        c = self.stream
        self.seq[c] += 1
        for t in ins:
            ptr = t.untyped_storage().data_ptr()
            w = self.written.get(ptr)
            if w is not None and w[0] != c and self.waited[c] < w[1]:
                self.races.append(f"read after write: {func} reads the other stream's value")
            if ptr in self.live:
                self.live[ptr][2][c] = self.seq[c]
        for o in outs:
            ptr = o.untyped_storage().data_ptr()
            if ptr not in sources:
                self.written[ptr] = (c, self.seq[c])
                self.live[ptr] = (c, [weakref.ref(o)], {})
        return out


def _stream(n: fx.Node) -> int:
    return streams.SIDE if isinstance(n.target, streams.OnSide) else streams.MAIN


def _producer(n: fx.Node) -> fx.Node:
    while streams.is_alias(n) and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return n


def _wait_kind(n: fx.Node) -> int | None:
    name = getattr(n.target, "__name__", "")
    return {"main_waits": streams.MAIN, "side_waits": streams.SIDE}.get(name)


def check_ordering(gm: fx.GraphModule) -> None:
    """Every node reading a value the other stream computed comes after a wait of its own
    stream that comes after the value's producer; the side stream's first node after a wait
    for the main stream; the output after the main stream's wait for the side stream."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    waits = [(order[n], _wait_kind(n)) for n in gm.graph.nodes if _wait_kind(n) is not None]
    work = [n for n in gm.graph.nodes if n.op == "call_function" and _wait_kind(n) is None
            and not streams.is_alias(n)]

    def waited(stream: int, after: int, before: int) -> bool:
        return any(after < k < before and s == stream for k, s in waits)

    first_side = next((n for n in work if _stream(n) == streams.SIDE), None)
    if first_side is not None:
        assert waited(streams.SIDE, -1, order[first_side])
    for n in work:
        c = _stream(n)
        for i in n.all_input_nodes:
            p = _producer(i)
            if p.op in ("placeholder", "get_attr"):
                continue
            if _stream(p) != c:
                assert waited(c, order[p], order[n]), f"{n.name} reads {p.name} unordered"
    last_side = max((order[n] for n in work if _stream(n) == streams.SIDE), default=-1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if last_side >= 0:
        assert waited(streams.MAIN, last_side, order[output])


def check_rewritten(gm: fx.GraphModule, rec: Recorder, inputs: list, want: object) -> None:
    """The rewritten graph's waits order every cross-stream read, it runs without a race
    (:class:`Recorder`), and it computes ``want``."""
    check_ordering(gm)
    with rec, torch.no_grad():
        got = gm(*inputs)
    assert not rec.races, rec.races[:3]
    assert all(torch.equal(g, h) for g, h in zip(torch.utils._pytree.tree_leaves(got),
                                                  torch.utils._pytree.tree_leaves(want),
                                                  strict=True))


def test_the_lighter_branch_goes_to_the_side_stream() -> None:
    model = TwoStream()
    img, txt = torch.randn(24, 32), torch.randn(6, 32)
    gm = _traced(model, img, txt)
    a = streams.assign(gm.graph)
    assert a.why_not is None
    gemms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    side = [n for n in gemms if n in a.side]
    # the four text projections (6 rows) and none of the image's (24)
    assert len(side) == 4
    assert all(streams._val(n).shape[0] == 6 for n in side)
    # the joint products read both branches: main
    joint = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert joint and not any(n in a.side for n in joint)
    # the text relu and scaling run beside their GEMMs
    relus = [n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default
             and streams._val(n).shape[0] == 6]
    assert relus and all(n in a.side for n in relus)


def _rewritten(model: nn.Module):  # noqa: ANN202
    """``model`` on 24 image and 6 text rows, traced, its branches assigned and rewritten:
    (graph, assignment, recorder, waits); the graph's outputs before are checked after."""
    torch.manual_seed(0)
    img, txt = torch.randn(24, 32), torch.randn(6, 32)
    gm = _traced(model, img, txt)
    want = gm(img, txt)
    a = streams.assign(gm.graph)
    rec = Recorder()
    waits = streams.apply(gm, a.side, rec)
    check_rewritten(gm, rec, [img, txt], want)
    return gm, a, rec, waits


def test_the_rewritten_graph_orders_every_cross_stream_read_and_computes_the_same() -> None:
    gm, _, rec, waits = _rewritten(TwoStream())
    assert waits == sum(1 for n in gm.graph.nodes if _wait_kind(n) is not None) > 0
    assert rec.log.count("side") == sum(1 for n in gm.graph.nodes if _stream(n) == streams.SIDE)
    assert rec.log[0] == "side_waits" or rec.log.index("side_waits") < rec.log.index("side")
    assert rec.log[-1] == "main_waits"


class RunsOn(nn.Module):
    """The side branch runs on after the main branch has read one of its values, never waiting
    for the main stream again: nothing but holding that value to the end keeps the side
    stream's next allocations off it while the main stream reads it."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.img = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.txt = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = torch.relu(self.txt[0](txt))
        i = self.img[0](img) + t.sum(0)  # the main branch reads the side branch's value
        for layer in self.txt[1:]:  # ... which goes on alone
            t = torch.relu(layer(t))
        for layer in self.img[1:]:
            i = torch.relu(layer(i))
        return i, t


def test_a_value_the_main_stream_read_is_held_while_the_side_stream_runs_on() -> None:
    gm, a, rec, _ = _rewritten(RunsOn())
    assert a.side_heavy == 4
    assert "side_waits" not in rec.log[1:]  # the side stream waits once, at its start
    last = [n for n in gm.graph.nodes if _wait_kind(n) == streams.MAIN][-1]
    read = {i for n in gm.graph.nodes if n.op == "call_function" and _stream(n) == streams.MAIN
            and _wait_kind(n) is None for i in n.all_input_nodes
            if i.op == "call_function" and _stream(_producer(i)) == streams.SIDE}
    assert read and read <= set(last.args)  # held to the end


def test_a_chain_stays_on_one_stream() -> None:
    gm = _traced(Chain(), torch.randn(8, 32))
    a = streams.assign(gm.graph)
    assert not a.side
    assert "no concurrent branch" in a.why_not


def test_a_third_branch_stays_on_the_main_stream() -> None:
    gm, a, _, _ = _rewritten(TwoStream(third=True))
    third = next(n for n in gm.graph.nodes if n.name == "addmm")  # the first projection
    assert third.args[1].target is torch.ops.aten.mul.Tensor  # of img * 2: the third branch
    assert third not in a.side  # concurrent with both chains' ends when it came


def test_a_graph_that_writes_in_place_keeps_one_stream() -> None:
    def f(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, b = x @ w, y @ w
        a.add_(1.0)
        return torch.cat([a, b]) @ w

    gm = make_fx(f)(torch.randn(8, 16), torch.randn(4, 16), torch.randn(16, 16))
    a = streams.assign(gm.graph)
    assert not a.side and "in place" in a.why_not


def _optimized(name: str, fp8: bool):  # noqa: ANN202
    """(workload, capture, optimized graph) of a model of kopt.models or of its zoo,
    unverified."""
    w = (zoo_build if name in ZOO else build)(name, device="cpu", dtype=torch.bfloat16)
    cap = capture_module(w.model, w.args, w.kwargs)
    config = PassConfig(fp8=FP8Config(min_features=16) if fp8 else None)
    gm = optimize_captured(cap, config, VerifyOptions(enabled=False), None, w.name, 0.0).gm
    return w, cap, gm


@pytest.mark.parametrize(("name", "fp8"), [
    ("qwen-image-tiny", False), ("qwen-image-tiny", True), ("flux2-tiny", True),
    ("wan2.1", True),  # the side stream: the text states' cross-attention keys and values
])
def test_the_text_branch_goes_to_the_side_stream_without_a_race(name: str, fp8: bool) -> None:
    w, cap, gm = _optimized(name, fp8)
    want = gm(*cap.example_inputs)
    a = streams.assign(gm.graph)
    text_rows = w.kwargs["encoder_hidden_states"].shape[1]
    side_gemms = [n for n in a.side if streams.heavy_flop(n) > 0]
    assert side_gemms and a.side_heavy == len(side_gemms)
    assert all(streams._val(n).shape[-2] == text_rows for n in side_gemms)
    main_gemms = [n for n in gm.graph.nodes if streams.heavy_flop(n) > 0 and n not in a.side]
    assert all(streams._val(n).shape[-2] != text_rows for n in main_gemms)
    rec = Recorder()
    streams.apply(gm, a.side, rec)
    check_rewritten(gm, rec, cap.example_inputs, want)


def test_getitem_and_views_are_aliases() -> None:
    gm = make_fx(lambda x: torch.split(x, 2)[0].view(-1))(torch.randn(4, 3))
    kinds = {n.target: streams.is_alias(n) for n in gm.graph.nodes
             if n.op == "call_function"}
    assert kinds[operator.getitem] and kinds[torch.ops.aten.view.default]


def test_the_execution_plan_runs_the_side_stream_after_its_bindings(monkeypatch) -> None:  # noqa: ANN001
    """The plan's lowering: branches chosen on the ops, views still known as views once the
    Python bindings replaced their targets (a view taken for work would free its base before
    the read that follows it), the waits ordering every cross-stream read."""
    from kopt import runtime
    from kopt.graph.splice import copy_graph_module

    _, cap, gm = _optimized("qwen-image-tiny", fp8=True)
    want = gm(*cap.example_inputs)
    rec = Recorder()
    monkeypatch.setattr(runtime.streams, "graph_device", lambda graph: torch.device("cuda"))
    monkeypatch.setattr(runtime.streams, "BranchStreams", lambda device: rec)
    summary = runtime.PlanSummary()
    plan = runtime._lower(copy_graph_module(gm), summary, [], runtime.STAGES,
                          branch_streams=True)
    assert summary.streams.startswith("two streams"), summary.streams
    assert summary.bound > 0  # bindings ran
    bound_views = [n for n in plan.graph.nodes if n.op == "call_function"
                   and not isinstance(n.target, torch._ops.OpOverload)
                   and n.target is not operator.getitem and streams.is_alias(n)]
    assert bound_views  # views through their bindings, still known as views
    check_rewritten(plan, rec, cap.example_inputs, want)
    assert "side" in rec.log and rec.log[-1] == "main_waits"
