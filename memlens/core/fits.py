"""The one rule for "does this step fit": used by estimate, fit, sweep, compare, doctor and the callbacks.

A budget is what the training process may use on the GPU, as nvidia-smi counts it: by default (for
a named GPU) the device's total memory as PyTorch reports it (``torch.cuda.get_device_properties
().total_memory``, the GPU facts' ``total_memory_bytes``). From it come off the CUDA context (the GPU
facts' ``cuda_context_bytes``, memory PyTorch's allocator never sees) and a safety margin (default 5%
of the rest, at least 256 MiB: :func:`margin_bytes`): what is left is ``usable_bytes``.
``Budget.make`` is the one way to build a budget: every caller goes through it, and a caller that
wants another margin says so with its ``margin`` argument.

A step *needs* its estimated peak reserved (``max_memory_reserved``): the caching allocator raises
OOM when a request finds no free block and reserved cannot grow, so "fits" must hold for reserved,
not for allocated alone. A step fits when peak reserved + CUDA context <= budget - margin, i.e.
need <= usable. Without a reserved figure (a closed form, an OOM message) the peak allocated stands
in for it, a lower bound (``Verdict.reserved_known`` False).

Why reserved and not the earlier min(reserved, allocated x 1.1): pressed against a limit the
allocator frees its cached segments and retries (``release_cached_blocks``) before it raises, so a
step can run with less than its unconstrained reserved, and the committed GPU measurements
(bench/results/fit_gpu.md, fit_gpu.jsonl; an H100 capped with set_per_process_memory_fraction)
show it: GPT-2 medium AMP fp16 + checkpointing under 12 GiB ran batch 9 (10.21 GiB allocated,
estimated reserved at batch 8 already 11.64 GiB) in fresh processes. But the same retry is not
something a verdict can count on: batch 10 (10.89 GiB allocated) ran in one process and hit OOM in
another, and Llama-3.2-1B bf16 batch 5 under 40 GiB (38.39 GiB allocated) likewise; whether the
freed cache fits the failing request depends on the allocator's history. The x 1.1 allowance was
chosen after seeing the two GPT-2 cases (a tuned constant), and it called a step "fits" whose
estimated reserved was above the usable memory (an 8B QLoRA on an RTX 4090: 22.45 GiB reserved,
22.11 GiB usable). On those four measured cases the reserved rule answers 7 (real 8), 7 (real 9 or
10), 4 (real 4 or 5) and 5 (real 5): never above the real limit; it is conservative where the
retry rescues a step (GPT-2 medium: 2 batches below the fresh-process limit of 9), and that is the
price of a "fits" that holds whatever the allocator's history.

>>> b = Budget.make("16GiB", context_bytes=0)
>>> v = fits(Need(peak_allocated_bytes=10 * 2**30, peak_reserved_bytes=12 * 2**30), b)
>>> v.fits, v.need_bytes == 12 * 2**30
(True, True)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MemlensError, NoDeviceError
from .gpus import LARGEST_GPU, GpuFacts, gpu_facts
from .units import fmt_bytes, parse_bytes

MARGIN_FRACTION = 0.05
MARGIN_MIN_BYTES = 256 * 2**20

RULE = "peak reserved + CUDA context <= budget - margin"


@dataclass(frozen=True)
class Need:
    """The two peaks the rule reads (from an estimate, a measurement or a Result)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None


def need_bytes(p: Any) -> int:
    """Bytes a step needs: its peak reserved; without a reserved figure (a closed form, a message),
    its peak allocated (a lower bound). A Result with a ``worst_case`` (DDP's stale buckets) needs that.

    >>> need_bytes(Need(peak_allocated_bytes=1000, peak_reserved_bytes=1500))
    1500
    >>> need_bytes(Need(peak_allocated_bytes=1000))
    1000
    """
    res = getattr(p, "peak_reserved_bytes", None)
    need = int(res) if res else int(getattr(p, "peak_allocated_bytes", 0) or 0)
    data = getattr(p, "data", None)
    worst = data.get("worst_case") if isinstance(data, Mapping) else None   # a Result's data is a Payload (a Mapping)
    if worst:   # DDP: the stale buckets may still be alive at the peak (measured both ways): a verdict takes the worst case
        need = max(need, int(worst.get("peak_reserved_bytes") or worst.get("peak_allocated_bytes") or 0))
    outside = data.get("outside_allocator_bytes") if hasattr(data, "get") else None
    if outside:   # vLLM colocated with TRL's GRPO: its own share of the GPU, outside torch's allocator
        need += int(outside)
    return need


def margin_bytes(rest: int, margin: float | int | str | None = None) -> int:
    """The safety margin taken off ``rest`` (the budget less the CUDA context): by default 5% of it,
    at least 256 MiB; ``margin`` overrides it: a fraction in [0, 1) of ``rest``, bytes (an int), or a
    size string (:func:`parse_margin`).

    >>> MiB = 2**20
    >>> margin_bytes(1024 * MiB) // MiB, margin_bytes(16 * 1024 * MiB) // MiB   # the floor; 5%
    (256, 819)
    >>> margin_bytes(16 * 1024 * MiB, 0), margin_bytes(1000, 0.5), margin_bytes(1000, "1KiB")
    (0, 500, 1024)
    """
    if margin is None:
        return max(int(MARGIN_FRACTION * rest), MARGIN_MIN_BYTES)
    m = parse_margin(margin)
    return int(m * rest) if isinstance(m, float) else m


def parse_margin(margin: float | int | str) -> float | int:
    """A margin as given: a fraction in [0, 1) (a float), or bytes (an int; a string with a unit).
    ``"0.05"`` is 5%; ``"512MiB"`` 512 MiB; ``"1.5"`` is neither and is refused, as are negatives.

    >>> parse_margin("0.05"), parse_margin("512MiB"), parse_margin(0), parse_margin("0")
    (0.05, 536870912, 0, 0.0)
    """
    hint = "a fraction of the memory below 1 (--margin 0.05 = 5%) or a size with a unit (--margin 512MiB)"
    if isinstance(margin, str):
        try:
            margin = float(margin)
        except ValueError:
            return parse_bytes(margin, "--margin")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise MemlensError(f"--margin {margin!r} is not a fraction or a size", hint=hint)
    if not margin >= 0:
        raise MemlensError(f"--margin {margin:g} is negative", hint=hint)
    if isinstance(margin, float) and not margin < 1:
        raise MemlensError(f"--margin {margin:g} is neither a fraction below 1 nor a size", hint=hint)
    return margin


def check_size_for_gpus(n: int, what: str) -> None:
    """Refuse ``n`` bytes of GPU memory that no GPU memlens knows has (``what``: how to name it, e.g.
    "budget 1e30GiB"): a size typed for one GPU's memory, read against the largest known one."""
    big = gpu_facts(LARGEST_GPU)
    if n > big.nominal_gb * 2**30:
        raise MemlensError(f"{what} is more than any GPU memlens knows has (the largest: the {big.name}, "
                           f"{fmt_bytes(big.total_memory_bytes)})",
                           hint="give the memory of one GPU, e.g. 24GiB or 80GiB (`memlens estimate --list-gpus`)")


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
    warning: str | None = None     # a budget above the GPU's memory but within its nominal size: used as its total

    @property
    def usable_bytes(self) -> int:
        return self.budget_bytes - self.context_bytes - self.margin_bytes

    @classmethod
    def make(cls, budget: "int | str | Budget | None", *, context_bytes: int | str | None = None,
             margin: float | int | str | None = None, gpu: str | None = None) -> "Budget":
        """The one constructor. ``budget`` None: this GPU's free memory now; ``"total"``: the total memory of
        ``gpu`` as PyTorch reports it (what a user of that whole GPU has); a Budget: itself. ``margin`` None:
        the rule's (:func:`margin_bytes`); else bytes, a size string, or a fraction in [0, 1) (0: none, for a
        caller that compares with a measured limit). ``context_bytes`` None: the CUDA context of ``gpu``
        (default: the GPU facts' default).

        A budget given (a size, not None or "total") with ``gpu`` named is checked against that GPU
        (:func:`_given`): above the largest known GPU or above ``gpu``'s nominal memory it is refused;
        between ``gpu``'s total memory and its nominal size (``--budget 80GiB`` on an H100 of 79.19 GiB)
        it is that total, with a ``warning``. Callers with a measured figure (free memory, an OOM
        message's capacity) pass no ``gpu``."""
        if isinstance(budget, Budget):
            return budget
        source, warning = "given", None
        if budget is None:
            total = gpu_free_bytes()
            source = "free memory of the current GPU"
        elif isinstance(budget, str) and budget.strip().lower() == "total":
            g = gpu_facts(gpu)
            total = g.total_memory_bytes
            source = f"total memory of the {g.name}"
        else:
            total = parse_bytes(budget, "budget")
            if gpu is not None:
                total, source, warning = _given(total, budget, gpu_facts(gpu))
        if total <= 0:
            raise MemlensError("the budget is 0 bytes", hint="give a size such as --budget 16GiB")
        ctx = gpu_facts(gpu).cuda_context_bytes if context_bytes is None else parse_bytes(context_bytes, "--context")
        m = margin_bytes(total - ctx, margin)
        b = cls(total, ctx, m, source, warning)
        if b.usable_bytes <= 0:
            raise MemlensError(f"budget {fmt_bytes(total)} leaves nothing after the CUDA context ({fmt_bytes(ctx)}) and the margin ({fmt_bytes(m)})",
                               hint="give a larger --budget, or --margin 0 / --context 0 for an allocator-only limit")
        return b

    def to_dict(self) -> dict[str, Any]:
        d = {"budget_bytes": self.budget_bytes, "context_bytes": self.context_bytes,
             "margin_bytes": self.margin_bytes, "usable_bytes": self.usable_bytes, "budget_source": self.source}
        if self.warning:
            d["budget_warning"] = self.warning
        return d

    def describe(self) -> str:
        return (f"budget {fmt_bytes(self.budget_bytes)} - CUDA context {fmt_bytes(self.context_bytes)} - margin "
                f"{fmt_bytes(self.margin_bytes)} = {fmt_bytes(self.usable_bytes)} usable")


def optional_budget(budget: "int | str | Budget | None", *, margin: float | int | str | None = None,
                    context_bytes: int | str | None = None, gpu: str | None = None) -> Budget | None:
    """A verb whose budget is optional (compare, sweep): :meth:`Budget.make`, or None without a budget; a margin or
    context given without one is refused (it would be ignored)."""
    if budget is None:
        if margin is not None or context_bytes is not None:
            raise MemlensError("--margin and --context are taken off a budget, and none is given",
                               hint="add --budget 16GiB, or --gpu NAME for that GPU's whole memory")
        return None
    return Budget.make(budget, context_bytes=context_bytes, margin=margin, gpu=gpu)


def _given(total: int, given: Any, g: GpuFacts) -> tuple[int, str, str | None]:
    """A budget given for GPU ``g``: (bytes, source, warning), or one line refusing it."""
    text = given.strip() if isinstance(given, str) else fmt_bytes(total)
    check_size_for_gpus(total, f"budget {text}")
    if total > g.nominal_gb * 2**30:
        raise MemlensError(f"budget {text} is more than the {g.name} has ({fmt_bytes(g.total_memory_bytes)} as PyTorch "
                           f"reports it, {g.nominal_gb:g} GB nominal)",
                           hint=f"leave --budget out to use the whole {g.name}, give a smaller one, or name your GPU with "
                                "--gpu (`memlens estimate --list-gpus`)")
    if total > g.total_memory_bytes:
        return (g.total_memory_bytes, f"total memory of the {g.name}; {text} given",
                f"budget {text} is more than the {g.name}'s {fmt_bytes(g.total_memory_bytes)} (its total memory as PyTorch "
                f"reports it; {g.nominal_gb:g} GB is its nominal size): using {fmt_bytes(g.total_memory_bytes)}")
    return total, "given", None


@dataclass(frozen=True)
class Verdict:
    fits: bool
    need_bytes: int
    usable_bytes: int
    reserved_known: bool = True

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.need_bytes

    def describe(self, where: str) -> str:
        """The verdict in words: ``fits <where> (<usable>): <headroom> to spare`` or
        ``does not fit <where> (<usable>): <need> needed, <over> over``.

        >>> Verdict(False, 3 * 2**30, 2 * 2**30).describe("the rtx-4090")
        'does not fit the rtx-4090 (2.00 GiB usable): needs 3.00 GiB reserved, 1.00 GiB over'
        """
        what = "reserved" if self.reserved_known else "allocated (no reserved figure)"
        if self.fits:
            return f"fits {where} ({fmt_bytes(self.usable_bytes)} usable): needs {fmt_bytes(self.need_bytes)} {what}, {fmt_bytes(self.headroom_bytes)} to spare"
        return (f"does not fit {where} ({fmt_bytes(self.usable_bytes)} usable): needs {fmt_bytes(self.need_bytes)} {what}, "
                f"{fmt_bytes(-self.headroom_bytes)} over")

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "need_bytes": self.need_bytes, "usable_bytes": self.usable_bytes,
                "headroom_bytes": self.headroom_bytes}


def fits(p: Any, budget: Budget) -> Verdict:
    """Does a step with these peaks (an estimate Point, a measurement, a Result) fit ``budget``?
    need (:func:`need_bytes`, the peak reserved) <= usable (budget - CUDA context - margin)."""
    n = need_bytes(p)
    return Verdict(n <= budget.usable_bytes, n, budget.usable_bytes, bool(getattr(p, "peak_reserved_bytes", None)))


def gpu_free_bytes() -> int:
    """Free memory of the current CUDA device (cudaMemGetInfo)."""
    try:
        import torch  # heavy: only when a budget is read from the GPU

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - any driver problem means "no GPU to ask"
        pass
    raise NoDeviceError("no --budget given and no CUDA GPU to read free memory from",
                        hint="give --budget 16GiB, or --gpu NAME for that GPU's whole memory")
