"""Repeated blocks in the graphs dynamo gives the backend (``outline_dynamo_blocks``): each
block is traced once, to the graph the flat capture gives (but for the nodes nothing reads,
which the instantiation drops), with the same outputs and the model's own weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kopt.capture as capture
from kopt.graph.query import attr
from kopt.models import build
from kopt.repeated import outline_dynamo_blocks
from tests.cpu.test_repeated import _Block, _Stack, _structure


def _nodes(gm) -> list[tuple]:
    """:func:`_structure` without the module paths, each weight named by the tensor it reads
    (the flat capture names them ``static_i``, the outlined one by block)."""
    names = {f"attr:{n.target}": f"tensor:{id(attr(gm, n.target))}"
             for n in gm.graph.nodes if n.op == "get_attr"}
    out = []
    for op, target, args, val, _path in _structure(gm):
        for name, tensor in names.items():
            args = args.replace(f"'{name}'", f"'{tensor}'")
        out.append((op, target, args, val))
    return out


def _dynamo_graph(model: nn.Module, *args, **kwargs):
    got = {}

    def grab(gm, example):
        got["gm"], got["example"] = gm, example
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=grab, dynamic=False)(*args, **kwargs)
    return got["gm"], got["example"]


def _captures(gm, example, monkeypatch):
    outlined, runtime = capture.capture_dynamo(gm, example)
    with monkeypatch.context() as m:
        m.setattr(capture, "outline_dynamo_blocks", lambda gm: 0)
        flat, _ = capture.capture_dynamo(gm, example)
    for c in (outlined, flat):
        c.gm.graph.eliminate_dead_code()
    return outlined, flat, [example[i] for i in runtime]


@pytest.mark.parametrize("name, traces", [("qwen-image-tiny", 1), ("flux2-tiny", 2),
                                          ("llm-tiny", 1)])
def test_dynamo_graphs_trace_their_blocks_once_to_the_flat_capture(name, traces, monkeypatch):
    w = build(name, dtype=torch.float32)
    gm, example = _dynamo_graph(w.model, *w.args, **w.kwargs)
    outlined, flat, inputs = _captures(gm, example, monkeypatch)
    assert flat.repeated is None
    assert outlined.repeated is not None and outlined.repeated.traced == traces
    assert outlined.repeated.instances >= 2
    assert _nodes(outlined.gm) == _nodes(flat.gm)
    with torch.no_grad():
        want = gm(*example)
        for a, b, c in zip(outlined.gm(*inputs), flat.gm(*inputs), want, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    # every instance reads the model's own tensors, not copies, and those the flat one reads
    own = {id(t) for t in w.model.parameters()}
    assert {id(t) for t in outlined.gm.parameters()} <= own
    assert _reads(outlined.gm) & own == _reads(flat.gm) & own != set()


def _reads(gm) -> set[int]:
    return {id(attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}


def test_blocks_with_other_code_stay_inline():
    """A per-layer constant (an index added) is in each block's code: no block shares it."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    differ = _Stack([_Block(8, index=i) for i in range(3)])
    gm, _ = _dynamo_graph(differ, x)
    assert outline_dynamo_blocks(gm) == 0
    assert not any(isinstance(m, nn.ModuleList) for m in gm.children())


def test_the_blocks_sharing_the_most_common_code_are_outlined(monkeypatch):
    """Three of four blocks scale by 1, one by 2: the three share a trace, under a name that
    says it is not the model's list; the fourth stays in the graph."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _Stack([_Block(8) for _ in range(4)], scales=[1.0, 2.0, 1.0, 1.0])
    gm, example = _dynamo_graph(model, x)
    outlined, flat, inputs = _captures(gm, example, monkeypatch)
    assert outlined.repeated.instances == 3 and outlined.repeated.traced == 1
    assert outlined.repeated.paths == ["blocks_repeated.0", "blocks_repeated.1",
                                       "blocks_repeated.2"]
    assert _nodes(outlined.gm) == _nodes(flat.gm)
    with torch.no_grad():
        assert torch.equal(outlined.gm(*inputs)[0], model(x))


class _Branching(nn.Module):
    """A block with a higher-order op: dynamo's graph reads its branches as submodules."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.lin(x)
        return torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))


def test_blocks_reading_subgraphs_stay_inline():
    torch.manual_seed(0)
    model = _Stack([_Branching(8) for _ in range(3)])
    x = torch.randn(4, 8)
    gm, example = _dynamo_graph(model, x)
    assert any(n.op == "get_attr" and not isinstance(attr(gm, n.target), torch.Tensor)
               for n in gm.graph.nodes)  # the branches, read by every block
    assert outline_dynamo_blocks(gm) == 0
    with torch.no_grad():
        assert torch.equal(gm(*example)[0], model(x))
