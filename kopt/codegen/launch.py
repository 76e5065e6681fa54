"""Launching kopt's Triton kernels, and replaying a fused op's launches without Triton's path.

Every kopt kernel is launched through :func:`launch` (``kernel[grid](*args, **kw)``), so that a
call of a fused op can be *recorded*: which compiled kernels it launched, on which grid, with
which arguments. A :class:`DirectOp` records its op's first call and from then on replays it: it
allocates the outputs (and any scratch buffer) the call allocated, computes each pointer
argument as a source tensor's address plus the offset it had, and calls each compiled kernel's
C launcher with the recorded scalars and constexprs (a host TMA descriptor argument is encoded
once per address it is given). That skips the dispatcher, the op's Python checks and planning,
Triton's argument binding and specialisation and its Python launcher object, and allocates
through PyTorch's dispatcher-free allocator: the replay costs the host about what a
``torch.add`` does, several times less than the op's call through the dispatcher
(``benchmarks/host_cost.py``; RESULTS.md).

A call can be replayed only if its launches are a function of what the replay keeps fixed:
the op's constant arguments and its tensors' shapes, strides, dtypes and devices. The caller
guarantees those (an execution plan is specialised on them, :mod:`kopt.runtime`); the replay
checks what it can cheaply (the device, and the 16-byte alignment Triton specialised a pointer
on). A call that computes anything outside Triton (an aten op other than an allocation or a
view: a ``.contiguous()`` copy, a fallback to the reference, a cuBLAS GEMM) or launches a kernel
:func:`launch` cannot note (an autotuner) is not replayed: the op's
Python implementation keeps running, still without the dispatcher. A recording is adopted only
if its replay reproduces the recorded call's outputs bit for bit.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kopt.graph.regions import same_value

log = logging.getLogger("kopt")

aten = torch.ops.aten


@dataclass
class Noted:
    """One launch as recorded: the compiled kernel, its grid and every parameter's value in the
    kernel's order (constexprs included, as Triton's launcher takes them)."""

    compiled: Any
    grid: tuple[int, int, int]
    values: list[Any]


# The launches of the call being recorded (None: not recording). A list per recording, set by
# :func:`_recording` on the calling thread; kernels launched on other threads are not noted.
_NOTES: list[Noted | None] | None = None


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, noted while a :class:`DirectOp` records."""
    compiled = kernel[grid](*args, **kwargs)
    if _NOTES is not None:
        _NOTES.append(_note(kernel, compiled, grid, args, kwargs))
    return compiled


def note(compiled: Any, grid: tuple[int, int, int], values: Sequence[Any]) -> None:
    """Note a launch made without :func:`launch` (a compiled kernel's launcher called directly)."""
    if _NOTES is not None:
        _NOTES.append(Noted(compiled, grid, list(values)))


def _note(kernel: Any, compiled: Any, grid: Any, args: tuple, kwargs: dict) -> Noted | None:
    """The launch as :class:`Noted`, or None where it cannot be replayed (an interpreted or
    autotuned kernel: no compiled kernel of known parameters)."""
    signature = getattr(kernel, "signature", None)
    if compiled is None or signature is None or not hasattr(compiled, "run"):
        return None
    params = signature.parameters
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    if len(bound.arguments) != len(params):
        return None
    if callable(grid):
        grid = grid(bound.arguments)
    grid = (*tuple(grid), 1, 1)[:3]
    return Noted(compiled, grid, list(bound.arguments.values()))


def _hooks_empty() -> bool:
    """Whether no Triton launch hook is set (a profiler such as Proton sets one): the replay
    passes none, so with a hook set the op keeps Triton's launch path."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover -- a Triton without knobs
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", [hook]):
            return False
    return True


# Ops a recorded call may run besides its Triton launches: allocations (replayed) and views
# (the kernel arguments they make are addresses into a source, recomputed by offset).
_ALLOCATIONS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default,
})
_VIEWS = frozenset({
    aten.view.default, aten.view.dtype, aten._unsafe_view.default, aten.as_strided.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor,
    aten.select.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.detach.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.narrow.default,
    aten.view_as_real.default, aten.view_as_complex.default, aten.reshape.default,
    aten.unflatten.int, aten.flatten.using_ints,
})


class _Watch(TorchDispatchMode):
    """Notes every aten op a recorded call runs: the storages it allocates, and the first op
    that is neither an allocation nor a view (the call then computes outside Triton)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: dict[StorageWeakRef, int] = {}  # storage -> bytes
        self.other: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated[StorageWeakRef(out.untyped_storage())] = out.untyped_storage().nbytes()
        elif func not in _VIEWS and self.other is None and any(
                isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs, out))):
            self.other = str(func)  # (an op on no tensor, e.g. promote_types, computes none)
        return out


class _Recording:
    def __enter__(self) -> list[Noted | None]:
        global _NOTES
        self.previous, _NOTES = _NOTES, []
        return _NOTES

    def __exit__(self, *exc: object) -> None:
        global _NOTES
        _NOTES = self.previous


def _leaves(args: Sequence[Any]) -> list[tuple[int, int | None, Any]]:
    """``(argument position, list position or None, value)`` of every argument and of every
    element of a list/tuple argument: how a replay reaches each tensor the op was given."""
    out: list[tuple[int, int | None, Any]] = []
    for i, a in enumerate(args):
        if isinstance(a, list | tuple):
            out += [(i, j, v) for j, v in enumerate(a)]
        else:
            out.append((i, None, a))
    return out


def _flat_outputs(result: Any) -> tuple[list[torch.Tensor], str] | None:
    """The op's output tensors and the form they are returned in (``tensor``, ``tuple``,
    ``list``); None for another form."""
    if isinstance(result, torch.Tensor):
        return [result], "tensor"
    if isinstance(result, tuple | list) and all(isinstance(t, torch.Tensor) for t in result):
        return list(result), "tuple" if isinstance(result, tuple) else "list"
    return None


def _extent_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))) \
        * t.element_size()


def _empty_strided_cuda() -> Callable[..., torch.Tensor]:
    """``f(shape, stride, dtype)``: an uninitialised tensor on the current CUDA device, from the
    caching allocator, without the dispatcher: PyTorch's own fast path, the one Inductor's
    generated code allocates with. The replay checks the current device before it
    allocates."""
    fast = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", None)
    if fast is not None:
        return fast

    def slow(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=dtype, device="cuda")
    return slow


class _Unreplayable(Exception):
    """Why a recorded call cannot be replayed."""


def _is_descriptor(v: Any) -> bool:
    """Whether ``v`` is a host-side tensor descriptor (``triton.tools.tensor_descriptor``)."""
    return type(v).__name__ == "TensorDescriptor" and isinstance(
        getattr(v, "base", None), torch.Tensor)


class _Address:
    """The base of a replayed tensor descriptor: what Triton's launcher reads from a tensor
    (its address, its dtype) when it encodes the descriptor's tensor map."""

    __slots__ = ("dtype", "ptr")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


def _template(desc: Any) -> Any:
    """A copy of the recorded descriptor that holds no tensor (its base an :class:`_Address`)."""
    out = object.__new__(type(desc))
    out.__dict__.update(desc.__dict__)
    out.base = _Address(desc.base.data_ptr(), desc.base.dtype)
    return out


def _redescribe(template: Any, ptr: int) -> Any:
    """The template's descriptor over the tensor at ``ptr``, made without the dataclass's
    checks (the recorded call passed them; the replay checks the base's alignment)."""
    out = object.__new__(type(template))
    out.__dict__.update(template.__dict__)
    out.base = _Address(ptr, template.base.dtype)
    return out


def _build_replay(name: str, args: Sequence[Any], result: Any, notes: list[Noted | None],
                  watch: _Watch) -> Callable[..., Any]:
    """Generate the replay of one recorded call (see the module's docstring)."""
    if watch.other is not None:
        raise _Unreplayable(f"it runs {watch.other} besides its Triton kernels")
    if not notes:
        raise _Unreplayable("it launched no Triton kernel")
    if any(n is None for n in notes):
        raise _Unreplayable("a launch could not be noted (an interpreted or autotuned kernel)")
    outputs = _flat_outputs(result)
    if outputs is None:
        raise _Unreplayable(f"it returns {type(result).__name__}, not tensors")
    outs, form = outputs
    if not _hooks_empty():
        raise _Unreplayable("a Triton launch hook is set")
    g: dict[str, Any] = {"empty_strided": _empty_strided_cuda(), "empty": torch.empty,
                         "uint8": torch.uint8, "current_device": torch._C._cuda_getDevice,
                         "raw_stream": torch._C._cuda_getCurrentRawStream, "scratch": {},
                         "redescribe": _redescribe}
    lines: list[str] = []
    sources: dict[StorageWeakRef, tuple[str, int]] = {}  # storage -> (expression, its ptr)
    leaves = _leaves(args)
    n_args = len(args)
    devices = {t.device for t in outs} | {v.device for _, _, v in leaves
                                          if isinstance(v, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise _Unreplayable(f"its tensors are on {sorted(map(str, devices))}, not one GPU")
    device = next(iter(devices))
    g["device"] = device
    # the inputs first: an input's address is read every call
    for k, (i, j, v) in enumerate(leaves):
        if isinstance(v, torch.Tensor) and v.numel():
            ref = StorageWeakRef(v.untyped_storage())
            expr = f"a{i}" if j is None else f"a{i}[{j}]"
            if ref not in sources:
                lines.append(f"p{k} = {expr}.data_ptr()")
                sources[ref] = (f"p{k}", v.data_ptr())
    taken = set(sources)
    # then the outputs, allocated as the call allocated them
    out_names = []
    for k, t in enumerate(outs):
        ref = StorageWeakRef(t.untyped_storage())
        if ref in taken:
            raise _Unreplayable("an output aliases an input or another output")
        if ref not in watch.allocated:
            raise _Unreplayable("an output was not allocated by the call")
        if t.storage_offset() or watch.allocated[ref] != _extent_bytes(t):
            raise _Unreplayable("an output is a part of a larger allocation")
        g[f"shape{k}"], g[f"stride{k}"], g[f"dtype{k}"] = tuple(t.shape), t.stride(), t.dtype
        lines.append(f"o{k} = empty_strided(shape{k}, stride{k}, dtype{k})")
        if t.numel():
            lines.append(f"q{k} = o{k}.data_ptr()")
            sources[ref] = (f"q{k}", t.data_ptr())
        taken.add(ref)
        out_names.append(f"o{k}")
    # every launch's arguments
    calls = []
    aligned: list[str] = []
    scratch = 0
    scratch_bytes: list[int] = []
    for c, n in enumerate(notes):
        assert n is not None
        values = []
        descs: list[tuple[int, str]] = []  # (position, the address expression) per descriptor
        for v_i, v in enumerate(n.values):
            if isinstance(v, torch.Tensor):
                ptr = v.data_ptr()
                if ptr == 0 or v.untyped_storage().nbytes() == 0:
                    values.append("0")
                    continue
                ref = StorageWeakRef(v.untyped_storage())
                if ref not in sources:
                    if ref in watch.allocated:  # a scratch buffer: one per stream, kept
                        scratch_bytes.append(watch.allocated[ref])
                        sources[ref] = (f"s[{scratch}]", v.untyped_storage().data_ptr())
                        scratch += 1
                    else:  # a tensor the op keeps between calls (a table): its own address
                        g[f"kept{c}_{v_i}"] = v
                        lines.append(f"k{c}_{v_i} = kept{c}_{v_i}.data_ptr()")
                        sources[ref] = (f"k{c}_{v_i}", ptr)
                expr, base = sources[ref]
                offset = ptr - base
                value = f"({expr} + {offset})" if offset else expr
                if ptr % 16 == 0:
                    aligned.append(value)
                values.append(value)
            elif _is_descriptor(v):
                # a host TMA descriptor of an input or output: the launcher encodes the tensor
                # map from its base's address, the rest is fixed by the specialisation
                ref = StorageWeakRef(v.base.untyped_storage())
                if ref not in sources:
                    raise _Unreplayable(f"launch {c} takes a descriptor of a tensor it was "
                                        "not given")
                expr, base = sources[ref]
                offset = v.base.data_ptr() - base
                value = f"({expr} + {offset})" if offset else expr
                aligned.append(value)
                g[f"desc{c}_{v_i}"] = _template(v)
                values.append(f"redescribe(desc{c}_{v_i}, {value})")
                descs.append((v_i, value))
            elif isinstance(v, bool | int | float | str | type(None)):
                values.append(repr(v))
            elif isinstance(v, torch.dtype) or type(v).__module__.startswith("triton.language"):
                g[f"const{c}_{v_i}"] = v  # a dtype or a constexpr: the same every call
                values.append(f"const{c}_{v_i}")
            else:
                raise _Unreplayable(f"launch {c} takes a {type(v).__name__}")
        calls += _launch_call(g, c, n, values, descs)
    params = ", ".join(f"a{i}" for i in range(n_args))
    body = [f"def replay({params}):"]
    body += [f"    {line}" for line in lines if line.startswith("p")]
    if aligned:  # Triton compiled the kernel for these addresses' 16-byte alignment
        inputs_aligned = [a for a in aligned if a.lstrip("(").startswith("p")]
        if inputs_aligned:
            body.append(f"    if ({' | '.join(inputs_aligned)}) & 15:")
            body.append("        return None")
    body.append(f"    if current_device() != {device.index}:")
    body.append("        return None")
    body += [f"    {line}" for line in lines if not line.startswith("p")]
    body.append(f"    stream = raw_stream({device.index})")
    if scratch_bytes:  # the kernels' scratch: launches on one stream run one after another
        g["scratch_bytes"] = scratch_bytes
        g["held"] = []
        body.append("    s = scratch.get(stream)")
        body.append("    if s is None:")
        body.append("        bufs = [empty((n,), dtype=uint8, device=device) "
                    "for n in scratch_bytes]")
        body.append("        held.append(bufs)")
        body.append("        s = scratch[stream] = [b.data_ptr() for b in bufs]")
    body += [f"    {call}" for call in calls]
    if form == "tensor":
        body.append(f"    return {out_names[0]}")
    elif form == "tuple":
        body.append(f"    return ({', '.join(out_names)},)")
    else:
        body.append(f"    return [{', '.join(out_names)}]")
    source = "\n".join(body) + "\n"
    exec(_compiled(source), g)  # noqa: S102 -- generated
    replay = g["replay"]
    replay.__qualname__ = f"replay of {name}"
    replay.source = source
    return replay


@functools.lru_cache(maxsize=4096)
def _compiled(source: str) -> Any:
    """A replay's source compiled once: a repeated block's calls of one op differ only in the
    values their globals bind (kernels, constants, descriptors), not in their source."""
    return compile(source, "<kopt replay>", "exec")


# A stream value no real stream has: what a spied launch is given, to find where the launcher
# passes the stream on.
_STREAM_MARK = 0x7EA5_0000_0001


def _launch_call(g: dict[str, Any], c: int, n: Noted, values: list[str],
                 descs: Sequence[tuple[int, str]] = ()) -> list[str]:
    """The replay's source lines that launch ``n`` (its arguments' expressions ``values``;
    ``descs``: the positions of its host tensor descriptors and their addresses' expressions).

    Triton's launcher object (``compiled.run``) is a Python wrapper around a C function
    (``run.launch``) that allocates the kernel's global and profile scratch, if it has any,
    and passes everything on. For a kernel without scratch the replay calls the C function
    directly: one wrapper call is spied on (the C function replaced, so nothing launches) to
    learn where it puts the stream and the kernel's arguments; every other argument it passes
    is a constant of this kernel. Where the wrapper does not pass the arguments on as recorded,
    the replay calls the wrapper. A kernel that takes host tensor descriptors has one more
    wrapper, which encodes each descriptor's tensor map; the replay keeps the encoded form of
    each address it has seen (:func:`_lower_descriptors`), so that a call on known addresses
    (a weight's; an activation's the allocator hands out again) skips that wrapper too."""
    run = n.compiled.run
    g[f"run{c}"], g[f"fn{c}"] = run, n.compiled.function
    g[f"meta{c}"] = n.compiled.packed_metadata
    wrapper = (f"run{c}({n.grid[0]}, {n.grid[1]}, {n.grid[2]}, stream, fn{c}, meta{c}, "
               f"None, None, None, {', '.join(values)})")
    spied = _spy(run, n)
    if spied is None:
        return [wrapper]
    inner, passed, stream_at, args_at, expanded = spied
    lines: list[str] = []
    if descs:
        lowered = _lower_descriptors(inner, passed, args_at, expanded, n,
                                     [i for i, _ in descs])
        if lowered is not None:
            inner, learn, memos = lowered
            g[f"learn{c}"] = learn
            names = [f"e{c}_{k}" for k in range(len(descs))]
            for k, (_, address) in enumerate(descs):
                g[f"memo{c}_{k}"] = memos[k]
                lines.append(f"{names[k]} = memo{c}_{k}.get({address})")
            lines.append(f"if {' or '.join(f'{e} is None' for e in names)}:")
            lines.append(f"    {', '.join(names)}, = learn{c}("
                         f"{', '.join(a for _, a in descs)})")
            at = {i: k for k, (i, _) in enumerate(descs)}
            values = [f"*{names[at[i]]}" if i in at else v for i, v in enumerate(values)]
    g[f"launch{c}"] = inner
    parts = []
    for k, v in enumerate(passed[:args_at]):
        if k == stream_at:
            parts.append("stream")
        else:
            g[f"pass{c}_{k}"] = v
            parts.append(f"pass{c}_{k}")
    kernel_args = ", ".join(values)
    if expanded:
        parts.append(kernel_args)
    else:
        parts.append(f"({kernel_args},)" if values else "()")
    return [*lines, f"launch{c}({', '.join(p for p in parts if p)})"]


_MEMO_ENTRIES = 64  # encoded descriptors kept per descriptor argument (then forgotten)


def _lower_descriptors(inner: Any, passed: tuple, args_at: int, expanded: bool, n: Noted,
                       positions: list[int]) -> tuple[Any, Callable[..., tuple],
                                                       list[dict[int, tuple]]] | None:
    """``(C function, learn, memos)`` for a launcher ``inner`` that encodes host tensor
    descriptors (a closure over the C function, named ``launcher``), or None for another form.

    ``learn(*addresses)`` runs the encoding for descriptors over those addresses (a copy of
    ``inner`` whose C function only records what it is given) and returns, per descriptor,
    the values it became in the C function's arguments, filing each in its ``memos`` entry
    keyed by address. The form is checked on the recorded call: every other argument passed
    through unchanged, every descriptor expanded to the same number of values."""
    code = getattr(inner, "__code__", None)
    closure = getattr(inner, "__closure__", None)
    if code is None or closure is None or "launcher" not in code.co_freevars:
        return None
    cells = list(closure)
    at = code.co_freevars.index("launcher")
    c_function = cells[at].cell_contents
    if not callable(c_function):
        return None
    seen: list[tuple] = []
    cells[at] = types.CellType(lambda *a: seen.append(a))
    encode = types.FunctionType(code, inner.__globals__, code.co_name, inner.__defaults__,
                                tuple(cells))
    encode.__kwdefaults__ = inner.__kwdefaults__
    base = passed[:args_at]
    templates = [_template(n.values[i]) for i in positions]
    # the other arguments as plain values: the encoding passes them through
    plain = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in n.values]
    where = set(positions)
    memos: list[dict[int, tuple]] = [{} for _ in positions]

    def learn(*addresses: int) -> tuple:
        values = list(plain)
        for i, t, a in zip(positions, templates, addresses, strict=True):
            values[i] = _redescribe(t, a)
        seen.clear()
        if expanded:
            encode(*base, *values)
        else:
            encode(*base, tuple(values))
        got = seen[-1][args_at:] if expanded else seen[-1][args_at]
        extra = len(got) - len(values)
        if extra < 0 or extra % len(positions):
            raise _Unreplayable("the descriptors' encoding has an unknown form")
        width = extra // len(positions) + 1
        out: list[tuple] = []
        j = 0
        for i, v in enumerate(values):
            if i in where:
                out.append(tuple(got[j:j + width]))
                j += width
            else:
                if not (got[j] is v or (isinstance(v, int | float) and got[j] == v)):
                    raise _Unreplayable("the descriptors' encoding has an unknown form")
                j += 1
        for memo, a, e in zip(memos, addresses, out, strict=True):
            if len(memo) >= _MEMO_ENTRIES:
                memo.clear()
            memo[a] = e
        return tuple(out)

    try:
        learn(*(n.values[i].base.data_ptr() for i in positions))
    except Exception:  # noqa: BLE001 -- a launcher of another form: the replay calls it
        return None
    return c_function, learn, memos


def _spy(run: Any, n: Noted) -> tuple[Any, tuple, int, int, bool] | None:
    """``(C function, the arguments the wrapper passed it, the stream's position, the kernel
    arguments' position, whether they are passed one by one)`` for a wrapper call of ``run``
    with ``n``'s arguments; None where ``run`` is not such a wrapper or passes anything else."""
    inner = getattr(run, "launch", None)
    if inner is None or not callable(inner) or "launch" not in getattr(run, "__dict__", {}):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
            or getattr(run, "gsan_enabled", False):
        return None
    seen: list[tuple] = []
    run.launch = lambda *a: seen.append(a)
    try:
        run(*n.grid, _STREAM_MARK, n.compiled.function, n.compiled.packed_metadata, None,
            None, None, *n.values)
    except Exception:  # noqa: BLE001 -- a wrapper of another form: call it as it is
        return None
    finally:
        run.launch = inner
    if len(seen) != 1:
        return None
    passed = seen[0]
    marks = [k for k, v in enumerate(passed) if isinstance(v, int) and v == _STREAM_MARK]
    if len(marks) != 1:
        return None
    values = tuple(n.values)
    if passed and isinstance(passed[-1], tuple) and len(passed[-1]) == len(values) and all(
            a is b for a, b in zip(passed[-1], values, strict=True)):
        args_at, expanded = len(passed) - 1, False
    elif len(passed) >= len(values) and all(
            a is b for a, b in zip(passed[len(passed) - len(values):], values, strict=True)):
        args_at, expanded = len(passed) - len(values), True
    else:
        return None
    if marks[0] >= args_at:
        return None
    return inner, passed, marks[0], args_at, expanded


class DirectOp:
    """A kopt op's call in an execution plan: the op's CUDA implementation called without the
    dispatcher; after its first call, that call's Triton launches replayed (module docstring).

    ``impl`` is the op's Python CUDA implementation (what the dispatcher would call); ``name``
    names the node in the generated forward and in the report."""

    def __init__(self, op: Any, impl: Callable[..., Any], name: str) -> None:
        self.op = op
        self.impl = impl
        self.__name__ = name
        self.__qualname__ = name
        self.__module__ = "kopt.runtime"
        self._replay: Callable[..., Any] | None = None
        self.recorded = False
        self.why_not: str | None = None  # why the call is not replayed, once recorded

    @property
    def direct(self) -> bool:
        """Whether the call is replayed (the cheap launch)."""
        return self._replay is not None

    def __call__(self, *args: Any) -> Any:
        replay = self._replay
        if replay is not None:
            out = replay(*args)
            if out is not None:
                return out
            return self.impl(*args)
        if self.recorded or torch.cuda.is_current_stream_capturing():
            return self.impl(*args)
        return self._record(args)

    def _record(self, args: tuple) -> Any:
        self.recorded = True
        watch = _Watch()
        with _Recording() as notes, watch:
            result = self.impl(*args)
        try:
            replay = _build_replay(self.__name__, args, result, notes, watch)
            try:
                again = replay(*args)
            except Exception as e:  # noqa: BLE001 -- a launcher of a form the replay mistook
                raise _Unreplayable(f"its replay failed: {type(e).__name__}: {e}") from e
            if again is None:
                raise _Unreplayable("its guards failed on the call it was recorded from")
            got = _flat_outputs(again)
            want = _flat_outputs(result)
            assert got is not None and want is not None
            if not all(same_value(a, b) for a, b in zip(got[0], want[0], strict=True)):
                raise _Unreplayable("the replay's outputs differ from the recorded call's")
            self._replay = replay
        except _Unreplayable as e:
            self.why_not = str(e)
            log.info("kopt: %s (%s) keeps its Python launch: %s", self.__name__, self.op, e)
        return result
