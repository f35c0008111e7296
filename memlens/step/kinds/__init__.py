"""The kinds of training step, as one registry: which one a spec runs, what it refuses, how it runs, and
which fast paths of the estimator may serve it.

Built in, in the order they are asked: TRL's SFT, DPO and GRPO trainers (:mod:`.trl`, ``--trainer sft|dpo|grpo``),
DP-SGD with Opacus (:mod:`.opacus`, ``--dp``), the compiled step (``--compile``), the Hugging Face Trainer's step
(``--hf-trainer``), the plain step (:mod:`memlens.step.loop`).
A new kind is one :func:`register_step_kind` call (a spec names it with ``step_kind``). A kind owns its refusals
(alone, :attr:`StepKind.refuse`, and over several GPUs, :attr:`StepKind.refuse_ranks`), its fast paths
(``layers_written``, ``repeats``) and what compare and fit offer it (``batch_field``, ``batch_unit``,
``compare_default``, ``plan_techniques``, ``offers``, ``recompute_searched``): explore asks the plan
(:class:`memlens.step.plan.StepPlan`), which asks the kind.

>>> from memlens.core.spec import TrainingSpec
>>> kind_for(TrainingSpec(model="gpt2")).name, kind_for(TrainingSpec(model="gpt2", hf_trainer=True)).name
('plain', 'hf-trainer')
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

from ...core import techniques
from ...core.errors import SpecError
from ...core.spec import TrainingSpec
from ...models.checkpoint import block_plan_flag
from ..parallel.base import check_dp_sharding
from .opacus import check_spec as _check_dp
from .trl import RUNS as _TRL_RUNS
from .trl import TITLES as _TRL_TITLES
from .trl import add_reference as _add_reference
from .trl import batch_unit as _grpo_unit
from .trl import search_base as _grpo_base
from .trl import refuse_trl as _refuse_trl


def _nothing(spec: TrainingSpec, task: str | None) -> None:
    return None


@dataclass(frozen=True)
class StepKind:
    """One kind of step.

    ``applies(spec)``: chosen for a spec that names no kind. ``refuse(spec, task)``: one line for what this
    kind cannot run (task: the model's, None before the model is resolved). ``refuse_ranks(plan)``: one line for
    what it cannot run on each rank of a multi-GPU job (None: every sharding). ``run(step, on_phase)``: one
    optimizer step of a :class:`memlens.step.prepare.PreparedStep` (None: the plain loop). ``layers_written``:
    the estimator may write a deep stack's layers from a shallow model's (:mod:`memlens.estimator.depth`);
    ``repeats``: its later steps repeat the first (:mod:`memlens.estimator.periodic`). ``flag``: the flag that
    selects it, which a kind whose step is its own (TRL's) refuses by that name.

    What compare and fit ask of it: ``private`` (it runs DP-SGD: ``plan.dp``), ``compiles`` (``plan.compiled``),
    ``batch_field`` (the field a batch search moves), ``batch_unit(spec)`` (the step between micro-batches; None: 1),
    ``compare_default`` / ``plan_techniques`` (the techniques compare shows and fit's plan tries; None: the
    table's, :mod:`memlens.core.techniques`), ``offers(spec, technique)`` (does it run that technique; None: all),
    ``recompute_searched`` (fit --least-recompute serves it), ``search_base(spec)`` (the spec fit searches with its
    accumulation and plan left as given, and the note that says why; None: accumulation searched, plan made).
    """

    name: str
    applies: Callable[[TrainingSpec], bool]
    refuse: Callable[[TrainingSpec, str | None], None] = _nothing
    run: Callable[[Any, Callable[[str], None]], Any] | None = None
    layers_written: bool = True
    title: str = ""
    keeps_outputs: bool = False      # its loops hold the model's outputs through backward (spec.keep_outputs None)
    setup: Callable[[Any], None] | None = None
    repeats: bool = True
    refuse_ranks: Callable[[Any], None] | None = None
    private: bool = False
    compiles: bool = False
    batch_field: str = "batch_size"
    batch_unit: Callable[[TrainingSpec], int] | None = None
    compare_default: tuple[str, ...] | None = None
    plan_techniques: tuple[str, ...] | None = None
    offers: Callable[[TrainingSpec, str], bool] | None = None
    recompute_searched: bool = True
    search_base: Callable[[TrainingSpec], tuple[TrainingSpec, str]] | None = None
    flag: str = ""                   # the flag that selects it (its refusal by a kind whose step is its own names it)


def _refuse_trl_kind(spec: TrainingSpec, task: str | None) -> None:
    """TRL's refusals; the flags that select another kind (``flag``: --dp, --compile) first among the flags it refuses."""
    _refuse_trl(spec, task, other_kinds=tuple((k.flag, k.applies(spec)) for k in _KINDS if k.flag))


def _refuse_block_plan(spec: TrainingSpec, why: str, hint: str) -> None:
    """A block plan (selective checkpointing, offloaded activations) this kind's step cannot take."""
    what = block_plan_flag(spec)
    if what is not None:
        raise SpecError(f"{what} with {why}", hint=hint.format(what=what))


def _refuse_compiled(spec: TrainingSpec, task: str | None) -> None:
    if spec.checkpoint_layers is not None:
        raise SpecError("--checkpoint-layers with --compile: the compiled partition of some checkpointed blocks is not modelled",
                        hint="use --grad-checkpointing (every block), or drop --compile")
    _refuse_block_plan(spec, "--compile: the compiled graph's own partition decides what is saved", "drop {what} or --compile")


def _refuse_dp(spec: TrainingSpec, task: str | None) -> None:
    _check_dp(spec, task)
    if (spec.grad_sample_mode or "hooks") == "hooks":
        _refuse_block_plan(spec, "--dp hooks: Opacus' per-sample gradient hooks need every layer's activations as they are",
                           "drop {what}, or use --grad-sample-mode ghost")


def _not_per_rank(what: str, hint: str) -> Callable[[Any], None]:
    def refuse(plan) -> None:
        raise SpecError(f"{what} with --sharding {plan.sharding.name} is not simulated per rank", hint=hint)
    return refuse


def _dp_offers(spec: TrainingSpec, technique: str) -> bool:
    """Opacus runs DPDDP over GPUs, and FSDP2 only with ghost clipping (ghost_fsdp): memlens.step.parallel.base.check_dp_sharding."""
    return technique != "fsdp" or spec.grad_sample_mode == "ghost"


def _run_dp(step, on_phase):
    return step.dp.run(on_phase)


_KINDS: list[StepKind] = [
    # TRL's trainers first: each refuses --dp / --compile itself (their steps are their own)
    *(StepKind(name, (lambda s, n=name: s.trainer == n), _refuse_trl_kind, _TRL_RUNS[name], layers_written=False,
               title=_TRL_TITLES[name], setup=_add_reference, repeats=False,
               batch_unit=_grpo_unit if name == "grpo" else None, search_base=_grpo_base if name == "grpo" else None)
      for name in ("sft", "dpo", "grpo")),
    # Opacus' loops take the loss outside the model, from outputs they hold: `logits = model(x).logits`
    # (measured on an H100: bench/results/raw/gpu_dp_gap_probe.jsonl)
    StepKind("dp", lambda s: s.dp, _refuse_dp, _run_dp,
             title="DP-SGD (Opacus make_private + BatchMemoryManager)", keeps_outputs=True,
             refuse_ranks=check_dp_sharding, private=True, batch_field="physical_batch_size",
             compare_default=techniques.COMPARE_DP, plan_techniques=techniques.PLAN_DP, offers=_dp_offers,
             recompute_searched=False, flag="--dp"),
    StepKind("compiled", lambda s: s.compile, _refuse_compiled, layers_written=False, title="torch.compile'd model",
             refuse_ranks=_not_per_rank("--compile", "drop --compile to estimate the eager step of each rank"),
             compiles=True, recompute_searched=False, flag="--compile"),
    StepKind("hf-trainer", lambda s: s.hf_trainer, title="the Hugging Face Trainer's step"),
    StepKind("plain", lambda s: True, title="plain PyTorch step"),
]


def register_step_kind(kind: StepKind) -> StepKind:
    """Add a step kind (a spec selects it with ``step_kind=<name>``); a kind of the same name is replaced."""
    _KINDS[:] = [k for k in _KINDS if k.name != kind.name]
    _KINDS.insert(0, kind)
    return kind


def kind_names() -> tuple[str, ...]:
    return tuple(k.name for k in _KINDS)


def kind_for(spec: TrainingSpec) -> StepKind:
    """The spec's step kind: the one it names, else the first that applies."""
    if spec.step_kind is not None:
        for k in _KINDS:
            if k.name == spec.step_kind:
                return k
        close = difflib.get_close_matches(spec.step_kind, kind_names(), n=1)
        raise SpecError(f"step kind {spec.step_kind!r} is not registered ({', '.join(kind_names())})",
                        hint=(f"did you mean {close[0]!r}? " if close else "") + "register it with memlens.step.kinds.register_step_kind")
    return next(k for k in _KINDS if k.applies(spec))


__all__ = ["StepKind", "register_step_kind", "kind_for", "kind_names"]
