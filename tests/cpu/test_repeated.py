"""Repeated blocks traced once (kopt.repeated): the same graph as a whole-model trace, node for
node, and the same optimized graph; blocks that must not share a trace do not."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import kopt.graph.serialize as serialize
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.graph import attr, module_path
from kopt.graph.serialize import fingerprint
from kopt.models import build
from kopt.passes import FP8Config, PassConfig
from kopt.repeated import find_groups
from kopt.verify import VerifyOptions


def _structure(gm: fx.GraphModule) -> list[tuple]:
    """Every computing node in order: op, target, inputs (placeholders by position, weights by
    name, nodes by position), value shape and dtype, module path."""
    names: dict[fx.Node, str] = {}
    inputs = 0
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = f"input{inputs}"
            inputs += 1
        elif n.op == "get_attr":
            names[n] = f"attr:{n.target}"
        else:
            names[n] = f"node{len(out)}"
            args = fx.node.map_arg((n.args, n.kwargs), lambda x: names[x])
            val = n.meta.get("val")
            out.append((n.op, str(n.target), str(args),
                        (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None,
                        module_path(n)))
    return out


def _run(cap) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(cap.gm(*cap.example_inputs))


@pytest.mark.parametrize("name, traces", [("qwen-image-tiny", 1), ("flux2-tiny", 2)])
def test_repeated_blocks_give_the_whole_model_trace_node_for_node(name, traces):
    w = build(name, dtype=torch.float32)
    once = capture_module(w.model, w.args, w.kwargs)
    whole = capture_module(w.model, w.args, w.kwargs, repeated=False)
    assert once.repeated is not None and whole.repeated is None
    assert once.repeated.traced == traces
    assert once.repeated.instances == sum(len(g.paths) for g in find_groups(w.model))
    assert _structure(once.gm) == _structure(whole.gm)
    for a, b in zip(_run(once), _run(whole), strict=True):
        assert torch.equal(a, b)
    # each instance reads its own weights, the model's tensors themselves
    block1 = w.model.transformer_blocks[1]
    name1 = next(n for n, _ in block1.named_parameters())
    assert once.gm.get_parameter(f"transformer_blocks.1.{name1}") is block1.get_parameter(name1)


def test_the_optimized_graphs_are_the_same_with_and_without_repeated_blocks():
    w = build("qwen-image-tiny", dtype=torch.float32)
    config = PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config())
    off = VerifyOptions(enabled=False)
    specs = [optimize_captured(capture_module(w.model, w.args, w.kwargs, repeated=r), config,
                               off, None, w.name, 0.0) for r in (True, False)]
    assert "repeated blocks transformer_blocks.{0,1}: 1 trace for 2 calls" in str(specs[0].report)
    assert "repeated blocks" not in str(specs[1].report)
    assert specs[0].report.applied == specs[1].report.applied > 0
    assert _structure(specs[0].gm) == _structure(specs[1].gm)
    example = capture_module(w.model, w.args, w.kwargs).example_inputs
    with torch.no_grad():
        for a, b in zip(specs[0].gm(*example), specs[1].gm(*example), strict=True):
            assert torch.equal(a, b)


class _Block(nn.Module):
    def __init__(self, width: int, index: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.index = index

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.relu(self.lin(x)) * scale + self.index


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], scales: list[float] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(blocks)
        self.scales = scales or [1.0] * len(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block, s in zip(self.blocks, self.scales, strict=True):
            x = block(x, scale=s)
        return x


def _check_same(model: nn.Module, x: torch.Tensor) -> object:
    once = capture_module(model, (x,))
    whole = capture_module(model, (x,), repeated=False)
    assert _structure(once.gm) == _structure(whole.gm)
    assert torch.equal(once.gm(x)[0], model(x))
    assert all(isinstance(b, _Block | _Mutating | _Alias) for b in model.blocks)  # restored
    return once.repeated


class _Sigmoid(_Block):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.sigmoid(self.lin(x)) * scale + self.index


def test_the_fingerprint_hashes_what_made_the_graph_until_it_is_edited(monkeypatch):
    """A capture's fingerprint (the warm start's key) comes from the outer trace and the one
    traced block, not from encoding every instance; other code in the blocks is another
    fingerprint, and an edit of the captured graph makes it encode the graph node by node."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def cap(cls: type = _Block) -> object:
        return capture_module(_Stack([cls(8) for _ in range(4)]), (x,))

    encoded: list[int] = []
    real = serialize.encode_graph
    monkeypatch.setattr(serialize, "encode_graph",
                        lambda g, **kw: encoded.append(len(g.nodes)) or real(g, **kw))
    a = cap()
    assert a.repeated.instances == 4 and a.repeated.structure is not None
    first = fingerprint(a.gm)
    assert encoded == []
    assert first == fingerprint(cap().gm) != fingerprint(cap(_Sigmoid).gm)
    relu = next(n for n in a.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.sigmoid.default
    assert fingerprint(a.gm) != first and encoded == [len(a.gm.graph.nodes)]


def test_the_graph_is_made_when_first_read_and_named_before():
    """A capture of repeated blocks makes its graph (the outer trace decomposed, every block
    inlined) when it is first read; before that, its fingerprint, its tensors by name and its
    module's training flag are what the made graph gives."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    cap = capture_module(_Stack([_Block(8) for _ in range(4)]), (x,))
    assert not cap.made
    before = cap.fingerprint()
    training = cap.training
    names = [f"blocks.{i}.lin.weight" for i in range(4)] + ["inp.weight"]
    tensors = {n: cap.tensor(n) for n in names}
    assert not cap.made
    gm = cap.gm
    assert cap.made and fingerprint(gm) == before and gm.training == training
    reads = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(names) <= reads
    assert all(tensors[n] is attr(gm, n) for n in names)
    assert all(cap.tensor(n) is attr(gm, n) for n in reads)


def test_a_capture_whose_blocks_cannot_be_inlined_is_made_whole(monkeypatch):
    """Where inlining the traced blocks fails when the graph is made (an argument laid out
    otherwise after the decompositions), the model is exported whole then: the same graph as
    a whole-model capture, no repeated blocks reported, and the fingerprint named before."""
    import kopt.capture as capture
    from kopt.repeated import NotRepeatable

    torch.manual_seed(0)
    model, x = _Stack([_Block(8) for _ in range(3)]), torch.randn(4, 8)
    cap = capture_module(model, (x,))
    before = cap.fingerprint()

    def fails(*args: object) -> None:
        raise NotRepeatable("a call's argument is laid out otherwise")

    monkeypatch.setattr(capture, "instantiate", fails)
    gm = cap.gm
    assert cap.repeated is None and fingerprint(gm) == before
    assert _structure(gm) == _structure(capture_module(model, (x,), repeated=False).gm)


def test_before_the_graph_is_made_the_outputs_are_the_models_forward():
    """What a warm start's check compares against: the model run on the flat inputs, the same
    leaves as the made graph's, and no graph made for them."""
    from kopt.verify import random_inputs, run_flat

    w = build("qwen-image-tiny", dtype=torch.float32)
    cap = capture_module(w.model, w.args, w.kwargs)
    inputs = random_inputs(cap.example_inputs, 0)
    eager = cap.outputs(inputs)
    assert not cap.made
    graph = run_flat(cap.gm, inputs)
    assert cap.made and cap.outputs(inputs)[0].equal(graph[0])  # the graph's, once made
    assert len(eager) == len(graph) > 0
    for a, b in zip(eager, graph, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a hook may do what the graph does not (move weights): the graph is made instead
    w.model.register_forward_pre_hook(lambda *a: None)
    hooked = capture_module(w.model, w.args, w.kwargs)
    hooked.outputs(inputs)
    assert hooked.made


def test_a_warm_start_on_the_meta_device_never_makes_the_captured_graph(tmp_path):
    """The optimized graph is restored over the model's own tensors; the report counts the
    captured graph's ops as the recording run did."""
    from kopt.kb import KnowledgeBase, using

    kb = KnowledgeBase.open(tmp_path / "kb.sqlite")
    config = PassConfig(fp8=FP8Config(), fuse_allreduce_norm=False)
    reports, caps = [], []
    for _ in range(2):
        w = build("qwen-image-tiny", device="meta", dtype=torch.bfloat16)
        cap = capture_module(w.model, w.args, w.kwargs)
        with using(kb):
            reports.append(optimize_captured(cap, config, VerifyOptions(enabled=False), None,
                                             w.name, 0.0).report)
        caps.append(cap)
    cold, hit = reports
    assert caps[0].made and not cold.warm
    assert not caps[1].made and hit.warm and hit.applied == cold.applied
    assert hit.nodes_captured == cold.nodes_captured == sum(
        1 for n in caps[1].gm.graph.nodes if n.op == "call_function")


def test_blocks_with_different_attributes_are_not_grouped():
    torch.manual_seed(0)
    same = _Stack([_Block(8) for _ in range(3)])
    differ = _Stack([_Block(8, index=i) for i in range(3)])  # a per-layer index changes the trace
    assert [g.paths for g in find_groups(same)] == [["blocks.0", "blocks.1", "blocks.2"]]
    assert find_groups(differ) == []
    x = torch.randn(4, 8)
    assert _check_same(same, x).traced == 1
    assert _check_same(differ, x) is None


def test_calls_with_other_python_arguments_get_their_own_trace():
    torch.manual_seed(0)
    model = _Stack([_Block(8) for _ in range(4)], scales=[1.0, 2.0, 1.0, 2.0])
    rep = _check_same(model, torch.randn(4, 8))
    assert (rep.traced, rep.instances) == (2, 4)


def test_blocks_with_hooks_or_another_width_are_not_grouped():
    torch.manual_seed(0)
    hooked = _Stack([_Block(8) for _ in range(2)])
    hooked.blocks[1].lin.register_forward_hook(lambda m, i, o: o * 2)
    assert find_groups(hooked) == []
    assert _check_same(hooked, torch.randn(4, 8)) is None
    mixed = _Stack([_Block(8), nn.Sequential(nn.Linear(8, 8))])
    assert find_groups(mixed) == []


class _Mutating(_Block):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x, scale)


class _Alias(_Block):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x


@pytest.mark.parametrize("cls", [_Mutating, _Alias])
def test_a_block_that_cannot_stand_for_its_siblings_is_traced_with_the_model(cls, caplog):
    torch.manual_seed(0)
    model = _Stack([cls(8) for _ in range(2)])
    x = torch.randn(4, 8)
    with caplog.at_level("INFO", logger="kopt"):
        once = capture_module(model, (x,))
    assert once.repeated is None
    assert "repeated blocks traced with the whole model" in caplog.text
    whole = capture_module(model, (x,), repeated=False)
    assert _structure(once.gm) == _structure(whole.gm)
    assert all(type(b) is cls for b in model.blocks)  # the stand-ins are gone


@pytest.mark.parametrize("name", ["flux1", "pixart-sigma", "sana", "wan2.1"])
def test_zoo_dits_trace_their_blocks_once_to_the_same_graph(name):
    from kopt.models.zoo import build as build_zoo

    w = build_zoo(name)
    once = capture_module(w.model, w.args, w.kwargs)
    whole = capture_module(w.model, w.args, w.kwargs, repeated=False)
    assert once.repeated is not None and once.repeated.instances >= 2
    assert _structure(once.gm) == _structure(whole.gm)
    for a, b in zip(_run(once), _run(whole), strict=True):
        assert torch.equal(a, b)
