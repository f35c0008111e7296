"""`estimate`: the peak memory of one training step, predicted on a CPU (no GPU, no weights).

>>> from memlens import TrainingSpec, estimate
>>> r = estimate(TrainingSpec(model="gpt2", batch_size=2, seq_len=128))   # doctest: +SKIP
>>> r.peak_allocated_bytes                                                  # doctest: +SKIP
"""
from __future__ import annotations

from ..core.gpus import gpu_facts
from ..core.parallel import is_distributed
from ..core.precision import precision_of
from ..core.result import Result
from .result import simulation_result
from ..core.spec import TrainingSpec

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
    from ..core.errors import MemlensError

    if method not in METHODS:
        raise MemlensError(f"method {method!r} is not one of {', '.join(METHODS)}", hint="use --method simulate or formula")
    result = _estimate(spec, method, steps, source)
    result.notes.extend(hardware_notes(spec))
    gpu_verdict(result, spec)
    return result


def gpu_verdict(result: Result, spec: TrainingSpec) -> None:
    """The fit rule (:mod:`memlens.core.fits`) against the whole of ``spec.gpu`` (the named GPU, or the
    default h100): its total memory as PyTorch reports it, less the CUDA context (and, per rank,
    NCCL's measured buffers) and the rule's margin. Always given, so an estimate never leaves out
    whether it fits the GPU it was made for; ``fit`` and ``fit_verdict`` in the payload."""
    from ..core.fits import Budget, fits
    from ..core.gpus import nccl_bytes

    g = gpu_facts(spec.gpu)
    ctx = g.cuda_context_bytes
    if spec.world_size > 1:
        ctx += nccl_bytes(g.name, spec.world_size)[0] or 0
    b = Budget.make("total", context_bytes=ctx, gpu=g.name)
    v = fits(result, b)
    words = v.describe(f"the {g.name}" + (" (per rank)" if spec.world_size > 1 else ""))
    result.data.fit = {**b.to_dict(), **v.to_dict(), "gpu": g.name}
    result.data.fit_verdict = words


def _estimate(spec: TrainingSpec, method: str, steps: int, source) -> Result:
    if method == "formula":
        from .formula import formula_estimate

        return formula_estimate(spec)
    if is_distributed(spec):
        from .ranks import estimate_ranks

        return estimate_ranks(spec, steps=steps, source=source)     # one simulation per rank that can differ
    from ..core import progress
    from ..core.ledger import analyze
    from .simulate import simulate

    sim = simulate(spec, source=source, steps=steps)
    progress.stage(f"{spec.describe()}: replaying the allocator")
    return simulation_result(sim, analyze(sim.log))


def hardware_notes(spec: TrainingSpec) -> list[str]:
    """What the GPU cannot do natively that the spec asks of it (the memory is the same; the speed is not).

    >>> hardware_notes(TrainingSpec(model="gpt2", gpu="t4", precision="bf16"))[0][:59]
    't4 (turing, sm75) has no bf16 tensor cores: bf16 runs emula'
    """
    gpu = gpu_facts(spec.gpu)
    p = precision_of(spec)
    uses_bf16 = "bfloat16" in (p.weights, p.autocast) or (spec.qlora and p.weights != "float16" and p.autocast != "float16")
    if uses_bf16 and not gpu.bf16:
        cc = "".join(map(str, gpu.compute_capability))
        return [f"{gpu.name} ({gpu.arch}, sm{cc}) has no bf16 tensor cores: bf16 runs emulated, much slower; "
                "memory is as estimated (use fp16 or amp-fp16 for speed on it)"]
    return []
