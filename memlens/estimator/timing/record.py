"""The op stream of a simulated step, priced as it goes: the hook the simulation calls on every op.

:func:`attach` gives a :class:`~memlens.estimator.simulate.SimulationTracker` a :class:`Recorder` (its ``timer``) and
the CUDA emulation's rules an ``on_attention`` callback (fused SDPA is emulated without its arithmetic, so the
kernel is priced from the call's shapes). The recorder keeps, for step 1's first pass of each phase (later
micro-batches and steps repeat it: memlens.estimator.periodic), one row per op: its bucket (forward, backward,
recompute, ...), the module it ran in, the GPU seconds of its kernel (from the timing table) and the host seconds
of dispatching it, plus its matmul-class FLOPs (for MFU). :mod:`.step` turns the rows into step seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...models.quant import Linear4bitSim
from ..depth import TEMPLATE
from .ops import ALLOC, ATTN_BWD, ATTN_FWD, COMM, CONV, MATMUL, META, SYNC, VIEW, OpFacts, attention_facts, op_facts
from .ops_kinds import CKPT, GATHER, MODULE
from .tables import TimingTable, table_for

# Selective checkpointing in eager mode runs every op of a checkpointed block through torch's Python
# TorchDispatchModes (caching in forward, replaying in recompute), host work the GPU waits on: measured on an H100
# host (bench/results/recompute_plan_accuracy.md, all blocks selective on an 8B LoRA, a 1B, ViT-L and LLaVA-7B): 12-30
# us per recomputed op beyond the roofline, median 22 (the figure memlens.estimator.result used before this model).
SAC_HOST_SECONDS_PER_OP = 22e-6

# FSDP2's hooks per parameter group beyond the aten ops they dispatch (which are rows of their own): pre_forward's
# unshard / wait_for_unshard / _register_post_backward_hook and post_forward's reshard (torch/distributed/fsdp/
# _fully_shard/_fsdp_param_group.py: Python over every parameter, setattr swaps, pytree over args), in units of the
# table's in-model host cost per kernel op (``model_forward``: per op as the simulation counts them, views aside).
# Measured on a CPU (a 16-layer Llama of width 64 under fully_shard per layer and at the root, gloo over 1 rank, against
# the same model bare, ops counted as memlens counts them): +31 to +45 forward-op equivalents per group in forward, of
# which 8.6 are aten kernel ops. Backward: +110 to +127 backward-op equivalents on that CPU, but the H200 measurement
# contradicts it (Llama-3.2-1B FSDP2 backward 69.7 ms for 65.7 ms of kernels: 17 x 110 x 25 us would make it
# host-bound at ~120 ms), so backward's hooks are left unpriced. A table may carry its own (host_us
# "fsdp_forward_group", "fsdp_backward_group", microseconds per group).
FSDP_FORWARD_HOOK_OPS = 30.0
FSDP_BACKWARD_HOOK_OPS = 0.0

# The calibration model's module calls per kernel op in forward (memlens.measure.calibrate.measure_model_host: a
# 16-layer Llama of width 64, 1 x 16 tokens): 214 nn.Module calls around 666 kernel ops (counted on a CPU as calibrate
# counts them, with a forward pre-hook on every module). Its ``model_forward`` per op is split into the bare dispatch
# (the table's ``forward``) and module calls: ``(model_forward - forward) x 666 / 214`` per call (31.6 us on the H200
# table, 27.2 on the H100's), so a model with more modules per op than Llama's (ViT: a Linear per op, dropouts, the
# attention's 4 wrappers) pays their Python, one with fewer less.
CALIBRATION_OPS_PER_MODULE = 666 / 214
_MODULE_CALL = OpFacts(MODULE)
_CKPT_CALL = OpFacts(CKPT)
# a module with a full backward hook (Opacus' GradSampleModule hooks every module with trainable parameters: a forward
# hook keeping its input, nn.Module's BackwardHook around its inputs and outputs, the backward hook computing the
# per-sample gradient): Python per call beyond the ops it dispatches, priced at the table's hooked_module_forward /
# hooked_module_backward (memlens.measure.calibrate.measure_dp_host)
HOOKED = "hooked"
_HOOKED_CALL = OpFacts(MODULE, op=HOOKED)
# a module's own host work per call, named by the module (``memlens_host_call``): bitsandbytes' Linear4bit
# ("qlora_layer": Linear4bit.forward -> matmul_4bit -> MatMul4Bit, its quant state's double-quantized absmax
# dequantized, then the weight, then F.linear; backward dequantizes again), priced at the table's ``<name>_forward`` and
# ``<name>_backward`` (memlens.measure.calibrate.measure_qlora_host)
BACKWARD_CALL = "/backward"

# phases priced from the op stream (the optimizer is priced from its parameters: .step)
STREAM_PHASES = ("forward", "backward", "clip", "reference", "generation")


@dataclass
class OpTrace:
    """Priced rows of one micro-batch (step 1's first pass of each phase) and what :mod:`.step` needs besides."""

    rows: list = field(default_factory=list)          # (bucket, module id, OpFacts), priced by :func:`price`
    size: tuple = ()                                  # (batch size, seq len) it was recorded at (a replay is priced scaled)
    modules: list = field(default_factory=list)       # module names by id (the simulation log's)
    stack: Any = None                                 # the layer stack of a shallow model (memlens.estimator.depth.Stack)
    layers: int | None = None                         # with ``stack``: the full model's layer count
    trainable_tensors: int = 0
    quantized: tuple = (0, 0)                         # 4-bit linears (QLoRA): (weights, layers), in the simulated model
    layer_tensors: int = 0                            # trainable tensors of one layer of the stack (a shallow model's layer 1)
    layer_quantized: tuple = (0, 0)                   # its 4-bit weights and linears
    selective: bool = False                           # selective checkpointing (recomputed ops pay SAC_HOST_SECONDS_PER_OP)


class Recorder:
    """Called by the tracker on every op (``op``) and by the CUDA emulation on every fused attention call."""

    def __init__(self, tracker, table: TimingTable):
        self.tracker = tracker
        self.table = table
        self.trace = OpTrace()
        self._passes: dict[str, int] = {}
        self._phase = None
        self._on = False

    def _live(self) -> bool:
        t = self.tracker
        ph = t.phase
        if ph != self._phase:
            self._phase = ph
            self._passes[ph] = self._passes.get(ph, 0) + 1
            self._on = t.step == 1 and ph in STREAM_PHASES and self._passes[ph] == 1
        return self._on

    def bucket(self) -> str:
        t = self.tracker
        if t.phase == "backward" and getattr(t, "recomputing", False):
            return "recompute"
        return t.phase

    def op(self, func, args, kwargs, out) -> None:
        if not self._live() or self.tracker.muted:   # muted: stand-ins and save_on_cpu's host copies (priced per byte over PCIe)
            return
        f = op_facts(func, args, kwargs, out)
        if f.kind == SYNC and self.trace.rows and self.trace.rows[-1][2].kind == SYNC:
            return   # item() after item(), nothing between: a fake tensor's tolist(), one copy to the host on CUDA
        if f.kind != META:
            self.add(f)

    def module_call(self, hooked: bool = False, call: str | None = None) -> None:
        """A module's forward entered (memlens.core.tracker.ModuleScope): a host-only row (:func:`host_costs`), one
        more for a module with a full backward hook (Opacus' per-sample-gradient hooks: :func:`price`), and one for a
        module that names its own host work per call (``call``: priced at the table's ``<call>_forward``, in forward
        and in recompute)."""
        if not self._live() or self.tracker.muted:
            return
        bucket = self.bucket()
        if bucket == "forward":
            self.add(_MODULE_CALL)
            if hooked:
                self.add(_HOOKED_CALL)
        if call and bucket in ("forward", "recompute"):
            self.add(OpFacts(MODULE, op=call))

    def host_call_backward(self, call: str) -> None:
        """Backward reached a module that names its own host work per call: a host-only row (``<call>_backward``)."""
        if self._live() and not self.tracker.muted and self.bucket() == "backward":
            self.add(OpFacts(MODULE, op=call + BACKWARD_CALL))

    def hooked_backward(self) -> None:
        """Backward reached a module with a full backward hook: a host-only row for its hook's Python."""
        if self._live() and not self.tracker.muted and self.bucket() == "backward":
            self.add(_HOOKED_CALL)

    def checkpoint_call(self) -> None:
        """A checkpointed call entered in forward, or its recomputation in backward (memlens.estimator.simulate's
        checkpoint wrapper): a host-only row where the host pays checkpoint's own work (:func:`price`)."""
        if self._live() and not self.tracker.muted:
            self.add(_CKPT_CALL)

    def add(self, f: OpFacts) -> None:
        self.trace.rows.append((self.bucket(), self.tracker.module, f))

    def attention(self, backend: str, q, k, v, causal: bool, out, dropout: bool = False) -> None:
        """A fused SDPA call (memlens.estimator.cuda_rules.cuda_sdpa): its forward kernel now, its backward when
        autograd reaches the node (a pre-hook that holds shapes only, never a tensor)."""
        if not self._live():
            return
        self.add(attention_facts(q, k, v, causal, backward=False, dropout=dropout))
        fn = getattr(out, "grad_fn", None)
        if fn is None:
            return
        bwd = attention_facts(q, k, v, causal, backward=True, dropout=dropout)

        def before_backward(grad_outputs, facts=bwd):
            if self._live():
                self.add(facts)

        fn.register_prehook(before_backward)

    def finish(self, model=None) -> OpTrace:
        tr = self.trace
        tr.modules = list(self.tracker.log.modules)
        sim_spec = getattr(self, "spec", None)
        if sim_spec is not None:
            tr.size = (sim_spec.batch_size, sim_spec.seq_len)
        if model is not None:
            tr.trainable_tensors = sum(1 for p in model.parameters() if p.requires_grad)
            q = [m for m in model.modules() if isinstance(m, Linear4bitSim)]
            tr.quantized = (sum(m.in_features * m.out_features for m in q), len(q))
            stack = getattr(self.tracker, "stack", None)
            if stack is not None:   # a shallow model (memlens.estimator.depth): what one more layer adds
                label = self.tracker.module_label

                def in_template(name: str) -> bool:
                    return stack.layer_of(label(name)) == TEMPLATE

                tr.layer_tensors = sum(1 for n, p in model.named_parameters() if p.requires_grad and in_template(n.rpartition(".")[0]))
                ql = [m for n, m in model.named_modules() if isinstance(m, Linear4bitSim) and in_template(n)]
                tr.layer_quantized = (sum(m.in_features * m.out_features for m in ql), len(ql))
        return tr


def attach(tracker, rules, spec) -> Recorder:
    """Price ``tracker``'s ops with the timing table of ``spec.gpu`` (memlens.estimator.timing.tables.table_for)."""
    rec = Recorder(tracker, table_for(spec.gpu))      # loaded now: a bad --timing-table fails before the simulation
    rec.spec = spec
    rec.trace.selective = spec.checkpoint_policy == "selective" and spec.grad_checkpointing
    tracker.timer = rec
    rules.on_attention = rec.attention
    return rec


def host_costs(tab: TimingTable, ckpt_share: float = 0.0, policy: str = "full") -> tuple[float, float, float, float]:
    """(view, forward, backward, recompute) host seconds per op. Where calibrate measured them inside a model's step
    (a small Llama, ``model_*``): the forward blended between its plain and checkpointed cost by the share of layers
    under checkpoint's hooks (full or selective), the autograd engine's backward, and a recomputed op's cost under
    that policy. Else the bare per-op costs, a recomputed op at the backward's plus, under the selective policy,
    :data:`SAC_HOST_SECONDS_PER_OP` (on the forward's ops too, in the layers it covers)."""
    h = tab.host_seconds
    if policy == "full" and h("ckpt_layer_forward") and h("model_forward"):
        # checkpoint's work is per checkpointed call (a ckpt row at each call: :func:`price`): the forward's ops cost
        # what they cost unhooked, a recomputed op what a forward op costs in a model (module calls included)
        return h("view"), h("model_forward"), h("model_backward"), h("model_forward")
    suffix = "_sac" if policy == "selective" else "_ckpt"
    if h("model_forward") and h("model_recompute" + suffix):
        fwd = h("model_forward") + ckpt_share * (h("model_forward" + suffix) - h("model_forward"))
        return h("view"), fwd, h("model_backward"), h("model_recompute" + suffix)
    sac = SAC_HOST_SECONDS_PER_OP if policy == "selective" else 0.0   # both passes run under its dispatch modes
    fwd, bwd = h("model_forward") or h("forward"), h("model_backward") or h("backward")
    return h("view"), fwd + ckpt_share * sac, bwd, bwd + sac


def price(trace: OpTrace, tab: TimingTable, ckpt_share: float = 0.0) -> list[tuple]:
    """The trace's rows priced with ``tab``: (bucket, module id, GPU seconds, host seconds, matmul-class FLOPs, kind).
    A kernel takes the larger of its compute and memory times (the table's rates for its shape and size; a matmul
    with an unaligned leading dimension at the unaligned rate, attention at its head dim and mask, a memory-bound op
    at its own measured ratio to a copy), never less than the kernel floor; views and allocations run no kernel. The
    host dispatches every op (:func:`host_costs`), plus the selective policy's dispatch modes in recompute."""
    out = []
    h_view, h_fwd, h_bwd, h_rec = host_costs(tab, ckpt_share, "selective" if trace.selective else "full")
    # an FSDP2 group's hooks, in units of the in-model cost per op (before the module calls' share is split off below)
    g_fwd = tab.host_seconds("fsdp_forward_group") or FSDP_FORWARD_HOOK_OPS * h_fwd
    g_bwd = tab.host_seconds("fsdp_backward_group") or FSDP_BACKWARD_HOOK_OPS * h_bwd
    # over several ranks each unshard issues a real all-gather and waits on it: calibrate's measurement over every GPU
    # of its machine (memlens.measure.calibrate_nccl), where it made one
    g_ranks = (tab.host_seconds("fsdp_forward_group_ranks"), tab.host_seconds("fsdp_backward_group_ranks"))
    h_mod = 0.0
    if any(r[2].kind == MODULE for r in trace.rows) and tab.host_seconds("model_forward") and tab.host_seconds("forward"):
        # the in-model forward cost split: the bare dispatch per op, the rest per module call (CALIBRATION_OPS_PER_MODULE)
        split = max(0.0, tab.host_seconds("model_forward") - tab.host_seconds("forward"))
        h_mod, h_fwd = split * CALIBRATION_OPS_PER_MODULE, h_fwd - split
    floor = tab.min_kernel_us * 1e-6
    # full checkpointing's work per checkpointed call, where calibrate measured it (else it is in host_costs' per-op blend)
    h_hooked = (tab.host_seconds("hooked_module_forward"), tab.host_seconds("hooked_module_backward"))
    h_call = {} if trace.selective else {"forward": tab.host_seconds("ckpt_layer_forward"),
                                         "recompute": tab.host_seconds("ckpt_layer_recompute")}
    for bucket, mod, f in trace.rows:
        kind = f.kind
        host = h_view if kind in (VIEW, ALLOC) else h_rec if bucket == "recompute" else h_bwd if bucket == "backward" else h_fwd
        fl = 0
        if kind == MODULE:
            if f.op == HOOKED:
                out.append((bucket, mod, 0.0, h_hooked[0] if bucket == "forward" else h_hooked[1], 0, kind))
            elif f.op:
                key = f.op[:-len(BACKWARD_CALL)] + "_backward" if f.op.endswith(BACKWARD_CALL) else f.op + "_forward"
                out.append((bucket, mod, 0.0, tab.host_seconds(key), 0, kind))
            else:
                out.append((bucket, mod, 0.0, h_mod, 0, kind))
            continue
        if kind == CKPT:
            out.append((bucket, mod, 0.0, h_call.get(bucket, 0.0), 0, kind))
            continue
        if kind in (VIEW, ALLOC, SYNC):
            gpu = 0.0
        elif kind in (MATMUL, CONV):
            m, n, k = f.mnk
            # an fp32 convolution runs on TF32 tensor cores: torch.backends.cudnn.allow_tf32 defaults to True (unlike
            # matmul's allow_tf32); torchvision's ResNet-50 fp32 forward convs ran at 105 TFLOP/s on an H200, past the
            # 67 TFLOP/s of its fp32 CUDA cores
            dt = "tf32" if kind == CONV and f.dtype == "float32" else f.dtype
            rate = tab.matmul_tflops(dt, m, n, k, f.aligned, f.out_unaligned)
            if f.op:   # a grouped GEMM: its measured rate against the dense one's (memlens.estimator.timing.ops)
                rate *= tab.op_ratio.get(f.op, 1.0)
            gpu = tab.kernel_seconds(f.flops * f.pad, rate, f.nbytes)
            fl = f.flops
        elif kind in (ATTN_FWD, ATTN_BWD):
            gpu = tab.kernel_seconds(f.flops, tab.attention_tflops(f.dtype, f.seq, kind == ATTN_BWD, f.hd, f.causal, f.dropout),
                                     f.nbytes)
            fl = f.flops
        elif kind == COMM:   # NCCL's ring law at the table's bus bandwidth for that size and group
            gpu = tab.collective_seconds(f.op, f.nbytes, f.seq) if f.seq > 1 else 0.0
        else:
            gpu = max(floor, tab.op_seconds(f.op, f.nbytes)) if f.nbytes else floor
            if f.fill:   # a zero-fill before the op's own kernels (a kernel of its own)
                gpu += max(floor, tab.op_seconds("fill_", f.fill))
        if f.gathered and bucket in ("forward", "backward"):   # an FSDP2 group's unshard (its hooks on the host)
            multi = f.seq > 1 and g_ranks[0] > 0
            host += (g_ranks[0] if multi else g_fwd) if bucket == "forward" else (g_ranks[1] if multi else g_bwd)
        out.append((bucket, mod, gpu, host, fl, kind))
        if f.gathered and f.seq > 1 and bucket == "forward":
            # forward's all-gather: issued by the host at the group's pre_forward and waited on by the compute stream
            # right there (wait_for_unshard); it overlaps earlier compute only as far as the host runs ahead (FSDP2's
            # implicit prefetch). Backward prefetches the next group explicitly (.step.collective_seconds).
            out.append((bucket, mod, tab.collective_seconds("all_gather", f.gathered, f.seq), 0.0, 0, GATHER))
    return out


STRAY_ROWS = 3   # rows of another module inside a template layer's span that still belong to its run (see expanded)


def _phase(bucket: str) -> str:
    """The step phase a row's bucket runs in: a checkpointed layer's recompute runs inside backward, layer by layer."""
    return "backward" if bucket == "recompute" else bucket


def expanded(rows: list, trace: OpTrace) -> list:
    """The priced rows of the full model from a shallow one's: each span of rows in the stack's template layer (the
    layer memlens.estimator.depth copies) followed by ``layers - depth`` copies of itself, as the written log
    repeats its events; the rows as they are otherwise.

    A span is the template layer's rows of one phase in the order they ran: in backward, a checkpointed layer's first
    backward ops, its recompute and the rest of its backward are one span, so the copies interleave recompute and
    backward layer by layer as the autograd engine runs them (copied bucket by bucket, 29 recomputes would run back to
    back and then 29 backwards: a host-bound stretch the GPU waits through, then GPU work with nothing left to hide).
    Up to :data:`STRAY_ROWS` rows another module owns inside the span (an op the simulation attributes to the next
    layer or to no layer, between two runs of the template's) are part of it: they run once per layer too."""
    if trace.stack is None or not trace.layers or trace.layers <= trace.stack.depth:
        return rows
    copies = trace.layers - trace.stack.depth
    lay = [trace.stack.layer_of(n) for n in trace.modules]

    def layer(r) -> int | None:
        return lay[r[1]] if 0 <= r[1] < len(lay) else None

    def same(k: int, ph: str) -> bool:
        return k < len(rows) and _phase(rows[k][0]) == ph

    out: list = []
    i = 0
    while i < len(rows):
        if layer(rows[i]) != TEMPLATE:
            out.append(rows[i])
            i += 1
            continue
        ph = _phase(rows[i][0])
        j = i
        while True:
            while same(j, ph) and layer(rows[j]) == TEMPLATE:
                j += 1
            k = j   # a few stray rows, then the template's again: still its span
            while k - j < STRAY_ROWS and same(k, ph) and layer(rows[k]) != TEMPLATE:
                k += 1
            if k > j and same(k, ph) and layer(rows[k]) == TEMPLATE:
                j = k
                continue
            break
        g = j   # the glue code between this layer and its neighbour (outside every layer) runs once per layer too
        while same(g, ph) and layer(rows[g]) is None:
            g += 1
        if same(g, ph) and layer(rows[g]) in (TEMPLATE - 1, TEMPLATE + 1):
            j = g
        out.extend(rows[i:j] * (copies + 1))
        i = j
    return out


def grown(trace: OpTrace | None, stack, layers: int) -> OpTrace | None:
    """The trace of a shallow model (memlens.estimator.simulate._from_shallow) standing for ``layers`` layers."""
    if trace is not None and stack is not None:
        trace.stack, trace.layers = stack, layers
    return trace


def timing_at(regime, x) -> OpTrace | None:
    """The priced trace of a replay at size ``x`` (memlens.estimator.scaling.Regime.simulation_at): each row's FLOPs,
    bytes, GEMM shape and sequence length interpolated exactly (Lagrange, as the regime's allocation sizes are) over
    the regime's traces, which run the same ops; so a replayed step is priced as its own simulation would be, whichever
    sizes happened to be simulated. None where the traces' rows do not line up (the template's trace, scaled by
    tokens, is used then: memlens.estimator.timing.step)."""
    traces = [t.sim.timing for t in regime.traces]
    if any(tr is None for tr in traces):
        return None
    first = traces[0]
    shape = [(r[0], r[1], r[2].kind) for r in first.rows]
    if any(len(tr.rows) != len(shape) or [(r[0], r[1], r[2].kind) for r in tr.rows] != shape for tr in traces[1:]):
        return None
    fit = regime.fit()
    if isinstance(fit, str):
        return None
    spaces = [sp for sp in fit[0] if sp.answers(x) and (sp.db or sp.dL)]
    if not spaces:
        return None
    points = [t.point for t in regime.traces]
    memo: dict = {}

    def at(values: list) -> int:
        """The value at ``x`` of the polynomial of least degree that reproduces every trace (as the regime fits sizes)."""
        key = tuple(values)
        hit = memo.get(key)
        if hit is None:
            for sp in spaces:
                if all(regime._predict(sp, values, points[q]) == values[q] for q in sp.checks):
                    break
            else:
                sp = spaces[-1]
            w, den = sp.weights(x)
            hit = memo[key] = max(0, round(sum(wi * values[i] for wi, i in zip(w, sp.nodes)) / den))
        return hit

    rows = []
    for j, (bucket, mod, f) in enumerate(first.rows):
        vals = [tr.rows[j][2] for tr in traces]
        if all(v == f for v in vals):
            rows.append((bucket, mod, f))
            continue
        # FLOPs are products of sizes (a matmul's 2 M N K, attention's B H L S D): interpolated as their factors, each
        # of degree <= 1 in batch and seq len (attention's L x S needs degree 2 in L, which a grid of traces rarely fixes)
        nbytes, seq, mnk, flops = at([v.nbytes for v in vals]), at([v.seq for v in vals]), None, 0
        if f.mnk is not None:
            mnk = tuple(max(1, at([v.mnk[d] for v in vals])) for d in range(3))
            flops = round(f.flops / max(1, 2 * f.mnk[0] * f.mnk[1] * f.mnk[2]) * 2 * mnk[0] * mnk[1] * mnk[2])
        elif f.seq:
            flops = at([v.flops // max(1, v.seq) for v in vals]) * seq
        rows.append((bucket, mod, f._replace(flops=flops, nbytes=nbytes, mnk=mnk, seq=seq)))
    out = OpTrace(rows=rows, modules=first.modules, stack=first.stack, layers=first.layers,
                  trainable_tensors=first.trainable_tensors, quantized=first.quantized, selective=first.selective,
                  layer_tensors=first.layer_tensors, layer_quantized=first.layer_quantized)
    out.size = ()      # priced as its own (the rows are this size's)
    return out
