"""Inductor compiles each kind of repeated block once (``kopt.regional``): the optimized graph's
blocks, found by structure, become calls of one kind's code, and the graph computes what it
computed."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import kopt
from kopt.capture import capture_module
from kopt.errors import KoptError
from kopt.graph.splice import copy_graph_module
from kopt.models import build, qwen_image
from kopt.regional import outline_blocks


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * 0.5


class Stack(nn.Module):
    def __init__(self, hidden: list[int], dim: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, h) for h in hidden)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.kopt.block.default]


def _outlined(gm: fx.GraphModule) -> tuple[fx.GraphModule, list]:
    out = copy_graph_module(gm)
    return out, outline_blocks(out)


def test_each_repeated_block_becomes_a_call_of_one_shared_subgraph() -> None:
    torch.manual_seed(0)
    model = Stack([40] * 5).eval()
    x = torch.randn(3, 7, 24)
    gm = capture_module(model, (x,)).gm
    out, kinds = _outlined(gm)
    calls = _calls(out)
    assert [k.sites for k in kinds] == [5] and len(calls) == 5  # one graph, compiled once
    assert {c.args[1] for c in calls} == {kinds[0].id}
    assert not [n for n in out.graph.nodes if n.target is torch.ops.aten.gelu.default]
    with torch.no_grad():
        assert torch.equal(out(x)[0], gm(x)[0])


def test_a_block_whose_code_differs_stays_inline() -> None:
    torch.manual_seed(0)
    model = Stack([40, 40, 56, 40, 40]).eval()  # the middle block's hidden size differs
    x = torch.randn(3, 7, 24)
    gm = capture_module(model, (x,)).gm
    out, kinds = _outlined(gm)
    assert [k.sites for k in kinds] == [4] and len(_calls(out)) == 4
    assert len([n for n in out.graph.nodes if n.target is torch.ops.aten.gelu.default]) == 1
    with torch.no_grad():
        assert torch.equal(out(x)[0], gm(x)[0])


def test_a_graph_without_repeated_blocks_is_left_as_it_is() -> None:
    torch.manual_seed(0)
    model = Stack([40]).eval()
    x = torch.randn(3, 7, 24)
    gm = capture_module(model, (x,)).gm
    before = gm.code
    assert outline_blocks(gm) == [] and gm.code == before


def _optimized_tiny(monkeypatch: pytest.MonkeyPatch, layers: int) -> tuple:
    """The FP8 graph kopt's backend hands its inner compiler for a tiny Qwen-Image of
    ``layers`` blocks, and that graph's inputs."""
    from kopt import backend

    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG,
                                                        num_layers=layers))
    got = {}
    real = backend.inner_compile

    def spy(inner, gm, inputs, **kw):  # noqa: ANN001, ANN003, ANN202
        got["gm"], got["inputs"] = gm, inputs
        return real("eager", gm, inputs)

    monkeypatch.setattr(backend, "inner_compile", spy)
    w = build("qwen-image-tiny", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(w.model, backend="kopt", dynamic=False, options={
        "verify": False, "config": kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))})
    with torch.no_grad():
        compiled(*w.args, **w.kwargs)
    torch._dynamo.reset()
    return got["gm"], got["inputs"]


def test_the_blocks_of_an_optimized_dit_are_outlined_around_the_ops_fused_between_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the FP8 graph, a fused op reads one block's gate and the next block's modulation
    (gated residual + norm across the boundary): it goes with the later block. The inner
    blocks (not the first and last, whose code differs) share one graph, bit for bit the same
    outputs."""
    gm, inputs = _optimized_tiny(monkeypatch, 5)
    out, kinds = _outlined(gm)
    assert [k.sites for k in kinds] == [3] and len(_calls(out)) == 3
    assert len(out.graph.nodes) < len(gm.graph.nodes) * 0.7
    with torch.no_grad():
        got, want = out(*inputs), gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_backend_has_inductor_compile_each_kind_of_block_once() -> None:
    """Through the backend the norm of each block after the first is fused with the residual
    add before it, across the boundary: the first and last block differ from the others."""
    torch.manual_seed(0)
    model = Stack([40] * 6).eval()
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        want = model(x)
    for regional, line in ((True, "Inductor, 4 repeated block sites compiled as 1 kind(s) "
                                  "of block"), (False, "Inductor")):
        reports: list = []
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kopt", dynamic=False, options={
            "reports": reports, "regional": regional})
        with torch.no_grad():
            got = compiled(x)
        assert reports[0].inner == line and f"inner compiler: {line}" in str(reports[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    with pytest.raises(KoptError, match="'regional' must be a bool"):
        kopt.backend.BackendOptions.parse({"regional": "yes"})


def test_a_block_output_over_an_operands_memory_is_copied_out() -> None:
    """An op's outputs are its own: where a kind's code returns an operand's memory (a view,
    or the operand itself) or one output twice, the site gets copies; the values are the
    same."""
    from kopt import regional

    x = torch.randn(4, 6)
    kind = regional.Kind(fx.symbolic_trace(torch.nn.Identity()), lambda a, b: (a, b.t(), b.t()),
                         [((4, 6), (6, 1), torch.float32, x.device)] * 3, sites=1, id=-7)
    regional._KINDS[kind.id] = kind
    y = torch.randn(6, 4)
    outs = torch.ops.kopt.block([x, y], kind.id)
    ptrs = {t.untyped_storage().data_ptr() for t in (x, y, *outs)}
    assert len(ptrs) == 5  # no output shares memory with an operand or another output
    assert torch.equal(outs[0], x) and torch.equal(outs[1], y.t()) and torch.equal(outs[2], y.t())


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny"])
def test_the_backend_regional_computes_what_the_flat_graph_does(
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Inductor through the backend, regional (the default) and flat, on DiTs deep enough to
    repeat, each in BF16 then FP8 in one process: a block graph compiled inside dynamo's
    tracing context left guards on symbols dynamo has no source for, and Qwen-Image's FP8
    compile then failed. (A run of FLUX.2 once failed Inductor's stride assertion at a site,
    a compiled block returning an output in other strides than the graph's; the site now
    restores the graph's layout, and this test did not make that failure again.)"""
    from kopt.models import flux2
    from kopt.verify import relative_error

    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=5))
    monkeypatch.setattr(flux2, "TINY_CONFIG", dict(flux2.TINY_CONFIG, num_layers=4,
                                                   num_single_layers=5))
    w = build(name, dtype=torch.bfloat16)
    for which in ("bf16", "fp8"):
        config = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16) if which == "fp8" else None)
        outs, lines = [], []
        for regional in (True, False):
            torch._dynamo.reset()
            reports: list = []
            compiled = torch.compile(w.model, backend="kopt", dynamic=False, options={
                "verify": False, "config": config, "reports": reports, "regional": regional})
            outs.append(w.run(compiled))
            lines.append(reports[0].inner)
        torch._dynamo.reset()
        assert lines[0].startswith("Inductor, ") and "repeated block sites" in lines[0]
        assert lines[1] == "Inductor"
        assert relative_error(outs[0].float(), outs[1].float()) <= 1e-3, which
