"""The execution plan (kopt.runtime): the optimized graph in the form that runs cheapest on the
host, bitwise the optimized graph; CUDA-graph defaults and the runner's logic, with a stand-in
for the capture (the CPU has no CUDA graphs; tests/gpu/test_runtime_gpu.py runs the real one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import kopt
from kopt.capture import flatten_inputs
from kopt.cudagraphs import CudaGraphRunner, not_capturable
from kopt.graph.regions import same_value
from kopt.models import build
from kopt.runtime import build_plan, is_dense
from kopt.verify import random_inputs

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


def _kopt_ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "kopt"]


def _same(a, b) -> bool:  # noqa: ANN001
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        same_value(x, y)
        for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("name", ["qwen-image-tiny", "flux2-tiny", "llm-tiny"])
def test_the_plan_is_bitwise_the_optimized_graph_and_has_no_fused_op_left(tiny, name) -> None:  # noqa: ANN001
    w = tiny[name]
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    spec = opt._specs[opt._first_key]
    plan = spec.plan
    assert plan is not None and plan.off is None
    fused = len(_kopt_ops(opt.graph_module))
    assert fused > 0
    assert plan.summary.inlined == sum(
        1 for n in _kopt_ops(opt.graph_module) if n.graph is opt.graph_module.graph)
    assert not [n for n in plan.gm.graph.nodes
                if str(getattr(n.target, "namespace", "")) == "kopt"]
    assert plan.summary.bound > 0 and plan.summary.folded_views > 0
    flat, _ = flatten_inputs(w.args, w.kwargs)
    for seed in (1, 2):
        inputs = random_inputs(flat, seed)
        with torch.no_grad():
            assert _same(plan.gm(*inputs), opt.graph_module(*inputs))
    assert "execution plan:" in str(opt.report) and "fused ops inlined" in str(opt.report)


def test_the_module_runs_the_plan_only_for_its_strides(tiny) -> None:  # noqa: ANN001
    w = tiny["qwen-image-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    spec = opt._specs[opt._first_key]
    ran = []
    for gm, label in ((spec.plan.gm, "plan"), (spec.gm, "graph")):
        gm.register_forward_pre_hook(lambda *_, label=label: ran.append(label))
    flat, _ = flatten_inputs(w.args, w.kwargs)
    with torch.no_grad():
        want = opt.graph_module(*flat)
        got = opt(*w.args, **w.kwargs)
    assert ran[-1] == "plan"
    assert _same(got, opt._specs[opt._first_key].captured.unflatten_outputs(want))
    # the latents of the same shape and values laid out otherwise: the optimized graph runs
    v = w.kwargs["hidden_states"]
    other = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert other.stride() != v.stride() and torch.equal(other, v)
    with torch.no_grad():
        assert _same(opt(*w.args, **dict(w.kwargs, hidden_states=other)), got)
    assert ran[-1] == "graph"


def test_view_chains_fold_and_identity_views_drop() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = (x * 2).reshape(4, 6).reshape(2, 2, 6).reshape(24)  # one view of x * 2
            z = x.t().reshape(6, 4)  # x.t() is not contiguous: this reshape copies
            w = (x + 1).reshape(4, 6)  # the shape it already has
            return y.sum() + z.reshape(24) + w.reshape(24)

    x = torch.randn(4, 6)
    opt = kopt.optimize(M().eval(), (x,))
    plan = opt._specs[opt._first_key].plan
    views = [n for n in plan.gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") in ("view", "reshape")]
    assert plan.summary.folded_views >= 2
    assert len(views) <= 4  # y's chain is one view, w's reshape is gone
    for seed in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(plan.gm(x)[0], opt.graph_module(x)[0])


def test_a_binding_is_used_only_where_it_dispatches_the_same_overload() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.add.Scalar, (x, 2))  # torch.add(x, 2) would run add.Tensor
    b = g.call_function(aten.add.Tensor, (a, a))
    c = g.call_function(aten.view.default, (b, [6, 4]))
    g.output((c,))
    gm = fx.GraphModule(nn.Module(), g)
    example = torch.randn(4, 6)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(example)
    plan = build_plan(gm, [example])
    targets = [n.target for n in plan.gm.graph.nodes if n.op == "call_function"]
    assert targets[0] is aten.add.Scalar  # kept: its binding dispatches add.Tensor
    assert targets[1] is torch._C._VariableFunctions.add
    assert targets[2] is torch._C.TensorBase.view
    assert plan.off is None and torch.equal(plan.gm(example)[0], gm(example)[0])


def test_is_dense() -> None:
    x = torch.randn(3, 4, 5)
    assert is_dense(x) and is_dense(x.permute(2, 0, 1)) and is_dense(x[:1])
    assert not is_dense(x[:, :1]) and not is_dense(torch.randn(3, 1).expand(3, 4))


def test_cuda_graphs_defaults_to_auto_and_takes_only_auto_true_false(tiny) -> None:  # noqa: ANN001
    w = tiny["llm-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs, verify=kopt.VerifyOptions(enabled=False))
    assert opt.cuda_graphs == "auto"
    assert "CUDA graphs: off (the inputs are not on a CUDA device)" in str(opt.report)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="cuda_graphs must be 'auto', True or False"):
            kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=bad)
    off = kopt.optimize(w.model, w.args, w.kwargs, cuda_graphs=False, execution_plan=False)
    assert off._specs[off._first_key].plan is None
    assert "CUDA graphs: off (cuda_graphs=False)" in str(off.report)


def test_not_capturable_names_a_host_sync() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.ops.aten._local_scalar_dense(x.sum())

    g = fx.Graph()
    x = g.placeholder("x")
    s = g.call_function(aten.sum.default, (x,))
    item = g.call_function(aten._local_scalar_dense.default, (s,))
    out = g.call_function(aten.mul.Tensor, (x, item))
    g.output((out,))
    reason = not_capturable(fx.GraphModule(nn.Module(), g))
    assert reason is not None and "_local_scalar_dense" in reason
    assert "syncs with the host" in reason
    g2 = fx.Graph()
    y = g2.placeholder("y")
    g2.output((g2.call_function(aten.mul.Tensor, (y, y)),))
    assert not_capturable(fx.GraphModule(nn.Module(), g2)) is None


class _Replay:
    """A stand-in for a CUDA graph: ``replay()`` runs the captured function again on the same
    buffers, as a graph replays its kernels on the addresses it captured."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.fn = fn

    def replay(self) -> None:
        self.out[:] = [self.fn()]


def test_the_runner_shares_the_timestep_work_of_a_cfg_pair_across_signatures(monkeypatch) -> None:  # noqa: ANN001
    """Two input signatures (cond and uncond prompts of other lengths), each with its runner,
    the hoisted region outside the graphs: each step's second call hits the first's entry,
    and every output is bitwise the eager one's."""
    captured: list = []

    def capture(fn, pool):  # noqa: ANN001, ANN202
        out = fn()
        graph = _Replay(fn)
        graph.out = [out]
        captured.append(graph)
        return graph, out

    w = build("qwen-image-tiny")
    opt = kopt.optimize(w.model, w.args, w.kwargs, verify=kopt.VerifyOptions(enabled=False))
    eager = kopt.optimize(w.model, w.args, w.kwargs, verify=kopt.VerifyOptions(enabled=False),
                          cuda_graphs=False)
    text = w.kwargs["encoder_hidden_states"]

    def runner_for(spec):  # noqa: ANN001, ANN202
        if spec.runner is None:
            spec.runner = CudaGraphRunner(spec.plan.gm, capture=capture)
        return spec.runner

    def run(module, kwargs):  # noqa: ANN001, ANN202
        flat, spec_tree = flatten_inputs(w.args, kwargs)
        key = kopt.api._key(flat, spec_tree)
        if key not in module._specs:
            module(*w.args, **kwargs)  # specialise
        spec = module._specs[key]
        if module is eager:
            with torch.no_grad():
                return module(*w.args, **kwargs)
        runner = runner_for(spec)
        with torch.no_grad():
            out = runner(*flat)
        if runner.graph is not None:  # the stand-in's outputs: the last replay's
            out = runner.graph.out[0]
        return spec.captured.unflatten_outputs(out)

    steps = [torch.full_like(w.kwargs["timestep"], v) for v in (0.9, 0.6, 0.3, 0.1)]
    uncond_text = torch.randn(text.shape[0], text.shape[1] + 3, text.shape[2])
    before = None
    for i, t in enumerate(steps):
        cond = dict(w.kwargs, timestep=t.clone())
        unc = dict(w.kwargs, timestep=t.clone(), encoder_hidden_states=uncond_text)
        for kwargs in (cond, unc):
            assert _same(run(opt, kwargs), run(eager, kwargs))
        if i == 0:
            before = opt.cache_stats()
    assert len(captured) == 2  # one graph per signature
    hits, misses = (a - b for a, b in zip(opt.cache_stats()["{timestep}"],
                                          before["{timestep}"], strict=True))
    assert (hits, misses) == (3, 3)


def test_every_kernel_launch_in_codegen_goes_through_launch() -> None:
    """A DirectOp replays the launches kopt.codegen.launch.launch noted: a launch made another
    way would be left out of the replay."""
    pattern = re.compile(r"\b\w+(\.\w+)*\[[^\]\n]*\]\(")
    offenders = []
    for path in sorted((ROOT / "kopt" / "codegen").rglob("*.py")):
        if path.name == "launch.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "kernel" in code.split("[")[0].lower():
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_a_plan_that_differs_is_made_again_without_the_rewrite_at_fault(tiny, monkeypatch) -> None:  # noqa: ANN001
    """A binding that computes something else (here: subtraction for every add) makes the
    plan's outputs differ: the plan is made again without bindings, and says so."""
    import kopt.runtime as runtime

    real = runtime._Bindings.of

    def wrong(self, node):  # noqa: ANN001, ANN202
        fn = real(self, node)
        return torch._C._VariableFunctions.sub if fn is torch._C._VariableFunctions.add else fn

    monkeypatch.setattr(runtime._Bindings, "of", wrong)
    w = tiny["llm-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    plan = opt._specs[opt._first_key].plan
    assert plan.off is None and plan.summary.bound == 0 and plan.summary.inlined > 0
    assert plan.summary.left_out.startswith("bindings left out (output 0 differs")
    assert "bindings left out" in str(opt.report)
    with torch.no_grad():
        flat, _ = flatten_inputs(w.args, w.kwargs)
        assert _same(plan.gm(*flat), opt.graph_module(*flat))


def test_the_plans_check_takes_the_graphs_outputs_from_verification(tiny, monkeypatch) -> None:  # noqa: ANN001
    """Verification ran the optimized graph on seed 0's random inputs last: the plan's check
    compares the plan with those outputs instead of running the graph again; outputs that are
    not the graph's fail it."""
    import kopt.runtime as runtime

    runs: list[bool] = []
    real = runtime._run_clean

    def counted(gm, inputs, planned_regions):  # noqa: ANN001, ANN202
        runs.append(planned_regions)
        return real(gm, inputs, planned_regions)

    monkeypatch.setattr(runtime, "_run_clean", counted)
    w = tiny["qwen-image-tiny"]
    opt = kopt.optimize(w.model, w.args, w.kwargs)
    spec = opt._specs[opt._first_key]
    assert spec.plan.off is None and runs == [True]  # the plan ran, the graph not again
    example = spec.captured.example_inputs
    want = real(opt.graph_module, random_inputs(example, 0), planned_regions=False)
    assert build_plan(opt.graph_module, example, outputs=want).off is None
    wrong = [x + 1 if x.is_floating_point() else x for x in want]
    assert "differs" in build_plan(opt.graph_module, example, outputs=wrong).off


class _Launcher36:
    """The form of Triton 3.6's launcher: the kernel's arguments passed on one by one."""

    def __init__(self) -> None:
        self.launch = self._c
        self.global_scratch_size = self.profile_scratch_size = 0
        self.calls: list[tuple] = []

    def _c(self, *a: object) -> None:
        self.calls.append(a)

    def __call__(self, gx, gy, gz, stream, function, *args):  # noqa: ANN001, ANN002, ANN204
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)


class _Launcher39(_Launcher36):
    """The form of Triton 3.9's: hooks and metadata first, the kernel's arguments as a tuple."""

    def __call__(self, gx, gy, gz, stream, function, meta, lmeta, enter, exit_, *args):  # noqa: ANN001, ANN002, ANN204
        self.launch(gx, gy, gz, stream, function, False, False, meta, lmeta, enter, exit_,
                    None, None, "annotations", "signature", args)


@pytest.mark.parametrize("form", [_Launcher36, _Launcher39])
def test_a_replayed_launch_calls_the_c_launcher_with_what_the_wrapper_would(form) -> None:  # noqa: ANN001
    """The replay skips Triton's Python wrapper; what reaches the C function must not change."""
    from types import SimpleNamespace

    from kopt.codegen.launch import Noted, _launch_call

    run = form()
    compiled = SimpleNamespace(run=run, function=1234, packed_metadata=("m",))
    n = Noted(compiled, (3, 1, 1), [7, 8, "c"])
    g: dict = {}
    (line,) = _launch_call(g, 0, n, ["p0", "(p0 + 16)", "const0_2"])
    assert line.startswith("launch0(")
    g.update(p0=4096, const0_2="c", stream=77)
    exec(f"p0 = 4096\n{line}", g)  # noqa: S102
    run(3, 1, 1, 77, 1234, ("m",), None, None, None, 4096, 4112, "c")
    assert len(run.calls) == 2 and run.calls[0] == run.calls[1]
    assert run.launch == run._c  # the spy is gone


def test_a_launcher_with_scratch_keeps_its_wrapper() -> None:
    from types import SimpleNamespace

    from kopt.codegen.launch import Noted, _launch_call

    run = _Launcher36()
    run.global_scratch_size = 128
    n = Noted(SimpleNamespace(run=run, function=1, packed_metadata=None), (1, 1, 1), [5])
    (line,) = _launch_call({}, 0, n, ["5"])
    assert line.startswith("run0(")


def test_a_descriptor_launchers_encoding_is_learned_once_per_address() -> None:
    """The replay of a kernel that takes host tensor descriptors calls the C launcher under
    Triton's descriptor wrapper with the encoding it learned for each address: learned by
    running the wrapper's own code over a recording stand-in of the C function."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kopt.codegen.launch import Noted, _lower_descriptors

    wrap = pytest.importorskip("triton.backends.driver").wrap_handle_tensordesc_impl
    launched = []

    def encode(arg, meta, _):  # noqa: ANN001, ANN202 -- the tensor map Triton would build
        return [("map", arg.base.data_ptr()), *arg.shape, *arg.strides]

    signature = {"a": "*bf16", "d": "tensordesc<bf16[16, 16]>", "n": "i32"}
    inner = wrap(lambda *a: launched.append(a), signature, [{"swizzle": 128}], encode)
    x = torch.randn(64, 32)
    noted = Noted(object(), (1, 1, 1), [x, TensorDescriptor.from_tensor(x, [16, 16]), 7])
    c_function, learn, (memo,) = _lower_descriptors(inner, (1, 1, 1, "stream"), 4, False,
                                                    noted, [1])
    assert c_function is not inner and not launched  # learning launches nothing
    assert memo == {x.data_ptr(): (("map", x.data_ptr()), 64, 32, 32, 1)}
    assert learn(4096) == ((("map", 4096), 64, 32, 32, 1),)
    assert set(memo) == {x.data_ptr(), 4096}
    assert _lower_descriptors(lambda *a: None, (1, 1, 1, "s"), 4, False, noted, [1]) is None


def _descriptor_wrapper36(launcher, positions, encode):  # noqa: ANN001, ANN202
    """The form of Triton 3.6's descriptor wrapper: nine base arguments, then the kernel's
    arguments one by one, each descriptor expanded in place."""

    def inner(*args):  # noqa: ANN002, ANN202
        final = list(args[:9])
        for i, arg in enumerate(args[9:]):
            final.extend(encode(arg) if i in positions else [arg])
        return launcher(*final)
    return inner


def test_a_descriptor_launchers_encoding_is_learned_in_the_one_by_one_form() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kopt.codegen.launch import Noted, _lower_descriptors

    launched = []
    inner = _descriptor_wrapper36(lambda *a: launched.append(a), {1},
                                  lambda d: [("map", d.base.data_ptr()), *d.shape, *d.strides])
    x = torch.randn(64, 32)
    noted = Noted(object(), (1, 1, 1), [x, TensorDescriptor.from_tensor(x, [16, 16]), 7])
    base = (1, 1, 1, "stream", "fn", False, False, None, None)
    _, learn, (memo,) = _lower_descriptors(inner, base, 9, True, noted, [1])
    assert not launched
    assert learn(8192) == ((("map", 8192), 64, 32, 32, 1),) and set(memo) == {x.data_ptr(), 8192}
