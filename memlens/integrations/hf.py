"""memlens profile inside a Hugging Face ``Trainer``: a ``TrainerCallback``.

    from memlens.integrations.hf import MemlensCallback
    cb = MemlensCallback(out_dir="prof/")          # mode="full" for categories and modules
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    cb.result.peak_allocated_bytes                 # the profile Result; prof/ has report.html

Phases: forward and backward come from hooks on the model; the optimizer phase starts at
``on_pre_optimizer_step`` and the step ends at ``on_step_end`` (after zero_grad), so the
accelerate-wrapped optimizer needs no hook. transformers is imported only when this module is.

Under torchrun (DDP, FSDP through accelerate) every rank profiles itself; at the end rank 0
gathers every rank's result (``result.data["ranks"]``, the top-level peak being the rank that
peaks) and writes the report; the other ranks keep their own result.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..measure.profiler import Profiler


class MemlensCallback(TrainerCallback):
    """Profile the whole ``train()``; ``.result`` is the Result once training ends."""

    def __init__(self, mode: str = "phases", out_dir: str | Path | None = None, device: Any = None):
        self.mode = mode
        self.out_dir = out_dir
        self.device = device
        self.profiler: Profiler | None = None
        self.result = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        self.profiler = Profiler(model, opt, device=self.device, mode=self.mode, optimizer_hooks=False,
                                 spec={"model": type(model).__name__ if model is not None else None, "batch_size": args.per_device_train_batch_size,
                                       "grad_accum": args.gradient_accumulation_steps})
        self.profiler.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.phase("end")

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is None:
            return
        self.result = self.profiler.stop()     # every rank: rank 0 gets every rank's result gathered
        self.result.data["integration"] = "transformers.Trainer"
        if self.out_dir is not None and getattr(state, "is_world_process_zero", True):
            from ..report.profile_report import write_report

            write_report(self.result, self.out_dir)
