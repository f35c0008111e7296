"""The reference training step that `estimate` simulates and `profile` measures.

It is what the Hugging Face Trainer does: the forward's outputs (logits included) are dropped
as soon as the loss is taken, so only the loss lives into backward.

    for each of grad_accum micro-batches:
        with autocast: loss = model(**batch).loss / grad_accum
        scaler.scale(loss).backward()
    scaler.step(optimizer) (or optimizer.step()); optimizer.zero_grad(set_to_none=True)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

PhaseHook = Callable[[str], None]


def forward_loss(model, batch, loss_fn: Callable | None = None):
    """Run the model on a batch and return a scalar loss (outputs are not kept)."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if loss_fn is not None:
        return loss_fn(out, batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        # a plain tensor output with no loss function: reduce it (memory-wise like any scalar loss)
        t = out[0] if isinstance(out, (tuple, list)) else out
        loss = t.float().mean()
    return loss


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
) -> float | None:
    """One optimizer step over ``grad_accum`` micro-batches (the same batch reused).

    ``on_phase`` is called with "forward", "backward", "optimizer" and "end" as the step moves on.
    Returns the loss of the last micro-batch as a float when it has data (None on fake tensors).
    """
    last = None
    for _ in range(grad_accum):
        on_phase("forward")
        with autocast():
            loss = forward_loss(model, batch, loss_fn)
            if grad_accum > 1:
                loss = loss / grad_accum
        on_phase("backward")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        last = loss.detach()
        del loss
    optimizer_step(optimizer, scaler=scaler, on_phase=on_phase)
    return last


def optimizer_step(optimizer, *, scaler=None, on_phase: PhaseHook = lambda name: None) -> None:
    """The end of :func:`train_step`: the optimizer phase (``scaler.step`` or ``optimizer.step``,
    then ``zero_grad(set_to_none=True)``) and the "end" mark. The estimator runs it alone for a
    step whose forward and backward it wrote from the first step's (memlens.estimator.periodic)."""
    on_phase("optimizer")
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    on_phase("end")
