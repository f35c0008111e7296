"""OOM handling inside a Lightning ``Trainer``: the guard's report and adaptive micro-batching (used
by :class:`memlens.integrations.lightning.MemlensCallback` with ``guard=`` / ``adaptive=True``).

Lightning (automatic optimization) calls ``training_step(batch, batch_idx)`` inside the optimizer's
closure, then zeroes the gradients (at the first batch of an accumulation window), divides the
returned loss by ``accumulate_grad_batches`` and runs its backward. With ``adaptive=True`` memlens
wraps the module's ``training_step``: it runs the batch as micro-batches,
each through the user's ``training_step``, weighs each loss by its share of the batch's rows, divides
by ``accumulate_grad_batches`` and runs its backward itself (through the precision plugin's
GradScaler for ``16-mixed``), outside autocast as Lightning does; it returns the batch's loss as a
fresh leaf, so Lightning's own backward has nothing left to do. Since the parts' gradients exist
before Lightning would zero them, the module's ``optimizer_zero_grad`` runs at the start of the
window instead (before the first part) and Lightning's own call does nothing. The batch size of the dataloader,
``accumulate_grad_batches``, gradient clipping and the optimizer step stay Lightning's.

Limits: automatic optimization only, one process (both refused otherwise); ``training_step`` runs
once per micro-batch (``self.log`` calls log each part); what it returns besides ``loss`` is dropped;
a ``LightningModule.backward`` override is not used for the parts; a loss that is not a mean over
rows needs rows of equal weight (tokens of equal count) to be split exactly.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ..core.errors import MemlensError
from ..core.payloads import AdaptivePayload
from ..core.result import Result
from ..explore.adaptive import MicroBatchPolicy, SplitRunner, TrendGuard
from ..measure.guard import Guard, is_oom


class LightningOom:
    """Installs the guard and/or adaptive micro-batching on one LightningModule for one ``fit()``."""

    def __init__(self, trainer, pl_module, *, adaptive: bool, guard: Guard | None, micro_batch: int | None = None,
                 min_micro_batch: int = 1, trend: bool = True, lookahead: int = 20, restore_rng: bool = True,
                 on_change=None):
        self.trainer = trainer
        self.module = pl_module
        self.adaptive = adaptive
        self.guard = guard
        self.policy = MicroBatchPolicy(micro_batch, min_micro_batch, on_change)
        self.trend = TrendGuard(lookahead) if adaptive and trend else None
        self.runner = SplitRunner(self.policy, self._forward_backward, self._zero_grad, restore_rng=restore_rng,
                                  step_fn=lambda: trainer.global_step + 1)
        self._orig = None
        self._orig_zero = None
        self._rest: tuple = ((), {})

    def install(self) -> "LightningOom":
        if self.adaptive:
            if getattr(self.trainer, "world_size", 1) > 1:
                raise MemlensError(f"adaptive micro-batching runs one process, this Trainer has {self.trainer.world_size}",
                                   hint="drop adaptive=True (ranks would have to change their micro-batch together)")
            if not self.module.automatic_optimization:
                raise MemlensError("adaptive micro-batching needs Lightning's automatic optimization",
                                   hint="with manual optimization, use memlens.adaptive_batch() in your training_step")
            self._orig = self.module.training_step
            self.module.training_step = self._training_step
            self._orig_zero = self.module.optimizer_zero_grad
            self.module.optimizer_zero_grad = lambda *a, **k: None
        if self.guard is not None:
            self.guard.start()
        return self

    def remove(self) -> None:
        for name in ("training_step", "optimizer_zero_grad"):
            if self._orig is not None and name in vars(self.module):
                delattr(self.module, name)
        self._orig = self._orig_zero = None
        if self.guard is not None:
            self.guard.stop()

    def batch_start(self, batch_idx: int) -> None:
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            if self._orig_zero is not None:
                opts = self.trainer.optimizers
                self._orig_zero(self.trainer.current_epoch, batch_idx, opts[0] if opts else None)
            self.runner.new_window()

    def batch_end(self, step: int) -> None:
        if self.trend is None:
            return
        why = self.trend.after_step(step)
        if why and self.policy.halve(step, "trend", why):
            self.trend.reset()

    def on_exception(self, e: BaseException) -> None:
        if self.guard is not None and is_oom(e):
            self.guard.handle(e)
        self.remove()

    # ------------------------------------------------------------ the wrapped training_step
    def _training_step(self, batch, *args, **kwargs):
        import torch  # heavy: torch, loaded on first use

        self._rest = (args, kwargs)
        try:
            total = self.runner.run(batch)
        finally:
            self._rest = ((), {})
        if total is None:
            return None
        return torch.as_tensor(total).detach().clone().requires_grad_(True)

    def _forward_backward(self, micro, factor: float) -> Any:
        import torch  # heavy: torch, loaded on first use

        args, kwargs = self._rest
        out = self._orig(micro, *args, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None:
            return None
        scaled = loss * (factor / self.trainer.accumulate_grad_batches)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.runner.backward_starts()
        with torch.autocast(device_type=loss.device.type, enabled=False):
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss.detach() * factor

    def _zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    @property
    def result(self) -> Result:
        rows = self.policy.last_rows
        data = AdaptivePayload(micro_batch=self.policy.micro_batch or rows, batch_size=rows,
                               accumulate_grad_batches=self.trainer.accumulate_grad_batches,
                               ooms_recovered=self.runner.ooms, windows_redone=self.runner.replays,
                               changes=[asdict(c) for c in self.policy.changes], integration="lightning.Trainer",
                               guard_report=[str(p) for p in self.guard.paths] if self.guard is not None else None)
        return Result(verb="adaptive", data=data, notes=[c.describe() for c in self.policy.changes])
