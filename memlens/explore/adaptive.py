"""Adaptive micro-batching: when a step runs out of memory, run it in smaller pieces, with the same
effective batch, the same loss scaling and the same optimizer step.

    ab = memlens.adaptive_batch(optimizer, micro_batch=16)      # or spec=..., budget=...: start from memlens.fit
    for batch in loader:                                         # each batch is one optimizer step's batch
        loss = ab.step(batch, lambda mb: model(**mb).loss)       # the mean loss of a micro-batch
    ab.result.data.changes                                       # every change, with its reason

How. Each batch is cut along its first dimension into micro-batches of ``micro_batch`` rows; each
micro-batch's loss is weighted by its share of the batch (rows, or ``weight_fn``: tokens) before
its backward, so the summed gradients are those of the whole batch's mean loss; then one optimizer
step. When a micro-batch runs out of memory:

- in its forward (no gradient touched yet): the micro-batch is halved and the batch goes on from
  that micro-batch, with the RNG state it started with;
- in its backward (some gradients may hold part of it): the gradients are dropped and the whole
  accumulation window is redone at the halved size, from the RNG state it started with;
- in the optimizer step: nothing smaller would help (the step's own memory does not depend on the
  batch): the error goes on.

Before redoing, what the failed attempt held is freed (the exception and its frames are gone,
``gc.collect()``, ``torch.cuda.empty_cache()``). The micro-batch never goes below
``min_micro_batch``: an OOM there goes on as it was, so nothing loops forever. Between steps, the
trend of memory per step (:class:`memlens.measure.monitor.StepTrend`) is extrapolated
``lookahead`` steps; when the predicted peak no longer fits what PyTorch can hold (the fit rule of
:mod:`memlens.core.fits`), the micro-batch is halved before the OOM. Every change is logged
(``logging`` at WARNING, and ``on_change``) and kept in ``result``.

The same mechanism drives the Hugging Face and Lightning callbacks (``adaptive=True``), which split
the batch their trainer hands to one training step (:mod:`memlens.integrations`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..core.errors import MemlensError
from ..core.fits import MARGIN_MIN_BYTES, Budget, Need, fits
from ..core.payloads import AdaptivePayload
from ..core.result import Result
from ..core.units import fmt_bytes
from ..measure.guard import free_cuda_cache, is_oom
from ..measure.monitor import StepTrend
from .fit import fit

log = logging.getLogger("memlens.adaptive")


@dataclass
class BatchChange:
    """One change of the micro-batch, and why."""

    step: int                       # the optimizer step it happened in (1-based)
    reason: str                     # "start" (from the estimate), "oom", "trend"
    micro_batch_from: int
    micro_batch_to: int
    accumulation_from: int          # micro-batches per optimizer step
    accumulation_to: int
    detail: str
    time_s: float

    def describe(self) -> str:
        return (f"step {self.step}: micro-batch {self.micro_batch_from} -> {self.micro_batch_to}, "
                f"{self.accumulation_from} -> {self.accumulation_to} micro-batches per step ({self.reason}: {self.detail})")


# ---------------------------------------------------------------- batches
def batch_rows(batch: Any) -> int:
    """Rows of a batch: the first dimension of its first tensor (dicts, lists, tuples, dataclasses of tensors).

    >>> import torch
    >>> batch_rows({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(6, 3)})
    6
    """
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise MemlensError("the batch holds no tensor with a batch dimension",
                       hint="pass a tensor, or a dict/list/tuple of tensors whose first dimension is the batch")


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every tensor whose first dimension is ``rows``; the rest as it is.

    >>> import torch
    >>> b = slice_batch({"x": torch.arange(6).view(6, 1), "scale": torch.tensor(2.0)}, 2, 4, 6)
    >>> b["x"].flatten().tolist(), b["scale"].item()
    ([2, 3], 2.0)
    """
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

    if start == 0 and stop == rows:
        return batch
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows else t, batch)


# ---------------------------------------------------------------- the rule
class MicroBatchPolicy:
    """The micro-batch and its changes: halve, never below ``min_micro_batch``, log each change.

    >>> p = MicroBatchPolicy(micro_batch=8)
    >>> p.halve(1, "oom", "test"), p.micro_batch, p.accumulation(32)
    (True, 4, 8)
    >>> p.halve(1, "oom", "test") and p.halve(1, "oom", "test") and p.halve(1, "oom", "test")
    False
    >>> p.micro_batch, len(p.changes)
    (1, 3)
    """

    def __init__(self, micro_batch: int | None = None, min_micro_batch: int = 1,
                 on_change: Callable[[BatchChange], None] | None = None):
        for name, v in (("micro_batch", micro_batch), ("min_micro_batch", min_micro_batch)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MemlensError(f"{name} must be a whole number >= 1, got {v!r}", hint=f"e.g. {name}=8")
        if micro_batch is not None and micro_batch < min_micro_batch:
            raise MemlensError(f"micro_batch {micro_batch} is below min_micro_batch {min_micro_batch}",
                               hint="lower min_micro_batch or raise micro_batch")
        self.micro_batch = micro_batch          # None: the whole batch until the first change
        self.min_micro_batch = min_micro_batch
        self.on_change = on_change
        self.changes: list[BatchChange] = []
        self.last_rows: int | None = None       # rows of the last batch seen (for accumulation counts)
        self._t0 = time.monotonic()

    def size(self, rows: int) -> int:
        """The micro-batch for a batch of ``rows``."""
        self.last_rows = rows
        return rows if self.micro_batch is None else min(self.micro_batch, rows)

    def accumulation(self, rows: int) -> int:
        """Micro-batches per batch of ``rows``."""
        m = self.micro_batch or rows
        return -(-rows // m)

    def can_halve(self, rows: int | None = None) -> bool:
        cur = self.micro_batch if self.micro_batch is not None else (rows or self.last_rows or 1)
        return cur // 2 >= self.min_micro_batch

    def halve(self, step: int, reason: str, detail: str, rows: int | None = None) -> bool:
        rows = rows or self.last_rows or self.micro_batch or 1
        cur = self.micro_batch if self.micro_batch is not None else rows
        new = cur // 2
        if new < self.min_micro_batch:
            return False
        return self.set(new, step, reason, detail, rows, cur)

    def set(self, new: int, step: int, reason: str, detail: str, rows: int | None = None, cur: int | None = None) -> bool:
        rows = rows or self.last_rows or new
        cur = cur if cur is not None else (self.micro_batch if self.micro_batch is not None else rows)
        change = BatchChange(step, reason, cur, new, -(-rows // cur), -(-rows // new), detail,
                             round(time.monotonic() - self._t0, 3))
        self.micro_batch = new
        self.changes.append(change)
        log.warning("memlens adaptive batch: %s", change.describe())
        if self.on_change is not None:
            self.on_change(change)
        return True


# ---------------------------------------------------------------- running a batch in pieces
class SplitRunner:
    """Runs the batches of one accumulation window in micro-batches and recovers from OOMs (see the
    module docstring). ``forward_backward(micro, factor)`` runs one micro-batch: its forward, the loss
    times ``factor`` (its share of the batch), and its backward; it calls :meth:`backward_starts`
    right before the backward and returns the (detached) weighted loss."""

    def __init__(self, policy: MicroBatchPolicy, forward_backward: Callable[[Any, float], Any],
                 zero_grad: Callable[[], None], *, weight_fn: Callable[[Any], float] | None = None,
                 normalized: Callable[[], bool] = lambda: False, restore_rng: bool = True,
                 step_fn: Callable[[], int] = lambda: 0):
        self.policy = policy
        self.forward_backward = forward_backward
        self.zero_grad = zero_grad
        self.weight_fn = weight_fn
        self.normalized = normalized            # True: the loss is already a share of the window (HF num_items)
        self.restore_rng = restore_rng
        self.step_fn = step_fn
        self.window: list[Any] = []
        self.in_backward = False
        self.ooms = 0
        self.replays = 0
        self._window_rng = None

    def new_window(self) -> None:
        """The next batches accumulate into fresh gradients (after the optimizer step / zero_grad)."""
        self.window = []
        self._window_rng = _rng_state() if self.restore_rng else None

    def backward_starts(self) -> None:
        self.in_backward = True

    def run(self, batch: Any) -> Any:
        """Run ``batch`` (the next of the window); returns the sum of its micro-batches' losses."""
        if self._window_rng is None and self.restore_rng:
            self._window_rng = _rng_state()
        self.window.append(batch)
        last = len(self.window) - 1
        idx, row, total = last, 0, None
        chunk_rng = None
        while True:
            try:
                while idx < len(self.window):
                    b = self.window[idx]
                    n = batch_rows(b)
                    weights = self._weights(b, n)
                    while row < n:
                        size = self.policy.size(n)
                        stop = min(row + size, n)
                        factor = weights(row, stop)
                        if factor == 0.0:           # nothing of the loss in this part (all padding): skip it
                            row = stop
                            continue
                        chunk_rng = _rng_state() if self.restore_rng else None
                        self.in_backward = False
                        loss = self.forward_backward(slice_batch(b, row, stop, n), factor)
                        if idx == last and loss is not None:
                            total = loss if total is None else total + loss
                        del loss
                        row = stop
                    idx, row = idx + 1, 0
                return total
            except Exception as e:  # noqa: BLE001 - only OOMs are handled; the rest goes on
                if not is_oom(e) or not self.policy.can_halve(batch_rows(self.window[idx])):
                    raise
                failed = (str(e).split("\n")[0][:300], self.in_backward)
            # outside the except block: the exception, its traceback and the frames holding the failed
            # micro-batch's tensors are gone; collect their cycles and hand the cache back
            self.ooms += 1
            free_cuda_cache()
            msg, in_backward = failed
            where = "backward" if in_backward else "forward"
            if in_backward:
                self.zero_grad()
                self.replays += 1
                _set_rng(self._window_rng)
                idx, row, total = 0, 0, None
                detail = f"OOM in a backward; gradients dropped, the accumulation window redone: {msg}"
            else:
                _set_rng(chunk_rng)
                detail = f"OOM in a forward; the batch goes on from row {row}: {msg}"
            self.policy.halve(self.step_fn(), "oom", detail, batch_rows(self.window[idx]))
            log.debug("memlens adaptive batch: recovered from an OOM in %s", where)

    def _weights(self, batch: Any, n: int) -> Callable[[int, int], float]:
        """Each micro-batch's share of the batch's loss: 1 when the loss is already normalized over
        the window, else its rows (or ``weight_fn``: e.g. label tokens) over the batch's."""
        if self.normalized():
            return lambda a, b: 1.0
        if self.weight_fn is None:
            return lambda a, b: (b - a) / n
        whole = float(self.weight_fn(batch))
        if whole <= 0:
            return lambda a, b: (b - a) / n
        return lambda a, b: float(self.weight_fn(slice_batch(batch, a, b, n))) / whole


# ---------------------------------------------------------------- trend: act before the OOM
class TrendGuard:
    """After each optimizer step: record memory, and tell whether the trend predicts an OOM within
    ``lookahead`` steps. ``probe()`` returns (allocated now, running max allocated, reserved now, bytes
    PyTorch could hold). The prediction goes through the one fit rule: need = min(reserved, allocated
    x 1.10) extrapolated ``lookahead`` steps by the slope of memory left at the end of a step, against
    what PyTorch could hold less the rule's minimum margin, 256 MiB (a measurement has no estimate error
    to cover; :mod:`memlens.core.fits`)."""

    def __init__(self, lookahead: int = 20, window: int = 10, probe: Callable[[], tuple[int, int, int, int]] | None = None):
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise MemlensError(f"lookahead must be a whole number of steps >= 1, got {lookahead!r}", hint="e.g. lookahead=20")
        self.lookahead = lookahead
        self.trend = StepTrend(window=window)
        self.probe = probe or cuda_probe
        self.last: dict[str, int] | None = None

    def after_step(self, step: int) -> str | None:
        """A reason to halve now (the prediction, in words), or None."""
        end, peak, reserved, reachable = self.probe()
        self.trend.record(step, end, peak)
        pred = self.trend.predicted_peak(self.lookahead)
        self.last = {"end_bytes": end, "peak_bytes": peak, "reserved_bytes": reserved, "reachable_bytes": reachable}
        if pred is None:
            return None
        grow = int(self.trend.slope() * self.lookahead)
        try:
            # a measured trend has no estimate error to cover: the rule's 256 MiB floor, not its 5%
            b = Budget.make(reachable, context_bytes=0, margin=MARGIN_MIN_BYTES)
        except MemlensError:
            return (f"memory grows {fmt_bytes(self.trend.slope())}/step and only {fmt_bytes(reachable)} is reachable: "
                    f"less than the fit rule's {fmt_bytes(MARGIN_MIN_BYTES)} margin")
        v = fits(Need(peak_allocated_bytes=pred, peak_reserved_bytes=reserved + grow), b)
        if v.fits:
            return None
        return (f"memory grows {fmt_bytes(self.trend.slope())}/step; in {self.lookahead} steps the peak would be "
                f"{fmt_bytes(pred)}, needing {fmt_bytes(v.need_bytes)} of the {fmt_bytes(v.usable_bytes)} usable")

    def reset(self) -> None:
        self.trend.reset()


def cuda_probe() -> tuple[int, int, int, int]:
    """(allocated now, running max allocated, reserved, what PyTorch could hold) on the current CUDA
    device; the last is reserved + free, capped by ``set_per_process_memory_fraction`` when one is set."""
    import torch  # heavy: torch, loaded on first use

    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    reachable = reserved + int(free)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        frac = get_fraction()
        if 0 < frac < 1:
            reachable = min(reachable, int(frac * total))
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), reserved, reachable


# ---------------------------------------------------------------- a plain training loop
class AdaptiveBatch:
    """Adaptive micro-batching for a plain loop: :meth:`step` runs one optimizer step on a batch."""

    def __init__(self, optimizer, *, micro_batch: int | None = None, min_micro_batch: int = 1, scaler=None,
                 spec=None, budget: int | str | None = None, fit_fn: Callable | None = None, trend: bool = True,
                 lookahead: int = 20, trend_window: int = 10, probe: Callable | None = None,
                 restore_rng: bool = True, on_change: Callable[[BatchChange], None] | None = None):
        self.optimizer = optimizer
        self.scaler = scaler
        self.policy = MicroBatchPolicy(micro_batch, min_micro_batch, on_change)
        self.start_fit: dict[str, Any] | None = None
        if spec is not None:
            self._start_from_fit(spec, budget, fit_fn, micro_batch)
        self.trend = TrendGuard(lookahead, trend_window, probe) if trend else None
        self.steps = 0
        self.losses: list[float] = []
        self._loss_fn: Callable | None = None
        self.runner = SplitRunner(self.policy, self._forward_backward, self._zero_grad, restore_rng=restore_rng,
                                  step_fn=lambda: self.steps + 1)

    def _start_from_fit(self, spec, budget, fit_fn, given: int | None) -> None:
        self.start_fit = start_from_fit(self.policy, spec, budget, spec.batch_size * spec.grad_accum, fit_fn)

    # the runner's callbacks
    def _forward_backward(self, micro, factor: float):
        loss = self._loss_fn(micro)
        weighted = loss * factor
        del loss
        self.runner.backward_starts()
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        return weighted.detach()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batch: Any, loss_fn: Callable[[Any], Any], *, weight_fn: Callable[[Any], float] | None = None,
             before_optimizer: Callable[[], None] | None = None):
        """One optimizer step on ``batch``: ``loss_fn(micro_batch)`` returns the mean loss of a
        micro-batch; ``weight_fn(part)`` (default: its rows) weighs the micro-batches' losses
        (e.g. the number of label tokens, for a loss averaged over tokens); ``before_optimizer()``
        runs between the last backward and the optimizer step (gradient clipping; with a scaler,
        unscale first). Returns the batch's loss (a detached tensor)."""
        self._loss_fn = loss_fn
        self.runner.weight_fn = weight_fn
        self.runner.new_window()
        total = self.runner.run(batch)
        self._loss_fn = None
        if before_optimizer is not None:
            before_optimizer()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.trend is not None:
            why = self.trend.after_step(self.steps)
            if why and self.policy.halve(self.steps, "trend", why, batch_rows(batch)):
                self.trend.reset()
        return total

    @property
    def micro_batch(self) -> int | None:
        return self.policy.micro_batch

    @property
    def changes(self) -> list[BatchChange]:
        return self.policy.changes

    @property
    def result(self) -> Result:
        rows = self.policy.last_rows
        data = AdaptivePayload(micro_batch=self.policy.micro_batch or rows, effective_batch=rows,
                               accumulation=self.policy.accumulation(rows) if rows else None, steps=self.steps,
                               ooms_recovered=self.runner.ooms, windows_redone=self.runner.replays,
                               changes=[asdict(c) for c in self.policy.changes], start_fit=self.start_fit,
                               trend=self.trend.last if self.trend is not None else None)
        notes = [c.describe() for c in self.policy.changes]
        return Result(verb="adaptive", data=data, notes=notes)


def adaptive_batch(optimizer, **kwargs) -> AdaptiveBatch:
    """An :class:`AdaptiveBatch` for a plain loop (see the module docstring).

    Keyword arguments: ``micro_batch`` (start; default the whole batch), ``min_micro_batch`` (1),
    ``scaler`` (a GradScaler), ``spec`` + ``budget`` (start from memlens.fit's largest micro-batch),
    ``trend`` (halve before an OOM the trend predicts, default True), ``lookahead`` (20 steps),
    ``restore_rng`` (redo a step from the RNG state it started with, default True), ``on_change``.
    """
    return AdaptiveBatch(optimizer, **kwargs)


# ---------------------------------------------------------------- helpers
def _fit(spec, budget, target: int | None = None):
    """memlens.fit's answer for ``spec``. Without a budget: what PyTorch could hold on this GPU now
    (reserved + free, so a model already on the GPU is not counted twice; no context to take off)."""
    ctx = None
    if budget is None:
        import torch  # heavy: torch, loaded on first use

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            # measured on this GPU: a Budget (gpu None), not held against the spec's named GPU (memlens.core.fits)
            budget, ctx = Budget.make(torch.cuda.memory_reserved() + int(free), context_bytes=0), 0
    return fit(spec, budget, target_batch=target or spec.batch_size * spec.grad_accum, context_bytes=ctx, plan=False)


def start_from_fit(policy: MicroBatchPolicy, spec, budget, rows: int, fit_fn: Callable | None = None) -> dict:
    """Set ``policy``'s micro-batch to memlens.fit's largest micro-batch of ``spec`` when it is
    smaller than ``rows`` (logged as a "start" change); returns what fit said."""
    r = (fit_fn or _fit)(spec, budget)
    d = r.data
    m = d.get("micro_batch_size") or d.get("max_batch_size")
    said = {k: d.get(k) for k in ("max_batch_size", "micro_batch_size", "grad_accum", "usable_bytes", "budget_bytes",
                                  "predicted_need_bytes") if k in d}
    if not m:
        raise MemlensError(f"memlens.fit finds no micro-batch of {spec.describe()} that fits the budget",
                           hint="see `memlens fit` with this configuration for a plan")
    cur = policy.micro_batch or rows
    if m < cur:
        policy.set(int(m), 0, "start", f"memlens.fit: the largest micro-batch that fits is {m}", rows, cur)
    return said


def _rng_state():
    import torch  # heavy: torch, loaded on first use

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state) -> None:
    if state is None:
        return
    import torch  # heavy: torch, loaded on first use

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
