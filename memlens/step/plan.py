"""One resolution of a TrainingSpec into the plan of its step: :func:`resolve`.

The plan holds one registry entry per decision, each owning its facts and its one-line refusals:

- ``sharding`` (:mod:`memlens.core.parallel`): one GPU, DDP, ZeRO-1, FSDP2 and what each shards;
  ``wrapper`` the class that wraps a rank (:mod:`memlens.step.parallel`);
- ``kind`` (:mod:`memlens.step.kinds`): plain, the Trainer's, compiled, DP-SGD, TRL's; how it runs, what it refuses
  (alone and over several GPUs), which fast paths of the estimator may serve it, which batch field a search
  moves and which techniques compare and fit offer it;
- ``optimizer`` (:mod:`memlens.core.optimizers`): state and temporary bytes, how it is built;
- ``precision`` (:mod:`memlens.core.precision`): weights dtype, autocast dtype, GradScaler.

:func:`memlens.step.prepare` builds the step the plan says; the estimator, the closed form, compare /
sweep / fit and the profiler ask the plan rather than the spec's fields: :attr:`StepPlan.distributed`,
:attr:`StepPlan.dp` and :attr:`StepPlan.compiled` are the one definition of each. ``resolve(spec, refuse=False)``
builds the same plan without its refusals, for what explore asks of a spec before (or instead of) estimating it.

>>> from memlens.core.spec import TrainingSpec
>>> p = resolve(TrainingSpec(model="gpt2", precision="amp-fp16", world_size=2, sharding="ddp"))
>>> p.distributed, p.sharding.family, p.kind.name, p.precision.grad_scaler, p.optimizer.adam_like
(True, 'ddp', 'plain', True, True)
>>> p.world_size, p.ranks, p.dp, p.compiled, p.batch_field
(2, 2, False, False, 'batch_size')
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

from ..core.errors import SpecError
from ..core.optimizers import Optimizer, optimizer_facts
from ..core.parallel import Sharding, data_parallel_ranks, is_distributed, sharding_of
from ..core.precision import Precision, precision_of
from ..core.spec import TrainingSpec
from ..models.liger import refuse as refuse_liger
from .ema import refuse as refuse_ema
from .kinds import StepKind, kind_for
from .parallel import check as check_parallel
from .parallel import wrapper_class

_TEXT = ("causal-lm", "masked-lm")


@dataclass(frozen=True)
class StepPlan:
    """What step a spec runs: its registry entries (see the module docstring)."""

    spec: TrainingSpec
    sharding: Sharding
    wrapper: type | None          # the rank wrapper's class (None on one GPU)
    kind: StepKind
    optimizer: Optimizer
    precision: Precision

    # ---------------------------------------------------------------- the one definition of each
    @property
    def distributed(self) -> bool:
        """A job of several ranks (each simulated, or run under torchrun)."""
        return is_distributed(self.spec)

    @property
    def world_size(self) -> int:
        """GPUs of the job (1 on one GPU)."""
        return self.spec.world_size

    @property
    def ranks(self) -> int:
        """Ranks that each take a micro-batch (the whole world of a data-parallel job; 1 on one GPU)."""
        return data_parallel_ranks(self.spec)

    @property
    def dp(self) -> bool:
        """The step runs DP-SGD (its kind is a private one: Opacus')."""
        return self.kind.private

    @property
    def compiled(self) -> bool:
        """The model runs torch.compile'd."""
        return self.kind.compiles

    @property
    def hf_trainer(self) -> bool:
        """The step is a transformers Trainer's (the Trainer's own, TRL's subclasses, or compiled by the Trainer)."""
        return self.spec.hf_trainer

    @property
    def grad_scaler(self) -> bool:
        return self.precision.grad_scaler

    @property
    def keep_outputs(self) -> bool:
        """The loop holds the model's outputs through backward (the spec's word, else the step kind's habit)."""
        return self.kind.keeps_outputs if self.spec.keep_outputs is None else self.spec.keep_outputs

    # ---------------------------------------------------------------- what the explorers ask (the kind's answers)
    @property
    def batch_field(self) -> str:
        """The spec field a batch search moves: what the step materializes at once (DP-SGD: physical batches)."""
        return self.kind.batch_field

    @property
    def batch_unit(self) -> int:
        """The step between micro-batches this step can take (1 unless its kind says otherwise: GRPO)."""
        return self.kind.batch_unit(self.spec) if self.kind.batch_unit is not None else 1

    def offers(self, technique: str) -> bool:
        """Does this step's kind run ``technique`` of :mod:`memlens.core.techniques` (besides the table's own rule)?"""
        return self.kind.offers is None or self.kind.offers(self.spec, technique)

    def refuse_recompute_search(self) -> None:
        """One line when fit's least-recompute search does not serve this step (one GPU's plain or Trainer step)."""
        if not self.kind.recompute_searched or self.distributed or self.spec.offload_optimizer:
            raise SpecError("--least-recompute is for one GPU's plain or Trainer step: DP-SGD, --compile, several GPUs and "
                            "--offload-optimizer are not searched", hint="drop --dp / --compile / --world-size / --offload-optimizer")

    # ---------------------------------------------------------------- what the estimator asks
    @property
    def world_size(self) -> int:
        """GPUs of the job (1 on one GPU)."""
        return self.spec.world_size


def resolve(spec: TrainingSpec, *, fake: bool = True, source: Any = None, refuse: bool = True) -> StepPlan:
    """The plan of ``spec``'s step; every field it cannot apply is refused here in one line.

    ``fake``: the step runs on fake tensors (estimate) rather than a real device. ``source``: the resolved
    model source, when known (its task decides some refusals). ``refuse=False``: the same registry entries,
    nothing refused (a multi-GPU spec no wrapper takes gets ``wrapper=None``): what compare, sweep and fit ask
    of a spec they may not estimate.
    """
    plan = StepPlan(spec=spec, sharding=sharding_of(spec), wrapper=None, kind=kind_for(spec),
                    optimizer=optimizer_facts(spec.optimizer), precision=precision_of(spec))
    if refuse:
        _refuse(plan, fake, source)
    try:
        return replace(plan, wrapper=wrapper_class(plan))
    except SpecError:
        if refuse:
            raise
        return plan


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):     # a module set to None in sys.modules, or one without a spec
        return False


def _refuse(plan: StepPlan, fake: bool, source: Any) -> None:
    """Every refusal of the plan's entries, in the order a user meets them."""
    spec, kind = plan.spec, plan.kind
    task = getattr(source, "task", None)
    if source is not None:
        _refuse_for_source(spec, source)
    check_parallel(plan, fake=fake)             # what one rank of a multi-GPU job cannot apply
    if not plan.distributed and spec.offload_optimizer:
        raise SpecError("--offload-optimizer is not simulated or run by this step yet",
                        hint="use --method formula, or drop --offload-optimizer")
    if spec.qlora and not fake and not _importable("bitsandbytes"):   # a device builds bitsandbytes' own 4-bit layers
        raise SpecError("--qlora on a device needs bitsandbytes (its 4-bit layers are what is measured)",
                        hint="pip install bitsandbytes; `memlens estimate --qlora` simulates QLoRA without it")
    kind.refuse(spec, task)                     # the kind's own (selective checkpointing / offload with --compile, DP hooks)
    if source is not None:
        refuse_liger(spec, source, fake)        # --liger: the architectures liger patches and memlens models
    if spec.loss != "model" and task not in (None, "causal-lm", "vlm"):
        raise SpecError(f"--loss {spec.loss} is a causal LM's criterion on shifted logits; {source.name} trains {task}",
                        hint="drop --loss (a factory's own loss_fn is its criterion)")
    if kind.name == "hf-trainer" and (spec.loss != "model" or spec.keep_outputs):
        raise SpecError("the Trainer's step takes the model's own loss and keeps no outputs (--loss / --keep-outputs)",
                        hint="drop --loss / --keep-outputs with --hf-trainer (a custom compute_loss is a factory's step)")
    refuse_ema(plan)                            # --ema: not with DP-SGD, the Trainer's step, FSDP2


def _refuse_for_source(spec: TrainingSpec, source) -> None:
    """Fields the model's task has no use for, and what a factory without a spec cannot see."""
    task = source.task
    if task == "factory":
        if source.kind != "factory":   # a model built elsewhere (a Trainer's): memlens makes its batch
            return

        try:
            takes_spec = len(inspect.signature(source.factory).parameters) >= 1
        except (TypeError, ValueError):
            takes_spec = False
        if not takes_spec:
            given = [f"--{n.replace('_', '-')}" for n, default in (("batch_size", 1), ("seq_len", None), ("image_size", None),
                                                                    ("images_per_sample", 1), ("grad_checkpointing", False),
                                                                    ("attn", "sdpa")) if getattr(spec, n) != default]
            if given:
                raise SpecError(f"factory {source.name} takes no spec, so {', '.join(given)} cannot reach it",
                                hint=f"define it as `def {source.name.split(':')[-1]}(spec)` and build the batch from spec")
        return
    if spec.image_size is not None and task in _TEXT:
        raise SpecError(f"--image-size does not apply to {source.name} (a {task} model)", hint="drop --image-size")
    if spec.images_per_sample != 1 and task != "vlm":
        raise SpecError(f"--images-per-sample applies to vision-language models, not {source.name} ({task})",
                        hint="drop --images-per-sample")
    if spec.seq_len is not None and task == "image-classification":
        raise SpecError(f"--seq-len does not apply to {source.name}: its sequence is the image patches",
                        hint="use --image-size to change the number of patches")


__all__ = ["StepPlan", "resolve"]
