"""Verification: a rewritten graph against the graph before it, on fresh random inputs.

Each pass declares a numerics tier (:class:`kopt.patterns.core.Numerics`):

* ``exact`` -- every output bitwise equal (NaNs in the same places) on every seed.
* ``tolerance`` -- against an fp64 run of the graph before the pass, the relative error
  (Frobenius norm) of the rewritten graph is at most ``factor`` x the error of the graph before
  it, or ``factor`` x the dtype's floor from :data:`RTOL_FLOOR` when the original happens to be
  more accurate than that. This bounds what a rewrite may lose relative to the original,
  whatever the model's own precision is. The floor matters for reordered reductions: two
  orders of one fp32 dot product of length K differ by ~sqrt(K) unit roundoffs, so an original
  that is by chance a few roundoffs off cannot set the bar.
* ``bounded`` -- for rewrites that lower precision on purpose (FP8): checked *locally*. Each
  rewritten site marks its output node with the fp64 computation it replaces
  (:data:`LOCAL_REFERENCE`); running the rewritten graph, every such site's relative error
  against that computation on the values actually flowing there must stay within the bound. The
  model's output error is reported, not bounded: how much a network amplifies a per-GEMM error
  is the network's property, and an end-to-end bound would accept or reject the same rewrite
  depending on where in the model it sits. It is reported against the fp64 run of the captured
  graph's function where an earlier check kept one (how far the passes so far moved the model
  from exact arithmetic), else against the captured graph's outputs: a bounded check runs no
  fp64 graph of the model only to report.

A ``tolerance`` check runs no fp64 graph where it cannot fail: if every output of the rewritten
graph lies within ``d`` (relative) of the graph before's, with ``d <= (factor - 1) f / (1 + f)``
for the output dtype's floor ``f``, the criterion above holds whatever the fp64 run would give
(:func:`near_enough`). An fp64 run of a full model costs seconds on a GPU (every GEMM in fp64),
while a merge usually leaves the outputs as they were. After an FP8 pass a rounding moved
anywhere flips quantizations downstream, and the first tolerance check there usually needs the
fp64 run (kept for the checks after it). ``VerifyOptions(fp64=True)`` runs it every time.

The pipeline checks each pass against a :class:`Baseline`: the outputs the graph before it
gave when it was itself checked, and an fp64 run kept until a ``bounded`` pass changes the
function, so a check runs the rewritten graph once and the fp64 reference only when it changed.

Inputs are drawn afresh per seed: floating tensors from a normal with the example's mean and
standard deviation, so a timestep stays a timestep-sized number; integer and bool tensors (ids,
positions, masks) and Python values are kept, since random ids or masks change the model's
control of data rather than its numerics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kopt.codegen import FP64_REFERENCES
from kopt.graph import attr
from kopt.patterns.core import LOCAL_REFERENCE, Numerics, Verdict

# The one tolerance table: per output dtype, the relative error below which an original is not
# taken as the bar. These are torch.testing.assert_close's default rtols (~22, ~4 and ~2
# unit roundoffs of fp32, bf16 and fp16).
RTOL_FLOOR = {
    torch.float64: 1e-7,
    torch.float32: 1.3e-6,
    torch.bfloat16: 1.6e-2,
    torch.float16: 1e-3,
}

_UPCAST = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class VerifyOptions:
    """``fp64``: run the fp64 reference in every check that has one, even where a ``tolerance``
    check passes without it (:func:`near_enough`) and where a ``bounded`` check would only
    report the model's output error with it; the report then gives every pass's error against
    exact arithmetic (one fp64 run of the model per changed function and seed).

    ``blocks``: check the passes on the model cut to this many blocks per repeated list
    (:func:`kopt.repeated.cut_repeats`), then apply them to the whole model, which one run
    checks end to end (:meth:`kopt.passes.PassManager.run`); W1's 60 blocks are then checked
    as 2, and its checks' runs of the model cost a thirtieth. ``None`` checks every pass on the
    whole model."""

    enabled: bool = True
    seeds: tuple[int, ...] = (0, 1, 2)
    fp64: bool = False
    blocks: int | None = 2

    def __post_init__(self) -> None:
        if self.blocks is not None and (isinstance(self.blocks, bool)
                                        or not isinstance(self.blocks, int) or self.blocks < 1):
            raise ValueError(f"VerifyOptions(blocks=...) takes a count of blocks >= 1 or None, "
                             f"got {self.blocks!r}")


def random_inputs(example: Sequence[Any], seed: int) -> list[Any]:
    """Fresh inputs shaped like ``example`` (flat leaves), reproducible from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: list[Any] = []
    for leaf in example:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel() > 0:
            ref = leaf.detach().float()
            mean = ref.mean().item()
            std = ref.std().item() if leaf.numel() > 1 else 0.0
            std = std if std > 0 else max(abs(mean), 1.0)
            noise = torch.randn(leaf.shape, generator=gen, dtype=torch.float32)
            out.append((noise * std + mean).to(dtype=leaf.dtype, device=leaf.device))
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf.clone())
        else:
            out.append(leaf)
    return out


def run_flat(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    with torch.no_grad():
        return list(pytree.tree_leaves(gm(*inputs)))


class _Upcast(fx.Interpreter):
    """Runs a graph with every floating tensor and floating dtype argument promoted to fp64.

    Parameters are promoted at each use, not when read: export puts every ``get_attr`` at the
    top of the graph, and holding a full model's weights in fp64 at once would not fit a GPU.
    ``view`` becomes ``reshape``: a captured graph's views are valid for the strides its kernels
    produced at capture, and the fp64 run may take another kernel (SDPA's math path) with other
    strides; the values are the same either way.
    """

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        return pytree.tree_map(_to64, result) if n.op == "placeholder" else result

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _VIEWS:
            target = torch.ops.aten.reshape.default
        if (isinstance(target, torch._ops.OpOverload) and target._schema.name in _QUANTIZERS
                and not _any_fp64((args, kwargs))):
            # A quantizer of values the fp64 run never upcast (a weight, at load time): its
            # result is what the optimized model uses, computed the model's way, in the
            # weight's dtype (an fp64 copy of W1's merged modulation weight is 55 GB).
            return super().call_function(target, args, kwargs)
        if target in _MOVES and _one_float_dtype((args, kwargs)):
            # Values moved, not computed: exact in the tensors' own dtype, and the consumer
            # upcasts them. Upcasting here would hold fp64 copies of whole weight sets (W1's
            # merged modulation weight: 121 weights concatenated, 55 GB in fp64).
            return super().call_function(target, args, kwargs)
        if target in _GEMMS and not kwargs:
            return _GEMMS[target](*args)  # upcasts its operands itself, a block at a time
        args = pytree.tree_map(_dtype64, pytree.tree_map(_to64, args))
        kwargs = pytree.tree_map(_dtype64, pytree.tree_map(_to64, kwargs))
        if target is torch.ops.aten._scaled_mm.default:
            return _scaled_mm64(*args, **kwargs)
        if target is torch.ops.aten._grouped_mm.default:
            return _grouped_mm64(*args, **kwargs)
        if target is _aten.scaled_dot_product_attention.default:
            return _sdpa64(*args, **kwargs)
        if target in FP64_REFERENCES:
            return FP64_REFERENCES[target](*args, **kwargs)
        return super().call_function(target, args, kwargs)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_aten = torch.ops.aten
# ops whose outputs are some of their inputs' values, rearranged: exact in any dtype
_MOVES = frozenset({
    _aten.cat.default, _aten.stack.default, _aten.slice.Tensor, _aten.select.int,
    _aten.reshape.default, _aten.permute.default, _aten.transpose.int, _aten.t.default,
    _aten.expand.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int, _aten.clone.default,
    _aten.alias.default, _aten.detach.default, _aten.narrow.default,
})
_QUANTIZERS = frozenset({"kopt::quant_fp8_rowwise", "kopt::quant_fp8_group",
                         "kopt::quant_fp8_block128", "kopt::quant_nvfp4"})  # schema names
# fp64 GEMMs of at most this many bytes of the second operand at a time (in fp64)
GEMM_CHUNK_BYTES = 1 << 30


def _any_fp64(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
               for t in pytree.tree_leaves(tree))


def _one_float_dtype(tree: Any) -> bool:
    """All floating tensors in ``tree`` have one dtype (so a cat does not promote)."""
    dtypes = {t.dtype for t in pytree.tree_leaves(tree)
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(dtypes) <= 1


def _column_blocks(b: torch.Tensor, scale: torch.Tensor | None = None
                   ) -> Iterator[tuple[slice, torch.Tensor]]:
    """``b`` (typically a weight, in its own dtype: bf16, fp8, ...) upcast to fp64 a block of
    columns at a time, times its per-column ``scale`` if given: an fp64 copy of a whole large
    weight would not fit (W1's merged modulation weight: 55 GB)."""
    cols = b.shape[-1] if b.dim() != 2 else max(1, GEMM_CHUNK_BYTES // (8 * b.shape[0]))
    for j in range(0, b.shape[-1], cols):
        block = b[..., j:j + cols].to(torch.float64)
        if scale is not None:
            block = block * (scale[..., j:j + cols] if scale.numel() > 1 else scale)
        yield slice(j, j + cols), block


# fp64 attention scores of at most this many bytes at a time
SDPA_CHUNK_BYTES = 1 << 28


def _sdpa64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
            is_causal: bool = False, scale: float | None = None,
            enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` in fp64, a block of query rows at a time: fp64 runs
    take the math path, which holds the scores and their softmax whole (W1: 24 heads x 4224 x
    4224 tokens, 3.2 GiB each). Each query row's softmax reads only its own scores, so the
    blocks compute the same values."""
    rows, cols = query.shape[-2], key.shape[-2]
    per_row = 8 * cols * max(1, query.numel() // (rows * query.shape[-1]))
    block = max(1, SDPA_CHUNK_BYTES // per_row)
    if block >= rows:
        return torch.ops.aten.scaled_dot_product_attention.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if is_causal:  # SDPA's causal mask: query i sees keys 0..i (aligned top-left)
        attn_mask = torch.ones(rows, cols, dtype=torch.bool, device=query.device).tril()
    out = []
    for i in range(0, rows, block):
        mask = attn_mask
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] == rows:
            mask = mask[..., i:i + block, :]
        out.append(torch.ops.aten.scaled_dot_product_attention.default(
            query[..., i:i + block, :], key, value, mask, dropout_p, False, scale=scale,
            enable_gqa=enable_gqa))
    return torch.cat(out, dim=-2)


def _mm64(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` in fp64, ``b`` upcast a block of columns at a time."""
    a = _to64(a)
    out = a.new_empty((*a.shape[:-1], b.shape[-1]))
    for cols, block in _column_blocks(b):
        out[..., cols] = a @ block
    return out + _to64(bias) if bias is not None else out


def _linear64(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _mm64(x.reshape(-1, x.shape[-1]), w.t(), bias)
    return out.reshape(*x.shape[:-1], w.shape[0])


# Site references computed with the weight upcast a block of columns at a time: an fp64 copy
# of a whole merged weight would not fit a GPU (W1's merged modulation weight: 50.8 GiB).
_BLOCKED_REFERENCES = {torch.nn.functional.linear: _linear64}

_GEMMS = {
    _aten.mm.default: _mm64,
    _aten.addmm.default: lambda bias, a, b: _mm64(a, b, bias),
    _aten.linear.default: _linear64,
}


def _scaled_mm64(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor, bias: torch.Tensor | None = None,
                 scale_result: torch.Tensor | None = None, out_dtype: Any = None,
                 use_fast_accum: bool = False) -> torch.Tensor:
    """The exact value of an FP8 GEMM of these quantized operands, in fp64 (the fp8 kernel
    itself has no fp64 variant); the fp8 weight is upcast a block of columns at a time."""
    a = a.double() * scale_a.double()
    out = a.new_empty((a.shape[0], b.shape[1]))
    for cols, block in _column_blocks(b, scale_b.double()):
        out[:, cols] = a @ block
    if bias is not None:
        out = out + bias.double()
    return out * scale_result.double() if scale_result is not None else out


def _grouped_mm64(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, out_dtype: Any = None) -> torch.Tensor:
    """``torch._grouped_mm`` in fp64 (its kernels take no fp64: transformers' MoE experts run
    on it). ``offs`` holds the groups' cumulative end offsets along the dimension the
    operands' ranks name: 2d x 3d, rows of ``a`` (group g times ``b[g]``); 3d x 2d, columns
    of ``b``; 2d x 2d, the shared K (one output per group); 3d x 3d, no ``offs`` (a batch)."""
    if a.dim() == 3 and b.dim() == 3:
        out = a @ b
    else:
        ends = [int(e) for e in offs.tolist()]
        starts = [0, *ends[:-1]]
        if a.dim() == 2 and b.dim() == 3:
            out = a.new_zeros((a.shape[0], b.shape[-1]))
            for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
                out[s:e] = a[s:e] @ b[g]
        elif a.dim() == 3 and b.dim() == 2:
            out = a.new_zeros((a.shape[1], b.shape[-1]))
            for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
                out[:, s:e] = a[g] @ b[:, s:e]
        else:
            out = torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends, strict=True)])
    return out + bias if bias is not None else out


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _UPCAST:
        return x.to(torch.float64)
    return x


def _dtype64(x: Any) -> Any:
    return torch.float64 if isinstance(x, torch.dtype) and x in _UPCAST else x


class _LocalCheck(fx.Interpreter):
    """Runs a graph and measures each marked site against its fp64 reference computation."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        # Keep only the values a reference reads: holding every activation of a full model
        # until the end of the run would not fit a GPU.
        # ... and only until the last reference that reads them (W1: the inputs of 480 FP8
        # sites, activations and merged weights, would otherwise all live to the end).
        self.last_reader: dict[str, str] = {}
        for n in gm.graph.nodes:
            for a in n.meta.get(LOCAL_REFERENCE, (None, ()))[1]:
                if a is not None:
                    self.last_reader[a] = n.name
        self.needed = set(self.last_reader)
        self.by_name: dict[str, Any] = {}
        self.worst = (0.0, "")

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.needed:
            self.by_name[n.name] = result
        ref = n.meta.get(LOCAL_REFERENCE)
        if ref is not None:
            fn, names = ref
            if fn in _BLOCKED_REFERENCES:  # upcasts its weight a block at a time itself
                fn, args = _BLOCKED_REFERENCES[fn], [
                    None if a is None else self.by_name[a] for a in names]
            else:
                args = [None if a is None else _to64(self.by_name[a]) for a in names]
            err = relative_error(result, fn(*args))
            if err != err:  # NaN: the worst there is
                err = float("inf")
            if err >= self.worst[0]:
                self.worst = (err, n.name)
            del args
            for a in names:
                if a is not None and self.last_reader[a] == n.name:
                    self.by_name.pop(a, None)
        return result


def forget_sites(gm: fx.GraphModule) -> None:
    """Drop the site references of the pass just checked: the next check measures its own
    sites only (an earlier pass's reference may name a weight folded away since)."""
    for n in gm.graph.nodes:
        n.meta.pop(LOCAL_REFERENCE, None)


def run_fp64(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    with torch.no_grad():
        return list(pytree.tree_leaves(_Upcast(gm).run(*inputs)))


def mutated_attributes(gm: fx.GraphModule) -> list[torch.Tensor]:
    """Buffers the graph writes in place (a KV cache, a step counter)."""
    out = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for arg, spec in zip(node.args, target._schema.arguments, strict=False):
            if (isinstance(arg, fx.Node) and arg.op == "get_attr" and spec.alias_info is not None
                    and spec.alias_info.is_write):
                out.append(attr(gm, arg.target))
    return out


# Outputs (and their fp64 runs) kept from pass to pass: at most this many bytes in all, else
# each pass runs the graph before it again (an LLM's prefill logits: 1.2 GB per seed in fp32).
BASELINE_BYTES = 1 << 30


class Baseline:
    """What the next pass's rewritten graph is checked against, carried from pass to pass: per
    seed, the outputs of the graph the passes have accepted so far, and their fp64 run.

    A pass's accepted graph computed its outputs while it was verified, so the next pass need
    not run it again. The fp64 run is kept across passes that compute the same function as the
    graph before them (tiers ``exact`` and ``tolerance``: only their roundings differ, by
    their own declarations), and computed again after a ``bounded`` pass, which changes the
    function on purpose (FP8 quantizes the weights). Where the kept values would exceed
    :data:`BASELINE_BYTES` they are not kept (each check then runs the graph before it, as
    :func:`compare` does).
    """

    def __init__(self, gm: fx.GraphModule, example: Sequence[Any]) -> None:
        self.gm = gm
        self.example = example
        self.want: dict[int, list[Any]] = {}
        self.ref: dict[int, list[Any]] = {}
        # (graph, its outputs per seed): the last graph checked that passed on every seed
        self._checked: tuple[fx.GraphModule, dict[int, list[Any]]] | None = None
        self.keep = True  # False once the values were too large to keep
        self.first: dict[int, list[Any]] = {}  # the first graph's outputs (the captured one's)
        self._first_gm = gm
        # the fp64 run of the first graph's function, kept after a bounded pass changes the
        # function: what a bounded check reports the model's output error against
        self.exact: dict[int, list[Any]] = {}
        self._changed = False  # a bounded pass was accepted

    def outputs(self, seed: int, inputs: Sequence[Any]) -> list[Any]:
        """The accepted graph's outputs on ``seed``'s inputs."""
        if seed in self.want:
            return self.want[seed]
        out = run_flat(self.gm, inputs)
        if self.keep:
            self.want[seed] = _owned(self.gm, out)
            if self.gm is self._first_gm:
                self.first[seed] = self.want[seed]
            self._fit()
        return out

    def end_to_end(self, seed: int) -> tuple[list[Any], list[Any]] | None:
        """(the accepted graph's outputs, the first graph's) on ``seed``'s inputs, where both
        were kept: how far the passes moved the outputs, with no graph run again."""
        if seed in self.want and seed in self.first:
            return self.want[seed], self.first[seed]
        return None

    def fp64(self, seed: int, inputs: Sequence[Any]) -> list[Any]:
        """The fp64 run of the accepted graph (or of one computing the same function)."""
        if seed in self.ref:
            return self.ref[seed]
        out = run_fp64(self.gm, inputs)
        if self.keep:
            self.ref[seed] = out
            if not self._changed:
                self.exact[seed] = out
            self._fit()
        return out

    def report_reference(self, seed: int, inputs: Sequence[Any], outputs: list[Any],
                         fp64: bool = False) -> tuple[list[Any], list[Any] | None, str]:
        """(a reference, the outputs of the graph before against it or None, what the reference
        is) for a bounded check's report of the model's output error, which bounds nothing:

        * the first graph's fp64 run and outputs where both were kept: how far the passes so
          far moved the model from exact arithmetic;
        * with ``fp64``, else the accepted graph's fp64 run and ``outputs``, its outputs;
        * else the first graph's outputs where kept (how far the passes so far moved the
          captured graph's outputs), or ``outputs``: no fp64 run of the model for a report.
        """
        if seed in self.exact and seed in self.first:
            return self.exact[seed], self.first[seed], "vs fp64"
        if fp64:
            return self.fp64(seed, inputs), outputs, "vs fp64"
        if seed in self.first:
            return self.first[seed], None, "from the captured graph's"
        return outputs, None, "from the graph before's"

    def checked(self, gm: fx.GraphModule, outputs: dict[int, list[Any]]) -> None:
        """``gm`` passed its check on every seed with these outputs."""
        self._checked = (gm, {seed: _owned(gm, out) for seed, out in outputs.items()}
                         ) if self.keep else None

    def accept(self, gm: fx.GraphModule, numerics: Numerics) -> None:
        """The passes go on from ``gm``, the graph a pass of tier ``numerics`` left: its outputs
        are the ones it was checked with; a graph it was not checked as (every site reverted, or
        nothing matched) computes what the graph before it did, bit for bit."""
        if gm is self.gm:
            return
        if self._checked is not None and self._checked[0] is gm:
            self.want = self._checked[1]
            if numerics.tier == "bounded":
                self.ref = {}
                self._changed = True
        self.gm, self._checked = gm, None

    def _fit(self) -> None:
        values = {id(v): v for d in (self.want, self.ref, self.first, self.exact)
                  for out in d.values() for v in out}  # shared until a pass changes them
        held = sum(v.nbytes for v in values.values() if isinstance(v, torch.Tensor))
        if held > BASELINE_BYTES:
            self.keep = False
            self.want, self.ref, self.first, self.exact = {}, {}, {}, {}


def _owned(gm: fx.GraphModule, outputs: list[Any]) -> list[Any]:
    """``outputs`` as kept for later checks: copies where the graph has state (a buffer it
    writes, a cache), since an output may be that state, which the next run writes and
    :func:`compare` then restores."""
    if not mutated_attributes(gm) and not _stateful(gm):
        return outputs
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in outputs]


def compare(
    before: fx.GraphModule,
    after: fx.GraphModule,
    example: Sequence[Any],
    numerics: Numerics,
    options: VerifyOptions = VerifyOptions(),
    baseline: Baseline | None = None,
) -> Verdict:
    """Check ``after`` against ``before`` at ``numerics``'s tier on ``options.seeds``.

    ``baseline``: ``before``'s outputs and fp64 runs kept from earlier checks (its graph must be
    ``before``); this check's outputs are recorded in it for the next pass.

    Buffers either graph writes in place are restored afterwards: verifying leaves the model's
    state (e.g. a KV cache) as it was.
    """
    if baseline is None:
        baseline = Baseline(before, example)
        baseline.keep = False
    elif baseline.gm is not before:
        raise ValueError("the baseline is of another graph than the one before the pass")
    with state_kept(before, after):
        return _compare(baseline, after, numerics, options)


@contextmanager
def state_kept(*gms: fx.GraphModule) -> Iterator[None]:
    """The buffers the graphs ``gms`` write in place (a KV cache) restored after the block:
    running them to check them leaves the model's state as it was."""
    state = [(t, t.clone()) for t in {id(t): t for gm in gms
                                      for t in mutated_attributes(gm)}.values()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, saved in state:
                t.copy_(saved)


def _compare(baseline: Baseline, after: fx.GraphModule, numerics: Numerics,
             options: VerifyOptions) -> Verdict:
    worst_ratio = 0.0
    worst_detail = ""
    nearest = -1.0  # the largest distance of a seed that passed without an fp64 run
    outputs: dict[int, list[Any]] = {}
    for seed in options.seeds:
        inputs = random_inputs(baseline.example, seed)
        want = baseline.outputs(seed, inputs)
        local = _LocalCheck(after) if numerics.tier == "bounded" else None
        try:
            if local is None:
                got = run_flat(after, inputs)
            else:  # the run that measures every site gives the outputs too
                with torch.no_grad():
                    got = list(pytree.tree_leaves(local.run(*inputs)))
        except Exception as exc:  # noqa: BLE001 -- a rewrite that crashes has failed
            return Verdict(False, numerics.tier, f"seed {seed}: rewritten graph raised "
                                                 f"{type(exc).__name__}: {exc}")
        outputs[seed] = got
        if len(got) != len(want):
            return Verdict(False, numerics.tier, f"{len(got)} outputs instead of {len(want)}")
        if seed == options.seeds[0] and _stateful(after):
            # A graph that keeps state across calls (cached regions) must give the same
            # result when called again with the same inputs, i.e. on a cache hit.
            again = run_flat(after, inputs)
            for i, (a, g) in enumerate(zip(again, got, strict=True)):
                if _bitwise_problem(a, g):
                    return Verdict(False, numerics.tier, f"output {i} differs on a second call "
                                   "with the same inputs (stale state)")
        if numerics.tier == "exact":
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                problem = _bitwise_problem(g, w)
                if problem:
                    return Verdict(False, "exact", f"seed {seed}, output {i}: {problem}")
            continue
        if local is None and not options.fp64 and seed not in baseline.ref:
            near = near_enough(got, want, numerics.factor)
            if near is not None:  # passes whatever the fp64 run would give: none is run
                nearest = max(nearest, near)
                continue
        try:  # a bounded check reports the output error, against the first graph's where kept
            if local is None:
                ref, base, against = baseline.fp64(seed, inputs), want, "vs fp64"
            else:
                ref, base, against = baseline.report_reference(seed, inputs, want,
                                                               options.fp64)
        except Exception as exc:  # noqa: BLE001 -- unverifiable counts as failed, never as passed
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return Verdict(False, numerics.tier, f"the fp64 reference could not be computed: "
                                                 f"{type(exc).__name__}: {first[:300]}",
                           unverifiable=True)
        bases = base if base is not None else [None] * len(want)
        for i, (g, w, r, b) in enumerate(zip(got, want, ref, bases, strict=True)):
            if not (isinstance(w, torch.Tensor) and w.is_floating_point()):
                problem = _bitwise_problem(g, w)
                if problem:
                    return Verdict(False, numerics.tier, f"seed {seed}, output {i}: {problem}")
                continue
            if g.shape != w.shape or g.dtype != w.dtype:
                return Verdict(False, numerics.tier, f"seed {seed}, output {i}: "
                               f"{g.dtype}{list(g.shape)} instead of {w.dtype}{list(w.shape)}")
            err_after = relative_error(g, r)
            err_before = max(relative_error(b, r), RTOL_FLOOR.get(w.dtype, 1.3e-6)) \
                if b is not None else None
            if local is not None:
                err_site, site = local.worst
                if not site:
                    return Verdict(False, "bounded", "no site carries a local reference")
                if not err_site <= numerics.bound:
                    return Verdict(False, "bounded", f"seed {seed}: site {site} relative "
                                   f"error {err_site:.3g} vs fp64 > the bound "
                                   f"{numerics.bound:g}")
                if err_site / numerics.bound >= worst_ratio:
                    worst_ratio = err_site / numerics.bound
                    original = "" if err_before is None else f" (original {err_before:.2g})"
                    worst_detail = (f"site error {err_site:.2g} vs fp64 at {site}; model output "
                                    f"{err_after:.2g} {against}{original}")
                break
            limit, ratio = numerics.factor * err_before, err_after / err_before
            said = f"{numerics.factor:g} x {err_before:.3g}"
            if err_after > limit or err_after != err_after:
                return Verdict(False, numerics.tier, f"seed {seed}, output {i}: relative error "
                               f"{err_after:.3g} vs fp64 > {said}")
            if ratio >= worst_ratio:
                worst_ratio = ratio
                worst_detail = f"rel. error {err_after:.2g} vs fp64, original {err_before:.2g}"
    baseline.checked(after, outputs)
    n = len(options.seeds)
    if numerics.tier == "exact":
        return Verdict(True, "exact", f"bitwise equal on {n} seeds")
    bound = (f"bound {numerics.bound:g}" if numerics.tier == "bounded"
             else f"bound {numerics.factor:g}x")
    if nearest >= 0.0:  # some seeds passed without an fp64 run
        near = ("outputs equal to the graph before's" if nearest == 0.0 else
                f"outputs within {nearest:.2g} of the graph before's")
        near += " (close enough to pass at any fp64 error: no fp64 run)"
        if not worst_detail:
            return Verdict(True, numerics.tier, f"{near}, {bound}, {n} seeds")
        worst_detail = f"{worst_detail}; on other seeds {near}"
    return Verdict(True, numerics.tier, f"worst {worst_detail}, {bound}, {n} seeds")


def agree_across_ranks(gm: fx.GraphModule, verdict: Verdict) -> Verdict:
    """A graph with collectives runs on every rank of its group, and every rank must go on
    issuing the same collectives: a pass is kept or undone on all ranks alike. The verdicts
    are combined (one all-reduce of a flag on the default group); where any rank failed, every
    rank reverts the whole pass without bisecting (a bisection driven by one rank's verdicts
    would run other verification collectives there than on its peers: a hang)."""
    import torch.distributed as dist

    from kopt.patterns.collectives import has_collectives

    if not (dist.is_available() and dist.is_initialized()) or not has_collectives(gm.graph):
        return verdict
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if verdict.passed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 1:
        return verdict
    if verdict.passed:
        return Verdict(False, verdict.tier, f"failed on another rank (passed here: "
                       f"{verdict.detail}); undone on every rank", unverifiable=True)
    return Verdict(False, verdict.tier, f"{verdict.detail}; undone on every rank (no per-site "
                   "bisection across ranks)", unverifiable=True)


def _stateful(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_module" for n in gm.graph.nodes)


def near_enough(got: Sequence[Any], want: Sequence[Any], factor: float) -> float | None:
    """The largest relative distance of ``got`` from ``want`` (the graph before's outputs) where
    that alone proves the ``tolerance`` criterion, else None (then only the fp64 run can tell).

    With ``r`` the fp64 run, ``e_b`` and ``e_a`` the relative errors of ``want`` and ``got``
    against it, and ``d = |got - want| / |want|``: ``|want| <= |r| (1 + e_b)``, so
    ``e_a <= e_b + d (1 + e_b)``; with ``m = max(e_b, f)`` the criterion ``e_a <= factor m``
    holds once ``d <= (factor - 1) m / (1 + m)``, which is at least ``(factor - 1) f / (1 + f)``
    since ``m >= f``. Non-floating outputs must be equal; a NaN, a zero output or another shape
    leaves it to the full check.
    """
    worst = 0.0
    if len(got) != len(want):
        return None
    for g, w in zip(got, want, strict=True):
        if not (isinstance(w, torch.Tensor) and w.is_floating_point()):
            if _bitwise_problem(g, w):
                return None
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return None
        floor = RTOL_FLOOR.get(w.dtype, 1.3e-6)
        scale = torch.linalg.vector_norm(w.to(torch.float64)).item()
        if not scale > 0:
            return None
        d = torch.linalg.vector_norm(g.to(torch.float64) - w.to(torch.float64)).item() / scale
        if not d <= (factor - 1.0) * floor / (1.0 + floor):  # NaN fails here too
            return None
        worst = max(worst, d)
    return worst


# How much more the whole model's output may move from the captured graph's than its shallow
# copy's did (:func:`end_to_end_problem`): errors that add up independently over 30 times the
# blocks grow by sqrt(30) = 5.5.
DEPTH_FACTOR = 10.0


def end_to_end_problem(got: Sequence[Any], want: Sequence[Any],
                       shallow: Sequence[float]) -> str | None:
    """What is wrong with the whole optimized model's outputs ``got`` against the captured
    graph's ``want`` on the same inputs, where the passes were verified on a shallow copy whose
    outputs moved by ``shallow`` (relative, per output) from its captured graph's; None if
    nothing. Outputs must have the shapes and dtypes of ``want``, be finite where ``want`` is,
    equal where not floating, and within ``DEPTH_FACTOR`` x the shallow copy's error (at least
    the dtype's floor, at most 1): a rewrite broken past the cut gives garbage there."""
    if len(got) != len(want):
        return f"{len(got)} outputs instead of {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not (isinstance(w, torch.Tensor) and w.is_floating_point()):
            problem = _bitwise_problem(g, w)
            if problem:
                return f"output {i}: {problem}"
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return (f"output {i}: {getattr(g, 'dtype', type(g).__name__)}"
                    f"{list(getattr(g, 'shape', []))} instead of {w.dtype}{list(w.shape)}")
        finite = torch.isfinite(w)
        if not bool(torch.isfinite(g)[finite].all()):
            return f"output {i}: not finite where the captured graph's is"
        err = relative_error(g[finite], w[finite])
        base = shallow[i] if i < len(shallow) else 0.0
        limit = min(1.0, DEPTH_FACTOR * max(base, RTOL_FLOOR.get(w.dtype, 1.3e-6)))
        if not err <= limit:
            return (f"output {i}: relative error {err:.3g} from the captured graph's > "
                    f"{limit:.3g} ({DEPTH_FACTOR:g} x the shallow model's {base:.2g})")
    return None


def output_errors(got: Sequence[Any], want: Sequence[Any]) -> list[float]:
    """Per output, ``got``'s relative error from ``want`` (0 where not floating)."""
    return [relative_error(g, w) if isinstance(w, torch.Tensor) and w.is_floating_point()
            and isinstance(g, torch.Tensor) and g.shape == w.shape else 0.0
            for g, w in zip(got, want, strict=False)]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(torch.float64)
    denom = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x.to(torch.float64) - ref).item()
    return num / denom if denom > 0 else num


def _bitwise_problem(got: Any, want: Any) -> str | None:
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"{got!r} != {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{list(got.shape)} instead of {want.dtype}{list(want.shape)}"
    if want.is_floating_point():
        nan_w, nan_g = torch.isnan(want), torch.isnan(got)
        if not torch.equal(nan_w, nan_g):
            return "NaNs in different places"
        if not torch.equal(got[~nan_g], want[~nan_w]):
            diff = (got.double() - want.double()).abs().nan_to_num().max().item()
            return f"not bitwise equal (max abs diff {diff:.3g})"
        return None
    return None if torch.equal(got, want) else "values differ"
