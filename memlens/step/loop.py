"""The reference training step that `estimate` simulates and `profile` measures.

Two flavours share one loop; ``hf_trainer`` picks the Trainer's.

Plain PyTorch (the default): the forward's outputs (logits included) are dropped as soon as the
loss is taken, so only the loss lives into backward::

    for each of grad_accum micro-batches:
        with autocast: loss = model(**batch).loss / grad_accum
        scaler.scale(loss).backward()
    clip_grad_norm_ (if max_grad_norm; after scaler.unscale_)
    scaler.step(optimizer) (or optimizer.step()); optimizer.zero_grad(set_to_none=True)

The Hugging Face Trainer (``hf_trainer=True``), as transformers 5.23 (installed here; the GPU
machine's 5.17 runs the same order) with accelerate 1.15 runs it (transformers/trainer.py
``_run_epoch`` / ``training_step`` / ``_clip_grad_norm``; accelerate/accelerator.py
``prepare_model``, ``backward``, ``clip_grad_norm_``)::

    for each of grad_accum micro-batches:                          # Trainer._run_epoch
        outputs = model(**batch)       # accelerate wraps forward: autocast(forward), then
                                       # convert_outputs_to_fp32 (logits etc. copied to fp32)
        loss = outputs.loss / grad_accum                            # Trainer.training_step
        accelerator.backward(loss)     # scaler.scale(loss).backward() under fp16
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)  # unscale_gradients, then
                                                                    # torch.nn.utils.clip_grad_norm_
    optimizer.step()                   # AcceleratedOptimizer: scaler.step + scaler.update under fp16
    lr_scheduler.step(); model.zero_grad()                          # set_to_none=True

The Trainer also sets ``model.config.use_cache = args.use_cache`` (False by default: no key/value
cache in the outputs), which memlens' builder applies with ``hf_trainer`` (models/build.py), and
builds its optimizer over a decay and a no-decay group (step/optim.py ``param_groups``).
The loss of a custom loss function (a factory's ``loss_fn``) is computed outside autocast there,
as the Trainer's ``compute_loss`` runs outside accelerate's wrapped forward. Not modelled: the
Trainer's 512-byte running-loss scalar and ``num_items_in_batch`` (a scalar; the loss is then a
sum divided by it instead of a mean: the same buffers).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from .ema import update as ema_update
from .optim import clip_gradients

PhaseHook = Callable[[str], None]


def call_model(model, batch, forward_keys: frozenset[str] | None = None):
    """The model's forward on a batch: a dict as keyword arguments (only the keys ``forward``
    takes when ``forward_keys`` is given: the rest are for the loss function), a tuple or list
    as positional arguments, anything else as the one argument."""
    if isinstance(batch, dict):
        if forward_keys is not None:
            return model(**{k: v for k, v in batch.items() if k in forward_keys})
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_of(out, batch, loss_fn: Callable | None = None):
    """A scalar loss from the model's output: ``loss_fn(out, batch)``, the output's ``loss``, or
    (a plain tensor output, no loss function) its mean, memory-wise like any scalar loss."""
    if loss_fn is not None:
        loss = loss_fn(out, batch)
        return loss.mean() if loss.dim() == 1 else loss   # one loss per sample (as ghost clipping needs): their mean
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        t = out[0] if isinstance(out, (tuple, list)) else out
        loss = t.float().mean()
    return loss


def shifted_logits(out, batch, fp32: bool):
    """A user's causal-LM criterion input: ``logits[:, :-1].reshape(-1, V)`` (a copy: the slice is not
    contiguous), upcast with ``.float()`` when ``fp32``, and the targets ``labels[:, 1:].reshape(-1)``."""
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    V = logits.shape[-1]
    x = logits[:, :-1].reshape(-1, V)
    if fp32:
        x = x.float()
    return x, batch["labels"][:, 1:].reshape(-1)


def criterion_loss(fp32: bool) -> Callable:
    """``loss_fn(out, batch)`` of ``--loss criterion`` / ``criterion-fp32``: cross-entropy on the shifted logits."""
    import torch  # heavy: torch, loaded on first use

    def loss_fn(out, batch):
        x, target = shifted_logits(out, batch, fp32)
        return torch.nn.functional.cross_entropy(x, target)

    loss_fn.__name__ = "criterion_fp32" if fp32 else "criterion"
    return loss_fn


def held_part(out, loss_fn: Callable | None):
    """What a loop that keeps the model's outputs holds: ``logits = model(x).logits`` under a criterion of
    its own, the whole output (``outputs = model(**batch)``) otherwise."""
    if loss_fn is not None and getattr(loss_fn, "__name__", "") in ("criterion", "criterion_fp32"):
        return out.logits if hasattr(out, "logits") else out["logits"]
    return out


def forward_loss(model, batch, loss_fn: Callable | None = None, forward_keys: frozenset[str] | None = None):
    """Run the model on a batch and return a scalar loss (outputs are not kept)."""
    return loss_of(call_model(model, batch, forward_keys), batch, loss_fn)


def outputs_to_fp32(out):
    """What accelerate's ``convert_outputs_to_fp32`` does to a forward's outputs under mixed
    precision (accelerate/utils/operations.py ``convert_to_fp32``): every fp16/bf16 tensor in a
    (nested) dict, tuple or list is replaced by ``.float()``; other objects are left alone."""
    import torch  # heavy: torch, loaded on first use

    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if isinstance(out, dict):  # ModelOutput is an OrderedDict: replace in place, the half tensor is dropped
        for k in list(out.keys()):
            out[k] = outputs_to_fp32(out[k])
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(outputs_to_fp32(v) for v in out) if not hasattr(out, "_fields") else type(out)(*(outputs_to_fp32(v) for v in out))
    return out


def train_step(
    model,
    optimizer,
    batch,
    *,
    grad_accum: int = 1,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    scaler=None,
    loss_fn: Callable | None = None,
    on_phase: PhaseHook = lambda name: None,
    max_grad_norm: float | None = None,
    hf_trainer: bool = False,
    forward_keys: frozenset[str] | None = None,
    step_fn: Callable | None = None,
    holder: list | None = None,
) -> float | None:
    """One optimizer step over ``grad_accum`` micro-batches (the same batch reused).

    ``on_phase`` is called with "forward", "backward", "optimizer" and "end" as the step moves on
    (gradient clipping belongs to "optimizer"). ``step_fn(model, batch) -> loss`` replaces the
    forward and loss (a factory's own step). ``holder``: a loop that keeps the model's outputs
    (``--keep-outputs``): they go into ``holder`` when the forward returns, replacing (freeing) the
    previous micro-batch's, and stay there through backward and the optimizer step. Returns the loss
    of the last micro-batch, detached (None on fake tensors' callers that ignore it).
    """

    last = None
    for _ in range(grad_accum):
        on_phase("forward")
        if step_fn is not None:
            with autocast():
                loss = step_fn(model, batch)
        elif hf_trainer:
            with autocast():
                out = call_model(model, batch, forward_keys)
            if autocast is not contextlib.nullcontext:
                out = outputs_to_fp32(out)
            loss = loss_of(out, batch, loss_fn)
            del out
        elif holder is not None:
            with autocast():
                out = call_model(model, batch, forward_keys)
                holder[:] = [held_part(out, loss_fn)]   # `logits = model(x).logits`: the previous one goes now
                loss = loss_of(out, batch, loss_fn)
            del out
        else:
            with autocast():
                loss = forward_loss(model, batch, loss_fn, forward_keys)
        if grad_accum > 1:
            loss = loss / grad_accum
        on_phase("backward")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        kept = loss.detach()
        del loss                # what the graph still held goes first,
        last = kept             # then the previous micro-batch's loss: the last thing a micro-batch frees
        del kept
    optimizer_step(optimizer, model=model, max_grad_norm=max_grad_norm, scaler=scaler, on_phase=on_phase)
    return last


def optimizer_step(optimizer, *, model=None, max_grad_norm: float | None = None, scaler=None,
                   on_phase: PhaseHook = lambda name: None) -> None:
    """The end of :func:`train_step`: the optimizer phase (clipping with ``max_grad_norm``,
    ``scaler.step`` or ``optimizer.step``, then ``zero_grad(set_to_none=True)``) and the "end"
    mark. The estimator runs it alone for a step whose forward and backward it wrote from the
    first step's (memlens.estimator.periodic)."""
    on_phase("optimizer")
    clip_gradients(model, max_grad_norm, scaler, optimizer)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ema_update(optimizer)   # --ema: diffusers' EMAModel.step, after zero_grad as its scripts run it (step/ema.py)
    on_phase("end")
