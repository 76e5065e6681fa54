"""torch.compile(model, backend="kopt"): registered by entry point, matches eager at the
declared tier with both inner compilers, and falls back cleanly where kopt cannot apply."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import kopt
from kopt import KoptError
from kopt.backend import BackendOptions
from kopt.capture import capture_module, flatten_inputs
from kopt.models import main_output
from kopt.verify import RTOL_FLOOR, relative_error, run_fp64
from tests.fixtures import QKV, BlockStack


def test_backend_is_found_through_the_entry_point_without_import() -> None:
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 4)\n"
        "f = torch.compile(m, backend='kopt', options={'inner': 'eager'})\n"
        "x = torch.randn(2, 4)\n"
        "assert torch.equal(f(x), m(x))\n"
        "assert 'kopt' not in sys.modules or 'kopt.backend' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_compiled_models_match_eager_at_the_declared_tier(tiny, name: str, inner: str) -> None:  # noqa: ANN001
    torch._dynamo.reset()
    w = tiny[name]
    reports: list = []
    compiled = torch.compile(w.model, backend="kopt",
                             options={"inner": inner, "reports": reports})
    got = w.run(compiled)
    want = w.run()
    assert len(reports) == 1 and reports[0].verified
    assert reports[0].result("merge_projections").matched >= 4
    assert reports[0].repeated.startswith("repeated blocks")  # each block traced once
    flat, _ = flatten_inputs(w.args, w.kwargs)
    ref = main_output(run_fp64(capture_module(w.model, w.args, w.kwargs).gm, flat))
    # merge_projections is the least exact pass: tolerance tier, 2x the original's error
    bound = 2 * max(relative_error(want, ref), RTOL_FLOOR[want.dtype])
    assert relative_error(got, ref) <= bound
    if inner == "eager":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_graph_break_gives_two_optimized_graphs() -> None:
    torch._dynamo.reset()

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = QKV(16), QKV(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            if y.sum() > 0:  # graph break
                y = y * 2
            return self.b(y)

    model = Broken().eval()
    reports: list = []
    f = torch.compile(model, backend="kopt", options={"inner": "eager", "reports": reports})
    x = torch.randn(3, 16)
    torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(reports) >= 2
    assert sum(r.result("merge_projections").matched for r in reports) == 2


def test_graph_break_inside_repeated_blocks_optimizes_each_blocks_weights() -> None:
    """A break inside a transformer's block: dynamo compiles the block's forward once, with the
    weights as graph inputs, and calls that graph for every block. kopt's graphs hold their
    weights as constants, so each block's weights get their own optimized graph (once: the
    second call reuses them)."""
    torch._dynamo.reset()

    model = BlockStack(16).eval()
    reports: list = []
    f = torch.compile(model, backend="kopt", options={"inner": "eager", "reports": reports})
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
        optimized = len(reports)
        assert sum(r.result("merge_projections").matched for r in reports) == 3  # one per block
        assert all(r.verified for r in reports)
        torch.testing.assert_close(f(x + 1), model(x + 1), rtol=1e-5, atol=1e-5)
    assert len(reports) == optimized  # each block's graphs were kept


def test_dynamic_shapes_fall_back_unoptimized_with_a_reason(caplog) -> None:  # noqa: ANN001
    torch._dynamo.reset()
    model = QKV(16).eval()
    reports: list = []
    f = torch.compile(model, backend="kopt", dynamic=True,
                      options={"inner": "eager", "reports": reports})
    x = torch.randn(5, 16)
    with caplog.at_level(logging.WARNING, logger="kopt"):
        torch.testing.assert_close(f(x), model(x))
    assert reports == []
    assert any("dynamic shapes" in r.getMessage() for r in caplog.records)


def test_bad_options_are_named() -> None:
    torch._dynamo.reset()
    model = nn.Linear(4, 4)
    with pytest.raises(Exception, match="unknown kopt backend option"):
        torch.compile(model, backend="kopt", options={"innr": "eager"})(torch.randn(2, 4))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="inner must be one of"):
        torch.compile(model, backend="kopt", options={"inner": "tvm"})(torch.randn(2, 4))
    with pytest.raises(KoptError, match="unknown pass"):
        BackendOptions.parse({"config": {"no_such_pass": True}})
    with pytest.raises(KoptError, match="cuda_graphs must be 'auto', True or False"):
        BackendOptions.parse({"cuda_graphs": "always"})


def test_cuda_graphs_default_to_auto_and_say_why_off_on_the_cpu() -> None:
    """The backend's graphs follow kopt.optimize's default: "auto", which on CPU inputs runs
    the compiled code and says so in the report; False says it was turned off."""
    assert BackendOptions.parse(None).cuda_graphs == "auto"
    for option, line in ((None, "the inputs are not on a CUDA device"),
                         (False, "cuda_graphs=False")):
        torch._dynamo.reset()
        reports: list = []
        options = {"inner": "eager", "reports": reports}
        if option is not None:
            options["cuda_graphs"] = option
        model = QKV(16).eval()
        f = torch.compile(model, backend="kopt", options=options)
        x = torch.randn(3, 16)
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
        (report,) = reports
        assert f"CUDA graphs: off ({line})" in str(report)


def test_config_dict_turns_passes_off() -> None:
    torch._dynamo.reset()
    model = QKV(16).eval()
    reports: list = []
    f = torch.compile(model, backend="kopt", options={
        "inner": "eager", "reports": reports, "config": {"merge_projections": False}})
    f(torch.randn(3, 16))
    names = [r.name for r in reports[0].passes]
    assert "merge_projections" not in names and "cse" in names and "fold_constants" in names


def test_fp8_config_compiles_with_inductor() -> None:
    # parameters require grad here; FP8 GEMMs have no derivative: kopt compiles for inference
    model = QKV(64, v_extra=0).eval()
    x = torch.randn(4, 64)
    reports: list = []
    f = torch.compile(model, backend="kopt", options={
        "inner": "inductor", "reports": reports,
        "config": {"fp8": kopt.FP8Config(min_features=16)}})
    got = f(x)
    assert reports[0].result("fp8").matched == 2
    assert reports[0].result("absorb_bias").matched == 2
    want = model(x)
    assert ((got - want).norm() / want.norm()).item() < 2.0**-3


def test_under_inductor_the_fusions_inductor_wins_are_left_to_it() -> None:
    from kopt.backend import LEFT_TO_INDUCTOR, BackendOptions
    from kopt.passes import PassConfig

    assert {"fuse_act", "cat_rows"} <= set(LEFT_TO_INDUCTOR)
    assert not BackendOptions.parse({"inner": "inductor"}).config.fuse_act
    assert not BackendOptions.parse({"inner": "inductor"}).config.cat_rows
    assert BackendOptions.parse({"inner": "eager"}).config.fuse_act
    assert BackendOptions.parse({"inner": "eager"}).config.cat_rows
    # asked for by name, or in a config object: kept
    assert BackendOptions.parse({"inner": "inductor",
                                 "config": {"fuse_act": True}}).config.fuse_act
    assert BackendOptions.parse({"inner": "inductor",
                                 "config": PassConfig()}).config.fuse_act
    # other fields of a config dict do not bring it back
    assert not BackendOptions.parse({"inner": "inductor",
                                     "config": {"cse": False}}).config.fuse_act
    # the others stay on
    assert BackendOptions.parse({"inner": "inductor"}).config.fuse_act_quant
