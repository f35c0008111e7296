"""The one rule for "does this step fit": used by fit, sweep, compare and doctor.

A budget is what the training process may use on the GPU, as nvidia-smi counts it. From it come
off the CUDA context (the GPU facts' ``cuda_context_bytes``, not PyTorch's) and a safety margin
(default 5% of the rest, at least 256 MiB: :func:`margin_bytes`): what is left is ``usable_bytes``.
``Budget.make`` is the one way to build a budget: every caller (fit, sweep, compare, doctor, the
trend guard, the Trainer callback) goes through it, and a caller that wants another margin says so
with its ``margin`` argument.

What a step *needs* under a limit is the smaller of its peak reserved (``max_memory_reserved``,
what the caching allocator holds unconstrained) and its peak allocated + 10%: pressed against a
limit (``set_per_process_memory_fraction``, a full GPU) the allocator frees its cached segments
and retries before it raises OOM, so a step needs about its peak allocated plus the
fragmentation inside live segments. Measured on an H100 (bench/results/fit_gpu.md): GPT-2 medium
AMP + checkpointing, batch 9: 10.21 GiB allocated, 11.64 GiB reserved unconstrained at batch 8,
yet batch 9 runs under a 12 GiB cap; batch 10 (10.89 GiB allocated) fits in one process and OOMs
in another. 10% over allocated covers both measured cases, and held on two Llama cases measured
afterwards.

A step fits when need <= usable.

>>> b = Budget.make("16GiB", context_bytes=0)
>>> v = fits(Need(peak_allocated_bytes=10 * 2**30, peak_reserved_bytes=12 * 2**30), b)
>>> v.fits, v.need_bytes == 11 * 2**30
(True, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import MemlensError, NoDeviceError
from .gpus import gpu_facts
from .units import fmt_bytes, parse_bytes

PRESSED_ALLOCATOR_OVERHEAD = 0.10
MARGIN_FRACTION = 0.05
MARGIN_MIN_BYTES = 256 * 2**20

RULE = (f"need = min(peak reserved, peak allocated x {1 + PRESSED_ALLOCATOR_OVERHEAD:.2f}) "
        "<= budget - CUDA context - margin")


@dataclass(frozen=True)
class Need:
    """The two peaks the rule reads (from an estimate, a measurement or a Result)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None


def need_bytes(p: Any) -> int:
    """Bytes a step needs under a hard limit: min(peak reserved, peak allocated x 1.10).
    Without a reserved figure (a closed form, a message), the allocated side alone.

    >>> need_bytes(Need(peak_allocated_bytes=1000, peak_reserved_bytes=1500))
    1100
    >>> need_bytes(Need(peak_allocated_bytes=1000))
    1100
    """
    alloc = int(getattr(p, "peak_allocated_bytes", 0) or 0)
    pressed = int(alloc * (1 + PRESSED_ALLOCATOR_OVERHEAD))
    res = getattr(p, "peak_reserved_bytes", None)
    return min(int(res), pressed) if res else pressed


def margin_bytes(rest: int, margin: float | int | str | None = None) -> int:
    """The safety margin taken off ``rest`` (the budget less the CUDA context): by default 5% of it,
    at least 256 MiB; ``margin`` overrides it: a fraction < 1 of ``rest``, bytes, or a size string.

    >>> MiB = 2**20
    >>> margin_bytes(1024 * MiB) // MiB, margin_bytes(16 * 1024 * MiB) // MiB   # the floor; 5%
    (256, 819)
    >>> margin_bytes(16 * 1024 * MiB, 0), margin_bytes(1000, 0.5), margin_bytes(1000, "1KiB")
    (0, 500, 1024)
    """
    if margin is None:
        return max(int(MARGIN_FRACTION * rest), MARGIN_MIN_BYTES)
    if isinstance(margin, float) and margin < 1:
        if margin < 0:
            raise MemlensError(f"margin {margin} is negative", hint="e.g. --margin 0.05 or --margin 512MiB")
        return int(margin * rest)
    return parse_bytes(margin)


@dataclass(frozen=True)
class Budget:
    """Bytes: ``budget`` as given, minus the CUDA context and the margin = ``usable`` for the step.

    >>> b = Budget.make("16GiB", context_bytes=0)
    >>> b.margin_bytes == int(0.05 * 16 * 2**30), b.usable_bytes == 16 * 2**30 - b.margin_bytes
    (True, True)
    """

    budget_bytes: int
    context_bytes: int
    margin_bytes: int
    source: str = "given"

    @property
    def usable_bytes(self) -> int:
        return self.budget_bytes - self.context_bytes - self.margin_bytes

    @classmethod
    def make(cls, budget: int | str | None, *, context_bytes: int | None = None, margin: float | int | str | None = None,
             gpu: str | None = None) -> "Budget":
        """The one constructor. ``budget`` None: this GPU's free memory now. ``margin`` None: the rule's
        (:func:`margin_bytes`); else bytes, a size string, or a fraction < 1 (0: none, for a caller that
        compares with a measured limit). ``context_bytes`` None: the CUDA context of ``gpu`` (default:
        the GPU facts' default)."""
        source = "given"
        if budget is None:
            total = gpu_free_bytes()
            source = "free memory of the current GPU"
        else:
            total = parse_bytes(budget)
        if total <= 0:
            raise MemlensError("the budget is 0 bytes", hint="give a size such as --budget 16GiB")
        ctx = gpu_facts(gpu).cuda_context_bytes if context_bytes is None else int(context_bytes)
        m = margin_bytes(total - ctx, margin)
        b = cls(total, ctx, m, source)
        if b.usable_bytes <= 0:
            raise MemlensError(f"budget {fmt_bytes(total)} leaves nothing after the CUDA context ({fmt_bytes(ctx)}) and the margin ({fmt_bytes(m)})",
                               hint="give a larger --budget, or --margin 0 / --context 0 for an allocator-only limit")
        return b

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "context_bytes": self.context_bytes,
                "margin_bytes": self.margin_bytes, "usable_bytes": self.usable_bytes, "budget_source": self.source}

    def describe(self) -> str:
        return (f"budget {fmt_bytes(self.budget_bytes)} - CUDA context {fmt_bytes(self.context_bytes)} - margin "
                f"{fmt_bytes(self.margin_bytes)} = {fmt_bytes(self.usable_bytes)} usable")


@dataclass(frozen=True)
class Verdict:
    fits: bool
    need_bytes: int
    usable_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.need_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "need_bytes": self.need_bytes, "usable_bytes": self.usable_bytes,
                "headroom_bytes": self.headroom_bytes}


def fits(p: Any, budget: Budget) -> Verdict:
    """Does a step with these peaks (an estimate Point, a measurement, a Result) fit ``budget``?"""
    n = need_bytes(p)
    return Verdict(n <= budget.usable_bytes, n, budget.usable_bytes)


def gpu_free_bytes() -> int:
    """Free memory of the current CUDA device (cudaMemGetInfo)."""
    try:
        import torch   # heavy: only when a budget is read from the GPU

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - any driver problem means "no GPU to ask"
        pass
    raise NoDeviceError("no --budget given and no CUDA GPU to read free memory from", hint="give --budget 16GiB")
