"""Shared pieces of compare / sweep / fit: a cached estimator and the step-time model.

Everything here returns numbers; nothing prints. A spec for several GPUs is estimated like any
other: ``memlens.estimator.estimate`` simulates each rank that can differ (memlens.step.parallel),
so one spec gives one peak (the rank that peaks) through estimate, compare, sweep and fit.

>>> p = Point(peak_allocated_bytes=10_000, peak_reserved_bytes=11_000, peak_phase="optimizer")
>>> p.peak_allocated_bytes, p.peak_rank
(10000, None)
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .. import estimator as estimator_pkg  # a module: its estimate is asked at call time (tests replace it)
from ..core.errors import MemlensError
from ..core.gpus import HOST_CPU_ADAM_PARAMS_PER_S, INTERCONNECT_BYTES_PER_S, gpu_facts
from ..core.parallel import data_parallel_ranks, sharding_of
from ..core.spec import TrainingSpec
from ..estimator.scaling import FORKED_AUTOGRAD, ScalingEstimator, _ForkUnusable
from ..step.plan import resolve as resolve_step
from .search import divisors


# ---------------------------------------------------------------- one estimate, reduced
@dataclass(frozen=True)
class Point:
    """What the search needs from one estimate (or one measurement) of a spec.

    ``peak_allocated_bytes`` is max_memory_allocated(); ``peak_reserved_bytes`` max_memory_reserved().
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    by_category: dict = field(default_factory=dict, compare=False)
    by_phase: dict = field(default_factory=dict, compare=False)
    peak_phase: str = ""
    param_count: int = 0
    trainable_param_count: int = 0
    seq_len: int | None = None
    timeline: tuple = field(default=(), compare=False)   # ~120 points and the peaks: {"event", "phase", "step", "allocated_bytes", "reserved_bytes"}
    by_component: tuple = field(default=(), compare=False)  # attention / mlp / embedding / norm / lora ... at the peak
    peak_rank: int | None = None        # several GPUs: the rank whose peak this is
    activation_plan: dict | None = field(default=None, compare=False)  # checkpointing / offload costs (estimator/result.py)
    step_time: dict | None = field(default=None, compare=False)   # the per-op step time (memlens.estimator.timing)
    # what the fit rule reads beyond the peaks (memlens.core.fits.need_bytes): DDP's worst case (its stale buckets held),
    # vLLM's share outside the allocator; a Point without it would judge DDP on its expected peak only
    data: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_result(cls, r) -> "Point":
        d = r.data
        tl = list(getattr(r, "timeline", None) or [])
        step = max(1, len(tl) // 120)
        # every step-th point, and the highest allocated and reserved ones (a sampled timeline that misses the
        # peak draws a picture below the figure the table states)
        idx = set(range(0, len(tl), step))
        for key in ("allocated_bytes", "reserved_bytes"):
            if tl and any(pt.get(key) is not None for pt in tl):
                idx.add(max(range(len(tl)), key=lambda i: tl[i].get(key) or 0))
        keep = tuple({k: tl[i].get(k) for k in ("event", "phase", "step", "allocated_bytes", "reserved_bytes")}
                     for i in sorted(idx))
        return cls(int(r.peak_allocated_bytes), int(r.peak_reserved_bytes or r.peak_allocated_bytes),
                   dict(r.by_category or {}), dict(r.by_phase or {}), d.get("peak_phase", ""),
                   int(d.get("param_count") or 0), int(d.get("trainable_param_count") or 0), d.get("seq_len"),
                   timeline=keep, by_component=tuple(d.get("by_component") or ()), peak_rank=d.get("peak_rank"),
                   activation_plan=d.get("activation_plan"), step_time=d.get("step_time"),
                   data={k: d.get(k) for k in ("worst_case", "outside_allocator_bytes") if d.get(k)})


from ..core.fits import need_bytes  # noqa: E402,F401 - the one fit rule (re-exported for the planners)

EstimateFn = Callable[[TrainingSpec], Any]   # spec -> memlens Result (or anything Point.from_result reads)


_ONE_AT_A_TIME = threading.Lock()


class CachedEstimator:
    """Estimates specs once each (a simulated 1B step takes seconds; a sharded spec one simulation
    per rank that can differ).

    ``fn`` defaults to ``memlens.estimator.estimate`` with ``method``; for "simulate", through a
    :class:`~memlens.estimator.scaling.ScalingEstimator`, which answers other batch sizes and
    sequence lengths of a spec already simulated by replaying its traces (the same bytes, a
    fraction of the time; ``prepare`` picks the traces for a known set of specs). A sharded spec
    is estimated per rank (:mod:`memlens.estimator.ranks`), without the replay.

    >>> est = CachedEstimator(fn=lambda s: _Fake(s.batch_size))
    >>> est(TrainingSpec(model="m", batch_size=3)).peak_allocated_bytes, est.calls
    (3000, 1)
    """

    def __init__(self, fn: EstimateFn | None = None, method: str = "simulate"):
        self.method = method
        self._fn = fn
        self.cache: dict[TrainingSpec, Point] = {}
        self.calls = 0
        self.per_rank = 0          # estimates of sharded specs (one simulation per rank that can differ; no replay)
        self.seconds = 0.0
        self.scaler = None
        self._lock = threading.Lock()
        self._inflight: dict[TrainingSpec, Future] = {}
        if fn is None and method == "simulate":
            self.scaler = ScalingEstimator()

    @staticmethod
    def _scalable(spec: TrainingSpec) -> bool:
        """Specs the replay serves (one rank); a sharded spec is simulated per rank, and a --liger spec whole: its fused
        loss's chunk is next_power_of_2 of the tokens (memlens.models.liger.chunk_size), no polynomial in b and L."""
        return not resolve_step(spec, refuse=False).distributed and not spec.liger

    def prepare(self, specs: list[TrainingSpec], progress: Callable[[int, int, TrainingSpec], None] | None = None) -> None:
        """Simulate first the specs that let the others be replayed (see ScalingEstimator.prepare)."""
        if self.scaler is not None:
            self.scaler.prepare([s for s in specs if self._scalable(s)], progress)

    def prefetch(self, specs: list[TrainingSpec], progress: Callable[[int, int, TrainingSpec], None] | None = None) -> None:
        """Estimate ``specs`` now, their simulations side by side in the worker processes (a no-op
        without the scaling estimator: each is then estimated when asked)."""
        if self.scaler is not None:
            self.scaler.prefetch([s for s in specs if self._scalable(s)], progress)

    def begin(self, specs: list[TrainingSpec]) -> None:
        """Start the simulations of ``specs`` in the worker processes, first in their queue, and return."""
        if self.scaler is not None:
            self.scaler.begin([s for s in specs if self._scalable(s)])

    @property
    def workers(self) -> int:
        """Simulations that can run at once (callers may then ask from several threads)."""
        return self.scaler.workers if self.scaler is not None else 1

    def stats(self) -> dict[str, Any]:
        """Estimates made, and with the scaling estimator how many were simulated or replayed."""
        out: dict[str, Any] = {"estimates": self.calls, "seconds": round(self.seconds, 2)}
        if self.scaler is not None:
            out.update(self.scaler.stats())
        if self.per_rank:
            out["per_rank"] = self.per_rank
        return out

    def start(self, spec: TrainingSpec) -> None:
        """Start the worker processes now, from this thread (see ScalingEstimator.start): call it
        before threads that ask for estimates exist."""
        if self.scaler is not None:
            self.scaler.start(spec)

    def known(self, spec: TrainingSpec, field_name: str = "batch_size") -> dict[int, float]:
        """What the fit rule needs (:func:`need_bytes`) of every spec estimated so far that differs
        from ``spec`` only in ``field_name``, by that field's value."""
        names = [f.name for f in fields(spec) if f.name != field_name]
        with self._lock:
            items = list(self.cache.items())
        return {getattr(s, field_name): need_bytes(p) for s, p in items
                if getattr(s, field_name) is not None and all(getattr(s, n) == getattr(spec, n) for n in names)}

    def raw(self, spec: TrainingSpec) -> Point:
        with self._lock:      # threads of a plan may ask at once: one estimate per spec
            hit = self.cache.get(spec)
            if hit is not None:
                return hit
            fut = self._inflight.get(spec)
            mine = fut is None
            if mine:
                fut = self._inflight[spec] = Future()
        if not mine:
            return fut.result()
        t = time.perf_counter()
        try:
            if self.scaler is not None and self._scalable(spec):
                r = self.scaler.estimate(spec)
            elif self._fn is None:
                r = self._elsewhere(spec)
                if resolve_step(spec, refuse=False).distributed:
                    with self._lock:
                        self.per_rank += 1
            else:
                r = self._fn(spec)
            with self._lock:
                p = self.cache[spec] = r if isinstance(r, Point) else Point.from_result(r)
                self.calls += 1
                self.seconds += time.perf_counter() - t
            fut.set_result(p)
            return p
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(spec, None)

    def _elsewhere(self, spec: TrainingSpec):
        """A spec the replay does not serve (sharded: one simulation per rank that can differ): in a
        worker process beside the others when there are workers, else here."""
        if self.scaler is not None and self.scaler.workers > 1 and self.method == "simulate":
            try:
                r = self.scaler.submit(_simulated_point, spec).result()
            except BrokenProcessPool:      # a worker died (killed for memory?)
                r = _ForkUnusable()
            if isinstance(r, _ForkUnusable):   # (or this process' autograd cannot run in a fork): here from now on
                self.scaler.stop_workers()
            elif isinstance(r, MemlensError):
                raise r
            else:
                return r

        with _ONE_AT_A_TIME:   # a rank's simulation owns the process' (fake) process group: one at a time
            return estimator_pkg.estimate(spec, method=self.method)

    def __call__(self, spec: TrainingSpec) -> Point:
        return self.raw(spec)


def _simulated_point(spec: TrainingSpec):
    """``memlens.estimator.estimate(spec)`` reduced to a Point, in a worker process (a MemlensError is returned, not raised;
    where autograd cannot run in a fork, the marker that says so: memlens.estimator.scaling)."""
    try:
        return Point.from_result(estimator_pkg.estimate(spec, method="simulate"))
    except (MemlensError, RuntimeError) as e:
        if FORKED_AUTOGRAD in str(e):
            return _ForkUnusable()
        if isinstance(e, MemlensError):
            return e
        raise


class _Fake:  # for the docstring above
    def __init__(self, b):
        self.peak_allocated_bytes = b * 1000
        self.peak_reserved_bytes = b * 1000
        self.by_category, self.by_phase, self.data, self.timeline = {}, {}, {}, []


# ---------------------------------------------------------------- step time (predicted)
# The per-op model of memlens.estimator.timing where the estimate priced its ops (every simulated Result carries
# ``step_time``); the FLOP model below only for a point without it (a formula estimate, a test's bare Point).
UTIL_HALF_TOKENS = 2048   # the FLOP model's utilisation(t) = t / (t + 2048) for t tokens per micro-batch


@dataclass(frozen=True)
class StepTime:
    seconds: float                      # one optimizer step of the effective batch (all micro-batches)
    parts: dict[str, float]             # per-op: forward, backward, recompute, optimizer, collectives, host, offload;
                                        # FLOP model: compute, recompute, offload, communication
    model: str = "per-op"               # "per-op" (memlens.estimator.timing) | "flop" (the FLOP formula below)

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "parts": self.parts, "model": self.model}


def checkpointed_fraction(spec: TrainingSpec, layers: int | None) -> float:
    """The share of the blocks that checkpointing recomputes: 1 for all, N/layers for some (1 if layers is unknown)."""
    c = spec.checkpoint_layers
    if c is None or not layers:
        return 1.0
    return min(c if isinstance(c, int) else len(c), layers) / layers


def predict_step_time(spec: TrainingSpec, p: Point, *, micro_batch: int | None = None, grad_accum: int | None = None,
                      tokens_per_sample: int | None = None, layers: int | None = None) -> StepTime:
    """Predicted seconds of one optimizer step (all its micro-batches), with its parts.

    Where ``p`` carries the per-op step time of its simulation (``p.step_time``: memlens.estimator.timing), that,
    rescaled to ``micro_batch`` / ``grad_accum`` / ``tokens_per_sample`` when they differ from the priced step's
    (:func:`memlens.estimator.timing.step.rescaled`), if ``p`` is of ``spec``'s setting (the same fields but those).
    Else the FLOP model (:func:`flop_step_time`).
    """
    st = getattr(p, "step_time", None)
    if st:
        from ..estimator.timing.step import setting_key  # the estimator's time model (no torch import)

        if st.get("setting") != setting_key(spec):
            st = None   # another setting's step: the FLOP model (fit's bounds for candidates not estimated yet)
    if not st:
        return flop_step_time(spec, p, micro_batch=micro_batch, grad_accum=grad_accum, tokens_per_sample=tokens_per_sample,
                              layers=layers)
    from ..estimator.timing.step import rescaled  # noqa: PLC0415 - as above

    mb = micro_batch if micro_batch is not None else spec.batch_size
    acc = grad_accum if grad_accum is not None else spec.grad_accum
    if spec.dp and micro_batch is None and grad_accum is None:
        mb = min(spec.physical_batch_size or spec.batch_size, spec.batch_size)
        acc = ceil_div(spec.batch_size, mb) * spec.grad_accum
    L = tokens_per_sample or spec.seq_len or st.get("seq_len")
    if (mb, acc, L) == (st.get("micro_batch_size"), st.get("micro_batches"), st.get("seq_len")):
        return StepTime(float(st["seconds"]), dict(st["parts"]))
    seconds, parts = rescaled(st, mb, acc, L)
    return StepTime(seconds, parts)


def flop_step_time(spec: TrainingSpec, p: Point, *, micro_batch: int | None = None, grad_accum: int | None = None,
                   tokens_per_sample: int | None = None, layers: int | None = None) -> StepTime:
    """The FLOP model: predicted seconds of one optimizer step (all its micro-batches), with its parts.

    Matmul FLOPs per token (Kaplan et al. 2020 / nanoGPT: 6N for training): forward 2N, backward
    2N for activation gradients + 2N_trainable for weight gradients (LoRA keeps only the first);
    checkpointing recomputes the forward (+2N). Utilisation falls for small micro-batches:
    t / (t + 2048) for t tokens per micro-batch (so 8 x 256 tokens run at ~50%, 8 x 2048 at ~89%).
    QLoRA dequantizes weights each matmul (x1.25). Offload adds moving gradients to the CPU and
    parameters back over PCIe, plus the CPU Adam step. ZeRO/FSDP over N GPUs splits the batch N
    ways and adds collectives: 2x (N-1)/N gradient bytes (stages 1-2, like DDP), 3x for stage 3.
    DP-SGD (Opacus): the physical batches of the logical batch are the micro-steps; hooks add the
    per-sample gradient einsums (2N_trainable per token), ghost clipping a second backward pass.

    >>> s = TrainingSpec(model="m", batch_size=8, seq_len=1024)
    >>> p = Point(0, 0, param_count=100_000_000, trainable_param_count=100_000_000)
    >>> round(predict_step_time(s, p).seconds, 3)
    0.154
    >>> round(predict_step_time(s.replace(grad_checkpointing=True), p).seconds / predict_step_time(s, p).seconds, 2)
    1.33

    Checkpointing N of the model's ``layers`` blocks (``checkpoint_layers``) recomputes N/layers of the
    forward (the blocks hold nearly all the FLOPs; without ``layers``, all of it: an upper bound):

    >>> round(predict_step_time(s.replace(checkpoint_layers=8), p, layers=32).parts["recompute"]
    ...       / predict_step_time(s.replace(grad_checkpointing=True), p).parts["recompute"], 2)
    0.25
    """
    mb = micro_batch if micro_batch is not None else spec.batch_size
    acc = grad_accum if grad_accum is not None else spec.grad_accum
    if spec.dp and micro_batch is None and grad_accum is None:
        mb = min(spec.physical_batch_size or spec.batch_size, spec.batch_size)
        acc = ceil_div(spec.batch_size, mb)
    L = tokens_per_sample or p.seq_len or spec.seq_len or 512
    n, nt = max(p.param_count, 1), p.trainable_param_count
    n_ranks = data_parallel_ranks(spec)
    tokens_micro = mb * L
    flops_per_token = 2 * n + 2 * n + 2 * nt
    if spec.dp:
        flops_per_token += (2 * n + 2 * nt) if spec.grad_sample_mode == "ghost" else 2 * nt
    recompute = 2 * n * checkpointed_fraction(spec, layers) if spec.grad_checkpointing else 0
    g = gpu_facts(spec.gpu)
    rate = 1e12 * (g.matmul_tflops_fp32 if spec.precision == "fp32" else g.matmul_tflops_half)
    util = tokens_micro / (tokens_micro + UTIL_HALF_TOKENS)
    slow = 1.25 if spec.qlora else 1.0
    micro_steps = acc
    compute = micro_steps * tokens_micro * flops_per_token * slow / (rate * util)
    recomp = micro_steps * tokens_micro * recompute * slow / (rate * util)
    parts = {"compute": compute, "recompute": recomp}
    grad_bytes = nt * (2 if spec.param_dtype != "float32" else 4)
    if spec.offload_optimizer:
        param_bytes = nt * (2 if spec.param_dtype != "float32" else 4)
        parts["offload"] = (grad_bytes + param_bytes) / g.pcie_bytes_per_s + nt / HOST_CPU_ADAM_PARAMS_PER_S
    if n_ranks > 1:
        factor = 3.0 if sharding_of(spec).shards_parameters else 2.0   # FSDP2 gathers parameters again in backward
        parts["communication"] = factor * (n_ranks - 1) / n_ranks * grad_bytes / INTERCONNECT_BYTES_PER_S
    # the batch per rank: the spec's micro-batch is per GPU, so each rank does all its micro-steps
    return StepTime(sum(parts.values()), {k: v for k, v in parts.items()}, model="flop")


def largest_divisor_at_most(n: int, cap: int) -> int:
    """Largest d <= cap dividing n (micro-batch that keeps the effective batch exact).

    >>> largest_divisor_at_most(48, 10), largest_divisor_at_most(7, 4)
    (8, 1)
    """
    return max((d for d in divisors(n) if d <= max(1, cap)), default=1)



def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fit_with_accumulation(estimate: Callable[[TrainingSpec], Point], spec: TrainingSpec, per_gpu: int, micro: int,
                          usable_bytes: int) -> tuple[int, Point, list[tuple[int, Point]]]:
    """The largest divisor of ``per_gpu`` <= ``micro`` whose run with accumulation fits: the
    micro-batches after the first run with every gradient held, so a micro-batch whose own step fits
    can still not fit accumulated. Returns (that micro-batch, 0 if not even 1 fits; the estimate of
    the last run tried; the micro-batches that did not fit, with their estimates).

    >>> pt = lambda s: _Fake(s.batch_size * 100 + (50 if s.grad_accum > 1 else 0))
    >>> m, p, rejected = fit_with_accumulation(pt, TrainingSpec(model="m"), 16, 8, 660_000)
    >>> m, [r for r, _ in rejected]
    (4, [8])
    """
    rejected: list[tuple[int, Point]] = []
    while True:
        accum = per_gpu // micro
        p = estimate(spec.replace(batch_size=micro, grad_accum=accum))
        if accum == 1 or need_bytes(p) <= usable_bytes:
            return micro, p, rejected
        rejected.append((micro, p))
        if micro == 1:
            return 0, p, rejected
        micro = largest_divisor_at_most(per_gpu, micro - 1)
