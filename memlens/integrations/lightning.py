"""memlens profile inside a Lightning ``Trainer``: a ``Callback``.

    from memlens.integrations.lightning import MemlensCallback
    cb = MemlensCallback(out_dir="prof/")
    lightning.Trainer(callbacks=[cb], max_steps=20).fit(module, loader)
    cb.result.by_phase                              # the profile Result; prof/ has report.html

Lightning runs forward and backward inside ``optimizer.step(closure)``, so the phases come from
Lightning's own hooks: on_train_batch_start (forward), on_before_backward, on_before_optimizer_step,
on_train_batch_end (end of the step). Works with ``lightning`` or ``pytorch_lightning``.

With several devices (DDP, FSDP strategies) every rank profiles itself; at the end rank 0 gathers
every rank's result (``result.data["ranks"]``) and writes the report.

At an OOM (:mod:`.lightning_oom`): ``guard=True`` (or a directory, or a ``memlens.guard(...)``)
writes the guard's report when an OOM ends ``fit()``; ``adaptive=True`` runs each batch in smaller
micro-batches when it runs out of memory, with the same effective batch:

    MemlensCallback(profile=False, guard="oom/", adaptive=True)
"""
from __future__ import annotations

from pathlib import Path

from ..measure.guard import guard_from_option
from ..models.checkpoint import apply, plan_of
from ..report.profile_report import write_report
from .lightning_oom import LightningOom

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from ..measure.profiler import Profiler


class MemlensCallback(Callback):
    """Profile ``fit()``'s training; ``.result`` is the Result once training ends."""

    def __init__(self, mode: str = "phases", out_dir: str | Path | None = None, *, profile: bool = True,
                 guard=False, adaptive: bool = False, micro_batch: int | None = None, min_micro_batch: int = 1,
                 trend: bool = True, lookahead: int = 20, spec=None, apply_plan=None):
        self.mode = mode
        # a memlens.apply plan (a dict, a `fit --least-recompute` Result or its result.json), applied to the
        # LightningModule when training starts; checked now
        self.apply_plan = None if apply_plan is None else plan_of(apply_plan)
        self.applied = None
        self.out_dir = out_dir
        self.profile = profile
        self.profiler: Profiler | None = None
        self.result = None
        self.oom_options = dict(guard=guard, adaptive=adaptive, micro_batch=micro_batch, min_micro_batch=min_micro_batch,
                                trend=trend, lookahead=lookahead, spec=spec)
        self.oom = None   # lightning_oom.LightningOom while training, with guard= or adaptive=True

    def on_train_start(self, trainer, pl_module):
        if self.apply_plan is not None:
            self.applied = apply(pl_module, self.apply_plan)
        opts = trainer.optimizers
        opt = opts[0] if opts else None
        o = self.oom_options
        if o["guard"] or o["adaptive"]:
            self.oom = LightningOom(trainer, pl_module, adaptive=bool(o["adaptive"]),
                                    guard=guard_from_option(o["guard"], pl_module, opt, o["spec"]), micro_batch=o["micro_batch"],
                                    min_micro_batch=o["min_micro_batch"], trend=o["trend"], lookahead=o["lookahead"]).install()
        if not self.profile:
            return
        self.profiler = Profiler(pl_module, opt, device=pl_module.device, mode=self.mode, optimizer_hooks=False,
                                 spec={"model": type(pl_module).__name__})
        self.profiler.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.oom is not None:
            self.oom.batch_start(batch_idx)
        if self.profiler is not None:
            self.profiler.phase("forward")

    def on_before_backward(self, trainer, pl_module, loss):
        if self.profiler is not None:
            self.profiler.phase("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.profiler is not None:
            self.profiler.phase("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profiler is not None:
            self.profiler.phase("end")
        if self.oom is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.oom.batch_end(trainer.global_step)

    def on_exception(self, trainer, pl_module, exception):
        if self.oom is not None:
            self.oom.on_exception(exception)

    def on_train_end(self, trainer, pl_module):
        if self.profiler is not None:     # first: the guard may own the allocator history the profiler reads
            self.result = self.profiler.stop()    # every rank: rank 0 gets every rank's result gathered
        if self.oom is not None:
            self.oom.remove()
        if self.profiler is None:
            return
        self.result.data["integration"] = "lightning.Trainer"
        if self.out_dir is not None and getattr(trainer, "is_global_zero", True):
            write_report(self.result, self.out_dir)
