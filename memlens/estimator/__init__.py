"""`estimate`: the peak memory of one training step, predicted on a CPU (no GPU, no weights).

>>> from memlens import TrainingSpec, estimate
>>> r = estimate(TrainingSpec(model="gpt2", batch_size=2, seq_len=128))   # doctest: +SKIP
>>> r.peak_allocated_bytes                                                  # doctest: +SKIP
"""
from __future__ import annotations

from ..core import progress
from ..core.errors import MemlensError
from ..core.ledger import analyze
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..models.source import resolve as resolve_source
from ..step.plan import resolve as resolve_plan
from .formula import formula_estimate
from .ranks import estimate_ranks
from .result import simulation_result

__all__ = ["estimate"]

METHODS = ("simulate", "formula")


def estimate(spec: TrainingSpec, method: str = "simulate", steps: int = 2, source=None) -> Result:
    """Predict the peak memory of ``spec``'s training step.

    method "simulate" runs the step on fake tensors (exact, seconds); "formula" uses the closed
    form (instant, any size, each term explained). ``source``: a resolved model source (default:
    ``spec.model`` resolved; :func:`memlens.estimate_trainer` passes a Trainer's model). With
    several GPUs "simulate" runs each rank that can differ under a fake process group
    (:mod:`memlens.estimator.ranks`).
    """
    if method not in METHODS:
        raise MemlensError(f"method {method!r} is not one of {', '.join(METHODS)}", hint="use --method simulate or formula")
    if spec.lengths:
        return estimate_with_lengths(spec, method=method)
    return _estimate(spec, method, steps, source)   # each Result says whether it fits its GPU (result.finish)


def estimate_with_lengths(spec: TrainingSpec, budget=None, method: str = "simulate") -> Result:
    """``spec.lengths`` read: the worst step of those lengths (:func:`memlens.estimator.lengths.estimate_lengths`),
    the Result's spec the one given (its batch_size and seq_len the micro-batch and the truncation length)."""
    from ..core.lengths import read_lengths
    from .lengths import estimate_lengths

    if method != "simulate":
        raise MemlensError("--lengths is estimated by simulation only", hint="drop --method formula")
    r = estimate_lengths(spec.replace(lengths=None), read_lengths(spec.lengths), budget=budget)
    r.spec = spec.to_dict()
    return r


def _estimate(spec: TrainingSpec, method: str, steps: int, source) -> Result:
    if method == "formula":
        return formula_estimate(spec)
    source = source or resolve_source(spec.model)
    plan = resolve_plan(spec, fake=True, source=source)
    if plan.distributed:
        return estimate_ranks(spec, steps=steps, source=source, plan=plan)     # one simulation per rank that can differ
    from .simulate import simulate  # heavy: imports torch

    sim = simulate(spec, source=source, steps=steps, plan=plan)
    progress.stage(f"{spec.describe()}: replaying the allocator")
    return simulation_result(sim, analyze(sim.log))
