"""Estimate by simulation: the real training step of the real model on fake CPU tensors.

Nothing is allocated: FakeTensorMode gives every tensor its shape, dtype and storage size only.
:class:`StorageTracker` logs every storage; :mod:`cuda_rules` maps the few CPU kernels whose
memory differs from CUDA's; the ledger's allocator model turns the log into what
``torch.cuda.max_memory_allocated`` and ``memory_reserved`` would read.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import MemlensError
from ..ledger import EventLog
from ..models.build import Built, build, make_optimizer, torch_dtype
from ..models.source import ModelSource, resolve
from ..spec import TrainingSpec
from ..step import train_step
from . import cuda_rules
from .tracker import OUTSIDE_LABEL, ROOT_LABEL, ModuleScope, StorageTracker, pack_hook_for

# Memory CUDA libraries take through PyTorch's caching allocator (so it is in memory_allocated).
# cuBLAS keeps one workspace per (handle, stream); the autograd engine's device thread gets its
# own handle, so forward and backward each hold one. Sizes: torch's default on sm90 (Hopper).
CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024  # measured: the first addmm with a bias adds 1 MiB


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


def simulate(spec: TrainingSpec, source: ModelSource | None = None, steps: int = 2) -> Simulation:
    """Run ``steps`` optimizer steps of ``spec`` on fake tensors and log every storage.

    >>> from memlens.spec import TrainingSpec
    >>> sim = simulate(TrainingSpec(model="gpt2", batch_size=1, seq_len=32))  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    source = source or resolve(spec.model)
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    log = EventLog()
    tracker = SimulationTracker(log)
    rules = cuda_rules.CudaRules(autocast_dtype=torch_dtype(spec.autocast_dtype) if spec.autocast_dtype else None)
    emulation = cuda_rules.CudaEmulation(rules)

    with torch.device("meta"), _quiet():
        # DP-SGD materializes the physical batch at once (Opacus BatchMemoryManager)
        built: Built = build(spec.replace(batch_size=spec.physical_batch_size) if spec.dp and spec.physical_batch_size else spec, source)
    model = materialize_on_fake(built.model, fake)
    batch = _fake_batch(built.batch, fake)
    _wrap_checkpoint_funcs(model, emulation)
    _register_model(tracker, model)
    _register_inputs(tracker, batch)
    optimizer = make_optimizer(spec, model, simulate=True)
    params = [p for p in model.parameters()]
    n_params = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    dp = None
    if spec.dp:
        from .dp import PerSampleGradients

        from torch.utils._pytree import tree_flatten

        first = next(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
        dp = PerSampleGradients(tracker, first.shape[0])  # samples actually in the micro-batch

    def on_grad(p) -> None:
        tracker.retag(p.grad, "gradients")
        if dp is not None:
            dp.on_grad(p)

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    scaler = _FakeGradScaler() if spec.precision == "amp-fp16" else None
    autocast = (lambda: cuda_rules.cuda_autocast(emulation, rules.autocast_dtype)) if rules.autocast_dtype else contextlib.nullcontext
    phase_module = {"forward": log.module_id(OUTSIDE_LABEL), "backward": log.module_id(ROOT_LABEL),
                    "optimizer": log.module_id("(optimizer step)")}

    try:
        with fake, _quiet(), _synthetic_batch_shortcuts(), cuda_rules.track_autocast_cache_clears(emulation), emulation, tracker, \
                torch.autograd.graph.saved_tensors_hooks(pack_hook_for(tracker), lambda t: t):
            for step in range(1, steps + 1):
                with ModuleScope(tracker, model):
                    def on_phase(name: str, step=step) -> None:
                        tracker.set_phase(name, step)
                        tracker.module = phase_module.get(name, tracker.module)
                        tracker.category_default = "temporaries"
                        if dp is not None and name == "optimizer":
                            dp.clip_and_noise()

                    train_step(model, optimizer, batch, grad_accum=spec.grad_accum, autocast=autocast,
                               scaler=scaler, loss_fn=built.loss_fn, on_phase=on_phase)
                    _tag_optimizer_state(tracker, optimizer)
            tracker.set_phase("done", steps)
    except MemlensError:
        raise
    except Exception as e:  # data-dependent ops and other untraceable code
        raise _untraceable(e, spec) from None
    finally:
        for h in hooks:
            h.remove()
    attention = sorted({f"{c.backend}" for c in rules.attention_calls})
    return Simulation(log, spec, source, built.seq_len, built.image_size, n_params, n_train, attention,
                      time.perf_counter() - t0)


def materialize_on_fake(model, fake: FakeTensorMode):
    """Swap every meta tensor of a model for a fake CPU tensor of the same shape (ties kept)."""
    memo: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        hit = memo.get(id(t))
        if hit is None:
            with fake:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            hit = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
            memo[id(t)] = hit
        return hit

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                mod._parameters[name] = fake_of(p)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = fake_of(b)
        for name, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and v.device.type == "meta":
                setattr(mod, name, fake_of(v))
    return model


def _fake_batch(batch: Any, fake: FakeTensorMode) -> Any:
    from torch.utils._pytree import tree_map

    memo: dict[int, torch.Tensor] = {}

    def conv(t):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            if id(t) not in memo:  # one tensor used twice (input_ids is labels) stays one
                with fake:
                    memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return memo[id(t)]
        return t

    return tree_map(conv, batch)


def _wrap_checkpoint_funcs(model, emulation: "cuda_rules.CudaEmulation") -> None:
    """Re-enter the CUDA emulation when checkpointing recomputes a layer inside backward
    (torch function modes are not carried into the autograd engine)."""
    from torch.overrides import _get_current_function_mode_stack

    def wrap(orig):
        def checkpoint(function, *args, **kwargs):
            def run(*a, **k):
                if any(m is emulation for m in _get_current_function_mode_stack()):
                    return function(*a, **k)
                with emulation:
                    return function(*a, **k)

            return orig(run, *args, **kwargs)

        return checkpoint

    for mod in model.modules():
        fn = getattr(mod, "_gradient_checkpointing_func", None)
        if fn is not None and not getattr(fn, "_memlens", False):
            w = wrap(fn)
            w._memlens = True
            mod._gradient_checkpointing_func = w


_GEMMS = None


def _gemm_ops():
    global _GEMMS
    if _GEMMS is None:
        a = torch.ops.aten
        _GEMMS = {a.mm.default, a.addmm.default, a.bmm.default, a.baddbmm.default, a.addbmm.default,
                  a.addmv.default, a.mv.default, a._addmm_activation.default}
    return _GEMMS


class SimulationTracker(StorageTracker):
    """The storage tracker plus the library workspaces a CUDA step takes through the allocator.

    cuBLAS allocates a workspace for each (handle, stream) at its first GEMM: one for the thread
    running the forward, one for the autograd engine's device thread (backward, and checkpoint
    recomputation). cuBLASLt takes its own 1 MiB at its first GEMM with a bias epilogue (addmm).
    Where they land matters: the backward workspace appears in the middle of the loss backward
    and best-fit may place it inside a freed logits-sized block, splitting it for good (measured
    on an H100: the second step of Qwen2.5-0.5B then reserves a new 4.6 GiB segment).
    """

    def __init__(self, log):
        super().__init__(log)
        self._workspaces: dict[str, torch.Tensor] = {}

    def _embedding_backward_scratch(self, grad: torch.Tensor, indices: torch.Tensor) -> None:
        """CUDA's embedding backward sorts the indices and sums rows per index segment in fp32
        after allocating the weight gradient: measured on an H100 (8192 indices x 768) at
        N*D*4 bytes of partial sums plus about 454 bytes per index of sort buffers."""
        n = indices.numel()
        d = grad.shape[-1]
        scratch = [torch.empty(n * d * 4, dtype=torch.uint8), torch.empty(n * 454, dtype=torch.uint8)]
        for t in scratch:
            self.register(t, "temporaries")
        del scratch

    def _workspace(self, name: str, nbytes: int) -> None:
        t = torch.empty(nbytes, dtype=torch.uint8)  # inside the handler this mode is off: register it
        self.register(t, "workspace")
        self._workspaces[name] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten.embedding_dense_backward.default:
            self._embedding_backward_scratch(args[0], args[1])
        if func in _gemm_ops():
            thread = "backward" if self.phase == "backward" else "forward"
            if thread not in self._workspaces:
                self._workspace(thread, CUBLAS_WORKSPACE_BYTES)
            if func is torch.ops.aten.addmm.default and thread + "-lt" not in self._workspaces:
                self._workspace(thread + "-lt", CUBLASLT_WORKSPACE_BYTES)
        return out


def _register_model(tracker: StorageTracker, model) -> None:
    names = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            names.setdefault(id(p), tracker.module_label(mname))
    for p in model.parameters():
        tracker.register(p, "parameters", names.get(id(p), ROOT_LABEL), op="model")
    for mname, mod in model.named_modules():
        for b in mod.buffers(recurse=False):
            tracker.register(b, "buffers", tracker.module_label(mname), op="model")


def _register_inputs(tracker: StorageTracker, batch: Any) -> None:
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor):
            tracker.register(t, "inputs", "(inputs)", op="batch")


def _tag_optimizer_state(tracker: StorageTracker, optimizer) -> None:
    for state in optimizer.state.values():
        for k, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if k == "step" and t.numel() == 1 and not getattr(optimizer, "_memlens_step_on_device", False):
                tracker.release(t)  # non-fused, non-capturable optimizers keep `step` on the CPU
            else:
                tracker.retag(t, "optimizer_state")


@contextlib.contextmanager
def _synthetic_batch_shortcuts():
    """Answer, without reading data, the data-dependent checks transformers makes on inputs.

    The synthetic batch is never packed (position ids are a plain range) and its image tokens
    always match the image features, so these checks would pass on the GPU; on fake tensors they
    cannot be evaluated (and transformers' `is_tracing` would assume the worst and build masks).
    """
    import os
    from unittest import mock

    patches = [mock.patch.dict(os.environ, {"TRANSFORMERS_DISABLE_TORCH_CHECK": "1"})]
    try:
        import transformers.masking_utils as mu

        if hasattr(mu, "find_packed_sequence_indices"):
            patches.append(mock.patch.object(mu, "find_packed_sequence_indices", lambda position_ids: None))
    except ImportError:  # pragma: no cover - older transformers
        pass
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextlib.contextmanager
def _quiet():
    import logging
    import warnings

    tlog = logging.getLogger("transformers")
    old = tlog.level
    tlog.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            tlog.setLevel(old)


def _untraceable(e: Exception, spec: TrainingSpec) -> MemlensError:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    name = type(e).__name__
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or "data-dependent" in str(e).lower():
        return MemlensError(f"{spec.model}: the step has a data-dependent op that cannot be simulated ({name})",
                            hint="use --method formula for this model")
    msg = str(e).splitlines()[0][:200] if str(e) else name
    return MemlensError(f"simulating {spec.model} failed: {name}: {msg}", hint="try --method formula, or rerun with --debug")
