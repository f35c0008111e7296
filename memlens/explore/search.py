"""Searches for the largest batch that fits: over estimates (cheap, monotone) and over real trials.

Three searches share one vocabulary ("fits(b)" is monotone: if b fits, every smaller b fits):

- ``max_fitting_budget(value, budget)``: over *estimates*. Seeded by a linear model of peak vs batch
  (peak ~ states + b x activations, Korthikanti et al. 2022), then secant/bisection. A handful of
  estimates, each cached.
- ``verify_limit(try_batch, seed)``: over *real trials*, seeded by the estimate. If the estimate
  is exact or one below the real limit (what the estimator's accuracy gives), it takes 2 trials.
- ``doubling_bisection(try_batch)``: the classic finder (Lightning's ``scale_batch_size``,
  the seeds' loop), for comparison: 1, 2, 4, ... until OOM, then bisection.

>>> fits = lambda b: b <= 37
>>> max_fitting_budget(lambda b: b * 10, 375, cap=1000).limit
37
>>> verify_limit(fits, seed=36).limit, len(verify_limit(fits, seed=36).trials)
(37, 2)
>>> doubling_bisection(fits).limit, len(doubling_bisection(fits).trials)
(37, 12)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

MAX_BATCH = 1 << 16


@dataclass
class Search:
    """A search's answer and every probe it made, in order."""

    limit: int                                   # largest fitting batch; 0 if 1 does not fit
    trials: list[dict[str, Any]] = field(default_factory=list)   # {"batch", "fits", "value"?}

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "trials": self.trials}


def max_fitting_budget(value: Callable[[int], float], budget: float, *, cap: int = MAX_BATCH,
                       start: int | None = None) -> Search:
    """``max_fitting`` when the budget is known: the linear model predicts the crossing directly.

    ``value(b)`` is the peak to compare with ``budget`` (fits when value <= budget).

    >>> s = max_fitting_budget(lambda b: 1000 + 300 * b, 10_000, cap=512)
    >>> s.limit, len(s.trials)
    (30, 4)
    """
    cap = max(1, int(cap))
    seen: dict[int, float] = {}
    trials: list[dict[str, Any]] = []

    def run(b: int) -> bool:
        if b not in seen:
            seen[b] = float(value(b))
            trials.append({"batch": b, "value": int(seen[b]), "fits": seen[b] <= budget})
        return seen[b] <= budget

    # batch 2 first: batch 1 is probed only if 2 does not fit (to the estimator it is a simulation of
    # its own: memlens.estimator.scaling.design)
    if cap == 1 or not run(2):
        return Search(1 if run(1) else 0, trials)
    lo, hi = 2, None
    b = min(cap, max(2, start or 8))
    for i in range(64):
        if run(b):
            lo = max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)
        if lo == cap:
            return Search(cap, trials)
        if hi is not None and hi - lo <= 1:
            return Search(lo, trials)
        upper = hi if hi is not None else cap + 1
        nxt = None
        if i < 4:
            # line through the two probes nearest the boundary (lo and hi, or lo and the one below, not
            # its neighbour if another is: the allocator's rounding tilts a line through neighbours)
            pts = sorted(seen)
            a = lo
            c = hi if hi is not None else max((x for x in pts if x < lo - 1), default=None) or max(
                (x for x in pts if x < lo), default=None)
            if c is not None and c != a and seen[a] != seen[c]:
                slope = (seen[c] - seen[a]) / (c - a)
                if slope > 0:
                    nxt = a + int((budget - seen[a]) // slope)
                    # land on the boundary pair: if the guess fits, its successor decides
                    if nxt in seen and seen[nxt] <= budget:
                        nxt += 1
        if nxt is None:
            nxt = (lo + upper) // 2 if hi is not None else min(cap, lo * 2)
        nxt = min(max(nxt, lo + 1), upper - 1)
        if nxt in seen:
            nxt = (lo + upper) // 2
        b = nxt
    return Search(lo, trials)


def verify_limit(try_batch: Callable[[int], bool], seed: int, *, cap: int = MAX_BATCH) -> Search:
    """The exact largest batch for which ``try_batch(b)`` succeeds, seeded by an estimate.

    Trials: seed+1 (fails -> seed, checked: 2 trials; succeeds -> seed+2 fails -> seed+1: 2 trials).
    Only if the estimate was off by more than one does it widen: doubling steps up from the last
    success, or bisection down from the first failure.
    """
    trials: list[dict[str, Any]] = []
    known: dict[int, bool] = {}

    def t(b: int) -> bool:
        if b not in known:
            known[b] = bool(try_batch(b))
            trials.append({"batch": b, "fits": known[b]})
        return known[b]

    seed = max(0, min(int(seed), cap))
    lo, hi = 0, cap + 1     # lo fits (0 trivially), hi fails (cap + 1 by definition)
    if seed + 1 <= cap:
        if t(seed + 1):
            lo = seed + 1
        else:
            hi = seed + 1
    if hi == seed + 1 and seed >= 1:
        if t(seed):
            lo = seed
        else:
            hi = seed
    elif lo == seed + 1:
        step = 1
        while lo + step < hi:           # upward: seed+2, then doubling steps
            b = lo + step
            if t(b):
                lo = b
                step *= 2
            else:
                hi = b
                break
    return Search(_bisect(lo, hi, t), trials)


def doubling_bisection(try_batch: Callable[[int], bool], *, cap: int = MAX_BATCH) -> Search:
    """The classic finder: 1, 2, 4, ... until a failure, then bisection between the last two."""
    trials: list[dict[str, Any]] = []

    def t(b: int) -> bool:
        ok = bool(try_batch(b))
        trials.append({"batch": b, "fits": ok})
        return ok

    if not t(1):
        return Search(0, trials)
    lo, b = 1, 2
    hi = cap + 1
    while b <= cap:
        if t(b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    else:
        if lo < cap and t(cap):
            return Search(cap, trials)
        hi = cap + 1 if lo == cap else cap
    return Search(_bisect(lo, hi, t), trials)


# The largest per-GPU target batch fit searches: the spec's own bound on a micro-batch (core/spec.py), so the whole
# target can be probed as one micro-batch. An effective batch is rarely above a few thousand samples per GPU.
MAX_TARGET_PER_GPU = 1_000_000


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending, in O(sqrt(n)) (a target batch of 10^8 has 81).

    >>> divisors(12), divisors(1), len(divisors(100_000_000))
    ([1, 2, 3, 4, 6, 12], [1], 81)
    """
    low, high = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            low.append(d)
            if d * d != n:
                high.append(n // d)
        d += 1
    return low + high[::-1]


def max_fitting_among(values: list[int], value: Callable[[int], float], budget: float,
                      known: Callable[[], dict[int, float]] | None = None,
                      slope: Callable[[], float | None] | None = None) -> Search:
    """Largest of the sorted ``values`` with ``value(v) <= budget`` (0 if none): the largest divisor
    of a target batch that fits, say. ``fits`` is taken as monotone (if v fits, every smaller v fits).

    Probes the largest value first (if it fits, that is the answer), then the value a line predicts
    at the budget's crossing: through the two probes nearest the boundary; with none that fits,
    through the smallest that does not with ``slope()`` (bytes per unit of value, e.g. of another
    setting of the same model: a guess only), else through the two smallest that do not. Values
    ``known()`` returns (already estimated elsewhere, e.g. by another search of the same spec)
    count as probes. The answer rests on probes only: v fits and the next value does not.
    Without a line (no slope), the second smallest value (if it fits, so does the smallest: batch 1
    costs a simulation of its own, see memlens.estimator.scaling.design), then bisection.

    >>> s = max_fitting_among([1, 2, 4, 8, 16, 32], lambda b: 1000 + 300 * b, 4000)
    >>> s.limit, [t["batch"] for t in s.trials]
    (8, [32, 2, 8, 16])
    >>> s = max_fitting_among([1, 2, 4, 8, 16, 32], lambda b: 1000 + 300 * b, 4000, slope=lambda: 300)
    >>> s.limit, [t["batch"] for t in s.trials]
    (8, [32, 8, 16])
    >>> max_fitting_among([1, 2, 4], lambda b: 1000 * b, 1500).limit, max_fitting_among([1, 2, 4], lambda b: 1000 * b, 900).limit
    (1, 0)
    """
    vals = sorted(set(int(v) for v in values))
    seen: dict[int, float] = {}
    trials: list[dict[str, Any]] = []

    def merge_known() -> None:
        for k, v in (known() if known else {}).items():
            seen.setdefault(int(k), float(v))

    def run(i: int) -> bool:
        b = vals[i]
        if b not in seen:
            merge_known()
        if b not in seen:
            seen[b] = float(value(b))
            trials.append({"batch": b, "value": int(seen[b]), "fits": seen[b] <= budget})
        return seen[b] <= budget

    if not vals:
        return Search(0, trials)
    lo_i, hi_i = -1, len(vals)              # vals[lo_i] fits (-1: none known), vals[hi_i] does not (len: none known)
    merge_known()
    lo_i, hi_i = _bracket(vals, seen, budget, lo_i, hi_i)
    if hi_i == len(vals):
        if run(len(vals) - 1):
            return Search(vals[-1], trials)
        hi_i = len(vals) - 1
    guesses = 0
    while True:
        lo_i, hi_i = _bracket(vals, seen, budget, lo_i, hi_i)
        if hi_i - lo_i <= 1:
            break
        nxt = _guess(vals, seen, budget, lo_i, hi_i, slope) if guesses < 3 else None
        guesses += 1
        if nxt is None:
            nxt = 1 if (lo_i == -1 and hi_i > 1 and guesses == 1) else (lo_i + hi_i) // 2
            nxt = min(max(nxt, lo_i + 1, 0), hi_i - 1)
        if run(nxt):
            lo_i = nxt
        else:
            hi_i = nxt
    return Search(vals[lo_i] if lo_i >= 0 else 0, trials)


def _bracket(vals: list[int], seen: dict[int, float], budget: float, lo_i: int, hi_i: int) -> tuple[int, int]:
    """(lo_i, hi_i) narrowed by every point estimated (monotone: a point that fits makes every value at or below it
    fit, one that does not every value at or above it)."""
    for x, v in sorted(seen.items()):
        if v <= budget:
            i = max((j for j in range(len(vals)) if vals[j] <= x), default=-1)
            if lo_i < i < hi_i:
                lo_i = i
    for x, v in sorted(seen.items(), reverse=True):
        if v > budget:
            i = min((j for j in range(len(vals)) if vals[j] >= x), default=len(vals))
            if lo_i < i < hi_i:
                hi_i = i
    return lo_i, hi_i


def _guess(vals: list[int], seen: dict[int, float], budget: float, lo_i: int, hi_i: int,
           slope: Callable[[], float | None] | None) -> int | None:
    """The index in (lo_i, hi_i) a line predicts at the budget (the largest value at or below the
    crossing): the line through the largest point that fits and the smallest that does not, else
    through the smallest that does not with ``slope()``, else through the two smallest that do not."""
    fit = [x for x in seen if seen[x] <= budget]
    over = sorted(x for x in seen if seen[x] > budget)
    if not over:
        return None
    c = over[0]
    a = max(fit) if fit else None
    k = (seen[c] - seen[a]) / (c - a) if a is not None and a != c else None
    if k is None and slope is not None:
        k = slope()
    if k is None and len(over) > 1:
        a = over[1]      # two that do not fit, when nothing better is known (their line may bend: accumulation)
        k = (seen[a] - seen[c]) / (a - c)
    if not k or k <= 0:
        return None
    cross = c + (budget - seen[c]) / k
    cand = [i for i in range(lo_i + 1, hi_i) if vals[i] <= cross]
    return cand[-1] if cand else lo_i + 1


def _bisect(lo: int, hi: int, fits) -> int:
    """The largest batch in [lo, hi) that fits, given that lo fits and hi does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
