"""memlens profile inside a Hugging Face ``Trainer``: a ``TrainerCallback``.

    from memlens.integrations.hf import MemlensCallback
    cb = MemlensCallback(out_dir="prof/")          # mode="full" for categories and modules
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    cb.result.peak_allocated_bytes                 # the profile Result; prof/ has report.html

Before the first step, ``MemlensCallback(fit_budget="24GiB")`` (or ``"auto"``: this GPU's free
memory plus what this process already reserved) estimates the Trainer's step
(:func:`memlens.integrations.trainer_estimate.estimate_parts`, on a meta skeleton of the model)
and checks it with the one fit rule (:mod:`memlens.core.fits`): ``.fit_verdict`` holds the
verdict, and a step that does not fit stops ``train()`` with one line before any OOM.

Phases: forward and backward come from hooks on the model; the optimizer phase starts at
``on_pre_optimizer_step`` and the step ends at ``on_step_end`` (after zero_grad), so the
accelerate-wrapped optimizer needs no hook. transformers is imported only when this module is.

Under torchrun (DDP, FSDP through accelerate) every rank profiles itself; at the end rank 0
gathers every rank's result (``result.data["ranks"]``, the top-level peak being the rank that
peaks) and writes the report; the other ranks keep their own result.

At an OOM (:mod:`.hf_oom`): ``guard=True`` (or a directory, or a ``memlens.guard(...)``) writes the
guard's report when an OOM ends training; ``adaptive=True`` runs each batch in smaller micro-batches
when it runs out of memory (or when the trend predicts it will), with the same effective batch:

    MemlensCallback(profile=False, guard="oom/", adaptive=True)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..core.errors import MemlensError
from ..core.fits import Budget, fits
from ..core.gpus import DEFAULT_GPU
from ..core.units import fmt_bytes
from ..models.checkpoint import apply, plan_of
from ..measure.profiler import Profiler
from ..report.profile_report import write_report
from .hf_oom import start_oom_handling
from .trainer_estimate import estimate_parts


class MemlensCallback(TrainerCallback):
    """Profile the whole ``train()``; ``.result`` is the Result once training ends."""

    def __init__(self, mode: str = "phases", out_dir: str | Path | None = None, device: Any = None, *,
                 profile: bool = True, fit_budget: str | int | None = None, gpu: str | None = None, guard: Any = False,
                 adaptive: bool = False, micro_batch: int | None = None, min_micro_batch: int = 1, trend: bool = True,
                 lookahead: int = 20, spec: Any = None, trainer: Any = None, apply_plan: Any = None):
        self.mode = mode
        # a memlens.apply plan (a dict, a `fit --least-recompute` Result or its result.json), applied to the model at
        # train begin; checked now
        self.apply_plan = None if apply_plan is None else plan_of(apply_plan)
        self.applied = None
        self.out_dir = out_dir
        self.device = device
        self.fit_budget = fit_budget
        self.gpu = gpu
        self.profile = profile
        self.profiler: Profiler | None = None
        self.result = None
        self.estimate = None
        self.fit_verdict = None
        self.oom_options = dict(guard=guard, adaptive=adaptive, micro_batch=micro_batch, min_micro_batch=min_micro_batch,
                                trend=trend, lookahead=lookahead, spec=spec, trainer=trainer)
        self.oom = None   # hf_oom.TrainerOom while training, with guard= or adaptive=True

    def check_fit(self, model, args, train_dataloader) -> None:
        """Estimate the step and apply the fit rule; raise MemlensError when it does not fit."""
        if train_dataloader is None:
            raise MemlensError("the fit check needs the Trainer's train dataloader", hint="train with a train_dataset")
        if self.fit_budget == "auto":
            import torch  # heavy: torch, loaded on first use

            device = getattr(args, "device", None)
            if not torch.cuda.is_available() or getattr(device, "type", "cuda") != "cuda":
                raise MemlensError('fit_budget="auto" reads the free memory of the CUDA device the Trainer trains on, '
                                   f"and this Trainer trains on {getattr(device, 'type', None) or 'the CPU'}",
                                   hint='give the budget itself, e.g. fit_budget="24GiB" with gpu="a10g", or train on a GPU')
        self.estimate = estimate_parts(model, args, train_dataloader.dataset, train_dataloader.collate_fn, gpu=self.gpu)
        budget, context = self.fit_budget, None
        if budget == "auto":  # what this process may still use: free memory + its own reserved; its context is paid
            import torch  # heavy: torch, loaded on first use

            free, _ = torch.cuda.mem_get_info()
            budget, context = int(free + torch.cuda.memory_reserved()), 0
        # the one rule (memlens.core.fits); a measured budget ("auto") is not held against the GPU named
        b = Budget.make(budget, gpu=None if self.fit_budget == "auto" else self.gpu or DEFAULT_GPU,
                        context_bytes=context)
        self.fit_verdict = fits(self.estimate, b)
        if not self.fit_verdict.fits:
            raise MemlensError(f"this Trainer's step needs {fmt_bytes(self.fit_verdict.need_bytes)} and {b.describe()}",
                               hint="lower per_device_train_batch_size (raise gradient_accumulation_steps), or turn on "
                                    "gradient_checkpointing / bf16 (`memlens fit` finds the largest batch that fits)")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.apply_plan is not None:
            self.applied = apply(model, self.apply_plan)
        if self.fit_budget is not None:
            self.check_fit(model, args, kwargs.get("train_dataloader"))
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        o = self.oom_options
        if o["guard"] or o["adaptive"]:
            self.oom = start_oom_handling(o, model, optimizer)
        if not self.profile:
            return
        self.profiler = Profiler(model, opt, device=self.device, mode=self.mode, optimizer_hooks=False,
                                 spec={"model": type(model).__name__ if model is not None else None, "batch_size": args.per_device_train_batch_size,
                                       "grad_accum": args.gradient_accumulation_steps})
        self.profiler.start()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.oom is not None:
            self.oom.step_begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.phase("end")
        if self.oom is not None:
            self.oom.step_end(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is not None:     # first: the guard may own the allocator history the profiler reads
            self.result = self.profiler.stop()    # every rank: rank 0 gets every rank's result gathered
        if self.oom is not None:
            self.oom.remove()
        if self.profiler is None:
            return
        self.result.data["integration"] = "transformers.Trainer"
        if self.out_dir is not None and getattr(state, "is_world_process_zero", True):
            write_report(self.result, self.out_dir)
