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
"""
from __future__ import annotations

from pathlib import Path

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from ..measure.profiler import Profiler


class MemlensCallback(Callback):
    """Profile ``fit()``'s training; ``.result`` is the Result once training ends."""

    def __init__(self, mode: str = "phases", out_dir: str | Path | None = None):
        self.mode = mode
        self.out_dir = out_dir
        self.profiler: Profiler | None = None
        self.result = None

    def on_train_start(self, trainer, pl_module):
        opts = trainer.optimizers
        opt = opts[0] if opts else None
        self.profiler = Profiler(pl_module, opt, device=pl_module.device, mode=self.mode, optimizer_hooks=False,
                                 spec={"model": type(pl_module).__name__})
        self.profiler.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
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

    def on_train_end(self, trainer, pl_module):
        if self.profiler is None:
            return
        self.result = self.profiler.stop()     # every rank: rank 0 gets every rank's result gathered
        self.result.data["integration"] = "lightning.Trainer"
        if self.out_dir is not None and getattr(trainer, "is_global_zero", True):
            from ..report.profile_report import write_report

            write_report(self.result, self.out_dir)
