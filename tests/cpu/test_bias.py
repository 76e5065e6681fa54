"""absorb_bias: the bias add after an FP8 GEMM moves into its epilogue; nothing to absorb where
there is no bias (FLUX.2), and a bias whose GEMM output has another user stays."""

from __future__ import annotations

import operator

import torch
from torch import nn

import kopt

aten = torch.ops.aten
FP8 = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def _gemms(opt) -> list:  # noqa: ANN001
    return [n for n in opt.graph_module.graph.nodes if n.target is aten._scaled_mm.default]


def test_absorbs_every_fp8_bias_of_qwen_image(tiny) -> None:  # noqa: ANN001
    w = tiny["qwen-image-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs, FP8)
    fp8, absorbed = opt.report.result("fp8"), opt.report.result("absorb_bias")
    # every Qwen-Image linear has a bias, merged ones a concatenated bias
    assert absorbed.matched == fp8.matched >= 16
    assert absorbed.verdict.passed and absorbed.verdict.tier == "tolerance"
    gemms = _gemms(opt) + [n for m in opt.graph_module.modules()
                           if isinstance(m, torch.fx.GraphModule) and m is not opt.graph_module
                           for n in m.graph.nodes if n.target is aten._scaled_mm.default]
    assert gemms and all(n.kwargs.get("bias") is not None for n in gemms)
    assert any("to_out" in d for d in absorbed.details)  # the output projections


def test_nothing_to_absorb_without_biases_and_says_so(tiny) -> None:  # noqa: ANN001
    w = tiny["flux2-tiny"]
    result = kopt.optimize(w.model, w.args, w.kwargs, FP8).report.result("absorb_bias")
    assert result.matched == 0 and result.rejected == {}
    assert result.notes[0].startswith("nothing to rewrite")


def test_bias_stays_when_the_gemm_output_has_another_user() -> None:
    class Tap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = nn.functional.linear(x, self.proj.weight)
            return y + self.proj.bias, y * 2  # y without the bias is needed too

    opt = kopt.optimize(Tap().eval(), (torch.randn(4, 32),), config=FP8)
    result = opt.report.result("absorb_bias")
    assert result.matched == 0
    assert result.rejected == {"the GEMM's output has other users, which must not see the bias": 1}


# -- a bias add before a split along the features (the blockwise FP8 GEMM adds no bias) --------
BLOCKWISE = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16, layout="blockwise"))


class QKV(nn.Module):
    """One merged projection split into three; ``dim`` is the split's dim."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.proj, self.dim = nn.Linear(512, 3 * 128, dtype=torch.bfloat16), dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x)
        if self.dim == -1:
            q, k, v = y.split([128, 128, 128], -1)
        else:
            q, k, v = y.split(1, self.dim)
        return q * 2, k + 1, v


def _adds(opt) -> list:  # noqa: ANN001
    return [n for n in opt.graph_module.graph.nodes if n.target is aten.add.Tensor]


def test_a_bias_add_the_gemm_cannot_take_is_split_per_slice() -> None:
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    opt = kopt.optimize(QKV().eval(), (x,), config=BLOCKWISE)
    result = opt.report.result("absorb_bias")
    assert result.matched == 1 and result.verdict.passed
    # q, k, v each get their slice of the bias (and k's + 1 stays)
    adds = _adds(opt)
    assert len(adds) == 4
    pieces = [n for n in adds if n.args[0].target is operator.getitem]
    assert sorted(tuple(n.meta["val"].shape) for n in pieces) == [(2, 3, 128)] * 3


def test_rowwise_fp8_absorbs_the_bias_before_the_split_instead() -> None:
    opt = kopt.optimize(QKV().eval(), (torch.randn(2, 3, 512, dtype=torch.bfloat16),),
                        config=FP8)
    result = opt.report.result("absorb_bias")
    assert result.matched == 1
    assert [n.kwargs.get("bias") is not None for n in _gemms(opt)] == [True]
    assert len(_adds(opt)) == 1  # k + 1 only: no per-slice bias adds


def test_a_split_across_tokens_keeps_the_add_and_says_why() -> None:
    opt = kopt.optimize(QKV(dim=1).eval(), (torch.randn(2, 3, 512, dtype=torch.bfloat16),),
                        config=BLOCKWISE)
    result = opt.report.result("absorb_bias")
    assert result.matched == 0
    assert result.rejected == {"the split after the bias add is along dim 1, not the features": 1}


def test_a_float32_fp8_gemm_on_cuda_keeps_its_bias_add(monkeypatch) -> None:  # noqa: ANN001
    """cuBLAS's FP8 GEMM takes no bias with a float32 output: the guard reads the GEMM's
    device and dtype from the graph's metadata (stood in for here: this machine has no GPU)."""
    from types import SimpleNamespace

    from kopt.patterns import bias as bias_mod

    class Node(SimpleNamespace):
        __hash__ = object.__hash__

    device = {"gemm": "cpu"}
    monkeypatch.setattr(bias_mod, "tensor_meta", lambda n: SimpleNamespace(
        dtype=torch.float32, device=torch.device(device[n.name] if n.name in device else "cpu")))
    gemm = Node(name="gemm", users=[None], args=(), kwargs={})
    bias = Node(name="bias", users=[None], args=(), kwargs={})
    assert bias_mod._why_not(gemm, None, bias, {bias}) is None  # on the CPU it takes the bias
    device["gemm"] = "cuda"
    assert bias_mod._why_not(gemm, None, bias, {bias}) == \
        "the GEMM writes float32, where cuBLAS's FP8 GEMM adds no bias"
