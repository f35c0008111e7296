"""Estimate by simulation: the real training step of the real model on fake CPU tensors.

Nothing is allocated: FakeTensorMode gives every tensor its shape, dtype and storage size only.
:class:`StorageTracker` logs every storage; :mod:`cuda_rules` maps the few CPU kernels whose
memory differs from CUDA's; the ledger's allocator model turns the log into what
``torch.cuda.max_memory_allocated`` and ``memory_reserved`` would read.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from ..core import progress, usercode
from ..core.enums import Category
from ..core.errors import MemlensError, sentences
from ..core.events import ALLOC, EventLog, canonical
from ..core.gpus import gpu_facts
from ..core.precision import precision_of
from ..core.spec import TrainingSpec
from ..core.tracker import (
    OPTIMIZER_LABEL,
    OUTSIDE_LABEL,
    ROOT_LABEL,
    ModuleScope,
    StorageTracker,
    pack_hook_for,
    register_inputs,
    register_model,
    tag_optimizer_state,
)
from ..core.version import check_tested_versions
from ..models.adapt import KNOWN
from ..models.build import quiet, torch_dtype
from ..models.source import ModelSource, resolve
from ..models.scripted import python_originals
from ..models.vlm import extra_forward_ops, known_constants
from ..step import ema
from ..step.plan import StepPlan
from ..step.plan import resolve as resolve_plan
from ..step.prepare import prepare
from . import conv_workspaces, cuda_rules, depth, periodic
from .reduce_scratch import ReduceScratch
from .timing import record as timing_record

check_tested_versions()   # one warning line when torch / transformers is outside the tested range

# Memory CUDA libraries take through PyTorch's caching allocator (so it is in memory_allocated):
# cuBLAS keeps one workspace per (handle, stream); the autograd engine's device thread gets its
# own handle, so forward and backward each hold one. Sizes: the GPU facts (memlens.core.gpus).


@dataclass
class Simulation:
    """The event log of a simulated run and facts gathered along the way."""

    log: EventLog
    spec: TrainingSpec
    source: ModelSource
    seq_len: int | None
    image_size: int | None
    param_count: int
    trainable_count: int
    attention: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    wrapper: Any = None             # the multi-GPU wrapper of the simulated rank (memlens.step.parallel)
    later_steps: str = ""        # how steps 2.. were made: "written from step 1" or "simulated (why)"
    later_micro_batches: str = ""  # with accumulation (k >= 2): how micro-batches 2..k were made
    later_layers: str = ""       # a stack of many layers: "written from 3 and 4 layers" or "simulated (why)"
    written: Any = None          # with later_layers written: (shallow log, its Stack, its live layers, copies,
    #                              sizes), what ``log`` was written from (depth.write_layers): a worker sends this
    costs: dict = field(default_factory=dict)  # one micro-batch's recompute and offload counts (SimulationTracker.costs)
    timing: Any = None           # one micro-batch's priced ops (memlens.estimator.timing.record.OpTrace)


class _FakeGradScaler:
    """What torch.amp.GradScaler does to memory: scale the loss, unscale grads in place."""

    scale_factor = 65536.0

    def scale(self, loss):
        return loss * self.scale_factor

    def step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found_inf = torch.zeros(1)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_factor)
        del found_inf
        optimizer.step()

    def update(self):
        pass


def simulate(spec: TrainingSpec, source: ModelSource | None = None, steps: int = 2, repeat: bool = True,
             plan: StepPlan | None = None) -> Simulation:
    """Run ``steps`` optimizer steps of ``spec`` on fake tensors and log every storage (``plan``: its step's
    plan, if resolved already).

    ``repeat``: write the forward and backward of steps 2.. from step 1's events where that is
    provably the same (:mod:`.periodic`; ``Simulation.later_steps`` says which happened), and a
    deep stack's layers from two shallow models where that is shown (:mod:`.depth`;
    ``Simulation.later_layers``).

    >>> from memlens.core.spec import TrainingSpec
    >>> sim = simulate(TrainingSpec(model="gpt2", batch_size=1, seq_len=32))  # doctest: +SKIP
    """
    source = source or resolve(spec.model)
    reason = depth.why_not(plan or resolve_plan(spec, fake=True, source=source), source) if repeat else "repeat=False"
    if reason is None:
        try:
            return _from_shallow(spec, source, steps)
        except depth.NotPeriodic as e:
            reason = str(e)
        except MemlensError as e:   # the whole model's own simulation says whether it fails too
            reason = f"the shallow models failed: {e.message}"
    sim = _simulate(spec, source, steps, repeat)
    if depth.depth_of(source) is not None:
        sim.later_layers = f"simulated ({reason})"
    return sim


def _from_shallow(spec: TrainingSpec, source: ModelSource, steps: int) -> Simulation:
    """The simulation of a model of N layers written from its 3- and 4-layer versions (:mod:`.depth`).

    The first spec of a family (the same spec at any size and accumulation) is checked
    on both shallow models; a later one of the family is written from its 4-layer simulation with
    the 3-vs-4 check taken from the first, and layers 1 and 2 of its own log checked alike
    (:func:`.depth.check_middle`). A family whose check failed is simulated whole at once."""
    t0 = time.perf_counter()
    n = depth.depth_of(source)
    family = depth.family(spec, source, steps)
    known = depth.CHECKED.get(family)
    if isinstance(known, str):
        raise depth.NotPeriodic(known)
    if known is None:
        depth.check_layers_alike(source)
    shallow = depth.SHALLOW + 1
    copied: dict = {}      # (copy, key) -> the copy's key, for a multi-GPU wrapper's own key sets
    b = _simulate(spec, depth.shallow_source(source, shallow), steps, True, layers=shallow)
    grow = n - shallow
    if known is not None and (not b.spanning or known[2] and None not in b.spanning.values()):
        depth.check_middle(b.log, b.stack, b.live_layers)
        sizes = depth.recorded_sizes(b.log, b.spanning, grow) if b.spanning else None
        written = (b.log, b.stack, b.live_layers, grow, sizes)
        log = depth.write_layers(*written[:4], sizes=sizes, keys=copied)
        how = f"written from {shallow} layers (the rule checked on {depth.SHALLOW} and {shallow} layers at another size)"
        params, trainable = known[:2]
    else:
        a = _simulate(spec, depth.shallow_source(source, depth.SHALLOW), steps, True, layers=depth.SHALLOW)
        try:
            sizes_a, sizes_b = depth.grown_sizes(a.log, a.spanning, b.log, b.spanning, grow)
            if canonical(depth.write_layers(a.log, a.stack, a.live_layers, 1, sizes=sizes_a)) != canonical(b.log):
                raise depth.NotPeriodic(f"the {shallow}-layer log written from {depth.SHALLOW} layers differs from its simulation")
            written = (b.log, b.stack, b.live_layers, grow, sizes_b)
            log = depth.write_layers(*written[:4], sizes=sizes_b, keys=copied)
        except depth.NotPeriodic as e:
            depth.CHECKED[family] = str(e)
            raise
        params, trainable = b.param_count - a.param_count, b.trainable_count - a.trainable_count
        depth.CHECKED[family] = (params, trainable, depth.grows_as_recorded(a.log, a.spanning, b.log, b.spanning))
        how = f"written from {depth.SHALLOW} and {shallow} layers"
    if b.wrapper is not None:
        _grow_wrapper(b.wrapper, copied, n)
    return Simulation(log, spec, source, b.seq_len, b.image_size, b.param_count + grow * params,
                      b.trainable_count + grow * trainable, b.attention, time.perf_counter() - t0, notes=b.notes,
                      applied=b.applied, wrapper=b.wrapper, later_steps=b.later_steps, later_micro_batches=b.later_micro_batches,
                      later_layers=how, written=written,
                      costs={k: v * n // shallow for k, v in b.costs.items()},   # all in the blocks, alike
                      timing=timing_record.grown(b.timing, b.stack, n))


def _grow_wrapper(wrapper, copied: dict, layers: int) -> None:
    """A rank's wrapper (FSDP2: memlens.estimator.depth.why_not) from the shallow model, made the whole
    model's: the storages it marks (gathered parameters and gradients) include the written layers'
    copies of them, and it counts the whole model's blocks."""
    for name in ("unsharded_keys", "unsharded_grad_keys"):
        marked = getattr(wrapper, name, None)
        if marked is not None:
            marked.update(new for (_, key), new in copied.items() if key in marked)
    if "blocks" in getattr(wrapper, "facts", {}):
        wrapper.facts["blocks"] = layers


def _simulate(spec: TrainingSpec, source: ModelSource, steps: int, repeat: bool, layers: int | None = None) -> Simulation:
    """One simulation of ``spec`` on ``source``'s model (``layers``: the model has that many
    layers and each allocation outside forward and backward is given the layer it was computed
    from, for :mod:`.depth`)."""
    t0 = time.perf_counter()
    label = spec.describe()
    progress.stage(f"{label}: building the model")
    log = EventLog()
    gpu = gpu_facts(spec.gpu)
    tracker = SimulationTracker(log, gpu)
    rules = cuda_rules.CudaRules(autocast_dtype=torch_dtype(spec.autocast_dtype) if spec.autocast_dtype else None, gpu=gpu)
    emulation = cuda_rules.CudaEmulation(rules)
    timer = timing_record.attach(tracker, rules, spec)
    autocast = (lambda: cuda_rules.cuda_autocast(emulation, rules.autocast_dtype)) if rules.autocast_dtype else contextlib.nullcontext
    step = prepare(spec, fake=True, source=source, autocast=autocast,
                   scaler=_FakeGradScaler() if precision_of(spec).grad_scaler else None)
    model = step.model            # the eager model (--compile replaces step.model by its compiled forward)
    ring = getattr(step.wrapper, "ring_attention", None)     # --cp: torch's ring attention around the kernels' stand-ins
    if ring is not None:
        rules.fused_attention = ring(cuda_rules.attention_kernel_forward, cuda_rules.attention_kernel_backward)
    _wrap_checkpoint_funcs(model, emulation, tracker)
    _wrap_offload(model, tracker)
    if spec.compile:  # the compiler's own joint-graph partition (estimator/compiled.py)
        _compile(spec, step, tracker, emulation, autocast)
    stack = None
    if layers is not None:
        stack = depth.find_stack(model, layers, tracker.module_label)
        tracker.label_layers(stack)
    _register_before_step(tracker, step, model, source)
    params = list(model.parameters())
    hooks = _grad_and_stop_hooks(tracker, params)
    why_not = ("repeat=False" if not repeat else "a multi-GPU wrapper's hooks keep state" if step.wrapper is not None
               else "--compile runs the compiled graph" if spec.compile
               else f"the {step.plan.kind.name} step kind has phases of its own" if not step.plan.kind.repeats else "")
    try:
        runner = periodic.Steps(tracker, step, params, label=label, why_not=why_not)   # may refuse (the hooks go in finally)
        _run_steps(tracker, step, model, emulation, runner, steps, label)
    except MemlensError:
        raise
    except Exception as e:  # data-dependent ops and other untraceable code
        raise _untraceable(e, spec) from None
    finally:
        for h in hooks:
            h.remove()
    attention = sorted({f"{c.backend}" for c in rules.attention_calls})
    sim = Simulation(log, spec, source, step.seq_len, step.image_size, step.param_count, step.trainable_param_count,
                     attention, time.perf_counter() - t0, notes=_notes(spec, step, model), applied=step.applied, wrapper=step.wrapper,
                     later_steps=runner.later_steps, later_micro_batches=runner.micro, costs=dict(tracker.costs),
                     timing=timer.finish(model))
    if stack is not None:
        sim.stack, sim.live_layers, sim.spanning = stack, tracker.live_layers, tracker.spanning
    return sim


def _compile(spec: TrainingSpec, step, tracker: SimulationTracker, emulation, autocast) -> None:
    """--compile: the step's model replaced by the compiler's own joint-graph partition of its forward
    (estimator/compiled.py), traced under the simulation's modes."""
    from .compiled import compile_for_simulation  # heavy: imports torch

    if step.step_fn is not None or step.plan.dp:
        raise MemlensError("--compile is simulated for a model's forward only, not with " +
                           ("a factory's own step function" if step.step_fn is not None else "--dp"),
                           hint="drop --compile (the eager estimate is an upper bound of the compiled step)")
    model = step.model

    def trace_context():
        stack = contextlib.ExitStack()
        for cm in (step.fake_mode, quiet(), _synthetic_batch_shortcuts(), python_originals(model), known_constants(step.batch),
                   cuda_rules.track_autocast_cache_clears(emulation), emulation,
                   autocast()):
            stack.enter_context(cm)
        return stack

    try:
        step.model = compile_for_simulation(model, step.batch, step.forward_keys, trace_context, emulation.rules)
        tracker.ops_limit = None
    except MemlensError:
        raise
    except Exception as e:  # noqa: BLE001 - a model AOTAutograd cannot trace
        raise _untraceable(e, spec) from None


def _register_before_step(tracker: SimulationTracker, step, model, source: ModelSource) -> None:
    """What the step holds before it runs: the (eager) model's parameters and buffers, --ema's shadow copy, TRL's
    reference model beside the policy, and the batch (DP-SGD: a host dataset, never logged)."""
    register_model(tracker, model)
    for t, p in ema.shadow(step.optimizer):   # --ema: the shadow copy, made at setup (step/ema.py)
        tracker.register_copy(t, p, Category.OPTIMIZER_STATE, ema.LABEL, op="ema")
    for other in step.frozen:       # TRL's reference model beside the policy
        register_model(tracker, other)
    tracker.model = model
    if source.task == "vlm" and tracker.ops_limit is not None:   # one attention call per window, rope index per row (models/vlm.py)
        tracker.ops_limit += extra_forward_ops(step.batch, source.config)
    if step.dp is None:
        register_inputs(tracker, step.batch)
    else:  # DP-SGD: the batch is the host dataset; Opacus' step tags each physical batch, per-sample gradients, Gram matrices
        tracker.on_host(t for t in tree_flatten(step.batch)[0] if isinstance(t, torch.Tensor))
        step.dp.observer = tracker


def _grad_and_stop_hooks(tracker: SimulationTracker, params: list) -> list:
    """Each accumulated gradient tagged as one; a module boundary raises what stopped the simulation
    (:data:`FORWARD_OPS_LIMIT`). Returns the handles."""
    from torch.nn.modules.module import (  # heavy: torch, loaded on first use
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    def on_grad(p) -> None:
        if p.grad is None:  # a hook can fire with no gradient (e.g. Swin's relative position tables)
            return
        tracker.retag(p.grad, Category.GRADIENTS)

    def stop(*_):
        if tracker.stopped is not None:
            raise tracker.stopped

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    return hooks + [register_module_forward_pre_hook(stop), register_module_forward_hook(stop)]


def _run_steps(tracker: SimulationTracker, step, model, emulation, runner: "periodic.Steps", steps: int, label: str) -> None:
    """The optimizer steps under every mode of the simulation, each phase marked (and charged to its module)."""
    log = tracker.log
    phase_module = {"forward": log.module_id(OUTSIDE_LABEL), "backward": log.module_id(ROOT_LABEL),
                    "clip": log.module_id(OPTIMIZER_LABEL), "optimizer": log.module_id(OPTIMIZER_LABEL)}
    wrapped = step.wrapper.simulation(tracker, step) if step.wrapper is not None else contextlib.nullcontext()
    with step.fake_mode, quiet(), _synthetic_batch_shortcuts(), python_originals(model), known_constants(step.batch), \
            cuda_rules.track_autocast_cache_clears(emulation), emulation, tracker, \
            wrapped, torch.autograd.graph.saved_tensors_hooks(pack_hook_for(tracker), lambda t: t):
        for n in range(1, steps + 1):
            with ModuleScope(tracker, model) as scope:
                def on_phase(name: str, n=n) -> None:
                    runner.at_phase(name, n)
                    if name == "forward":
                        # a checkpointed module's recomputation stops early in backward, its
                        # forward hook unreached: the next forward starts outside any module
                        scope.stack.clear()
                    if name != "end":
                        progress.stage(f"{label}: step {n} {name}")
                    tracker.set_phase(name, n)
                    tracker.module = phase_module.get(name, tracker.module)
                    tracker.category_default = Category.TEMPORARIES

                runner.run(n, on_phase)
                tag_optimizer_state(tracker, step.optimizer)
        tracker.set_phase("done", steps)


def _notes(spec: TrainingSpec, step, model) -> list[str]:
    """The step's notes, and what the simulation does not count (uncalibrated conv workspaces, a paged optimizer's states)."""
    notes = list(step.notes)
    if any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules()):
        if not conv_workspaces.calibrated(spec.gpu):
            # (calibrated by bench/gpu_generality_calibrate.py, group conv)
            notes.append(f"cuDNN convolution workspaces are not calibrated for {spec.gpu}: not counted")
    paged = getattr(step.optimizer, "paged_bytes", 0)
    if paged:
        notes.append(f"paged optimizer: {paged / 2**20:.1f} MiB of states in CUDA managed memory, outside the caching allocator "
                     "(not in peak allocated; nvidia-smi shows them while they are on the GPU)")
    return notes


def _checkpoint_call(tracker) -> None:
    timer = getattr(tracker, "timer", None) if tracker is not None else None
    if timer is not None:
        timer.checkpoint_call()


def _wrap_checkpoint_funcs(model, emulation: "cuda_rules.CudaEmulation", tracker: SimulationTracker | None = None) -> None:
    """Re-enter the CUDA emulation when checkpointing recomputes a layer inside backward
    (torch function modes are not carried into the autograd engine), and tell ``tracker`` the ops it
    then sees are recomputed. Under selective checkpointing torch's own dispatch mode sits above the
    tracker: the ops whose outputs it kept are answered from its cache and never reach the tracker."""
    from torch.overrides import _get_current_function_mode_stack  # heavy: torch, loaded on first use

    def wrap(orig):
        def checkpoint(function, *args, **kwargs):
            def run(*a, **k):
                again = tracker is not None and tracker.phase == "backward"
                if again:
                    tracker.recomputing = True
                    _checkpoint_call(tracker)       # the recomputation's own host work (timing)
                try:
                    if any(m is emulation for m in _get_current_function_mode_stack()):
                        return function(*a, **k)
                    with emulation:
                        return function(*a, **k)
                finally:
                    if again:
                        tracker.recomputing = False

            if emulation.rules.compile_trace:    # --compile's trace: the region as dynamo hands it to AOTAutograd
                from .compiled import checkpoint_as_compiled  # heavy: imports torch

                return checkpoint_as_compiled(run, *args)
            _checkpoint_call(tracker)               # torch.utils.checkpoint's own host work in forward (timing)
            return orig(run, *args, **kwargs)

        return checkpoint

    for mod in model.modules():
        fn = getattr(mod, "_gradient_checkpointing_func", None)
        if fn is not None and not getattr(fn, "_memlens", False):
            w = wrap(fn)
            w._memlens = True
            mod._gradient_checkpointing_func = w


def _wrap_offload(model, tracker: SimulationTracker) -> None:
    """The simulation's ``save_on_cpu`` for offloaded blocks (models/checkpoint.py sets ``_memlens_offload``).

    Fake tensors all live on the CPU, where torch's would keep each saved tensor as it is (``.cpu()`` of a CPU
    tensor is itself). On CUDA its pack copies each saved tensor into a new pinned host tensor (not device
    memory: made here unaccounted), so autograd holds no device tensor (the original is freed when nothing
    else holds it), and each unpack in backward is ``.to(device, non_blocking=True)``: a new device tensor,
    alive while the backward node that asked for it runs. A tensor saved twice is copied twice, as torch does,
    and parameters saved by their ops (a linear's weight) are copied too."""
    def pack(t):
        muted, tracker.muted = tracker.muted, True
        try:
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
            host.copy_(t)
        finally:
            tracker.muted = muted
        tracker.count_offload(t, host.numel() * host.element_size())
        return host

    def unpack(host):
        back = host.clone()
        tracker.retag(back, Category.ACTIVATIONS)
        return back

    def context():
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    for mod in model.modules():
        if getattr(mod, "_memlens_offload", None) is not None:
            mod._memlens_offload = context


_GEMMS = None


def _gemm_ops():
    global _GEMMS
    if _GEMMS is None:
        a = torch.ops.aten
        _GEMMS = {a.mm.default, a.addmm.default, a.bmm.default, a.baddbmm.default, a.addbmm.default,
                  a.addmv.default, a.mv.default, a._addmm_activation.default}
    return _GEMMS


_INPLACE_FOREACH: dict = {}


def _inplace_foreach(func) -> bool:
    """An in-place foreach op (``aten::_foreach_mul_.Scalar``...): it updates its first list in place
    and returns nothing, so it allocates nothing and changes no tensor's metadata."""
    hit = _INPLACE_FOREACH.get(func)
    if hit is None:
        schema = getattr(func, "_schema", None)
        hit = _INPLACE_FOREACH[func] = bool(
            schema is not None and schema.name.startswith("aten::_foreach_") and schema.name.endswith("_")
            and not schema.returns and schema.arguments and schema.arguments[0].alias_info is not None
            and schema.arguments[0].alias_info.is_write)
    return hit


def _same_shapes(args, kwargs) -> bool:
    """Whether an in-place foreach op's operands are plain fake tensors that need no checking: every
    list as long as the first, each of its tensors of the shape of the first list's at the same
    position (no broadcasting), and any single tensor a scalar. Then the op is answered without
    running it on fake tensors (an optimizer step runs a few of them over every parameter, about a
    fifth of a GPT-2 simulation): it would allocate nothing and change no metadata. Anything else
    (a DTensor, a broadcast, a kwarg) is run as usual."""
    from torch._subclasses.fake_tensor import FakeTensor  # heavy: torch, loaded on first use

    if kwargs or not args or not isinstance(args[0], (list, tuple)):
        return False
    first = args[0]
    shapes = []
    for t in first:
        if type(t) is not FakeTensor:
            return False
        shapes.append(t.shape)
    for a in args[1:]:
        if isinstance(a, (list, tuple)):
            if len(a) != len(first):
                return False
            for t, shape in zip(a, shapes):
                if isinstance(t, torch.Tensor) and (type(t) is not FakeTensor or t.shape != shape):
                    return False
        elif isinstance(a, torch.Tensor) and (type(a) is not FakeTensor or a.dim() != 0):
            return False
    return True


# The most ops one module may run itself (its children's are theirs) in one forward pass. A
# transformer block's own code runs tens; a thousand means a Python loop, e.g. over the tokens of a
# Mamba/RWKV-style scan in transformers' sequential fallback (24 layers x 512 tokens x ~12 ops,
# forward and backward, two steps: a Mamba-130m config took 454 s), whose memory is not that of
# the fused CUDA kernel the real run uses when its package (mamba-ssm) is installed.
FORWARD_OPS_LIMIT = 1000
# not counted towards it: a tensor's item(), which a fake tensor's tolist() runs once per element (Qwen2.5-VL's
# get_rope_index reads each row's 1,024 token ids so: 2,570 a row), where CUDA copies the tensor to the host once,
# and a device read (prim::device), which runs no kernel
_ITEM = torch.ops.aten._local_scalar_dense.default
# what SimulationTracker.costs counts: ops a checkpointed block runs again in backward, their matmul/attention/conv
# FLOPs (torch.utils.flop_counter's formulas) and output bytes; saved tensors offloaded to host memory, their bytes
# and the part that are copies of parameters (which stay on the device besides)
COST_KEYS = ("recompute_ops", "recompute_flops", "recompute_bytes", "offload_tensors", "offload_bytes", "offload_parameter_bytes")


class SimulationTracker(StorageTracker):
    """The storage tracker plus the library workspaces a CUDA step takes through the allocator.

    cuBLAS allocates a workspace for each (handle, stream) at its first GEMM: one for the thread
    running the forward, one for the autograd engine's device thread (backward, and checkpoint
    recomputation). cuBLASLt takes its own 1 MiB at its first GEMM with a bias epilogue (addmm).
    Where they land matters: the backward workspace appears in the middle of the loss backward
    and best-fit may place it inside a freed logits-sized block, splitting it for good (measured
    on an H100: the second step of Qwen2.5-0.5B then reserves a new 4.6 GiB segment).
    """

    def __init__(self, log, gpu=None):
        super().__init__(log)
        self.gpu = gpu or gpu_facts(None)
        self._workspaces: dict[str, torch.Tensor] = {}
        self._forward_ops: dict[int, int] = {}   # module id -> ops it ran itself in this forward pass
        self.stopped: MemlensError | None = None  # why the simulation must stop (see FORWARD_OPS_LIMIT)
        self.model = None                         # for naming a module that runs too many ops
        self.ops_limit: int | None = FORWARD_OPS_LIMIT  # None: a compiled graph (thousands of ops by design, no loop)
        self.live_layers: dict | None = None      # key -> layer of allocations outside forward and backward (depth.py)
        # one micro-batch's (step 1's first forward and backward) recompute and offload counts (estimator/result.py)
        self.costs: dict[str, int] = dict.fromkeys(COST_KEYS, 0)
        self.recomputing = False                  # inside a checkpointed block's recomputation (_wrap_checkpoint_funcs)
        self._passes = {"forward": 0, "backward": 0}
        self.layer_hint = None                    # a tensor whose layer an allocation made from no tensor takes (layer_from)
        self._made_by: dict[int, tuple | None] = {}  # this backward's storages -> the autograd node that made them
        self.timer = None                         # prices each op for the step time (memlens.estimator.timing.record)
        # CUDA's dropout allocates the mask, then the output (Dropout.cu dropout_cuda; measured on an H100)
        self.output_order = {torch.ops.aten.native_dropout.default: (1, 0)}

    # ---------------------------------------------------------------- layers (memlens.estimator.depth)
    def label_layers(self, stack) -> None:
        """From now on, give each allocation outside forward and backward the layer of the tensor it
        is computed from (a foreach op's i-th output: its first list's i-th tensor's)."""
        self.stack = stack
        self.live_layers = {}
        # keys of tensors made from a list with an entry per layer -> the bytes one layer's entries add (or None)
        self.spanning: dict = {}
        self._key_layers: dict = {}
        self._module_layers: list = []
        self._scanned = 0

    @contextlib.contextmanager
    def layer_from(self, t):
        """Allocations made from no tensor inside (``torch.zeros(shape)``, ``torch.normal(size=...)``) take the
        layer of ``t``: Opacus' noise for a parameter is made from its shape alone."""
        old, self.layer_hint = self.layer_hint, t
        try:
            yield
        finally:
            self.layer_hint = old

    def _layer_of(self, t) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        key = self.key_of(t)
        if key is None:
            return None
        mods, evs = self.log.modules, self.log.events
        while len(self._module_layers) < len(mods):
            self._module_layers.append(self.stack.layer_of(mods[len(self._module_layers)]))
        for ev in evs[self._scanned:]:
            if ev.kind == ALLOC:
                lay = self._module_layers[ev.module] if ev.module >= 0 else None
                self._key_layers[ev.key] = lay if lay is not None else self.live_layers.get(ev.key)
        self._scanned = len(evs)
        return self._key_layers.get(key)

    def copy_layers(self, remap: dict) -> None:
        """Storages written as copies of others (``remap``: original key -> the copy's) take their originals' layers."""
        for d in (self.live_layers, self._key_layers, self.spanning):
            d.update({new: d[old] for old, new in remap.items() if old in d})

    def register_copy(self, t, of, category, label: str, op: str) -> None:
        """Account ``t``, a copy of ``of`` made before the step (an EMA shadow); in a layer stack it is
        of ``of``'s layer, so that :mod:`.depth` writes one copy per layer."""
        lay = self._layer_of(of) if self.live_layers is not None else None
        key = self.register(t, category, label, op=op)
        if lay is not None and key is not None:
            self.live_layers[key] = self._key_layers[key] = lay

    def _label_outputs(self, args, out, first_new: int, spans_only: bool = False) -> None:
        """``spans_only`` (backward, where an allocation's layer is its module's): only mark a tensor made from
        a list with an entry per layer (Opacus' ghost clipping stacks every layer's per-sample norms in backward)."""
        outs = out if isinstance(out, (list, tuple)) else (out,)
        first = args[0] if args else None
        if spans_only and not isinstance(first, (list, tuple)):
            return
        per_item = isinstance(first, (list, tuple)) and len(first) == len(outs) and not spans_only
        common, spans = None, False
        if not per_item:
            flat = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            found = {self._layer_of(a) for a in flat} - {None}
            common = found.pop() if len(found) == 1 else None
            spans = len(found) > 1 and isinstance(first, (list, tuple))
            if not flat and self.layer_hint is not None:     # made from no tensor: the hint's layer (layer_from)
                common = self._layer_of(self.layer_hint)
        for i, o in enumerate(outs):
            key = self.key_of(o) if isinstance(o, torch.Tensor) else None
            if key is None or key < first_new:
                continue
            lay = self._layer_of(first[i]) if per_item else common
            if lay is not None and not spans_only:
                self.live_layers[key] = self._key_layers[key] = lay
            elif spans:    # one tensor from a list over every layer (clip_grad_norm_'s stack of norms)
                self.spanning[key] = self._bytes_per_layer(first, o)

    def _bytes_per_layer(self, entries, out: torch.Tensor) -> int | None:
        """The bytes of ``out`` (made from the list ``entries``) that one layer's entries account for: where
        ``out`` holds each entry's elements once (``torch.stack``, ``torch.cat``) and every layer of the
        stack has entries of the same number of elements; else None (:func:`.depth.grows_as_recorded`)."""
        if not all(isinstance(e, torch.Tensor) for e in entries) or sum(e.numel() for e in entries) != out.numel() \
                or out.untyped_storage().nbytes() != out.numel() * out.element_size():
            return None
        per: dict[int, int] = {}
        for e in entries:
            lay = self._layer_of(e)
            if lay is not None:
                per[lay] = per.get(lay, 0) + e.numel()
        if set(per) != set(range(self.stack.depth)) or len(set(per.values())) != 1:
            return None
        return per[0] * out.element_size()

    def set_phase(self, name: str, step: int) -> None:
        if name == "forward":
            self._forward_ops = {}
        if name in self._passes and step == 1:
            self._passes[name] += 1
        super().set_phase(name, step)

    def _first(self, phase: str) -> bool:
        return self.step == 1 and self._passes[phase] == 1

    def count_offload(self, t, nbytes: int) -> None:
        """A saved tensor packed to host memory (the simulation's save_on_cpu)."""
        if self._first("forward"):
            self.costs["offload_bytes"] += nbytes
            self.costs["offload_tensors"] += 1
            if self.category_of(self.key_of(t)) == Category.PARAMETERS:
                self.costs["offload_parameter_bytes"] += nbytes

    def _count_recompute(self, func, args, kwargs, out, first_new: int) -> None:
        from torch.utils.flop_counter import flop_registry  # heavy: torch, loaded on first use

        c = self.costs
        c["recompute_ops"] += 1
        f = flop_registry.get(getattr(func, "_overloadpacket", None))
        if f is not None:
            c["recompute_flops"] += int(f(*args, **(kwargs or {}), out_val=out))
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            key = self.key_of(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key >= first_new:     # a new storage written (not a view or an alias)
                c["recompute_bytes"] += t.untyped_storage().nbytes()

    def _too_many_ops(self) -> MemlensError:
        label = self.log.modules[self.module] if 0 <= self.module < len(self.log.modules) else "?"
        cls = next((type(m).__name__ for n, m in (self.model.named_modules() if self.model is not None else ())
                    if self.module_label(n) == label), None)
        return MemlensError(
            f"{label}{f' ({cls})' if cls else ''} runs more than {FORWARD_OPS_LIMIT} ops of its own in one forward pass: "
            "a Python loop, e.g. over tokens, as transformers' sequential fallback for a fused CUDA kernel (Mamba's "
            "selective scan without mamba-ssm) runs; simulated op by op it takes minutes, and it is not the fused "
            "kernel's memory", hint="use --method formula, or simulate a short --seq-len (the cost grows with it)")

    def _embedding_backward_scratch(self, grad: torch.Tensor, indices: torch.Tensor, by_freq: bool = False) -> None:
        """CUDA's embedding backward sorts the indices and sums rows per index segment in fp32
        after allocating the weight gradient: measured on an H100 (8192 indices x 768) at
        N*D*4 bytes of partial sums plus about 454 bytes per index of sort buffers. Up to 3,072 indices (without
        ``scale_grad_by_freq``) it adds rows into the gradient directly, with no scratch (Embedding.cu
        ``embedding_dense_backward_cuda``; GPT-2's 1,024 positions: none on an H100)."""
        n = indices.numel()
        if n <= 3072 and not by_freq:
            return
        d = grad.shape[-1]
        scratch = [torch.empty(n * d * 4, dtype=torch.uint8), torch.empty(n * 454, dtype=torch.uint8)]
        for t in scratch:
            self.register(t, Category.TEMPORARIES)
        del scratch

    def _conv_workspace(self, func, args, out) -> None:
        """cuDNN's workspace for one convolution call: allocated after the outputs, freed at the
        end of the call (estimator/conv_workspaces.py: measured per class)."""
        fwd = func is torch.ops.aten.convolution.default
        x, w = (args[0], args[1]) if fwd else (args[1], args[2])
        groups = args[8] if fwd else args[9]
        y = out if fwd else args[0]
        nbytes = conv_workspaces.workspace_bytes(self.gpu.name, "forward" if fwd else "backward", x.dtype, tuple(w.shape), groups,
                                                 x.shape[1], x.numel() * x.element_size(), y.numel() * y.element_size())
        if nbytes > 0:
            ws = torch.empty(nbytes, dtype=torch.uint8)
            self.register(ws, Category.WORKSPACE)
            del ws

    def _reduce_scratch(self, args) -> None:
        """``gpu_reduce_kernel``'s staging buffer and semaphores (estimator/reduce_scratch.py): allocated after the
        output, freed when the call returns (the semaphores first). Logged for every float reduction on the device, 0
        bytes where it takes none (the log's sequence then does not depend on the sizes: scaling.py)."""
        x = args[0]
        if (not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64
                or (self.device_type is not None and x.device.type != self.device_type)):
            return      # float accumulators only (a double sum accumulates in double: not modelled)
        dims = args[1] if len(args) > 1 and args[1] is not None else ()
        ops = [ReduceScratch(part, tuple(x.shape), tuple(x.stride()), tuple(dims), x.element_size(), self.gpu.sm_count,
                             self.gpu.max_threads_per_sm) for part in (0, 1)]
        keys = [self.new_key(), self.new_key()]
        stream = self.stream_of() if self.stream_of is not None else 0
        for key, op in zip(keys, ops):
            self.log.alloc(key, op.nbytes, Category.WORKSPACE, self.module, self.phase, op, stream=stream)
        for key in reversed(keys):
            self.log.free(key)

    def _workspace(self, name: str, nbytes: int) -> None:
        t = torch.empty(nbytes, dtype=torch.uint8)  # inside the handler this mode is off: register it
        self.register(t, Category.WORKSPACE)
        self._workspaces[name] = t

    # ---------------------------------------------------------------- autograd's InputBuffer sums
    def _buffer_sum_into(self, args, kwargs):
        """The tensor the engine sums into, in place, when this ``add.Tensor`` is its sum of two gradients of one
        tensor (a residual stream's, a tensor used twice, a tied weight's: ``lm_head.weight is embed_tokens.weight``;
        torch/csrc/autograd/input_buffer.cpp ``accumulate``), else None. After a node's apply its output ``var`` is added to the buffer's ``old_var``
        (which another node made): on the GPU in place into ``old_var`` when the buffer holds the last reference to
        it and its storage (``can_accumulate_inplace``), else a new tensor - never into ``var`` (the ``accumulate`` of
        the torch releases memlens supports; older ones tried ``var`` too). Measured on an H200 (torch 2.11,
        bench/results/zero1_probe.md): GPT-2 medium fp32, whose head gradient is TBackward's transposed view, made a
        third [V, H] tensor every step on one GPU and under DDP / ZeRO-1 (reserved -2.5% when summed into the
        embedding's gradient, -0.03% with the third tensor); TRL's fused head, whose gradient is a fresh tensor, was
        summed into in place.
        Under a Python dispatch mode, as here, that check fails (the wrappers count as references) and the sum is
        always a new tensor: memlens sums in place as the GPU does. Told apart from an add inside a backward
        formula by its operands: ``var`` made by the running node, ``old_var`` by another. Sums inside the graph were
        measured in place too (GPT-2 medium on an H100: GELU's input and both residual streams of every layer, no new
        tensor; bench/results/zero1_probe.md, ninth session)."""
        node = torch._C._current_autograd_node()
        if kwargs or node is None or torch.is_grad_enabled() or len(args) != 2:
            return None
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is not b and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device):
            return None
        me = _node_key(node)
        if self._made_by.get(self.key_of(b)) != me or self._made_by.get(self.key_of(a)) in (None, me):
            return None
        return a if _stealable(a) else None

    def _note_maker(self, out, first_new: int) -> None:
        """Which autograd node made each new storage of this backward (for :meth:`_is_buffer_sum`)."""
        node = torch._C._current_autograd_node()
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            key = self.key_of(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key >= first_new:
                self._made_by[key] = _node_key(node) if node is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            return self._device_read(func, args, kwargs)
        phase = self.phase
        into = self._buffer_sum_into(args, kwargs) if phase == "backward" and func is _ADD else None
        if into is not None:
            other = args[1] if into is args[0] else args[0]
            self._dispatch(_ADD_, types, (into, other), {})
            if self.timer is not None:   # the GPU runs the sum all the same, in place: priced as the add (two reads, a
                # write: a view is not an input; view, not view_as: FakeTensorMode caches view and runs view_as whole)
                self.timer.op(_ADD, (into, other), {}, into.view(into.shape))
            return into
        if phase != "backward" and self._made_by:
            self._made_by.clear()
        if phase == "optimizer":
            if func is _LIFT_FRESH:
                # `torch.tensor(x)` in an optimizer step: torch's non-fused optimizers keep their step
                # counters on the CPU and add a CPU constant to them (torch/optim/adam.py): host memory on CUDA
                return func(*args, **(kwargs or {}))
            if _inplace_foreach(func) and _same_shapes(args, kwargs):
                return None
        first_new = self._next
        out = self._dispatch(func, types, args, kwargs)   # StorageTracker's, unwrapped (this call is dynamo-disabled already)
        phase = self.phase                                 # read again after the op, as it always was
        if self.timer is not None:
            self.timer.op(func, args, kwargs, out)
        if phase == "backward" and self._next > first_new:    # new storages were made (else it would note none)
            self._note_maker(out, first_new)
        if self.recomputing and self._first("backward"):
            self._count_recompute(func, args, kwargs, out, first_new)
        if self.live_layers is not None and self._next > first_new and phase != "forward":
            self._label_outputs(args, out, first_new, spans_only=phase == "backward")
        if phase == "forward" and self.ops_limit is not None and func is not _ITEM:
            self._count_forward_op()
        if func in _EXTRA_WORK:
            self._extra_work(func, args, out)
        return out

    def _device_read(self, func, args, kwargs):
        """``prim::device``, a tensor's device read (the autograd engine asks it of every gradient: about half the ops
        the mode sees): what :meth:`__torch_dispatch__` does for it, done directly. It makes no storage (nothing to
        log, label or note), is priced as nothing (the timer only marks the phase), and counts as an op of a
        recomputation, not of the module's forward (``ops_limit``: it runs no kernel)."""
        if self.phase != "backward" and self._made_by:
            self._made_by.clear()
        t = args[0] if len(args) == 1 and not kwargs else None
        if type(t) is FakeTensor:    # FakeTensorMode's own answer (its prim.device handler), without the mode's dispatch
            out = _META if t.fake_mode.in_kernel_invocation else t.fake_device
        else:
            out = func(*args, **(kwargs or {}))
        if self.timer is not None:
            self.timer.op(func, args, kwargs, out)
        if self.recomputing and self._first("backward"):
            self.costs["recompute_ops"] += 1
        return out

    def _count_forward_op(self) -> None:
        n = self._forward_ops.get(self.module, 0) + 1
        self._forward_ops[self.module] = n
        if n > self.ops_limit and self.stopped is None:
            self.stopped = self._too_many_ops()   # raised at the next module boundary (not from inside an op)

    def _extra_work(self, func, args, out) -> None:
        """What CUDA allocates beside an op's outputs: embedding backward's sort buffers, cuDNN's convolution
        workspace, cuBLAS' workspaces at a thread's first GEMM, a long reduction's staging buffer."""
        if func in _REDUCTIONS:
            self._reduce_scratch(args)
            return
        if func is _EMBEDDING_BACKWARD:
            self._embedding_backward_scratch(args[0], args[1], bool(args[4]) if len(args) > 4 else False)
        if func is _CONV or func is _CONV_BACKWARD:
            self._conv_workspace(func, args, out)
        if func is _CONV_BACKWARD and len(args) > 10 and args[10][2]:
            # the bias gradient: a sum of grad_output over every dim but the channels, after cuDNN's call, on grad_output
            # as it came (ViT's patch embedding: channels fastest, a column reduction staged in global memory; measured
            # on an H100: a 132 MiB staging at batch 128)
            g = args[0]
            self._reduce_scratch((g, [0, *range(2, g.dim())]))
        if func in _gemm_ops():
            thread = "backward" if self.phase == "backward" else "forward"
            if thread not in self._workspaces:
                self._workspace(thread, self.gpu.cublas_workspace_bytes)
            if func is _ADDMM and thread + "-lt" not in self._workspaces:
                self._workspace(thread + "-lt", self.gpu.cublaslt_workspace_bytes)


_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
_ADD, _ADD_ = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_CONV, _CONV_BACKWARD = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
_ADDMM = torch.ops.aten.addmm.default
# Reduce.cuh's gpu_reduce_kernel with a float accumulator (sum and mean of floating tensors, over dims or all of them)
_REDUCTIONS = frozenset({torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default, torch.ops.aten.mean.dim,
                         torch.ops.aten.mean.default})
# the ops after which _extra_work allocates something
_EXTRA_WORK = frozenset({_EMBEDDING_BACKWARD, _CONV, _CONV_BACKWARD} | _gemm_ops() | _REDUCTIONS)


def _node_key(node) -> tuple:
    """An autograd node told apart without keeping it alive (its Python wrapper, and so ``id``, is made anew)."""
    return node.name(), node._sequence_nr()


def _stealable(t) -> bool:
    """``can_accumulate_inplace`` (input_buffer.cpp) as far as Python sees it: a dense tensor, not a view, alone
    on a storage it fills (the storage's count: the tensor and the Python storage object made here)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false  # heavy: torch, loaded on first use

    if t._is_view() or not is_non_overlapping_and_dense_or_false(t) or t.storage_offset():
        return False
    st = t.untyped_storage()
    return st.nbytes() == t.numel() * t.element_size() and torch._C._storage_Use_Count(st._cdata) <= 2


@contextlib.contextmanager
def _synthetic_batch_shortcuts():
    """Answer, without reading data, the data-dependent checks transformers makes on inputs.

    The synthetic batch is never packed (position ids are a plain range) and its image tokens
    always match the image features, so these checks would pass on the GPU; on fake tensors they
    cannot be evaluated (and transformers' `is_tracing` would assume the worst and build masks).
    """
    patches = [mock.patch.dict(os.environ, {"TRANSFORMERS_DISABLE_TORCH_CHECK": "1"})]
    mu = sys.modules.get("transformers.masking_utils")   # imported by the model's code if it uses it (not for plain torch models)
    if mu is not None and hasattr(mu, "find_packed_sequence_indices"):
        patches.append(mock.patch.object(mu, "find_packed_sequence_indices", _packed_sequences))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _packed_sequences(position_ids):
    """transformers' ``find_packed_sequence_indices`` for the synthetic batch: None (one sequence a row), except for
    position ids marked packed (TRL's padding-free rows, memlens.models.trl_batch), where the sequence index of each
    token is computed as transformers does (the diff of the positions, cumsum) without reading whether there is
    more than one sequence: there is."""
    if getattr(position_ids, KNOWN, None) != "packed":
        return None
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _untraceable(e: Exception, spec: TrainingSpec) -> MemlensError:
    from torch._subclasses.fake_tensor import (  # heavy: torch, loaded on first use
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    name = type(e).__name__
    if "convert all Tensors to FakeTensors" in str(e):   # FakeTensorMode meets a tensor made before the simulation
        d = usercode.describe(e)
        who, where = d if d is not None else (f"the model or loss function of {spec.model}", None)
        return MemlensError(f"{who} uses a real tensor created outside the factory, which estimate cannot trace"
                            + (f" ({where})" if where else ""),
                            hint="create every tensor inside the factory (or register it on the model as a buffer)")
    mine = usercode.user_code_error(e)
    if mine is not None and not isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        return mine
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or "data-dependent" in str(e).lower():
        return MemlensError(f"{spec.model}: the step has a data-dependent op that cannot be simulated ({name})",
                            hint="use --method formula for this model")
    msg = sentences(e) or name
    if "TorchScript interpreter" in str(e):   # a scripted function models/scripted.py cannot swap (a method, a ScriptModule)
        return MemlensError(f"simulating {spec.model} failed: its model code runs TorchScript code that is not a module-level "
                            "function, which fake tensors cannot run", hint="use --method formula (or a factory without TorchScript)")
    return MemlensError(f"simulating {spec.model} failed: {name}: {msg}", hint="try --method formula, or rerun with --debug")
