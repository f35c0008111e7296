"""OOM handling inside a Hugging Face ``Trainer``: the guard's report and adaptive micro-batching
(used by :class:`memlens.integrations.hf.MemlensCallback` with ``guard=`` / ``adaptive=True``).

The mechanism, and why. ``auto_find_batch_size`` (accelerate's ``find_executable_batch_size``)
restarts the whole inner training loop with half the per-device batch and the same
``gradient_accumulation_steps``: the effective batch halves, the learning-rate schedule is rebuilt,
and the steps before the OOM are lost. MosaicML Composer's automatic micro-batching keeps the device
batch and splits it into micro-batches. memlens does the latter inside the Trainer's own loop: it
wraps ``trainer.training_step`` (the Trainer calls it once per dataloader batch, accumulating
``gradient_accumulation_steps`` of them per optimizer step) and runs each batch it gets as micro-
batches, each through the Trainer's own ``training_step`` (its ``compute_loss``, loss scaling and
``accelerator.backward``). So the dataloader's batch size, ``gradient_accumulation_steps``, the
optimizer step, the scheduler and the logged loss stay the Trainer's; the effective batch is
unchanged, and only the micro-batch that runs at once halves.

Loss scaling. When the loss is normalized over the whole accumulated batch (transformers >= 4.46
with a model that accepts ``num_items_in_batch``, or a ``compute_loss_func``), each micro-batch's
loss already is its share: it runs as it is. Otherwise the Trainer averages each batch's loss: each
micro-batch's loss is weighted by its share of the batch's label tokens (counted as the Trainer
counts them: ``labels != -100``, shifted for causal LMs) or rows, through a wrapper of
``trainer.compute_loss``. A Trainer subclass whose ``training_step`` does not call
``compute_loss`` cannot be weighted: it is refused at its first split, with one line.

Limits: one process on one GPU (DDP, FSDP, DeepSpeed and DataParallel are refused: ranks would have
to split in step); tensors are split along their first dimension when it is the batch's; a model
whose forward mixes rows (batch norm) sees smaller batches.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict
from typing import Any

from ..core.errors import MemlensError
from ..core.payloads import AdaptivePayload
from ..core.result import Result
from ..explore.adaptive import (
    MicroBatchPolicy,
    SplitRunner,
    TrendGuard,
    batch_rows,
    start_from_fit,
)
from ..measure.guard import Guard, guard_from_option, is_oom


def find_trainer(start_depth: int = 2):
    """The ``transformers.Trainer`` whose callback is running (callbacks are not given it): the
    ``self`` of a calling frame."""
    from transformers import Trainer  # heavy: transformers, loaded on first use

    frame = inspect.currentframe()
    try:
        for _ in range(start_depth):
            frame = frame.f_back if frame is not None else None
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer):
                return obj
            frame = frame.f_back
    finally:
        del frame
    return None


def refuse_distributed(trainer) -> None:
    a = trainer.args
    why = None
    if getattr(a, "world_size", 1) > 1:
        why = f"{a.world_size} processes"
    elif getattr(a, "n_gpu", 1) > 1:
        why = f"DataParallel over {a.n_gpu} GPUs"
    elif getattr(trainer, "is_deepspeed_enabled", False):
        why = "DeepSpeed"
    elif getattr(trainer, "is_fsdp_enabled", False):
        why = "FSDP"
    if why:
        raise MemlensError(f"adaptive micro-batching runs one process on one GPU, this Trainer uses {why}",
                           hint="drop adaptive=True (ranks would have to change their micro-batch together)")


class TrainerOom:
    """Installs the guard and/or adaptive micro-batching on one Trainer for one ``train()``."""

    def __init__(self, trainer, *, adaptive: bool, guard: Guard | None, micro_batch: int | None = None,
                 min_micro_batch: int = 1, trend: bool = True, lookahead: int = 20, restore_rng: bool = True,
                 on_change=None):
        self.trainer = trainer
        self.guard = guard
        self.adaptive = adaptive
        self.policy = MicroBatchPolicy(micro_batch, min_micro_batch, on_change)
        self.trend = TrendGuard(lookahead) if adaptive and trend else None
        self.runner = SplitRunner(self.policy, self._forward_backward, self._zero_grad, weight_fn=self._weight,
                                  normalized=self._normalized, restore_rng=restore_rng,
                                  step_fn=lambda: trainer.state.global_step + 1)
        self._orig_step = None
        self._orig_loss = None
        self._orig_opt_step = None
        self._factor = 1.0
        self._loss_calls = 0
        self._model = None
        self._num_items = None
        self._shift: bool | None = None
        self._extra: tuple = ((), {})
        self.start_fit: dict | None = None

    # ------------------------------------------------------------ install / remove
    def install(self) -> "TrainerOom":
        t = self.trainer
        if self.adaptive:
            refuse_distributed(t)
        self._orig_step = t.training_step
        t.training_step = self._training_step
        if self.adaptive:
            self._orig_loss = t.compute_loss
            t.compute_loss = self._compute_loss
        opt = getattr(t, "optimizer", None)
        if self.guard is not None and opt is not None:
            self._orig_opt_step = opt.step
            opt.step = self._optimizer_step
        if self.guard is not None:
            self.guard.start()
        return self

    def remove(self) -> None:
        t = self.trainer
        for name, orig in (("training_step", self._orig_step), ("compute_loss", self._orig_loss)):
            if orig is not None and name in vars(t):
                delattr(t, name)
        opt = getattr(t, "optimizer", None)
        if self._orig_opt_step is not None and opt is not None and "step" in vars(opt):
            delattr(opt, "step")
        self._orig_step = self._orig_loss = self._orig_opt_step = None
        if self.guard is not None:
            self.guard.stop()

    @property
    def result(self) -> Result:
        """The changes of the micro-batch and the recoveries (a Result, verb "adaptive")."""
        rows = self.policy.last_rows
        data = AdaptivePayload(micro_batch=self.policy.micro_batch or rows, per_device_batch=rows,
                               accumulation_per_batch=self.policy.accumulation(rows) if rows else None,
                               gradient_accumulation_steps=self.trainer.args.gradient_accumulation_steps,
                               ooms_recovered=self.runner.ooms, windows_redone=self.runner.replays,
                               changes=[asdict(c) for c in self.policy.changes], start_fit=self.start_fit,
                               integration="transformers.Trainer",
                               guard_report=[str(p) for p in self.guard.paths] if self.guard is not None else None)
        return Result(verb="adaptive", data=data, notes=[c.describe() for c in self.policy.changes])

    # ------------------------------------------------------------ callback moments
    def step_begin(self) -> None:
        self.runner.new_window()

    def step_end(self, step: int) -> None:
        if self.trend is None:
            return
        why = self.trend.after_step(step)
        if why and self.policy.halve(step, "trend", why):
            self.trend.reset()

    # ------------------------------------------------------------ wrappers
    def _training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        try:
            if not self.adaptive:
                return self._orig_step(model, inputs, num_items_in_batch, *args, **kwargs)
            self._model, self._num_items = model, num_items_in_batch
            self._extra = (args, kwargs)
            return self.runner.run(inputs)
        except Exception as e:
            self._on_error(e)
            raise
        finally:
            self._model = self._num_items = None
            self._extra = ((), {})

    def _optimizer_step(self, *args, **kwargs):
        try:
            return self._orig_opt_step(*args, **kwargs)
        except Exception as e:
            self._on_error(e)
            raise

    def _on_error(self, e: BaseException) -> None:
        """An error leaves the training step: train() ends without on_train_end, so clean up here."""
        if self.guard is not None and is_oom(e):
            self.guard.handle(e)
        self.remove()

    def _forward_backward(self, micro, factor: float):
        calls = self._loss_calls
        self._factor = factor
        try:
            args, kwargs = self._extra
            loss = self._orig_step(self._model, micro, self._num_items, *args, **kwargs)
        finally:
            self._factor = 1.0
        if factor != 1.0 and self._loss_calls == calls:
            raise MemlensError("this Trainer's training_step does not call compute_loss, so memlens cannot weigh the "
                               "loss of a part of the batch", hint="drop adaptive=True, or call self.compute_loss in training_step")
        return loss

    def _compute_loss(self, model, inputs, *args, **kwargs):
        self._loss_calls += 1
        out = self._orig_loss(model, inputs, *args, **kwargs)
        if self._factor != 1.0:
            if isinstance(out, tuple):
                out = (out[0] * self._factor, *out[1:])
            else:
                out = out * self._factor
        self.runner.backward_starts()
        return out

    def _zero_grad(self) -> None:
        m = self._model if self._model is not None else self.trainer.model
        m.zero_grad(set_to_none=True)

    def _normalized(self) -> bool:
        """Is the loss already each batch's share of the accumulated batch (the Trainer's own rule)?"""
        t = self.trainer
        scaled = getattr(t, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return self._num_items is not None and (bool(getattr(t, "model_accepts_loss_kwargs", False))
                                                or getattr(t, "compute_loss_func", None) is not None)

    def _shifts(self) -> bool:
        """Does the model's loss shift labels (a causal LM: position i predicts label i + 1)? The
        Trainer's own flag reads ``model.loss_type``, None for most models; the loss function says."""
        if self._shift is None:
            t = self.trainer
            self._shift = bool(getattr(t, "_loss_shifts_labels", False))
            if not self._shift:
                try:
                    from transformers.loss.loss_utils import ForCausalLMLoss  # heavy: transformers, loaded on first use

                    m = t.accelerator.unwrap_model(t.model)
                    m = getattr(getattr(m, "base_model", None), "model", m) if hasattr(m, "peft_config") else m
                    self._shift = getattr(m, "loss_function", None) is ForCausalLMLoss and not getattr(
                        getattr(m, "config", None), "is_encoder_decoder", False)
                except Exception:  # noqa: BLE001 - older transformers: the Trainer's flag alone
                    self._shift = False
        return self._shift

    def _weight(self, part: Any) -> float:
        """A part's weight in a batch-averaged loss: its label tokens as the Trainer counts them, else rows."""
        import torch  # heavy: torch, loaded on first use

        labels = part.get("shift_labels") if isinstance(part, dict) else None
        if labels is None and isinstance(part, dict) and isinstance(part.get("labels"), torch.Tensor):
            labels = part["labels"]
            if labels.dim() > 1 and self._shifts():
                labels = labels[..., 1:]
        if isinstance(labels, torch.Tensor) and labels.dim() > 1:
            return float(labels.ne(-100).sum().item())
        return float(batch_rows(part))


def start_oom_handling(options: dict, model, optimizer) -> TrainerOom:
    """What ``MemlensCallback(guard=..., adaptive=...)`` does at ``on_train_begin``."""
    trainer = options.get("trainer") or find_trainer(start_depth=2)
    if trainer is None:
        raise MemlensError("MemlensCallback(guard=/adaptive=) could not find the Trainer it runs in",
                           hint="pass it: MemlensCallback(adaptive=True, trainer=trainer)")
    g = guard_from_option(options.get("guard"), model, optimizer, options.get("spec"))
    oom = TrainerOom(trainer, adaptive=bool(options.get("adaptive")), guard=g, micro_batch=options.get("micro_batch"),
                     min_micro_batch=options.get("min_micro_batch", 1), trend=options.get("trend", True),
                     lookahead=options.get("lookahead", 20))
    spec = options.get("spec")
    if oom.adaptive and spec is not None and options.get("micro_batch") is None:
        # start from the estimate: memlens.fit's largest micro-batch for one per-device batch

        rows = trainer.args.per_device_train_batch_size
        oom.start_fit = start_from_fit(oom.policy, spec.replace(batch_size=rows, grad_accum=1), None, rows)
    return oom.install()
