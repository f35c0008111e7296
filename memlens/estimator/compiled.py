"""``--compile``: the ``torch.compile``'d step, simulated with the compiler's own partitioner.

What decides a compiled step's memory is which activations the compiled backward keeps, and
which intermediates the generated kernels write. ``torch.compile`` (inductor) traces the model's
forward and backward into one joint graph (AOTAutograd), applies inductor's decompositions, and
splits it with the min-cut rematerialization partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``, ``compiler="inductor"``):
the forward graph returns exactly the tensors the backward graph needs; what is cheap to
recompute is recomputed in backward instead of kept.

:func:`compile_for_simulation` runs that same machinery on the simulation's fake tensors: it
traces the model's forward under the CUDA emulation (CUDA's autocast policy; fused attention as
two opaque ops whose backward reads q, k, v, the output and the softmax statistics, as the real
kernels do), partitions it with inductor's partitioner, and returns a module that runs the
forward graph and, in backward, the backward graph under the storage tracker, with inductor's
boxed calling convention (inputs freed at their last use). So the saved activations are the
compiled step's own (exact).

The generated kernels' buffers are modelled by inductor's fusion rule (:func:`materialized`):
a pointwise op whose consumers are all pointwise ops or reductions is fused into them and never
stored; matmuls, attention, random ops, reductions and graph outputs are buffers. That is the
scheduler's default behaviour; its exceptions (a pointwise node read by many kernels may be
stored, some reductions fuse further) are not, and dynamo's graph breaks are not reproduced (one
graph per forward). ``fuse=False`` runs every op as its own buffer, an upper bound.
bench/gpu_generality_calibrate.py measures compiled steps at shapes outside the accuracy set;
bench/results/generality_accuracy.md reports the gap.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

BOUND = ("saved activations from inductor's min-cut partitioner (exact); kernel buffers from inductor's fusion rule "
         "(modelled; one graph, dynamo's graph breaks not reproduced): an upper bound, measured 8-15% above three real "
         "compiled steps on an H100 (bench/results/generality_accuracy.md)")


class CompiledForSimulation(torch.nn.Module):
    """A model whose forward runs an AOTAutograd-partitioned graph (forward and backward)."""

    def __init__(self, model: torch.nn.Module, fn: Callable, params: dict, out_spec, constants: list, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self._fn = fn
        self._params = params
        self._out_spec = out_spec
        self._constants = constants
        self._keys = keys

    def forward(self, **kwargs):
        from torch.utils._pytree import tree_unflatten

        outs = self._fn(self._params, *[kwargs[k] for k in self._keys])
        it = iter(outs)
        leaves = [next(it) if c is _TENSOR else c for c in self._constants]
        return tree_unflatten(leaves, self._out_spec)


_TENSOR = object()   # placeholder for a tensor leaf of the model's output


_OPS: dict[str, Any] = {}


def _attention_ops():
    """Two opaque ops standing for CUDA's fused attention kernels inside a traced graph
    (registered on first use). Like the real kernels (``_scaled_dot_product_cudnn_attention`` and
    its backward) the backward takes q, k, v, the output and the softmax statistics as inputs,
    so the partitioner keeps them for backward; their fake implementations allocate what
    :class:`memlens.estimator.cuda_rules.FusedAttention` allocates (outputs only: the backward
    kernel's scratch is not in the graph)."""
    if _OPS:
        return _OPS["fwd"], _OPS["bwd"]
    from .cuda_rules import _ceil_to, _kernel_output

    @torch.library.custom_op("memlens::fused_sdpa_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("memlens' attention stand-in runs on fake tensors only")

    @fwd.register_fake
    def _(q, k, v, backend):
        B, H, L, _ = q.shape
        out = _kernel_output(backend, q, (B, H, L, v.shape[-1]))
        stats = torch.empty(B, H, _ceil_to(L, 32) if backend == "efficient" else L, dtype=torch.float32, device=q.device)
        n = 0 if backend == "efficient" else 1
        return out, stats, torch.empty(n, dtype=torch.int64, device=q.device), torch.empty(n, dtype=torch.int64, device=q.device)

    @torch.library.custom_op("memlens::fused_sdpa_bwd", mutates_args=())
    def bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
            mask: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("memlens' attention stand-in runs on fake tensors only")

    @bwd.register_fake
    def _(grad, q, k, v, out, stats, mask, backend):
        B, H, L, D = q.shape
        return tuple(_kernel_output(backend, t, shape) for t, shape in ((q, (B, H, L, D)), (k, tuple(k.shape)), (v, tuple(v.shape))))

    _OPS.update(fwd=fwd, bwd=bwd)
    return fwd, bwd


class OpaqueAttention(torch.autograd.Function):
    """Fused SDPA as one opaque forward op and one opaque backward op (for the compile trace)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, backend):
        fwd, _ = _attention_ops()
        out, stats, rng0, rng1 = fwd(q, k, v, backend)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.empty(attn_mask.shape, dtype=q.dtype, device=q.device)  # additive mask, as the kernel makes
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, stats, attn_mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        _, bwd = _attention_ops()
        q, k, v, out, stats, mask = ctx.saved_tensors
        dq, dk, dv = bwd(grad, q, k, v, out, stats, mask, ctx.backend)
        return dq, dk, dv, None, None


def _random_ops() -> set:
    a = torch.ops.aten
    return {a.rand.default, a.rand_like.default, a.randn.default, a.randn_like.default, a.bernoulli.default, a.bernoulli.p}


def _indexing_ops() -> set:
    """Ops inductor lowers to pointwise kernels that load through an index (torch/_inductor/lowering.py:
    ``gather``, ``index``, and the constants ``full``, ``scalar_tensor``, ``arange``/``iota``)."""
    a = torch.ops.aten
    return {a.gather.default, a.index.Tensor, a.full.default, a.scalar_tensor.default, a.arange.default, a.arange.start,
            a.arange.start_step, torch.ops.prims.iota.default}


def _pointwise(node) -> bool:
    """Elementwise in inductor's sense: pointwise ops, dtype conversions, random draws (inductor
    generates them inside the consuming kernel from a philox seed), indexing loads and constants,
    and a scatter into a constant tensor (inductor's ``scatter_upon_const_tensor`` pass turns it
    into a pointwise ``where``: cross-entropy's backward never stores its one-hot)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if t in (torch.ops.aten.scatter.value, torch.ops.aten.scatter.src):
        base = node.args[0]
        return getattr(base, "target", None) is torch.ops.aten.full.default
    return (torch.Tag.pointwise in t.tags or t is torch.ops.aten._to_copy.default or t in _random_ops()
            or t in _indexing_ops())


def _fusible(node) -> bool:
    t = node.target
    return _pointwise(node) or (isinstance(t, torch._ops.OpOverload) and torch.Tag.reduction in t.tags)


def _is_view(node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.is_view


def _consumers(node):
    """The nodes reading ``node``'s data, through any chain of views."""
    for u in node.users:
        if u.op == "call_function" and _is_view(u):
            yield from _consumers(u)
        else:
            yield u


def materialized(graph) -> dict:
    """Which nodes inductor writes to memory: a pointwise node whose every consumer (through
    views) is pointwise or a reduction is fused into that consumer's kernel and never stored
    (inductor's scheduler fuses such chains); anything else (matmuls, convolutions, attention,
    random ops, reductions, graph outputs) is a buffer."""
    out = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        out[n] = not _pointwise(n) or any(u.op == "output" or not _fusible(u) for u in _consumers(n))
    return out


def _reinplaceable_ops() -> set:
    """Functional scatters that inductor's reinplacing pass (torch/_inductor/fx_passes/reinplace.py)
    turns into in-place kernels on their ``self`` buffer when nothing else reads it (an embedding's
    weight gradient: ``full`` zeros, then the index_put accumulate writes into them)."""
    a = torch.ops.aten
    return {a.index_put.default, a._unsafe_index_put.default, a._unsafe_masked_index_put_accumulate.default,
            a.scatter_add.default, a.scatter.src, a.scatter.value, a.scatter_reduce.two}


def _writes_in_place(node) -> bool:
    base = node.args[0] if node.args else None
    return (node.target in _reinplaceable_ops() and getattr(base, "op", None) == "call_function"
            and len(base.users) == 1)


def boxed_runner(gm, fuse: bool):
    """Run a partitioned graph the way inductor's generated ``call(args)`` runs: inputs as one list
    that is cleared once read, every value freed at its last use, and (``fuse``) the values
    inductor fuses away computed without being accounted (outside the storage tracker), and the
    scatters it reinplaces written into their ``self`` buffer."""
    from torch.fx.node import map_arg
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    from ..core.tracker import StorageTracker

    def unaccounted(fn, a, kw):
        """Run one op with the storage tracker (the innermost mode) set aside: its output is fused
        away, so it takes no memory; the fake mode beneath still gives it its shape."""
        if isinstance(_get_current_dispatch_mode(), StorageTracker):
            with _pop_mode_temporarily():
                return fn(*a, **kw)
        return fn(*a, **kw)

    graph = gm.graph
    keep = materialized(graph) if fuse else {}
    # values never stored, and the views of them (a view of a fused value is no new storage either)
    fused_away: set = set()
    for n in graph.nodes:
        if n.op == "call_function" and (not keep.get(n, True) or (_is_view(n) and n.args and n.args[0] in fused_away)):
            fused_away.add(n)
    last: dict = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            last[a] = n
    frees: dict = {}
    for a, n in last.items():
        frees.setdefault(n, []).append(a)

    def run(args):
        env = {}
        it = iter(list(args))
        args.clear()
        for n in graph.nodes:
            if n.op == "placeholder":
                env[n] = next(it)
            elif n.op == "get_attr":
                env[n] = getattr(gm, n.target)
            elif n.op == "call_function":
                a = map_arg(n.args, env.__getitem__)
                kw = map_arg(n.kwargs, env.__getitem__)
                if n in fused_away:
                    env[n] = unaccounted(n.target, a, kw)
                elif fuse and _writes_in_place(n) and n.args[0] not in fused_away:
                    unaccounted(n.target, a, kw)   # shape check only
                    env[n] = a[0]                  # the result is the self buffer, written in place
                else:
                    env[n] = n.target(*a, **kw)
            elif n.op == "output":
                return list(map_arg(n.args[0], env.__getitem__))
            for dead in frees.get(n, ()):
                env.pop(dead, None)
        raise AssertionError("graph without output")

    run._boxed_call = True
    return run


def compile_for_simulation(model, batch: dict, forward_keys, trace_context: Callable[[], Any], rules=None,
                           fuse: bool = True) -> CompiledForSimulation:
    """Trace ``model(**batch)`` and its backward with AOTAutograd, partition the joint graph with
    inductor's min-cut partitioner, and return the module that runs the two graphs.

    ``trace_context``: the contexts the forward runs in during the simulated step (fake mode,
    CUDA emulation, autocast): the trace happens under them, outside the storage tracker.
    """
    from functools import partial

    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.utils._pytree import tree_flatten

    from ..core.errors import MemlensError

    if not isinstance(batch, dict):
        raise MemlensError("--compile needs a dict batch (keyword inputs)", hint="return a dict batch from the factory")
    keys = tuple(k for k in batch if (forward_keys is None or k in forward_keys) and isinstance(batch[k], torch.Tensor))
    extra = {k: v for k, v in batch.items() if k not in keys and (forward_keys is None or k in forward_keys)}
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    structure: dict[str, Any] = {}

    def f(p, *inputs):
        out = torch.func.functional_call(model, p, (), {**dict(zip(keys, inputs)), **extra}, tie_weights=True)
        leaves, spec = tree_flatten(out)
        structure["spec"] = spec
        structure["constants"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def keep(gm, example_inputs):
        return boxed_runner(gm, fuse)

    fn = aot_function(f, fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                      partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))
    previous = getattr(rules, "fused_attention", None)
    if rules is not None:
        rules.fused_attention = OpaqueAttention   # the kernels as opaque ops with the real data dependencies
    try:
        with trace_context():
            outs = fn(params, *[batch[k] for k in keys])   # traces and partitions (the outputs are dropped)
        del outs
    finally:
        if rules is not None:
            rules.fused_attention = previous
    return CompiledForSimulation(model, fn, params, structure["spec"], structure["constants"], keys)


@contextlib.contextmanager
def no_context():
    yield
