"""Capture: aten IR with fake-tensor metadata, parameters as shared constants, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kopt
from kopt.capture import capture_dynamo, capture_module, flatten_inputs
from kopt.errors import CaptureError
from tests.fixtures import QKV


def test_capture_ir_metadata_and_constants() -> None:
    model = QKV().eval()
    x = torch.randn(2, 5, 37)
    cap = capture_module(model, (x,))
    nodes = list(cap.gm.graph.nodes)
    for node in nodes:
        if node.op != "output":
            assert "val" in node.meta, node.name
    targets = {n.target for n in nodes if n.op == "call_function"}
    assert torch.ops.aten.linear.default in targets  # composite ops kept whole
    assert torch.ops.aten.layer_norm.default in targets
    attrs = [n for n in nodes if n.op == "get_attr"]
    assert {n.target for n in attrs} >= {"q.weight", "q.bias", "norm.weight"}
    assert cap.gm.get_parameter("q.weight") is model.q.weight  # shared, not copied
    assert [n.op for n in nodes].count("placeholder") == 1
    flat, _ = flatten_inputs((x,), {})
    assert torch.equal(cap.unflatten_outputs(cap.gm(*flat)), model(x))


def test_capture_keeps_python_inputs_and_kwargs() -> None:
    class M(nn.Module):
        def forward(self, x, shapes, scale=None, flag=True):  # noqa: ANN001, ANN201
            n = sum(a * b for a, b in shapes)
            y = x * n if scale is None else x * scale
            return {"y": y, "z": y + 1} if flag else y

    x = torch.randn(3, 4)
    cap = capture_module(M(), (x, [(2, 3), (1, 1)]), {"flag": True})
    flat, _ = flatten_inputs((x, [(2, 3), (1, 1)]), {"flag": True})
    out = cap.unflatten_outputs(cap.gm(*flat))
    assert set(out) == {"y", "z"}
    assert torch.equal(out["y"], x * 7)


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent branch
            return x * 2
        return x * 3


class NumpyInside(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2) + x


def test_data_dependent_branch_is_named_and_model_still_runs() -> None:
    model = Branchy().eval()
    x = torch.ones(3)
    with pytest.raises(CaptureError) as info:
        kopt.optimize(model, (x,))
    assert info.value.kind == "data-dependent control flow"
    assert "test_capture.py" in info.value.where and "x.sum() > 0" in info.value.where
    assert "original model is unchanged" in str(info.value)
    assert torch.equal(model(x), x * 2)


def test_unsupported_op_is_named_and_model_still_runs() -> None:
    model = NumpyInside().eval()
    x = torch.ones(3)
    with pytest.raises(CaptureError) as info:
        kopt.optimize(model, (x,))
    assert info.value.kind == "unsupported operation"
    assert "numpy" in str(info.value)
    assert "x.numpy()" in info.value.where
    assert torch.equal(model(x), x * 3)


def test_dynamo_graph_writing_into_its_input_is_named() -> None:
    """A graph that writes into its input (SGLang's FLUX.2 fills an output buffer after a
    graph break) is refused with the input named, not an internal error."""
    graphs = []

    def keep(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append((gm, example_inputs))
        return gm.forward

    def fill(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out.copy_(y)

    torch._dynamo.reset()
    torch.compile(fill, backend=keep)(torch.empty(3), torch.randn(3))
    with pytest.raises(CaptureError, match="writes into its input l_out_ in place") as exc:
        capture_dynamo(*graphs[0])
    assert exc.value.kind == "input mutation"


def test_dynamo_graph_lowering_turns_parameters_into_constants() -> None:
    model = QKV().eval()
    x = torch.randn(2, 5, 37)
    seen = {}

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        cap, runtime = capture_dynamo(gm, example_inputs)
        seen["cap"], seen["runtime"], seen["n"] = cap, runtime, len(example_inputs)
        return gm.forward

    torch.compile(model, backend=backend)(x)
    cap = seen["cap"]
    assert len(seen["runtime"]) == 1 and seen["n"] > 1  # x stays an input, weights do not
    assert sum(n.op == "placeholder" for n in cap.gm.graph.nodes) == 1
    assert sum(n.op == "get_attr" for n in cap.gm.graph.nodes) == seen["n"] - 1
    assert cap.source == "dynamo"
