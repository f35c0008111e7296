"""``memlens.estimate_trainer(trainer)``: the peak memory of a built, not yet trained HF Trainer's step.

The step is the Trainer's own (``hf_trainer``), from its model, its ``TrainingArguments``
(:mod:`memlens.integrations.trainer_args`) and one micro-batch collated from its dataset, as its
dataloader would collate it. Nothing moves to the GPU and nothing of the model is copied: the
estimate runs on a skeleton of the model (every parameter and buffer a meta tensor of the same
shape, dtype and ``requires_grad``), so it works on a CPU-only machine and before ``train()``.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    r = memlens.estimate_trainer(trainer)          # a Result, like memlens.estimate
    r.peak_allocated_bytes

What the Trainer would do that this does not, refused in one line: a subclass's own
``compute_loss`` or a ``compute_loss_func`` (the loss would differ), DeepSpeed / FSDP.
"""
from __future__ import annotations

import collections
import copy
import json
from typing import Any

from ..core.errors import MemlensError
from ..core.spec import TrainingSpec
from ..estimator import estimate
from ..models.source import ModelSource
from .trainer_args import spec_fields


def weights_precision(model) -> str:
    """fp32 | bf16 | fp16: the dtype of the model's floating-point parameters (the most common one)."""
    import torch  # heavy: torch, loaded on first use

    count: collections.Counter = collections.Counter()
    for p in model.parameters():
        if p.is_floating_point():
            count[p.dtype] += p.numel()
    if not count:
        return "fp32"
    dt = count.most_common(1)[0][0]
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, "fp32")


def meta_skeleton(model):
    """A deep copy of ``model`` whose tensors are meta tensors (same shape, dtype, requires_grad):
    no weight is copied, whatever device the model is on. Forward wrappers that accelerate may
    have installed on the instance are dropped (the Trainer's step adds its own)."""
    import torch  # heavy: torch, loaded on first use

    memo: dict[int, Any] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        for b in mod._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        for v in vars(mod).values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = torch.empty(v.shape, dtype=v.dtype, device="meta")
    skel = copy.deepcopy(model, memo)
    for mod in skel.modules():
        if "forward" in vars(mod) and hasattr(mod, "_original_forward"):
            del mod.forward
    return skel


def sample_batch(trainer, batch_size: int) -> dict:
    """One micro-batch as the Trainer's dataloader collates it (unused columns removed), as meta tensors."""
    collator = trainer.data_collator
    if hasattr(trainer, "_get_collator_with_removed_columns"):
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    return collate_meta(trainer.train_dataset, collator, batch_size)


def collate_meta(ds, collator, batch_size: int) -> dict:
    """``collator`` over the first ``batch_size`` samples of ``ds``, as meta tensors."""
    import torch  # heavy: torch, loaded on first use

    if ds is None:
        raise MemlensError("the Trainer has no train_dataset", hint="pass train_dataset= to the Trainer (one batch is read)")
    try:
        n = len(ds)
    except TypeError:
        n = None
    if n is not None and n < batch_size:
        raise MemlensError(f"the train dataset has {n} samples, fewer than per_device_train_batch_size {batch_size}",
                           hint="estimate with a smaller batch or a larger dataset")
    samples = [ds[i] for i in range(batch_size)] if n is not None else [s for _, s in zip(range(batch_size), iter(ds))]
    batch = collator(samples)
    batch = dict(batch.items()) if hasattr(batch, "items") else batch
    if not isinstance(batch, dict):
        raise MemlensError(f"the Trainer's collator returned {type(batch).__name__}, not a dict of tensors", hint="collate to a dict")
    memo: dict[int, Any] = {}

    def meta(v):
        if isinstance(v, torch.Tensor):
            if id(v) not in memo:  # one tensor under two keys stays one
                memo[id(v)] = torch.empty(v.shape, dtype=v.dtype, device="meta")
            return memo[id(v)]
        return v

    return {k: meta(v) for k, v in batch.items()}


def trainer_spec_and_source(trainer, gpu: str | None = None):
    """(TrainingSpec, ModelSource) of a Trainer's step."""
    from transformers import Trainer  # heavy: transformers, loaded on first use

    if type(trainer).compute_loss is not Trainer.compute_loss or getattr(trainer, "compute_loss_func", None) is not None:
        raise MemlensError("the Trainer computes its own loss (a compute_loss override or compute_loss_func), which memlens does not run",
                           hint="estimate the model's own loss: memlens.estimate with the hand-typed spec")
    return spec_and_source(trainer.model, trainer.args, lambda bs: sample_batch(trainer, bs), gpu)


def spec_and_source(model, args, batch_of, gpu: str | None = None):
    """(TrainingSpec, ModelSource) from a model, its TrainingArguments and ``batch_of(batch_size)``
    returning one collated micro-batch of meta tensors."""
    fields = spec_fields(json.loads(args.to_json_string()), weights_precision(model))
    name = f"trainer:{type(getattr(model, 'base_model', model)).__name__}"
    spec = TrainingSpec(model=name, **fields, **({"gpu": gpu} if gpu else {}))

    def factory(spec):   # takes the spec, so its batch size reaches the batch
        return meta_skeleton(model), batch_of(spec.batch_size)

    return spec, ModelSource(name, "module", "factory", config=getattr(model, "config", None), factory=factory)


def estimate_trainer(trainer, gpu: str | None = None, steps: int = 2):
    """Estimate ``trainer``'s training step (a Result, as :func:`memlens.estimate` returns).

    ``gpu``: the GPU the estimate is for (default h100; :mod:`memlens.core.gpus`)."""
    spec, source = trainer_spec_and_source(trainer, gpu)
    return estimate(spec, steps=steps, source=source)


def estimate_parts(model, args, dataset, collate_fn, gpu: str | None = None, steps: int = 2):
    """The same estimate from a model, its TrainingArguments, a dataset and a collate function
    (what the Trainer's callbacks see: ``train_dataloader.dataset`` / ``.collate_fn``)."""
    spec, source = spec_and_source(model, args, lambda bs: collate_meta(dataset, collate_fn, bs), gpu)
    return estimate(spec, steps=steps, source=source)


__all__ = ["estimate_trainer", "estimate_parts", "trainer_spec_and_source", "meta_skeleton", "weights_precision"]
