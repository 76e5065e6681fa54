"""Verification on a shallow copy: the passes checked on the model cut to its first blocks per
repeated list, applied to the whole model, which one run checks end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

import kopt
import kopt.passes.pipeline as pipeline
from kopt import verify
from kopt.api import optimize_captured
from kopt.capture import capture_module
from kopt.graph import module_path
from kopt.models import build, flux2, qwen_image
from kopt.passes import FP8Config, PassConfig, RewritePass
from kopt.patterns import PatternRewrite, exact
from kopt.verify import VerifyOptions, end_to_end_problem


def _deeper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen_image, "TINY_CONFIG", dict(qwen_image.TINY_CONFIG, num_layers=4))
    monkeypatch.setattr(flux2, "TINY_CONFIG", dict(flux2.TINY_CONFIG, num_layers=3,
                                                   num_single_layers=5))


def _first_blocks(model: nn.Module, keep: int) -> nn.Module:
    """``model`` with each ModuleList longer than ``keep`` cut to its first ``keep`` blocks."""
    cut = copy.copy(model)
    cut._modules = dict(model._modules)
    for name, child in model._modules.items():
        if isinstance(child, nn.ModuleList) and len(child) > keep:
            cut._modules[name] = nn.ModuleList(list(child)[:keep])
    return cut


@pytest.mark.parametrize("name, said", [
    ("qwen-image-tiny", "2 of 4 transformer_blocks"),
    ("flux2-tiny", "2 of 3 transformer_blocks, 2 of 5 single_transformer_blocks"),
])
def test_the_shallow_model_is_the_model_with_its_first_blocks(monkeypatch, name, said):
    _deeper(monkeypatch)
    w = build(name, dtype=torch.float32)
    cap = capture_module(w.model, w.args, w.kwargs)
    shallow = cap.shallow(2)
    assert shallow is not None and shallow.cut.describe() == said
    assert len(shallow.gm.graph.nodes) < len(cap.gm.graph.nodes)
    paths = {".".join(module_path(n).split(".")[:2]) for n in shallow.gm.graph.nodes
             if module_path(n)}
    assert "transformer_blocks.1" in paths and "transformer_blocks.2" not in paths
    with torch.no_grad():
        want = pytree.tree_leaves(_first_blocks(w.model, 2)(*w.args, **w.kwargs))
        got = shallow.gm(*cap.example_inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert cap.shallow(2) is None  # the whole graph is made now: nothing left to cut from


class _Scale(nn.Module):
    def __init__(self, sign: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", sign * (torch.rand(8) + 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class _Chain(nn.Module):
    def __init__(self, signs: list[float], collect: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Scale(s) for s in signs)
        self.collect = collect

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        seen = []
        for block in self.blocks:
            x = block(x)
            seen.append(x)
        return torch.stack(seen).sum(0) if self.collect else x


def test_blocks_whose_outputs_are_read_elsewhere_are_not_cut():
    x = torch.randn(3, 8)
    chained = capture_module(_Chain([1.0] * 4).eval(), (x,))
    assert chained.shallow(2) is not None
    collected = capture_module(_Chain([1.0] * 4, collect=True).eval(), (x,))
    assert collected.repeated is not None and collected.shallow(2) is None
    short = capture_module(_Chain([1.0] * 2).eval(), (x,))
    assert short.shallow(2) is None  # nothing past the cut


def _structure(gm: fx.GraphModule) -> list[tuple]:
    names: dict[fx.Node, str] = {}
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            names[n] = n.target if n.op == "get_attr" else f"input{len(names)}"
            continue
        names[n] = f"node{len(out)}"
        out.append((n.op, str(n.target), str(fx.node.map_arg((n.args, n.kwargs),
                                                             lambda a: names[a]))))
    return out


def test_checked_on_the_shallow_model_the_result_is_the_whole_models_checked(monkeypatch):
    _deeper(monkeypatch)
    w = build("qwen-image-tiny", dtype=torch.bfloat16)
    config = PassConfig(fuse_allreduce_norm=False).replace(fp8=FP8Config())
    ran: list[int] = []
    real = verify.run_flat

    def counted(gm, inputs):  # noqa: ANN001, ANN202
        ran.append(len(gm.graph.nodes))
        return real(gm, inputs)

    monkeypatch.setattr(verify, "run_flat", counted)
    specs = []
    for blocks in (2, None):
        cap = capture_module(w.model, w.args, w.kwargs)
        ran.clear()
        specs.append(optimize_captured(cap, config, VerifyOptions(seeds=(0, 1), blocks=blocks),
                                       None, w.name, 0.0))
        if blocks:  # every check ran the shallow model: fewer nodes than the whole captured
            assert ran and max(ran) < len(cap.gm.graph.nodes)
    shallow, whole = specs
    assert shallow.report.verified and whole.report.verified
    assert "verified on the model cut to 2 of 4 transformer_blocks" in shallow.report.verified_on
    assert "checked end to end" in str(shallow.report) and not whole.report.verified_on
    checked = [r for r in shallow.report.passes if r.verdict is not None]
    assert checked and all("cut to 2 of 4" in r.verdict.detail for r in checked)
    assert [(r.name, r.matched) for r in shallow.report.passes] == \
        [(r.name, r.matched) for r in whole.report.passes]
    assert _structure(shallow.gm) == _structure(whole.gm)
    example = capture_module(w.model, w.args, w.kwargs).example_inputs
    with torch.no_grad():
        for a, b in zip(shallow.gm(*example), whole.gm(*example), strict=True):
            assert torch.equal(a, b)
    # the warm start's check compares against these: the whole model's, not the shallow one's
    want = pytree.tree_leaves(whole.outputs) if whole.outputs is not None else None
    assert want is not None and shallow.outputs is not None
    for a, b in zip(shallow.outputs, want, strict=True):
        assert torch.equal(a, b)


# x * y -> x * |y|: right where y > 0, wrong where y < 0. Declared exact on purpose.
WRONG_ABS = PatternRewrite(
    "wrong_abs", lambda x, y: x * y, lambda x, y: x * torch.abs(y),
    lambda: [torch.randn(4), torch.randn(4)], exact("(deliberately false)"),
)


def test_a_rewrite_wrong_only_past_the_cut_is_caught_and_reverted(monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "build_passes",
                        lambda config: [RewritePass("under_test", [WRONG_ABS])])
    model = _Chain([1.0, 1.0, -1.0, -1.0]).eval()  # the kept blocks scale up, the rest flip
    x = torch.randn(3, 8)
    with caplog.at_level("WARNING", logger="kopt"):
        opt = kopt.optimize(model, (x,), verify=VerifyOptions(seeds=(0,)),
                            cuda_graphs=False)
    assert "verifying the whole model pass by pass" in caplog.text
    assert "relative error" in caplog.text
    result = opt.report.result("under_test")
    assert result.matched == 2 and len(result.reverted) == 2  # blocks 2 and 3 undone
    assert not opt.report.verified_on
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_a_rewrite_failing_on_the_shallow_model_is_checked_on_the_whole(monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "build_passes",
                        lambda config: [RewritePass("under_test", [WRONG_ABS])])
    model = _Chain([1.0, -1.0, 1.0, 1.0]).eval()
    x = torch.randn(3, 8)
    with caplog.at_level("WARNING", logger="kopt"):
        opt = kopt.optimize(model, (x,), verify=VerifyOptions(seeds=(0,)),
                            cuda_graphs=False)
    assert "under_test failed verification" in caplog.text or "reverted" in caplog.text
    result = opt.report.result("under_test")
    assert result.matched == 3 and len(result.reverted) == 1  # the whole model's bisection
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_the_end_to_end_check_names_what_is_wrong():
    want = [torch.ones(4, 8), torch.tensor([3])]
    assert end_to_end_problem([t.clone() for t in want], want, [0.0, 0.0]) is None
    near = [want[0] * (1 + 5e-4), want[1]]
    assert end_to_end_problem(near, want, [1e-4, 0.0]) is None  # 10 x the shallow 1e-4
    assert "relative error" in end_to_end_problem(near, want, [1e-5, 0.0])
    nan = want[0].clone()
    nan[0, 0] = float("nan")
    assert "not finite" in end_to_end_problem([nan, want[1]], want, [0.1, 0.0])
    assert "values differ" in end_to_end_problem([want[0], torch.tensor([4])], want, [0.0])
    assert "instead of" in end_to_end_problem([want[0][:2], want[1]], want, [0.0])
    assert "outputs instead of" in end_to_end_problem(want[:1], want, [0.0])


def test_blocks_takes_a_count_or_none():
    assert VerifyOptions(blocks=None).blocks is None
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="blocks"):
            VerifyOptions(blocks=bad)


@pytest.mark.parametrize("verify_option", [True, False])
def test_the_backend_checks_on_the_shallow_model_and_compiles_with_inductor(monkeypatch,
                                                                            verify_option):
    """Inductor lifts every parameter the optimized graph module holds: the unchecked whole
    model's graph (or any run without checks) must hold only what it reads, not the weights a
    merge re-pointed into its packed buffer (their storage offsets moved since dynamo's trace)."""
    _deeper(monkeypatch)
    torch._dynamo.reset()
    w = build("qwen-image-tiny", dtype=torch.float32)
    reports: list = []
    compiled = torch.compile(w.model, backend="kopt",
                             options={"reports": reports, "verify": verify_option})
    with torch.no_grad():
        got = pytree.tree_leaves(compiled(*w.args, **w.kwargs))
        want = pytree.tree_leaves(w.model(*w.args, **w.kwargs))
    (report,) = reports
    assert report.applied > 0
    if verify_option:
        assert report.verified and "cut to 2 of 4 transformer_blocks" in report.verified_on
    else:
        assert not report.verified_on
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_pass_split_from_another_by_size_counts_as_it_on_the_shallow_model():
    """W1's 60 merged modulation weights are over 1 GiB (``fp8_large`` quantizes them); the
    shallow model's 2 merged are not (``fp8`` does): its check of them stands."""
    from types import SimpleNamespace

    from kopt.passes import PassResult

    fp8, large = SimpleNamespace(split_from=None), SimpleNamespace(split_from="fp8")
    other = SimpleNamespace(split_from=None)

    def r(name: str, n: int) -> PassResult:
        return PassResult(name, n, {}, 0, 0, 0.0)

    whole = [r("fp8", 479), r("fp8_large", 1)]
    assert pipeline._disagree([fp8, large], whole, [r("fp8", 16), r("fp8_large", 0)]) is None
    why = pipeline._disagree([fp8, other], whole, [r("fp8", 16), r("fp8_large", 0)])
    assert why == "fp8_large rewrote 1 sites in the whole model and 0 in the shallow one"
    assert "fp8 rewrote" in pipeline._disagree([fp8, large], whole,
                                               [r("fp8", 0), r("fp8_large", 0)])


def test_the_outer_trace_is_decomposed_once_for_the_shallow_model_and_the_whole(monkeypatch):
    _deeper(monkeypatch)
    w = build("qwen-image-tiny", dtype=torch.float32)
    alone = capture_module(w.model, w.args, w.kwargs).gm  # no shallow model made first
    calls: list[int] = []
    real = torch.export.ExportedProgram.run_decompositions

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        return real(self, *args, **kwargs)

    cap = capture_module(w.model, w.args, w.kwargs)
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    shallow = cap.shallow(2)
    assert shallow is not None and len(calls) == 1
    made = cap.gm  # from the decomposition the shallow model was copied from
    assert len(calls) == 1 and _structure(made) == _structure(alone)
    with torch.no_grad():
        for a, b in zip(cap.gm(*cap.example_inputs), alone(*cap.example_inputs), strict=True):
            assert torch.equal(a, b)
