"""One place that turns a TrainingSpec into a step ready to run: :func:`prepare`.

``estimate`` (fake tensors on the CPU standing for CUDA), ``profile``, the measured trials of
compare / sweep / fit and the bench scripts (real tensors on a device) all get their model,
batch, optimizer, autocast and GradScaler here, so they run the same step. Every spec field is
applied here or refused here with one line; no caller may ignore one.

What is applied, in order:

1. the model from its source (built-in config, Hugging Face id, directory, factory): on the meta
   device then on fake tensors (``fake=True``), or with random weights on the device (optionally
   built on the CPU and moved, ``load_on_cpu``);
2. weight dtype (``precision`` fp16/bf16), ``freeze``, peft's ``prepare_model_for_kbit_training``
   (``kbit_prep``), gradient checkpointing, LoRA (``lora_dropout``), QLoRA (by :mod:`memlens.models.build`);
3. the batch (``batch_size`` x ``seq_len`` / ``image_size`` / ``images_per_sample``; ``pad_fraction``'s
   attention_mask; DP-SGD's ``physical_batch_size`` samples at once);
4. the optimizer over the trainable parameters (:mod:`memlens.step.optim`);
5. autocast and GradScaler for ``amp-*``;
6. DP-SGD: Opacus' ``make_private`` and ``BatchMemoryManager`` over the logical batch
   (:mod:`memlens.step.kinds.opacus`); for several GPUs the multi-GPU wrapper of this rank
   (:mod:`memlens.step.parallel`: DDP, ZeRO-1, FSDP2), applied before the optimizer is built.

``on_stage(label)`` is called after each setup stage ("model load", "data preparation",
"optimizer setup", "privacy engine setup"), so a profiler can read the device there.

>>> from memlens.core.spec import TrainingSpec
>>> p = prepare(TrainingSpec(model="tests.tiny_models:mlp"), device="cpu")   # doctest: +SKIP
>>> p.run()                                                                 # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.errors import SpecError
from ..core.precision import precision_of
from ..core.spec import TrainingSpec, checkpoint_layers_text
from ..core.units import fmt_bytes
from ..models.build import build, quiet
from ..models.liger import applied_line as liger_applied
from ..models.quant import param_count
from ..models.source import resolve as resolve_source
from .fake import fake_batch, materialize_on_fake, tensors, to_device
from .ema import attach as attach_ema
from .kinds.opacus import describe, make_private
from .loop import PhaseHook, criterion_loss, optimizer_step, train_step
from .optim import make_optimizer
from .parallel import wrapper_for
from .plan import StepPlan, resolve


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
    dp: Any = None                    # memlens.step.kinds.opacus.DPStep under --dp (runs the step)
    applied: list[str] = field(default_factory=list)   # what was applied, in order (for reports)
    notes: list[str] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)  # model-load figures (real devices)
    forward_keys: frozenset[str] | None = None   # a factory's dict batch: the entries forward takes
    step_fn: Callable | None = None              # a factory's own step(model, batch) -> loss
    target_len: int | None = None                # seq2seq: decoder tokens
    wrapper: Any = None                          # memlens.step.parallel wrapper of this rank (several GPUs)
    plan: StepPlan | None = None                 # what step this is (memlens.step.plan.resolve)
    held: list = field(default_factory=list)     # the model outputs a loop that keeps them holds (--keep-outputs)
    frozen: list = field(default_factory=list)   # models beside the trained one (TRL's reference), frozen, accounted too

    @property
    def param_count(self) -> int:
        """The model's parameters, a 4-bit weight (QLoRA) counted as the weights it packs (models/quant.py)."""
        return param_count(self.model)

    @property
    def trainable_param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def run(self, on_phase: PhaseHook = lambda name: None):
        """One optimizer step (all ``grad_accum`` micro-batches, or under DP-SGD all physical batches of
        the logical batch); returns the last micro-batch's loss."""
        if self.plan is not None and self.plan.kind.run is not None:
            return self.plan.kind.run(self, on_phase)
        if getattr(self.wrapper, "run_step", None) is not None:     # --pp: the pipeline schedule's own order
            return self.wrapper.run_step(self, on_phase)
        return train_step(self.model, self.optimizer, self.batch, grad_accum=self.spec.grad_accum,
                          autocast=self.autocast, scaler=self.scaler, loss_fn=self.loss_fn, on_phase=on_phase,
                          max_grad_norm=self.spec.max_grad_norm, hf_trainer=self.spec.hf_trainer,
                          forward_keys=self.forward_keys, step_fn=self.step_fn,
                          holder=self.held if self.plan is not None and self.plan.keep_outputs else None)

    def run_optimizer(self, on_phase: PhaseHook = lambda name: None) -> None:
        """Only the optimizer phase of :meth:`run` (the gradients must be in place)."""
        optimizer_step(self.optimizer, model=self.model, max_grad_norm=self.spec.max_grad_norm, scaler=self.scaler,
                       on_phase=on_phase)


def build_for_sharding(spec: TrainingSpec, source, wrapper):
    """Build the model under the wrapper's device context (FSDP2: meta parameters, real buffers).

    accelerate's ``init_empty_weights`` re-registers every parameter, which unties a Hugging Face
    model's tied embeddings (transformers 5: ``lm_head.weight is not embed_tokens.weight``); they are
    tied again, as ``from_pretrained`` does, so the rank holds one copy as the simulation does
    (measured on 2 x H200 before this: +5 x the embedding shard per rank on Llama-3.2-1B).
    """
    import torch  # heavy: loaded when a step is built

    with wrapper.build_context(), quiet():
        built = build(spec, source)
        if source.kind == "factory" and spec.param_dtype != "float32":
            built.model, built.batch = _cast_factory(built.model, built.batch, getattr(torch, spec.param_dtype))
    # outside the context: inside it, assigning the tied parameter registers a new copy again
    base = built.model.get_base_model() if hasattr(built.model, "get_base_model") else built.model
    tie = getattr(base, "tie_weights", None)
    if callable(tie):
        tie()
    return built


def _qlora_applied(model) -> list[str]:
    """What QLoRA put in the model, for ``applied``: the stand-ins' 4-bit weights, counted as parameters
    (core.tracker.register_model) at their storage dtypes, or on a device bitsandbytes' own layers
    (memlens.models.quant.quantize_with_bitsandbytes)."""
    out, q = [], {}
    for mod in model.modules():
        for bname in getattr(mod, "memlens_weight_buffers", ()):
            b = getattr(mod, bname)
            q[str(b.dtype).removeprefix("torch.")] = q.get(str(b.dtype).removeprefix("torch."), 0) + b.numel() * b.element_size()
    if q:
        out.append("4-bit NF4 frozen weights under parameters: " + ", ".join(f"{fmt_bytes(v)} {k}" for k, v in q.items())
                   + " (packed 2 a byte; absmax uint8 per 64 weights, fp32 per 256 blocks)")
    n4 = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes"))
    if n4:
        out.append(f"bitsandbytes Linear4bit on {n4} linear layers (NF4, double quantization), LoRA on them")
    return out


def prepare(spec: TrainingSpec, *, device: Any = "cuda", fake: bool = False, source=None, fake_mode=None,
            autocast: Callable[[], Any] | None = None, scaler: Any = None, load_on_cpu: bool = False,
            seed: int | None = None, on_stage: Callable[[str], None] | None = None) -> PreparedStep:
    """Build ``spec``'s step: on fake CPU tensors (``fake=True``; no memory, no weights) or with
    random weights on ``device``. ``autocast`` / ``scaler`` override the precision's own (the
    estimator passes its CUDA emulation). ``load_on_cpu`` builds on the CPU and moves the model,
    recording the load figures in ``.load``."""
    import torch  # heavy: loaded when a step is built

    if spec.lengths:   # one step has one shape: only `estimate` reads lengths (memlens.estimator.lengths picks the shape)
        raise SpecError("--lengths is read by `memlens estimate` only: one step has one shape",
                        hint="run memlens estimate --lengths FILE (it says which step peaks and what would fit), then "
                             "use the shape it names here")
    source = source or resolve_source(spec.model)
    plan = resolve(spec, fake=fake, source=source)
    stage = on_stage or (lambda label: None)
    wrapper = wrapper_for(plan, fake=fake) if plan.distributed else None
    micro = spec.batch_size   # under DP-SGD the logical batch: Opacus' data loader splits it
    applied: list[str] = []
    load: dict[str, Any] = {}
    if seed is not None:
        torch.manual_seed(seed)
    if fake:
        from .fake_mode import simulation_fake_mode  # heavy: torch, loaded on first use

        fake_mode = fake_mode or simulation_fake_mode(allow_non_fake_inputs=False)
        with torch.device("meta"), quiet():
            built = build(spec, source, fake=True)
            if source.kind == "factory" and spec.param_dtype != "float32":
                built.model, built.batch = _cast_factory(built.model, built.batch, getattr(torch, spec.param_dtype))
        if wrapper is not None:
            model = wrapper.wrap(built.model, device=torch.device("cpu"), fake_mode=fake_mode)
        else:
            model = materialize_on_fake(built.model, fake_mode)
        batch = fake_batch(built.batch, fake_mode)
        if wrapper is not None:
            batch = wrapper.shard_inputs(batch, built.seq_len)    # context parallel: the rank's share of the sequence
        dev = torch.device("cpu")
    elif wrapper is not None and wrapper.builds_on_meta:
        # FSDP2: parameters on the meta device, sharded, then materialized on the device (no rank holds the model)
        if load_on_cpu:
            raise SpecError("--load-on-cpu builds the whole model on the CPU; FSDP2 builds each rank's shards only",
                            hint="drop --load-on-cpu with --sharding fsdp/zero2/zero3")
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            load["before_allocated_bytes"] = torch.cuda.memory_allocated(dev)

        load["t0"] = time.perf_counter()
        built = build_for_sharding(spec, source, wrapper)
        stage("model load")                    # parameters still on the meta device: buffers only
        model = wrapper.wrap(built.model, device=dev)
        batch = wrapper.shard_inputs(to_device(built.batch, dev), built.seq_len)
    else:
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            load["before_allocated_bytes"] = torch.cuda.memory_allocated(dev)

        t0 = time.perf_counter()
        with quiet():
            built = build(spec, source, device="cpu" if (load_on_cpu and cuda) else dev)
            if source.kind == "factory" and spec.param_dtype != "float32":
                built.model, built.batch = _cast_factory(built.model, built.batch, getattr(torch, spec.param_dtype))
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
        load["t0"] = t0
        if wrapper is not None:
            stage("model load")
            model = wrapper.wrap(model, device=dev)
    # the seed profiler's phases: model load, then the wrap of a sharded job ("FSDP wrap", "DDP wrap")
    stage(f"{plan.sharding.family.upper()} wrap" if wrapper is not None and not fake else "model load")
    if not fake:
        # DP-SGD: the logical batch is the data loader's dataset, on the host; each physical batch is copied over
        batch = to_device(batch, torch.device("cpu") if plan.dp else dev)
    stage("data preparation")
    applied.append(f"model from {source.kind} source {source.name!r}")
    if spec.param_dtype != "float32":
        applied.append({"float16": "fp16", "bfloat16": "bf16"}[spec.param_dtype] + " weights")
    if spec.freeze:
        applied.append("freeze " + ",".join(spec.freeze))
    if spec.grad_checkpointing:
        applied.append({"selective": "selective ", "torchtitan-op": "torchtitan's selective op "}.get(spec.checkpoint_policy, "")
                       + "gradient checkpointing"
                       + ("" if spec.checkpoint_layers is None else f" of blocks {checkpoint_layers_text(spec.checkpoint_layers)}")
                       + {"selective": " (matmul, attention and conv outputs kept, the rest recomputed)",
                          "torchtitan-op": " (every other matmul's output, flash attention and reduce-scatter outputs kept, the "
                                           "rest recomputed)"}.get(spec.checkpoint_policy, ""))
    if spec.offload_layers is not None:
        applied.append(f"activation offload (save_on_cpu, pinned) of blocks {checkpoint_layers_text(spec.offload_layers)}")
    if source.kind != "factory":
        applied.append(f"attention {spec.attn}")
    if spec.use_cache is not None and source.kind != "factory":
        applied.append(f"config.use_cache = {spec.use_cache}")
    if spec.pad_fraction:
        applied.append(f"padding: the last {spec.pad_fraction:g} of each sample's tokens (attention_mask 0, labels -100)")
    if spec.liger:
        applied.append(liger_applied(spec, source, built.seq_len, fake))
    if spec.kbit_prep:
        applied.append("peft prepare_model_for_kbit_training (non-quantized parameters in fp32, gradient checkpointing "
                       "as peft enables it, input gradients)")
    if spec.lora_rank:
        applied.append(("QLoRA" if spec.qlora else "LoRA") + f" r={spec.lora_rank} alpha={spec.lora_alpha or 2 * spec.lora_rank:g}"
                       + (f" on {','.join(spec.lora_targets)}" if spec.lora_targets else "")
                       + (f" dropout {spec.lora_dropout:g}" if spec.lora_dropout else ""))
    if spec.qlora:
        applied.extend(_qlora_applied(model))
    if wrapper is not None:
        applied.extend(wrapper.applied)
        optimizer = wrapper.make_optimizer(spec, model, simulate=fake)
    else:
        optimizer = make_optimizer(spec, model, simulate=fake)
    optimizer = attach_ema(spec, model, optimizer, applied)   # --ema: diffusers' EMAModel (step/ema.py)
    if spec.compile and not fake:  # what the Trainer's torch_compile does: the model compiled, the optimizer not
        model = torch.compile(model)
        applied.append("torch.compile (inductor)")
    elif spec.compile:
        applied.append("torch.compile (simulated: AOTAutograd's partition of the fake step; kernel buffers modelled)")
    applied.append(f"optimizer {spec.optimizer}")
    stage("optimizer setup")
    if autocast is None:
        autocast, default_scaler = amp_setup(spec, dev)
        scaler = scaler if scaler is not None else (None if fake else default_scaler)
    if wrapper is not None and not wrapper.autocast:
        autocast = contextlib.nullcontext      # FSDP2's MixedPrecisionPolicy casts the parameters instead
    if spec.autocast_dtype and (wrapper is None or wrapper.autocast):
        applied.append(f"autocast {spec.autocast_dtype}" + (" + GradScaler" if plan.grad_scaler else ""))
    if spec.grad_accum > 1:
        applied.append(f"accumulation x{spec.grad_accum}")
    if spec.max_grad_norm and not plan.dp:
        applied.append(f"clip_grad_norm_ {spec.max_grad_norm:g}")
    if spec.step_kind is not None:
        applied.append(f"step kind {plan.kind.name} ({plan.kind.title})" if plan.kind.title else f"step kind {plan.kind.name}")
    if spec.hf_trainer and plan.kind.setup is not None:   # a Trainer subclass with a step of its own (TRL's)
        applied.append(f"{plan.kind.title} (the Trainer's decay/no-decay groups, config.use_cache = False)")
    elif spec.hf_trainer:
        applied.append("the Trainer's step (decay/no-decay groups" + (", fp32 outputs)" if spec.autocast_dtype else ")"))
    first = next((t for t in tensors(batch) if t.dim() > 0), None)
    if first is not None:
        micro = int(first.shape[0])   # a factory's batch has the samples it built
    loss_fn, forward_keys = built.loss_fn, built.forward_keys
    if spec.loss != "model":      # the user's criterion on the shifted logits: the model runs without labels
        loss_fn = criterion_loss(fp32=spec.loss == "criterion-fp32")
        forward_keys = frozenset(k for k in batch if k != "labels")
        applied.append(f"loss: cross-entropy on logits[:, :-1]{'.float()' if spec.loss == 'criterion-fp32' else ''} "
                       "against labels[:, 1:]")
    if plan.keep_outputs:
        applied.append("the loop holds the model's outputs through backward until its next forward returns")
    dp = None
    if plan.dp:
        dp = make_private(spec, model, optimizer, batch, device=dev, fake=fake, task=source.task, loss_fn=loss_fn, keep_outputs=plan.keep_outputs,
                          autocast=autocast, name=source.name)
        model, optimizer, micro = dp.model, dp.optimizer, dp.physical_batch
        applied.append(describe(dp))
        stage("privacy engine setup")
    p = PreparedStep(spec, source, dev, fake, model, batch, optimizer, loss_fn, autocast, scaler,
                     built.seq_len, built.image_size, micro, fake_mode, dp, applied, list(built.notes), load=load,
                     forward_keys=forward_keys, step_fn=built.step, target_len=built.target_len, wrapper=wrapper,
                     plan=plan)
    if plan.kind.setup is not None:
        plan.kind.setup(p)
    if not fake:
        _load_figures(p)
    return p


def _cast_factory(model, batch, dtype):
    """fp16/bf16 weights for a factory's model (transformers models are built in the dtype): its
    floating parameters and buffers, and the batch's floating tensors to match."""
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

    model = model.to(dtype)
    batch = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)
    return model, batch


def amp_setup(spec: TrainingSpec, device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for a spec's precision on ``device``:
    autocast for amp-*, a GradScaler for amp-fp16 on CUDA."""
    import torch  # heavy: torch, loaded on first use

    dev = torch.device(device)
    if spec.autocast_dtype:
        dt = getattr(torch, spec.autocast_dtype)

        def autocast():
            return torch.autocast(dev.type, dtype=dt)
    else:
        autocast = contextlib.nullcontext
    scaler = torch.amp.GradScaler(dev.type) if precision_of(spec).grad_scaler and dev.type == "cuda" else None
    return autocast, scaler


def _load_figures(p: PreparedStep) -> None:
    """What loading the model, batch and optimizer took on the device vs the parameters' own bytes."""
    import torch  # heavy: torch, loaded on first use

    load = p.load
    cuda = p.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(p.device)
    t0 = load.pop("t0", None)
    if t0 is not None:
        load["seconds"] = round(time.perf_counter() - t0, 3)
    params = [getattr(t, "_local_tensor", t) for t in p.model.parameters()]   # a rank's own shards under FSDP2
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


__all__ = ["PreparedStep", "prepare", "amp_setup", "materialize_on_fake", "fake_batch"]
