"""The execution plan and CUDA graphs by default, on CUDA: every fused op launched by replaying
its recorded launches, bitwise the optimized graph; the default module replays from CUDA
graphs that share one memory pool; a graph that cannot be captured runs eagerly, saying why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kopt
from kopt.capture import flatten_inputs
from kopt.codegen.launch import DirectOp
from kopt.graph.regions import same_value
from kopt.models import build, main_output
from kopt.verify import random_inputs
from tests.fixtures import backend_outputs, perturbed_kwargs

pytestmark = pytest.mark.gpu
FP8_EVERYWHERE = kopt.PassConfig(fp8=kopt.FP8Config(min_features=16))


def _leaves_equal(a, b) -> bool:  # noqa: ANN001
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return all(same_value(x, y)
               for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize(("name", "config"), [
    ("qwen-image-tiny", kopt.PassConfig()), ("qwen-image-tiny", FP8_EVERYWHERE),
    ("flux2-tiny", FP8_EVERYWHERE), ("llm-tiny", kopt.PassConfig()),
])
def test_every_fused_op_is_replayed_bitwise(name, config) -> None:  # noqa: ANN001
    w = build(name, device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs, config, cuda_graphs=False)
    plan = opt._specs[opt._first_key].plan
    assert plan is not None and plan.off is None, opt.report
    assert plan.summary.left_out is None, plan.summary.left_out
    assert plan.ops and all(isinstance(op, DirectOp) for op in plan.ops)
    flat, _ = flatten_inputs(w.args, w.kwargs)
    for seed in (1, 2, 3):  # fresh values each call: the replay reads its new inputs
        inputs = random_inputs(flat, seed)
        with torch.no_grad():
            assert _leaves_equal(plan.gm(*inputs), opt.graph_module(*inputs))
    # replayed, unless the op copies an input it cannot read in place (that copy is an aten
    # op the replay would leave out): the op's Python launch then runs, still off the
    # dispatcher
    not_replayed = {str(op.op): op.why_not for op in plan.ops if not op.direct}
    copies = {op: why for op, why in not_replayed.items() if why.startswith("it runs aten.clone")}
    assert not_replayed == copies, not_replayed
    assert sum(op.direct for op in plan.ops) >= 0.9 * len(plan.ops)
    assert "replayed" in str(opt.report)
    # the same op of the model's two blocks replays from one compiled source
    codes = [op._replay.__code__ for op in plan.ops if op.direct]
    assert len(set(codes)) < len(codes)


def test_the_default_replays_from_cuda_graphs_sharing_one_pool() -> None:
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    eager = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=False)
    assert opt.cuda_graphs == "auto" and "CUDA graphs: auto" in str(opt.report)
    text = w.kwargs["encoder_hidden_states"]
    other = dict(w.kwargs, encoder_hidden_states=torch.randn(
        text.shape[0], text.shape[1] + 5, text.shape[2], device="cuda", dtype=text.dtype))
    with torch.no_grad():
        for _ in range(4):
            for kwargs in (w.kwargs, other):
                got = main_output(opt(*w.args, **kwargs))
                assert same_value(got, main_output(eager(*w.args, **kwargs)))
    runners = [s.runner for s in opt._specs.values()]
    assert len(runners) == 2 and all(r is not None and r.graph is not None for r in runners)
    assert all(r.pool == opt._pool.id for r in runners)
    held = [line for line in opt.reports[0].runtime if "the memory pool its graphs share" in line]
    assert held and float(held[0].split("holds ")[1].split(" MiB")[0]) > 0


def test_auto_runs_eagerly_where_the_graph_reads_a_host_tensor() -> None:
    class HostScale(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale.to(x.device) + 1

    x = torch.randn(8, 32, device="cuda")
    scale = torch.randn(8, 1)  # on the host: copied to the device at every call
    opt = kopt.optimize(HostScale().eval(), (x, scale))
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(opt(x, scale), x * scale.cuda() + 1)
    spec = opt._specs[opt._first_key]
    assert spec.runner is None and "a CPU tensor" in (spec.graphs_off or "")
    assert "CUDA graphs: off" in str(opt.report)


def test_decode_with_a_kv_cache_replays_from_a_graph_bitwise() -> None:
    w = build("llm-tiny", device="cuda", dtype=torch.bfloat16, mode="decode", batch=2,
              seq_len=16)
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    eager = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=False)
    with torch.no_grad():
        for _ in range(4):
            assert same_value(main_output(opt(*w.args, **w.kwargs)),
                                 main_output(eager(*w.args, **w.kwargs)))
    assert opt._specs[opt._first_key].runner.graph is not None


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_the_backend_replays_from_cuda_graphs_by_default(inner: str) -> None:
    """torch.compile(backend="kopt") with its defaults replays each optimized graph from a CUDA
    graph from the third call: bitwise what the same compile gives with cuda_graphs=False, on
    fresh inputs every call, and the outputs a caller keeps are not overwritten by later
    replays (a CFG loop keeps the cond output across the uncond call)."""
    w = build("qwen-image-tiny", device="cuda", dtype=torch.bfloat16)
    calls = perturbed_kwargs(w.kwargs, 5)
    options = {"inner": inner}  # the outputs all kept to the end, as returned
    plain, plain_reports = backend_outputs(w.model, w.args, calls, options, False)
    graphed, reports = backend_outputs(w.model, w.args, calls, options)
    assert all("CUDA graphs: off (cuda_graphs=False)" in str(r) for r in plain_reports)
    assert reports and all("CUDA graphs: replayed from one graph" in str(r) for r in reports), \
        "\n".join(map(str, reports))
    for i, (a, b) in enumerate(zip(graphed, plain, strict=True)):
        assert torch.equal(a, b), f"call {i}"


def test_a_memory_pool_outlives_the_graphs_captured_into_it():
    """Every graph the backend captures in a process shares one pool. Once the graphs captured
    into it are freed while a tensor one made is still held (a report, an output), the next
    capture into it must still work: with a bare ``torch.cuda.graph_pool_handle()`` the caching
    allocator asserts (``use_count > 0``), which turned CUDA graphs off for a later model."""
    import gc

    from kopt.cudagraphs import capture_graph, memory_pool

    pool = memory_pool()
    x = torch.randn(4096, device="cuda")
    graph, kept = capture_graph(lambda: x * 2, pool.id)
    graph.replay()
    del graph
    gc.collect()
    graph, out = capture_graph(lambda: x + 1, pool.id)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x + 1) and torch.equal(kept, x * 2)
