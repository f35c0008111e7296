"""The kinds of training step, as one registry: which one a spec runs, what it refuses, how it runs, and
which fast paths of the estimator may serve it.

Built in, in the order they are asked: TRL's SFT, DPO and GRPO trainers (:mod:`.trl`, ``--trainer sft|dpo|grpo``),
DP-SGD with Opacus (:mod:`.opacus`, ``--dp``), the compiled step (``--compile``), the Hugging Face Trainer's step
(``--hf-trainer``), the plain step (:mod:`memlens.step.loop`).
A new kind is one :func:`register_step_kind` call (a spec names it with ``step_kind``).

>>> from memlens.core.spec import TrainingSpec
>>> kind_for(TrainingSpec(model="gpt2")).name, kind_for(TrainingSpec(model="gpt2", hf_trainer=True)).name
('plain', 'hf-trainer')
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

from ...core.errors import SpecError
from ...core.spec import TrainingSpec
from .opacus import check_spec as _check_dp
from .trl import RUNS as _TRL_RUNS
from .trl import TITLES as _TRL_TITLES
from .trl import add_reference as _add_reference
from .trl import refuse_trl as _refuse_trl


def _nothing(spec: TrainingSpec, task: str | None) -> None:
    return None


@dataclass(frozen=True)
class StepKind:
    """One kind of step.

    ``applies(spec)``: chosen for a spec that names no kind. ``refuse(spec, task)``: one line for what this
    kind cannot run (task: the model's, None before the model is resolved). ``run(step, on_phase)``: one
    optimizer step of a :class:`memlens.step.prepare.PreparedStep` (None: the plain loop). ``layers_written``:
    the estimator may write a deep stack's layers from a shallow model's (:mod:`memlens.estimator.depth`).
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


def _refuse_compiled(spec: TrainingSpec, task: str | None) -> None:
    if spec.checkpoint_layers is not None:
        raise SpecError("--checkpoint-layers with --compile: the compiled partition of some checkpointed blocks is not modelled",
                        hint="use --grad-checkpointing (every block), or drop --compile")


def _run_dp(step, on_phase):
    return step.dp.run(on_phase)


_KINDS: list[StepKind] = [
    # TRL's trainers first: each refuses --dp / --compile itself (their steps are their own)
    *(StepKind(name, (lambda s, n=name: s.trainer == n), _refuse_trl, _TRL_RUNS[name], layers_written=False,
               title=_TRL_TITLES[name], setup=_add_reference, repeats=False) for name in ("sft", "dpo", "grpo")),
    # Opacus' loops take the loss outside the model, from outputs they hold: `logits = model(x).logits`
    # (measured on an H100: bench/results/raw/gpu_dp_gap_probe.jsonl)
    StepKind("dp", lambda s: s.dp, _check_dp, _run_dp,
             title="DP-SGD (Opacus make_private + BatchMemoryManager)", keeps_outputs=True),
    StepKind("compiled", lambda s: s.compile, _refuse_compiled, layers_written=False, title="torch.compile'd model"),
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
