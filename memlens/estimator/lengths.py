"""Estimate with lengths that vary: the step that peaks, its length, and what would keep it under a budget.

:mod:`memlens.core.lengths` gives the micro-batch shapes (rows, tokens) a data loader hands the model; this
estimates the worst of them (over any order: the Trainer's sampler shuffles) and the worst in file order, says
which step and which sample reach the peak, and, when the worst does not fit the budget, the largest max_length
and the largest micro-batch that would, answered by :class:`~memlens.estimator.scaling.ScalingEstimator` (a few
simulations, the other sizes replayed from their traces), and what bfd packing's worst step would be.
"""
from __future__ import annotations

from ..core.errors import SpecError
from ..core.fits import Budget, fits
from ..core.parallel import is_distributed
from ..core.lengths import (
    Batch,
    Lengths,
    batches,
    flags_worst_case,
    packed_rows,
    spec_changes,
    worst,
    worst_any_order,
)
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..core.units import fmt_bytes
from .scaling import ScalingEstimator

LENGTH_STEP = 128     # max_length candidates are multiples of this (SEQ_PAD: one scaling regime answers them all)


def batching_of(spec: TrainingSpec) -> tuple[str | None, bool]:
    """(packing, padding_free) of ``spec``: the SFT fields the trl work adds (absent here: no packing)."""
    return getattr(spec, "packing", None), bool(getattr(spec, "padding_free", False))


def shape_spec(spec: TrainingSpec, b: Batch) -> TrainingSpec:
    return spec.replace(**spec_changes(b))


def _shape_text(b: Batch) -> str:
    return f"{b.rows} x {b.tokens} tokens"


def estimate_lengths(spec: TrainingSpec, lengths: Lengths | list[int], budget: Budget | None = None,
                     estimator: ScalingEstimator | None = None) -> Result:
    """The estimate Result of the worst micro-batch the lengths give (over any order), with ``data["lengths"]``:
    the steps in file order, the one that peaks (step, shape, longest sample, its peaks) and, against ``budget``
    (default: the whole ``spec.gpu``), the largest max_length / micro-batch that fit and bfd packing's worst step."""
    if spec.seq_len is None:
        raise SpecError("--lengths needs --seq-len: the max_length samples are truncated at (TRL's SFTConfig.max_length)",
                        hint="add --seq-len 2048 (TRL's default max_length is 1024)")
    if is_distributed(spec):
        raise SpecError("--lengths with several GPUs is not modelled yet (each rank gets its own batches)",
                        hint="estimate one GPU with --lengths, then the shape it names with --world-size")
    if not isinstance(lengths, Lengths):
        lengths = Lengths(tuple(lengths))
    est = estimator or ScalingEstimator(workers=1)
    packing, pf = batching_of(spec)
    B, L = spec.batch_size, spec.seq_len
    bs = batches(lengths, B, L, packing, pf)
    any_ = worst_any_order(lengths, B, L, packing, pf)
    r = est.estimate(shape_spec(spec, any_))
    info = _summary(lengths, bs, any_, L, packing, pf)
    if lengths.ordered:
        w, rw = _file_order_peak(est, spec, bs, any_, r)
        first = max(w.samples, key=lambda i: (lengths.values[i], -i)) if w.samples else None
        info["worst_step"] = {**w.to_dict(), "longest_sample_number": None if first is None else first + 1,
                              "samples": [i + 1 for i in w.samples][:64], **_peaks(rw)}
    info["worst_any_order"] = {**any_.to_dict(), **_peaks(r)}
    budget = budget or Budget.make("total", gpu=spec.gpu)
    v = fits(r, budget)
    info["budget"] = {**budget.to_dict(), **v.to_dict()}
    if not v.fits:
        info["would_fit"] = would_fit(spec, lengths, budget, est)
    info["note"] = lengths_note(info)
    r.data["lengths"] = info
    r.notes.append(info["note"])
    return r


def _file_order_peak(est: ScalingEstimator, spec: TrainingSpec, bs: list[Batch], any_: Batch, r_any: Result):
    """The step of ``bs`` that peaks, and its Result: the most tokens (rows x tokens), and where a shorter batch has
    longer rows (the last, short one), that one too (attention can grow with the square of the length): the larger."""
    cands = list(dict.fromkeys([worst(bs), max(bs, key=lambda b: (b.tokens, b.rows, -b.step))]))
    best = None
    for b in cands:
        rb = r_any if (b.rows, b.tokens) == (any_.rows, any_.tokens) else est.estimate(shape_spec(spec, b))
        if best is None or rb.peak_allocated_bytes > best[1].peak_allocated_bytes:
            best = (b, rb)
    return best


def _peaks(r: Result) -> dict:
    return {"peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes}


def _summary(lengths: Lengths, bs: list[Batch], any_: Batch, L: int, packing, pf: bool) -> dict:
    vals = lengths.values
    return {
        "source": lengths.source, "samples": len(vals), "longest_sample": max(vals), "mean_sample": round(sum(vals) / len(vals), 1),
        "truncated_samples": sum(1 for n in vals if n > L), "max_length": L, "packing": packing,
        "padding_free": pf or packing == "bfd", "steps": len(bs),
        "order": "file order (a sequential sampler); the Trainer shuffles (RandomSampler): worst_any_order bounds every order"
                 if lengths.ordered else "a histogram has no order: worst_any_order only",
        "tokens_per_step": {"min": min(b.size for b in bs), "max": max(b.size for b in bs)},
    }


def lengths_note(info: dict) -> str:
    """One line: which step peaks, with which sample length, and the bound over any order."""
    a = info["worst_any_order"]
    head = (f"lengths ({info['samples']} samples, longest {info['longest_sample']} tokens, max_length {info['max_length']}"
            f"{', packing ' + info['packing'] if info['packing'] else ''}{', padding-free' if info['padding_free'] else ''}): ")
    if "worst_step" in info:
        w = info["worst_step"]
        which = f" (sample {w['longest_sample_number']})" if w.get("longest_sample_number") else ""
        head += (f"in file order step {w['step']} of {info['steps']} peaks ({w['rows']} x {w['tokens']} tokens, its longest sample "
                 f"{w['longest_sample']} tokens{which}, {fmt_bytes(w['peak_allocated_bytes'])} allocated); ")
    head += (f"any order: at most {a['rows']} x {a['tokens']} tokens, {fmt_bytes(a['peak_allocated_bytes'])} allocated, "
             "the peak reported here")
    b = info.get("budget")
    if b and not b["fits"]:
        head += (f"; that does not fit the budget ({fmt_bytes(b['usable_bytes'])} usable of {fmt_bytes(b['budget_bytes'])}: "
                 f"needs {fmt_bytes(b['need_bytes'])} reserved)")
    fit = info.get("would_fit")
    if fit:
        head += "; " + fit["summary"]
    return head + "."


def _fits(est: ScalingEstimator, spec: TrainingSpec, b: Batch, budget: Budget) -> tuple[bool, int]:
    r = est.estimate(shape_spec(spec, b))
    v = fits(r, budget)
    return v.fits, v.need_bytes


def _largest(cands: list, ok) -> tuple:
    """The largest of ascending ``cands`` for which ``ok(c)`` holds (monotone: ok at c implies ok below), by bisection."""
    lo, hi, best = 0, len(cands) - 1, (None, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        good, need = ok(cands[mid])
        if good:
            best, lo = (cands[mid], need), mid + 1
        else:
            hi = mid - 1
    return best


def would_fit(spec: TrainingSpec, lengths: Lengths, budget: Budget, est: ScalingEstimator) -> dict:
    """The largest max_length (a multiple of 128 below the current) and the largest micro-batch whose worst step
    (any order) fits ``budget``, and bfd packing's worst step. The max_length candidates share one scaling regime
    (same residue modulo 128), so after a few traces the rest are replays."""
    packing, pf = batching_of(spec)
    B, L = spec.batch_size, spec.seq_len
    out: dict = {"usable_bytes": budget.usable_bytes}

    def at_length(n: int) -> Batch:
        return worst_any_order(lengths, B, n, packing, pf)

    cands = [n for n in range(LENGTH_STEP, L, LENGTH_STEP)]
    if cands and not (packing or pf):     # padded shapes (B, min(longest, n)): the regime's traces, then replays
        est.prepare([shape_spec(spec, at_length(n)) for n in cands])
    n, need = _largest(cands, lambda n: _fits(est, spec, at_length(n), budget))
    out["max_length"] = None if n is None else {"max_length": n, "shape": _shape_text(at_length(n)), "need_bytes": need,
                                                  "truncated_samples": sum(1 for v in lengths.values if v > n)}
    sizes = list(range(1, B))
    b, need = _largest(sizes, lambda b: _fits(est, spec, worst_any_order(lengths, b, L, packing, pf), budget))
    out["batch_size"] = None if b is None else {"batch_size": b, "grad_accum": -(-B * spec.grad_accum // b),
                                                "shape": _shape_text(worst_any_order(lengths, b, L, packing, pf)), "need_bytes": need}
    if packing is None:
        rows = sorted((t for t, _, _ in packed_rows(lengths.values, L, "bfd")), reverse=True)[:B]
        pk = Batch(0, 1, sum(rows), (), 0)
        try:
            ok, need = _fits(est, spec, pk, budget)
        except SpecError as e:        # e.g. one row longer than the model's positions (padding-free restarts them per sample)
            out["packing_bfd"] = {"shape": _shape_text(pk), "fits": None, "not_estimated": e.message}
        else:
            out["packing_bfd"] = {"shape": _shape_text(pk), "fits": ok, "need_bytes": need}
    out["summary"] = _would_fit_text(out, spec)
    out["estimates"] = est.stats()      # how many were simulated, how many replayed from their traces
    return out


def _would_fit_text(out: dict, spec: TrainingSpec) -> str:
    words = []
    m = out["max_length"]
    words.append(f"max_length {m['max_length']} would fit ({m['shape']}, {m['truncated_samples']} samples truncated)" if m
                 else "no max_length (multiple of 128) fits at this batch size")
    b = out["batch_size"]
    if b:
        words.append(f"batch size {b['batch_size']} with --grad-accum {b['grad_accum']} would fit ({b['shape']}; "
                     f"{b['batch_size'] * b['grad_accum']} samples per optimizer step)")
    elif spec.batch_size > 1:
        words.append("no smaller batch size fits at this max_length")
    p = out.get("packing_bfd")
    if p and p["fits"] is None:
        words.append(f"bfd packing's worst step ({p['shape']}, padding-free) not estimated here ({p['not_estimated']})")
    elif p:
        words.append(f"bfd packing's worst step ({p['shape']}, padding-free) {'would fit' if p['fits'] else 'would not fit'}"
                     " (approximated as a plain row of that many tokens)")
    return "under the budget, " + "; ".join(words)


def flags_note(spec: TrainingSpec, seq_len: int | None) -> str | None:
    """Without --lengths: the one line that says the estimate is the worst case of the flags."""
    if not seq_len:
        return None
    packing, pf = batching_of(spec)
    b = flags_worst_case(spec.batch_size, seq_len, packing, pf)
    return (f"lengths: every sample at {seq_len} tokens ({_shape_text(b)} per step), the worst case of these flags; a collator "
            "that pads to each batch's longest sample gives smaller steps (--lengths FILE finds the step that peaks).")
