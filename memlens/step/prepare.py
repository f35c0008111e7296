"""One place that turns a TrainingSpec into a step ready to run: :func:`prepare`.

``estimate`` (fake tensors on the CPU standing for CUDA), ``profile``, the measured trials of
compare / sweep / fit and the bench scripts (real tensors on a device) all get their model,
batch, optimizer, autocast and GradScaler here, so they run the same step. Every spec field is
applied here or refused here with one line; no caller may ignore one.

What is applied, in order:

1. the model from its source (built-in config, Hugging Face id, directory, factory): on the meta
   device then on fake tensors (``fake=True``), or with random weights on the device (optionally
   built on the CPU and moved, ``load_on_cpu``);
2. weight dtype (``precision`` fp16/bf16), ``freeze``, gradient checkpointing, LoRA, QLoRA
   (by :mod:`memlens.models.build`);
3. the batch (``batch_size`` x ``seq_len`` / ``image_size`` / ``images_per_sample``; DP-SGD's
   ``physical_batch_size`` samples at once);
4. the optimizer over the trainable parameters (:mod:`memlens.step.optim`);
5. autocast and GradScaler for ``amp-*``;
6. DP-SGD and sharding wrappers, where the step kind supports them.

>>> from memlens.core.spec import TrainingSpec
>>> p = prepare(TrainingSpec(model="tests.tiny_models:mlp"), device="cpu")   # doctest: +SKIP
>>> p.run()                                                                 # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.errors import SpecError
from ..core.spec import TrainingSpec
from .loop import PhaseHook, optimizer_step, train_step


@dataclass
class PreparedStep:
    """Everything one training step of a spec needs, built for one device."""

    spec: TrainingSpec
    source: Any                       # memlens.models.source.ModelSource
    device: Any                       # torch.device the tensors live on (cpu for fake tensors)
    fake: bool
    model: Any
    batch: Any
    optimizer: Any
    loss_fn: Callable | None = None
    autocast: Callable[[], Any] = contextlib.nullcontext
    scaler: Any = None
    seq_len: int | None = None
    image_size: int | None = None
    micro_batch: int = 1              # samples materialized at once (the physical batch under DP-SGD)
    fake_mode: Any = None
    applied: list[str] = field(default_factory=list)   # what was applied, in order (for reports)
    notes: list[str] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)  # model-load figures (real devices)

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def trainable_param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def run(self, on_phase: PhaseHook = lambda name: None):
        """One optimizer step (all ``grad_accum`` micro-batches); returns the last micro-batch's loss."""
        return train_step(self.model, self.optimizer, self.batch, grad_accum=self.spec.grad_accum,
                          autocast=self.autocast, scaler=self.scaler, loss_fn=self.loss_fn, on_phase=on_phase)

    def run_optimizer(self, on_phase: PhaseHook = lambda name: None) -> None:
        """Only the optimizer phase of :meth:`run` (the gradients must be in place)."""
        optimizer_step(self.optimizer, scaler=self.scaler, on_phase=on_phase)


def refuse_unsupported(spec: TrainingSpec, *, fake: bool) -> None:
    """One clear line for every spec field this step kind cannot apply (never ignore one)."""
    if spec.world_size > 1 or spec.sharding != "none":
        raise SpecError(f"--world-size {spec.world_size} --sharding {spec.sharding}: one rank of a multi-GPU job is not "
                        "simulated or run by this step yet",
                        hint="use --method formula for sharded model states, or drop --world-size/--sharding")
    if spec.offload_optimizer:
        raise SpecError("--offload-optimizer is not simulated or run by this step yet",
                        hint="use --method formula, or drop --offload-optimizer")
    if spec.dp and not fake:
        raise SpecError("real DP-SGD steps need Opacus, which this step does not run yet",
                        hint="use `memlens estimate --dp` (simulated), or drop --dp")
    if spec.qlora and not fake:
        raise SpecError("--qlora on a real device needs bitsandbytes' 4-bit layers, which this step does not build",
                        hint="use `memlens estimate --qlora` (simulated), or drop --qlora")


def prepare(spec: TrainingSpec, *, device: Any = "cuda", fake: bool = False, source=None, fake_mode=None,
            autocast: Callable[[], Any] | None = None, scaler: Any = None, load_on_cpu: bool = False,
            seed: int | None = None) -> PreparedStep:
    """Build ``spec``'s step: on fake CPU tensors (``fake=True``; no memory, no weights) or with
    random weights on ``device``. ``autocast`` / ``scaler`` override the precision's own (the
    estimator passes its CUDA emulation). ``load_on_cpu`` builds on the CPU and moves the model,
    recording the load figures in ``.load``."""
    import torch

    from ..models.build import build, quiet
    from ..models.source import resolve
    from .optim import make_optimizer

    refuse_unsupported(spec, fake=fake)
    source = source or resolve(spec.model)
    # DP-SGD materializes the physical batch at once (Opacus' BatchMemoryManager)
    micro = spec.physical_batch_size if spec.dp and spec.physical_batch_size else spec.batch_size
    build_spec = spec.replace(batch_size=micro) if micro != spec.batch_size else spec
    applied: list[str] = []
    load: dict[str, Any] = {}
    if seed is not None:
        torch.manual_seed(seed)
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=False)
        with torch.device("meta"), quiet():
            built = build(build_spec, source)
        model = materialize_on_fake(built.model, fake_mode)
        batch = fake_batch(built.batch, fake_mode)
        dev = torch.device("cpu")
    else:
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            load["before_allocated_bytes"] = torch.cuda.memory_allocated(dev)
        import time

        t0 = time.perf_counter()
        with quiet():
            built = build(build_spec, source, device="cpu" if (load_on_cpu and cuda) else dev)
        model, batch = built.model, built.batch
        if load_on_cpu and cuda:
            load["cpu_build_seconds"] = round(time.perf_counter() - t0, 3)
            load["allocated_after_cpu_load_bytes"] = torch.cuda.memory_allocated(dev)
            t1 = time.perf_counter()
            model.to(dev)
            torch.cuda.synchronize(dev)
            load["move_seconds"] = round(time.perf_counter() - t1, 3)
            load["allocated_after_move_bytes"] = torch.cuda.memory_allocated(dev)
            load["reserved_after_move_bytes"] = torch.cuda.memory_reserved(dev)
        batch = to_device(batch, dev)
        load["t0"] = t0
    applied.append(f"model from {source.kind} source {source.name!r}")
    if spec.precision in ("fp16", "bf16"):
        applied.append(f"{spec.precision} weights")
    if spec.freeze:
        applied.append("freeze " + ",".join(spec.freeze))
    if spec.grad_checkpointing:
        applied.append("gradient checkpointing")
    if spec.lora_rank:
        applied.append(("QLoRA" if spec.qlora else "LoRA") + f" r={spec.lora_rank}")
    optimizer = make_optimizer(spec, model, simulate=fake)
    applied.append(f"optimizer {spec.optimizer}")
    if autocast is None:
        autocast, default_scaler = amp_setup(spec, dev)
        scaler = scaler if scaler is not None else (None if fake else default_scaler)
    if spec.autocast_dtype:
        applied.append(f"autocast {spec.autocast_dtype}" + (" + GradScaler" if spec.precision == "amp-fp16" else ""))
    if spec.grad_accum > 1:
        applied.append(f"accumulation x{spec.grad_accum}")
    if spec.dp:
        applied.append(f"DP-SGD, physical batch {micro}")
    first = next((t for t in tensors(batch) if t.dim() > 0), None)
    if first is not None:
        micro = int(first.shape[0])   # a factory's batch has the samples it built
    p = PreparedStep(spec, source, dev, fake, model, batch, optimizer, built.loss_fn, autocast, scaler,
                     built.seq_len, built.image_size, micro, fake_mode, applied, load=load)
    if not fake:
        _load_figures(p)
    return p


def amp_setup(spec: TrainingSpec, device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for a spec's precision on ``device``:
    autocast for amp-*, a GradScaler for amp-fp16 on CUDA."""
    import torch

    dev = torch.device(device)
    if spec.autocast_dtype:
        dt = getattr(torch, spec.autocast_dtype)

        def autocast():
            return torch.autocast(dev.type, dtype=dt)
    else:
        autocast = contextlib.nullcontext
    scaler = torch.amp.GradScaler(dev.type) if spec.precision == "amp-fp16" and dev.type == "cuda" else None
    return autocast, scaler


def _load_figures(p: PreparedStep) -> None:
    """What loading the model, batch and optimizer took on the device vs the parameters' own bytes."""
    import time

    import torch

    load = p.load
    cuda = p.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(p.device)
    t0 = load.pop("t0", None)
    if t0 is not None:
        load["seconds"] = round(time.perf_counter() - t0, 3)
    params = list(p.model.parameters())
    theo = sum(t.numel() * t.element_size() for t in params)
    load["theoretical_param_bytes"] = theo
    load["buffer_bytes"] = sum(b.numel() * b.element_size() for b in p.model.buffers())
    load["batch_bytes"] = sum(t.numel() * t.element_size() for t in tensors(p.batch))
    if not cuda:
        return
    load.update(after_allocated_bytes=torch.cuda.memory_allocated(p.device),
                after_reserved_bytes=torch.cuda.memory_reserved(p.device),
                peak_allocated_bytes=torch.cuda.max_memory_allocated(p.device))
    loaded = load["after_allocated_bytes"] - load.get("before_allocated_bytes", 0)
    load["loaded_bytes"] = loaded
    load["overhead_bytes"] = loaded - theo
    load["overhead_fraction"] = round((loaded - theo) / theo, 6) if theo else None
    load["label"] = ("loaded_bytes: memory_allocated() after building the model with random weights on the device and "
                     "making the batch and optimizer, minus before; overhead: that minus the parameters' own bytes "
                     "(buffers, the batch, 512-byte rounding)")


# ---------------------------------------------------------------- fake tensors
def materialize_on_fake(model, fake_mode):
    """Swap every meta tensor of a model for a fake CPU tensor of the same shape (ties kept)."""
    import torch

    memo: dict[int, Any] = {}
    cpu = torch.device("cpu")
    wrap = fake_mode.fake_tensor_converter.from_meta_and_device

    def fake_of(t):
        hit = memo.get(id(t))
        if hit is None:
            # a fresh contiguous meta tensor wrapped as a fake CPU tensor: what torch.empty under the
            # fake mode returns, without dispatching an op for each of a 70B model's parameters
            new = wrap(fake_mode, torch.empty(t.shape, dtype=t.dtype, device="meta"), cpu)
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


def fake_batch(batch: Any, fake_mode) -> Any:
    """The batch's meta tensors as fake CPU tensors (one tensor used twice stays one)."""
    import torch
    from torch.utils._pytree import tree_map

    memo: dict[int, Any] = {}

    def conv(t):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            if id(t) not in memo:
                with fake_mode:
                    memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return memo[id(t)]
        return t

    return tree_map(conv, batch)


def tensors(obj) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def to_device(batch, dev):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) and t.device != dev else t, batch)


__all__ = ["PreparedStep", "prepare", "amp_setup", "refuse_unsupported", "materialize_on_fake", "fake_batch"]
