"""``--compile``: the ``torch.compile``'d step, simulated with the compiler's own partitioner.

What decides a compiled step's memory is which activations the compiled backward keeps, and
which intermediates the generated kernels write. ``torch.compile`` (inductor) traces the model's
forward and backward into one joint graph (AOTAutograd), applies inductor's decompositions and
joint-graph passes, and splits it with the min-cut rematerialization partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``, ``compiler="inductor"``):
the forward graph returns exactly the tensors the backward graph needs; what is cheap to
recompute is recomputed in backward instead of kept.

:func:`compile_for_simulation` runs that same machinery on the simulation's fake tensors: it
traces the model's forward under the CUDA emulation (CUDA's autocast policy; fused attention as
two opaque ops that read q, k, v and the mask, and whose backward reads the output and the
softmax statistics too, as the real kernels do) with ``torch.compiler.is_compiling()`` True (the
model takes its traced path: transformers materializes the attention mask and expands grouped
key/value heads), pads half-precision matmuls as inductor's ``pad_mm`` pass does
(:func:`pad_matmuls`), partitions with inductor's partitioner, and returns a module that runs the
forward graph and, in backward, the backward graph under the storage tracker, with inductor's
boxed calling convention: the argument list is cleared, and every value is freed after the
kernel that reads it last. Tensors that an output object holds (a key/value cache) are graph
outputs too, so the backward gets autograd's zeros for them, as the real one does. Where dynamo
breaks the graph at transformers' loss function (:func:`loss_graph_break`) the loss is a graph
of its own. A checkpointed layer is traced as dynamo hands it over (:func:`checkpoint_as_compiled`).

The backward is traced under the forward's autocast, as AOTAutograd traces it
(``backward_pass_autocast="same_as_forward"``; CPU autocast's dispatch-level policy stands in for
CUDA's there, the two agree on matmuls).

The generated kernels' buffers are modelled by inductor's fusion rule (:func:`materialized`):
a pointwise op whose consumers are all pointwise ops or reductions is inlined into them and never
stored, unless a value read more than once has grown too big an expression (``mark_reuse``);
matmuls, attention, random ops, reductions and graph outputs are buffers; a stored pointwise copy
is written by its source's kernel (:func:`kernel_order`). Not reproduced: the scheduler's other
fusion choices, its reordering for peak memory, the row-stride padding of its own buffers
(``comprehensive_padding``) and graph breaks other than the loss'. ``fuse=False`` runs every op
as its own buffer, an upper bound.
bench/gpu_peak_probe.py replays a real compiled step's allocator history at its peak (and keeps
inductor's generated code); bench/results/generality_accuracy.md reports the accuracy.
"""
from __future__ import annotations

import contextlib
import dis
import inspect
import sys
from typing import Any, Callable

import torch

from ..core.errors import MemlensError
from ..core.gpus import gpu_facts

MODEL = ("saved activations from inductor's min-cut partitioner; kernel buffers from inductor's fusion and "
         "realization rules, its pad_mm pass and the loss graph break (modelled): measured within 2.2% of ten real "
         "compiled steps on an H100 (docs/trainers.md, --compile)")


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
        from torch.utils._pytree import tree_unflatten  # heavy: torch, loaded on first use

        outs, loss = self._fn(self._params, [kwargs[k] for k in self._keys])
        it = iter(outs)
        leaves = [next(it) if c is _TENSOR else c for c in self._constants]
        out = tree_unflatten(leaves, self._out_spec)
        if loss is not None:
            out["loss"] = loss
        return out


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
    from .cuda_rules import _ceil_to, _kernel_output  # heavy: imports torch

    @torch.library.custom_op("memlens::fused_sdpa_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("memlens' attention stand-in runs on fake tensors only")

    @fwd.register_fake
    def _(q, k, v, mask, backend):
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
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # the additive mask SDPA makes of a boolean one (attention.cpp convert_boolean_attn_mask): traced
            # ops, so the compiler's CSE makes one of them for all layers that share the mask, as it does
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(attn_mask.logical_not(), float("-inf"))
        out, stats, rng0, rng1 = fwd(q, k, v, attn_mask, backend)
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


REALIZE_READS = 4     # torch/_inductor/config.py realize_reads_threshold
REALIZE_OPS = 30      # realize_opcount_threshold


def materialized(graph) -> dict:
    """Which nodes inductor writes to memory: a pointwise node whose every consumer (through
    views) is pointwise or a reduction is inlined into its consumers' kernels and never stored;
    anything else (matmuls, convolutions, attention, random ops, reductions, graph outputs) is a
    buffer. Inlining stops where inductor realizes a reused value (``TensorBox.mark_reuse``): a
    pointwise value read by more than one node whose inlined expression reads more than
    ``REALIZE_READS`` buffers or runs more than ``REALIZE_OPS`` ops is stored (a residual stream
    is stored every few layers, not recomputed from all of them)."""
    out = {}
    reads: dict = {}     # an inlined node: the buffers its expression reads
    ops: dict = {}       # and its op count
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        keep = not _pointwise(n) or any(u.op == "output" or not _fusible(u) for u in _consumers(n))
        if not keep:
            r: set = set()
            c = 1
            for a in n.all_input_nodes:
                b = _view_base(a)
                if b in reads:
                    r |= reads[b]
                    c += ops[b]
                else:
                    r.add(b)
            if len(set(n.users)) > 1 and (len(r) > REALIZE_READS or c > REALIZE_OPS):
                keep = True
            else:
                reads[n], ops[n] = r, c
        out[n] = keep
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


def _view_base(n):
    while n.op == "call_function" and _is_view(n) and n.args:
        n = n.args[0]
    return n


def kernel_order(nodes: list, fused_away: set) -> list:
    """The order the generated code computes ``nodes`` in: inductor's scheduler fuses a stored
    pointwise node into the kernel of the pointwise producer it reads last (a second output of that
    kernel, written where the kernel runs): the partitioner puts a forward value kept for backward
    in its own precision (a bf16 copy of an fp32 operand, cast for the backward's autocast matmul)
    at the end of the forward graph, the real kernel writes it beside its source, which then dies
    after its own last reader. Views needed by a moved node move with it."""
    pos = {n: i for i, n in enumerate(nodes)}

    def hostable(q) -> bool:
        return q.op == "call_function" and q not in fused_away and not _is_view(q) and _pointwise(q)

    hosted: dict = {}
    moving: set = set()
    for n in nodes:
        if n.op != "call_function" or n in fused_away or _is_view(n) or not _pointwise(n) or not n.all_input_nodes:
            continue
        host = max((_view_base(a) for a in n.all_input_nodes), key=lambda q: pos[q])
        if not hostable(host) or pos[host] + 1 >= pos[n] or host in moving:
            continue
        chain: list = []
        for a in n.all_input_nodes:
            while a.op == "call_function" and _is_view(a) and pos[a] > pos[host]:
                chain.append(a)
                a = a.args[0]
        if any(pos[_view_base(a)] > pos[host] for a in chain):
            continue
        hosted.setdefault(host, []).extend(sorted(set(chain), key=pos.__getitem__) + [n])
        moving.update(chain)
        moving.add(n)
    out: list = []
    done: set = set()

    def emit(n):
        if n not in done:
            done.add(n)
            out.append(n)
            for m in hosted.get(n, ()):
                emit(m)

    for n in nodes:
        if n in moving and n not in done:
            continue
        emit(n)
    return out


def last_reads(nodes: list, fused_away: set) -> dict:
    """Each value's last reader in ``nodes`` (the order they run in), as the generated code reads
    it: a value read by a fused-away node is read by the kernels that compute that node's
    materialized consumers (inductor frees a kernel's inputs after the kernel has run, so its
    output buffer is allocated while they are alive)."""
    order = {n: i for i, n in enumerate(nodes)}
    reach: dict = {}     # a fused-away node: the position of the last kernel that computes through it
    for n in reversed(nodes):
        if n in fused_away:
            reach[n] = max((reach[u] if u in fused_away else order[u] for u in n.users), default=order[n])
    last: dict = {}
    for n in nodes:
        at = reach[n] if n in fused_away else order[n]
        for a in n.all_input_nodes:
            if a not in last or at > last[a]:
                last[a] = at
    return {a: nodes[i] for a, i in last.items()}


def boxed_runner(gm, fuse: bool):
    """Run a partitioned graph the way inductor's generated ``call(args)`` runs: inputs as one list
    that is cleared once read, every value freed at its last use, and (``fuse``) the values
    inductor fuses away computed without being accounted (outside the storage tracker), and the
    scatters it reinplaces written into their ``self`` buffer."""
    from torch.fx.node import map_arg  # heavy: torch, loaded on first use
    from torch.utils._python_dispatch import (  # heavy: torch, loaded on first use
        _get_current_dispatch_mode,
        _pop_mode_temporarily,
    )

    from ..core.tracker import StorageTracker  # heavy: imports torch

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
    seq = kernel_order(list(graph.nodes), fused_away) if fuse else list(graph.nodes)
    last = last_reads(seq, fused_away)
    frees: dict = {}
    for a, n in last.items():
        frees.setdefault(n, []).append(a)

    def run(args):
        env = {}
        inputs = list(args)
        args.clear()
        k = 0
        for n in seq:
            if n.op == "placeholder":   # taken out of the list: the graph's own reference is its only one
                env[n], inputs[k] = inputs[k], None
                k += 1
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


def held_tensors(obj, depth: int = 3) -> list:
    """Tensors an output object that is no pytree holds in its attributes (a key/value cache's
    layers): dynamo returns them from the graph as outputs too, so the compiled backward gets a
    gradient for each, zeros that autograd materializes when nothing used them. They come after
    the output's own tensors and are dropped at run time (the step drops the outputs)."""
    found: list = []

    def walk(x, d):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif d <= 0 or isinstance(x, (str, bytes, int, float, bool, type(None))):
            return
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            for v in vars(x).values():
                walk(v, d - 1)

    walk(obj, depth)
    return list({id(t): t for t in found}.values())


def _compute_bound(M: int, K: int, N: int, gpu: str | None) -> bool:
    """inductor's ``is_mm_compute_bound``: arithmetic intensity above half the machine balance (the GPU
    facts' data-sheet dense fp16/bf16 TFLOP/s over DRAM GB/s; None: the default GPU)."""
    g = gpu_facts(gpu)
    intensity = M * N * K / max(1, M * K + N * K + M * N)
    return intensity > 0.5 * 1000 * g.peak_tflops_half / g.dram_gbps


def pad_matmuls(gm, gpu: str | None = None) -> int:
    """inductor's ``pad_mm`` joint-graph pass (torch/_inductor/fx_passes/pad_mm.py), on the joint graph
    before it is partitioned: a half-precision CUDA ``mm``/``addmm``/``bmm`` with a dimension that is not
    a multiple of 8 runs on copies of its operands padded with zeros, and its result is a slice of the
    padded product (so the storage is the padded one). Returns the matmuls padded.

    Which to pad inductor decides by timing both on the GPU; modelled: it pads when the product is
    compute-bound (its own rule) and K or N is unaligned (they are the row strides of row-major
    operands and result, which cuBLAS' fast kernels need aligned), not when only M is (measured on an
    H100: GPT-2's vocabulary matmuls: forward N and grad-input K padded, grad-weight M not)."""
    from torch._guards import detect_fake_mode  # heavy: torch, loaded on first use

    a = torch.ops.aten
    g = gm.graph
    done = 0
    pads: dict = {}

    def val(n):
        return n.meta.get("val") if hasattr(n, "meta") else None

    def pad(node, amounts: tuple, mode):
        """constant_pad_nd of ``node`` by (last dim, ..., first dim) amounts; one per (node, amounts)."""
        key = (node, amounts)
        hit = pads.get(key)
        if hit is None:
            spec = [x for p in amounts for x in (0, p)]
            hit = pads[key] = g.call_function(a.constant_pad_nd.default, (node, spec, 0.0))
            with mode:
                hit.meta["val"] = a.constant_pad_nd.default(val(node), spec, 0.0)
        return hit

    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in (a.mm.default, a.addmm.default, a.bmm.default):
            continue
        m1, m2 = (n.args[1], n.args[2]) if n.target is a.addmm.default else (n.args[0], n.args[1])
        v1, v2 = val(m1), val(m2)
        if not isinstance(v1, torch.Tensor) or not isinstance(v2, torch.Tensor):
            continue
        if v1.dtype not in (torch.float16, torch.bfloat16) or v2.dtype != v1.dtype:   # (the simulated step is CUDA's)
            continue
        M, K, N = int(v1.shape[-2]), int(v1.shape[-1]), int(v2.shape[-1])
        pm, pk, pn = ((-d) % 8 if d != 1 else 0 for d in (M, K, N))
        if not (pk or pn) or not _compute_bound(M, K, N, gpu):
            continue
        mode = detect_fake_mode([v1, v2])
        with g.inserting_before(n):
            p1 = pad(m1, (pk, pm) + (0,) * (v1.dim() - 2), mode) if (pm or pk) else m1
            p2 = pad(m2, (pn, pk) + (0,) * (v2.dim() - 2), mode) if (pk or pn) else m2
            args = (p1, p2)
            if n.target is a.addmm.default:
                bias = n.args[0]
                vb = val(bias)
                if isinstance(vb, torch.Tensor) and pn and vb.shape[-1] != 1:
                    bias = pad(bias, (pn,) + (0,) * (vb.dim() - 1), mode)
                args = (bias, p1, p2)
            mm = g.call_function(n.target, args, dict(n.kwargs))
            with mode:
                mm.meta["val"] = n.target(*[val(x) if hasattr(x, "meta") else x for x in args], **n.kwargs)
            out = mm
            for dim, (size, extra) in ((-2, (M, pm)), (-1, (N, pn))):
                if extra:
                    out = g.call_function(a.slice.Tensor, (out, mm.meta["val"].dim() + dim, 0, size))
                    with mode:
                        out.meta["val"] = a.slice.Tensor(val(out.args[0]), out.args[1], 0, size)
        n.replace_all_uses_with(out)
        g.erase_node(n)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def loss_graph_break(model) -> tuple[Any, Callable] | None:
    """(the model whose loss function dynamo runs as a graph of its own, that loss function), or None
    (one graph).

    transformers' ``PreTrainedModel.loss_function`` logs a warning (``logger.warning_once``) when the
    model's ``loss_type`` is not one it knows (GPT-2's, whose class name names no loss); dynamo
    cannot trace a logging call and breaks the graph there, so a compiled step runs the model up to
    the loss as one graph and the loss as the next (``torch._dynamo.explain`` shows it:
    tests/estimator/test_compiled.py). The loss graph's backward then hands the logits their real
    gradient instead of autograd's zeros for an unused output. A wrapped model (PEFT's) breaks in
    the transformers model it wraps."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING  # heavy: transformers, loaded on first use
        from transformers.modeling_utils import PreTrainedModel  # heavy: transformers, loaded on first use
    except ImportError:
        return None

    owner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if owner is None or "_loss_function" in vars(owner):
        return None
    if inspect.getattr_static(type(owner), "loss_function", None) is not PreTrainedModel.__dict__.get("loss_function"):
        return None
    loss_type = getattr(owner, "loss_type", None)
    if loss_type is not None and loss_type in LOSS_MAPPING:
        return None
    return owner, LOSS_MAPPING["ForCausalLM"]   # what the property returns after its warning


def _live_tensors(frame) -> list:
    """Tensors a frame's locals hold that its code reads after the current instruction (what dynamo
    returns from a graph that ends there: the live values)."""
    later = {i.argval for i in dis.get_instructions(frame.f_code)
             if i.offset > frame.f_lasti and i.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"))}
    out: list = []
    for name, v in frame.f_locals.items():
        if name in later and name != "self":
            out += held_tensors(v) if not isinstance(v, torch.Tensor) else [v]
    return out


class _Graphs:
    """The compiled step's graphs at run time: the model's, then (after a graph break) the loss's."""

    def __init__(self, model_fn, loss_fn=None, loss_args=None):
        self.model_fn = model_fn
        self.loss_fn, self.loss_args = loss_fn, loss_args     # loss_args: ("out", i) or ("in", i) per tensor argument

    def __call__(self, params, inputs: list):
        outs = self.model_fn(params, *inputs)
        if self.loss_fn is None:
            return outs, None
        pick = [outs[i] if where == "out" else inputs[i] for where, i in self.loss_args]
        return outs, self.loss_fn(*pick)


def compile_for_simulation(model, batch: dict, forward_keys, trace_context: Callable[[], Any], rules=None,
                           fuse: bool = True) -> CompiledForSimulation:
    """Trace ``model(**batch)`` and its backward with AOTAutograd, partition the joint graph with
    inductor's min-cut partitioner, and return the module that runs the graphs (two where dynamo
    breaks the graph at the loss: :func:`loss_graph_break`).

    ``trace_context``: the contexts the forward runs in during the simulated step (fake mode,
    CUDA emulation, autocast): the trace happens under them, outside the storage tracker.
    """
    import torch._inductor.lowering  # noqa: F401 - inductor's decompositions consult it (max-pool's), as compile_fx has it loaded

    if not isinstance(batch, dict):
        raise MemlensError("--compile needs a dict batch (keyword inputs)", hint="return a dict batch from the factory")
    keys = tuple(k for k in batch if (forward_keys is None or k in forward_keys) and isinstance(batch[k], torch.Tensor))
    extra = {k: v for k, v in batch.items() if k not in keys and (forward_keys is None or k in forward_keys)}
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    structure: dict[str, Any] = {}
    brk = loss_graph_break(model)
    owner, loss_fn = brk if brk is not None else (None, None)
    call: dict[str, Any] = {}
    f = _model_graph_function(model, keys, extra, owner, call, structure)
    aot = _aot_compiler(rules, fuse)
    previous = getattr(rules, "fused_attention", None)
    if rules is not None:
        rules.fused_attention = OpaqueAttention   # the kernels as opaque ops with the real data dependencies
        rules.compile_trace = True
    try:
        graphs = _Graphs(aot(f))
        with trace_context(), compiling():
            inputs = [batch[k] for k in keys]
            outs = graphs.model_fn(params, *inputs)   # traces and partitions (the outputs are dropped)
            if call:   # the loss graph: its tensor arguments in order, the rest as the model passed them
                graphs = _with_loss_graph(graphs, aot, call, loss_fn, structure["loss_args"], outs, inputs)
            del outs
    finally:
        if rules is not None:
            rules.fused_attention = previous
            rules.compile_trace = False
    return CompiledForSimulation(model, graphs, params, structure["spec"], structure["constants"], keys)


def _model_graph_function(model, keys: tuple, extra: dict, owner, call: dict, structure: dict):
    """The function AOTAutograd traces: the model's forward on (parameters, *tensor inputs), returning every tensor
    leaf of its output, the tensors its non-tensor leaves hold, and (where dynamo breaks the graph at the loss, the
    loss function of ``owner`` stood in for) the tensors live at the loss call and its tensor arguments. Fills
    ``structure`` (how to rebuild the output; where the loss' arguments are) and ``call`` (the loss call)."""
    from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

    def stand_in(*args, **kwargs):
        """The loss function while the model's graph is traced: the graph ends here."""
        call.update(args=args, kwargs=kwargs, live=_live_tensors(sys._getframe(1)))
        return None

    def f(p, *inputs):
        if owner is not None:
            owner._loss_function = stand_in
        try:
            out = torch.func.functional_call(model, p, (), {**dict(zip(keys, inputs)), **extra}, tie_weights=True)
        finally:
            if owner is not None:
                del owner._loss_function
        leaves, spec = tree_flatten(out)
        structure["spec"] = spec
        structure["constants"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        held = [t for x in leaves if not isinstance(x, torch.Tensor) for t in held_tensors(x)]
        outs = list(tensors)      # one per tensor leaf (the run-time output is rebuilt from them in order)
        for t in held + call.get("live", []):
            if not any(t is x for x in outs):
                outs.append(t)
        if call:   # the loss' tensor arguments: outputs of this graph or its inputs
            structure["loss_args"] = _loss_arguments(call, inputs, outs)
        return tuple(outs)

    return f


def _loss_arguments(call: dict, inputs: tuple, outs: list) -> list[tuple[str, int]]:
    """Where each tensor argument of the loss call is: ("in", i) an input of the graph, ("out", i) an output
    (one is added to ``outs`` for an argument the graph does not return yet)."""
    where = []
    for a in [*call["args"], *call["kwargs"].values()]:
        if not isinstance(a, torch.Tensor):
            continue
        j = next((i for i, x in enumerate(inputs) if x is a), None)
        if j is not None:
            where.append(("in", j))
            continue
        i = next((i for i, x in enumerate(outs) if x is a), None)
        if i is None:
            outs.append(a)
            i = len(outs) - 1
        where.append(("out", i))
    return where


def _aot_compiler(rules, fuse: bool):
    """fn -> AOTAutograd's function of it: inductor's decompositions, its pad_mm joint-graph pass and min-cut
    partitioner, each graph kept as a runner (:func:`boxed_runner`)."""
    from torch._functorch.aot_autograd import aot_function  # heavy: torch, loaded on first use
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # heavy: torch, loaded on first use
    from torch._inductor.decomposition import select_decomp_table  # heavy: torch, loaded on first use

    def keep(gm, example_inputs):
        return boxed_runner(gm, fuse)

    def partition(joint, joint_inputs, **kw):   # inductor's pad_mm joint-graph pass, then its partitioner
        pad_matmuls(joint, getattr(getattr(rules, "gpu", None), "name", None))
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kw)

    def aot(fn):
        return aot_function(fn, fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(),
                            partition_fn=partition)

    return aot


def _with_loss_graph(graphs: "_Graphs", aot, call: dict, loss_fn, loss_args: list, outs, inputs) -> "_Graphs":
    """The model's graph and the loss' (traced now on the model graph's outputs and inputs ``loss_args`` names)."""
    args = [_TENSOR if isinstance(a, torch.Tensor) else a for a in call["args"]]
    kwargs = {k: _TENSOR if isinstance(v, torch.Tensor) else v for k, v in call["kwargs"].items()}
    call.clear()     # (the traced tensors)

    def loss(*ts):
        it = iter(ts)
        a = [next(it) if x is _TENSOR else x for x in args]
        kw = {k: next(it) if v is _TENSOR else v for k, v in kwargs.items()}
        return loss_fn(*a, **kw)

    graphs = _Graphs(graphs.model_fn, aot(loss), loss_args)
    graphs.loss_fn(*[outs[i] if w == "out" else inputs[i] for w, i in loss_args])   # traces it
    return graphs


_AC_IDS = iter(range(1, 1 << 62))


def checkpoint_as_compiled(function, *args):
    """A checkpointed region as a compiled step runs it: dynamo hands it over as a
    ``tag_activation_checkpoint`` graph whose nodes are tagged "prefer recompute" with one graph id
    per region; the tags travel to the traced ATen nodes (``preserve_node_meta``), and inductor's
    partitioner recomputes them in backward, keeping what the region's inputs need
    (torch/_higher_order_ops/wrap.py ``tag_nodes``; torch 2.13 reaches the same tags through
    selective checkpointing)."""
    import torch.fx.traceback as fx_traceback  # heavy: torch, loaded on first use
    from torch.utils.checkpoint import CheckpointPolicy  # heavy: torch, loaded on first use

    gid = next(_AC_IDS)
    with fx_traceback.preserve_node_meta():
        fx_traceback.current_meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        fx_traceback.current_meta["ac_graph_id"] = gid
        return function(*args)


@contextlib.contextmanager
def compiling():
    """``torch.compiler.is_compiling()`` answers True, as it does while dynamo traces the model: code
    that branches on it takes its traced path (transformers then builds the attention mask as a tensor
    instead of leaving it to SDPA's ``is_causal``, and expands grouped key/value heads)."""
    old = getattr(torch.compiler, "_is_compiling_flag", None)
    if old is None:
        yield
        return
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old
