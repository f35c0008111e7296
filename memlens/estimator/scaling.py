"""One trace, many sizes: answer a spec at other batch sizes and sequence lengths by replaying
the allocator model over the same event sequence with the sizes re-evaluated.

Why it works. A simulated step's event log (which storages appear and die, in which order, with
which category, module, phase and op) does not depend on the batch size b or the sequence length
L unless the code branches on them (a kernel chosen by size, a data-dependent path). Only the
sizes do, and each size is a polynomial in b and L of low degree (b x L x hidden; b x heads x
L x L for an attention matrix; b x b for a contrastive loss), on which the allocator's rounding
(:mod:`memlens.core.ledger`) acts at replay time.

How (agnostic to what produced the log: any :class:`~memlens.estimator.simulate.Simulation`):

- A *family* is a spec with b and L left open. Every full simulation of a member is a *trace*.
- Traces whose event sequences are equal except for allocation sizes (and whose facts agree:
  parameter counts, attention kernels, what was applied) form a *regime*. A trace whose sequence
  differs starts another regime: the sequence changes with size.
- In a regime, each allocation's size is fitted exactly (rational Lagrange interpolation on a grid
  of traces, integer results) by the polynomial of least degree (<= 2 in each of b and L) that
  reproduces every other trace of the regime to the byte. A size answered off the fitting grid in
  an axis needs a trace off that grid in that axis that the fit reproduced (the check).
- A size is answered by replay only inside the regime's traced range (a kernel threshold between
  traces shows as a changed sequence or a size the fit does not reproduce; one outside the range
  would not), with no trace of another regime inside that range, and for a sequence length of
  the same residue modulo :data:`SEQ_PAD` as the traces (kernels pad sequence dimensions, e.g.
  efficient attention's logsumexp to a multiple of 32, flash's scratch to 128:
  :mod:`memlens.estimator.cuda_rules`). Otherwise the spec is simulated (and becomes a trace), and
  the Result says why in ``data["scaling"]``.

A replayed answer is the full simulation's to the byte: ``tests/estimator/test_scaling.py``
checks it over grids of batch sizes and sequence lengths, and ``bench/scaling_check.py`` on the
built-in models.

>>> from memlens.core.spec import TrainingSpec
>>> est = ScalingEstimator()
>>> r = est.estimate(TrainingSpec(model="gpt2", batch_size=4, seq_len=256))   # doctest: +SKIP
>>> r.data["scaling"]["answer"]                                                # doctest: +SKIP
'simulated'
"""
from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property
from math import lcm
from typing import Any, Callable

from ..core import progress
from ..core import progress as _progress
from ..core.errors import MemlensError
from ..core.events import ALLOC, Alloc, EventLog, until_done
from ..core.ledger import analyze
from ..core.spec import TrainingSpec
from ..models.source import resolve
from . import depth
from .depth import write_layers
from .reduce_scratch import ReduceScratch
from .result import simulation_result
from .timing.record import timing_at

SEQ_PAD = 128        # sequence lengths answered from one regime share their residue modulo this
MAX_DEGREE = 2       # per axis
AXES = ("batch_size", "seq_len")

Point = tuple        # (batch size, sequence length or None)


def family_of(spec: TrainingSpec) -> tuple[tuple, Point]:
    """(family key, point): the spec without b and L (plus L's residue), and (b, L)."""
    d = spec.to_dict()
    b, L = d.pop("batch_size"), d.pop("seq_len")
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))
    return key + (("seq_len_residue", None if L is None else L % SEQ_PAD),), (b, L)


# ---------------------------------------------------------------- one trace
def _by_name(events: list) -> list:
    """The events with each allocation's op by name (ops do not pickle; names compare as ops do). A reduction's
    scratch keeps its op: what sizes it (:class:`~memlens.estimator.reduce_scratch.ReduceScratch`)."""
    names: dict = {}
    out = []
    for ev in events:
        if ev.kind == ALLOC and not isinstance(ev.op, (str, ReduceScratch)):
            name = names.get(ev.op)
            if name is None:
                name = names[ev.op] = str(ev.op)
            ev = Alloc(ALLOC, ev.key, ev.nbytes, ev.category, ev.module, ev.phase, name, ev.rank, ev.stream)
        out.append(ev)
    return out


@dataclass
class Trace:
    """A simulation at one point. Its log, skeleton and sizes are made when first asked for: a
    simulation written from a shallow one (:mod:`.depth`) comes from a worker as that shallow log
    and how to write it, and most traces are never compared or replayed."""

    point: Point
    sim: Any                      # memlens.estimator.simulate.Simulation (log None: to write from sim.written)

    @classmethod
    def of(cls, sim, point: Point) -> "Trace":
        return cls(point, sim)

    @cached_property
    def log(self) -> EventLog:
        """The log up to "done", ops by name (the trace's simulation keeps this one only)."""
        sim = self.sim
        if sim.log is None:
            shallow, stack, live, copies, sizes = sim.written
            log = write_layers(shallow, stack, live, copies, sizes=sizes)
        else:
            log = EventLog(events=_by_name(until_done(sim.log.events)), modules=list(sim.log.modules), rank=sim.log.rank)
        self.sim = replace(sim, log=log, written=None)
        return log

    @cached_property
    def skeleton(self) -> list:
        """The events with allocation sizes left out."""
        return [(ALLOC, ev.key, ev.category, ev.module, ev.phase, ev.op.kind if isinstance(ev.op, ReduceScratch) else ev.op,
                 ev.rank, ev.stream) if ev.kind == ALLOC else ev for ev in self.log.events]

    @cached_property
    def derived(self) -> dict[int, ReduceScratch]:
        """Allocations sized by a rule from shapes, by position among allocations: a reduction's scratch."""
        allocs = (ev for ev in self.log.events if ev.kind == ALLOC)
        return {i: ev.op for i, ev in enumerate(allocs) if isinstance(ev.op, ReduceScratch)}

    @cached_property
    def sizes(self) -> list[int]:
        """Allocation sizes, in order."""
        return [ev.nbytes for ev in self.log.events if ev.kind == ALLOC]

    @cached_property
    def facts(self) -> tuple:
        sim = self.sim
        L = self.point[1]
        seq_fact = "L" if L is not None and sim.seq_len == L else sim.seq_len
        return (sim.param_count, sim.trainable_count, sim.image_size, tuple(sim.attention), tuple(sim.applied),
                sim.later_steps, seq_fact, tuple(self.log.modules), sim.source.to_dict().get("name"), sim.later_micro_batches)


# ---------------------------------------------------------------- exact interpolation
def _lagrange(nodes: tuple, x: int) -> list[Fraction]:
    """Weights of the values at ``nodes`` for the interpolating polynomial at ``x``."""
    out = []
    for i, xi in enumerate(nodes):
        w = Fraction(1)
        for j, xj in enumerate(nodes):
            if j != i:
                w *= Fraction(x - xj, xi - xj)
        out.append(w)
    return out


@dataclass
class _Space:
    """Polynomials of degree <= db in b and <= dL in L, interpolated on the grid bnodes x Lnodes."""

    db: int
    dL: int
    bnodes: tuple
    Lnodes: tuple
    nodes: list[int]              # trace indices of the grid, row-major (b, then L)
    checks: list[int]             # the other traces
    evidence_b: bool              # a check off bnodes exists
    evidence_L: bool
    _w: dict = field(default_factory=dict)

    def weights(self, x: Point) -> tuple[list[int], int]:
        """Integer weights and denominator: value(x) = sum(w_i * value(node_i)) / den."""
        hit = self._w.get(x)
        if hit is None:
            wb = _lagrange(self.bnodes, x[0])
            wl = _lagrange(self.Lnodes, x[1]) if self.dL or self.Lnodes[0] is not None else [Fraction(1)]
            fr = [a * c for a in wb for c in wl]
            den = lcm(*(f.denominator for f in fr))
            hit = self._w[x] = ([int(f * den) for f in fr], den)
        return hit

    def answers(self, x: Point) -> bool:
        return (x[0] in self.bnodes or self.evidence_b) and (x[1] in self.Lnodes or self.evidence_L)


class _NoAnswer(Exception):
    pass


class Regime:
    """Traces with one event sequence, and the fit of their sizes."""

    def __init__(self, first: Trace):
        self.traces: list[Trace] = [first]
        self.template = first
        self._fit: tuple[list[_Space], list[int], list[int]] | str | None = None
        self._derived: dict[int, list[tuple[int, list[int]]]] = {}   # allocation -> (space, values) per number

    def matches(self, t: Trace) -> bool:
        return t.facts == self.template.facts and t.skeleton == self.template.skeleton

    def add(self, t: Trace) -> None:
        self.traces.append(t)
        self._fit = None

    def hull(self) -> tuple[tuple[int, int], tuple]:
        bs = [t.point[0] for t in self.traces]
        Ls = [t.point[1] for t in self.traces]
        return (min(bs), max(bs)), ((min(Ls), max(Ls)) if Ls[0] is not None else (None, None))

    def contains(self, x: Point) -> bool:
        (b0, b1), (L0, L1) = self.hull()
        return b0 <= x[0] <= b1 and (L0 is None or L0 <= x[1] <= L1)

    # -- fitting
    def _spaces(self) -> list[_Space]:
        pts = [t.point for t in self.traces]
        index = {p: i for i, p in enumerate(pts)}
        bvals = sorted({p[0] for p in pts})
        Lvals = sorted({p[1] for p in pts}, key=lambda v: (v is None, v))
        out = []
        for db, dL in sorted(itertools.product(range(MAX_DEGREE + 1), repeat=2), key=lambda d: ((d[0] + 1) * (d[1] + 1), d)):
            best = None
            for bn in itertools.combinations(bvals, db + 1):
                for Ln in itertools.combinations(Lvals, dL + 1):
                    grid = [(b, L) for b in bn for L in Ln]
                    if not all(g in index for g in grid):
                        continue
                    nodes = [index[g] for g in grid]
                    checks = [i for i in range(len(pts)) if i not in nodes]
                    eb = any(pts[i][0] not in bn for i in checks)
                    eL = any(pts[i][1] not in Ln for i in checks)
                    score = (eb + eL, bn[0] == bvals[0] and bn[-1] == bvals[-1])
                    if best is None or score > best[0]:
                        best = (score, _Space(db, dL, bn, Ln, nodes, checks, eb, eL))
            if best is not None:
                out.append(best[1])
        return out

    def fit(self) -> tuple[list[_Space], list[int], list[int]] | str:
        """(spaces, the space of each varying allocation, their positions among allocations), or why not."""
        if self._fit is not None:
            return self._fit
        spaces = self._spaces()
        cols = [t.sizes for t in self.traces]
        varying: list[int] = []
        chosen: list[int] = []
        n = len(cols[0])
        derived = self.template.derived
        for e in range(n):
            if e in derived:
                continue
            si = self._fit_column([c[e] for c in cols], spaces)
            if si is None:
                self._fit = (f"allocation {e} ({self._describe(e)}) fits no polynomial of degree <= {MAX_DEGREE} "
                             f"in batch and seq len that the traces ({self._points()}) determine")
                return self._fit
            if si >= 0:
                varying.append(e)
                chosen.append(si)
        # a reduction's scratch: each number of its input's shape and strides fitted, the size computed again
        self._derived = {}
        for e, op in derived.items():
            numbers = [t.derived[e].numbers for t in self.traces]
            fits = []
            for k in range(len(op.numbers)):
                si = self._fit_column([nums[k] for nums in numbers], spaces)
                if si is None:
                    self._fit = (f"allocation {e} ({self._describe(e)}): its input's shape fits no polynomial of degree "
                                 f"<= {MAX_DEGREE} in batch and seq len that the traces ({self._points()}) determine")
                    return self._fit
                fits.append((si, [nums[k] for nums in numbers]))
                if si >= 0:
                    chosen.append(si)
            self._derived[e] = fits
        self._fit = (spaces, chosen, varying)
        return self._fit

    def _fit_column(self, vals: list[int], spaces: list[_Space]) -> int | None:
        """The index of the first space whose polynomial reproduces every trace's value (-1: a constant), or None."""
        if all(v == vals[0] for v in vals):
            return -1
        for si, sp in enumerate(spaces):
            if sp.db == 0 and sp.dL == 0:
                continue
            if all(self._predict(sp, vals, self.traces[q].point) == vals[q] for q in sp.checks):
                return si
        return None

    @staticmethod
    def _predict(sp: _Space, vals: list[int], x: Point) -> int | None:
        w, den = sp.weights(x)
        num = sum(wi * vals[i] for wi, i in zip(w, sp.nodes))
        q, r = divmod(num, den)
        return None if r else q

    def _describe(self, e: int) -> str:
        i = -1
        for ev in self.template.log.events:
            if ev.kind == ALLOC:
                i += 1
                if i == e:
                    mods = self.template.log.modules
                    module = mods[ev.module] if 0 <= ev.module < len(mods) else '?'
                    return f"{ev.category} in {module} by {ev.op} during {ev.phase}"
        return "?"

    def _points(self) -> str:
        return ", ".join(_fmt(t.point) for t in self.traces)

    # -- answering
    def why_not(self, x: Point) -> str | None:
        """None if ``x`` can be answered by replay, else why not."""
        if not self.contains(x):
            (b0, b1), (L0, L1) = self.hull()
            rng = f"batch {b0}..{b1}" + (f", seq len {L0}..{L1}" if L0 is not None else "")
            return f"{_fmt(x)} is outside the traced range ({rng})"
        fit = self.fit()
        if isinstance(fit, str):
            return fit
        spaces, chosen, _ = fit
        for si in set(chosen):
            if not spaces[si].answers(x):
                return (f"{len(self.traces)} trace(s) ({self._points()}) do not check a size of degree "
                        f"({spaces[si].db}, {spaces[si].dL}) in (batch, seq len) at {_fmt(x)}")
        return None

    def sizes_at(self, x: Point) -> list[int]:
        spaces, chosen, varying = self.fit()  # type: ignore[misc]
        sizes = list(self.template.sizes)
        cols = [t.sizes for t in self.traces]
        for e, si in zip(varying, chosen):
            sp = spaces[si]
            v = self._predict(sp, [c[e] for c in cols], x)
            if v is None or v < 0:
                raise _NoAnswer(f"allocation {e} ({self._describe(e)}) is not a whole number of bytes at {_fmt(x)}")
            sizes[e] = v
        for e, fits in self._derived.items():
            numbers = []
            for si, vals in fits:
                v = vals[0] if si < 0 else self._predict(spaces[si], vals, x)
                if v is None or v < 0:
                    raise _NoAnswer(f"allocation {e} ({self._describe(e)}): its input's shape is not whole at {_fmt(x)}")
                numbers.append(v)
            sizes[e] = self.template.derived[e].at(tuple(numbers)).nbytes
        return sizes

    def simulation_at(self, spec: TrainingSpec, x: Point):
        """The template's simulation with every size re-evaluated at ``x`` (a Simulation of ``spec``)."""
        t0 = time.perf_counter()
        sizes = iter(self.sizes_at(x))
        tpl, tlog = self.template.sim, self.template.log
        events = [ev.resized(next(sizes)) if ev.kind == ALLOC else ev for ev in tlog.events]
        log = EventLog(events=events, modules=tlog.modules, rank=tlog.rank)
        seq_len = x[1] if self.template.facts[6] == "L" else tpl.seq_len
        return replace(tpl, log=log, spec=spec, seq_len=seq_len, seconds=time.perf_counter() - t0, notes=list(tpl.notes),
                       written=None, timing=timing_at(self, x) or tpl.timing)


def _fmt(x: Point) -> str:
    return f"b={x[0]}" + (f" L={x[1]}" if x[1] is not None else "")


# ---------------------------------------------------------------- families
class Family:
    """All traces of one family, split into regimes. A trace is added at once and filed into its
    regime when the family is next asked for a replay (filing compares logs, which may have to be
    written first: :meth:`write_logs` does that before the estimator's lock is taken)."""

    def __init__(self) -> None:
        self._regimes: list[Regime] = []
        self.unfiled: list[Trace] = []
        self.order: list[Point] = []            # every trace's point, in the order added
        self.results: dict[Point, Any] = {}     # exact answers (simulated or replayed), by point
        self.errors: dict[Point, Exception] = {}  # points whose simulation failed (raised again when asked)

    def add(self, t: Trace) -> None:
        self.unfiled.append(t)
        self.order.append(t.point)

    def write_logs(self) -> None:
        """Write the logs that filing the unfiled traces compares (theirs, and each regime's first)."""
        unfiled = list(self.unfiled)
        if unfiled and (self._regimes or len(unfiled) > 1):
            for t in unfiled + [r.template for r in list(self._regimes)]:
                t.skeleton, t.facts

    @property
    def regimes(self) -> list[Regime]:
        """The regimes, every trace filed."""
        for t in self.unfiled:
            for r in self._regimes:
                if r.matches(t):
                    r.add(t)
                    break
            else:
                self._regimes.append(Regime(t))
        self.unfiled = []
        return self._regimes

    def points(self) -> list[Point]:
        return list(self.order)

    def regime_for(self, x: Point) -> tuple[Regime | None, str]:
        regimes = self.regimes
        if not regimes:
            return None, "first trace of this spec"
        reasons = []
        for r in regimes:
            if not r.contains(x):
                reasons.append(r.why_not(x))
                continue
            others = [t.point for o in regimes if o is not r for t in o.traces if r.contains(t.point)]
            if others:
                reasons.append(f"the event sequence changes with size inside the traced range (at {_fmt(others[0])})")
                continue
            why = r.why_not(x)
            if why is None:
                return r, ""
            reasons.append(why)
        return None, reasons[0] if len(regimes) == 1 else "; ".join(dict.fromkeys(reasons))


# ---------------------------------------------------------------- the estimator
def default_workers() -> int:
    """Processes that simulate at once: ``MEMLENS_WORKERS``, else the cores this process may use
    (at most 4: each holds a model skeleton and an event log); 1 where a process cannot be forked
    (the workers are forks of this process, so they start with its imports: not on macOS/Windows)."""
    env = os.environ.get("MEMLENS_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            return 1
    if not sys.platform.startswith("linux"):
        return 1
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - Linux has it
        n = os.cpu_count() or 1
    return max(1, min(n, 4))


def _warm(spec: TrainingSpec) -> None:
    """Before the workers are forked: import what every simulation of ``spec``'s model imports on
    first use (transformers' modeling code, peft, the fake-tensor machinery), once, so that each
    worker starts with it instead of importing it again."""
    import torch  # heavy: torch, loaded on first use
    from torch._subclasses.fake_tensor import FakeTensorMode  # heavy: torch, loaded on first use

    with FakeTensorMode():
        torch.empty(2) + 1                       # the dispatch path (it imports torch._dynamo on first use)
    try:
        cfg = resolve(spec.model).config
        mt = getattr(cfg, "model_type", None)
        if mt:
            mod = mt.replace("-", "_")
            importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        if spec.lora_rank:
            import peft  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up: the simulation reports any real problem
        pass


def _worker_init() -> None:
    """A worker never reports (the progress bar lives in the parent), ignores Ctrl-C (the terminal sends SIGINT to
    the whole process group: the parent alone answers it, in one line, and ends the workers) and ends itself when its
    parent is gone (killed: nobody else would end it)."""
    _progress._current.set(None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, name="memlens-orphan-watch", daemon=True).start()


def end_workers() -> None:
    """End every worker process this process started (at Ctrl-C or a kill: what they compute is no longer wanted;
    waiting for them would hold the exit for as long as their simulations run)."""
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(timeout=2)


# torch's autograd engine refuses to run in a forked child once the parent has started its device
# threads (a CUDA build of torch that has run a backward: torch/csrc/autograd/engine.cpp); the
# worker answers this, and the estimator simulates in its own process from then on
FORKED_AUTOGRAD = "Unable to handle autograd's threading in combination with fork-based multiprocessing"


class _ForkUnusable:
    """What a worker returns when this process' autograd cannot run in a fork."""


def _simulate_in_worker(spec: TrainingSpec, checked: dict | None = None):
    """simulate(spec) in a worker process, and its analysis (the estimate Result, made here beside
    the other workers' rather than in the parent). The log travels back as plain tuples (ops by
    name), or, where it was written from a shallow model's, as that log and how to write it (the
    parent writes it only if a replay needs it). With it, what the worker learnt of which steps'
    layers repeat (``depth.CHECKED``, given by the parent in ``checked``: a family checked in one
    worker is not checked again in another)."""
    from .simulate import simulate  # heavy: imports torch

    depth.CHECKED.update(checked or {})
    before = set(depth.CHECKED)
    try:
        sim = simulate(spec)
    except MemlensError as e:
        return _ForkUnusable() if FORKED_AUTOGRAD in str(e) else e
    except RuntimeError as e:
        if FORKED_AUTOGRAD in str(e):
            return _ForkUnusable()
        raise
    result = simulation_result(sim, analyze(sim.log))
    if sim.written is not None:
        shallow, stack, live, copies, sizes = sim.written
        shallow = EventLog(events=_by_name(shallow.events), modules=list(shallow.modules), rank=shallow.rank)
        sim = replace(sim, log=None, written=(shallow, stack, live, copies, sizes))
    else:
        sim = replace(sim, log=EventLog(events=_by_name(until_done(sim.log.events)), modules=list(sim.log.modules), rank=sim.log.rank))
    learnt = {k: v for k, v in depth.CHECKED.items() if k not in before}
    return _FromWorker(sim, learnt, result)


@dataclass
class _FromWorker:
    """A worker's simulation (see :func:`_simulate_in_worker`), the families whose layers it
    checked (see :mod:`.depth`) and its estimate Result."""

    sim: Any
    checked: dict
    result: Any = None


class ScalingEstimator:
    """``estimate(spec)`` over many sizes of a few specs: replays where it can, simulates where it must.

    ``simulate_fn(spec) -> Simulation`` defaults to :func:`memlens.estimator.simulate.simulate`.
    Every Result carries ``data["scaling"]``: ``answer`` ("simulated" or "replayed"), ``traces``
    (the points simulated for its family), and for a simulated one ``reason`` (why no replay).

    With ``workers`` > 1 (default :func:`default_workers`; always 1 with a ``simulate_fn``),
    simulations run in that many forked worker processes: :meth:`prefetch` and :meth:`prepare`
    start them together, and ``estimate`` may be called from several threads at once (the
    answers do not depend on the order; only which of them were simulated does).
    """

    def __init__(self, simulate_fn: Callable[[TrainingSpec], Any] | None = None, workers: int | None = None):
        self._simulate = simulate_fn
        self.workers = 1 if simulate_fn is not None else (default_workers() if workers is None else max(1, int(workers)))
        self.families: dict[tuple, Family] = {}
        self.simulations = 0
        self.replays = 0
        self.seconds_simulating = 0.0
        self.seconds_replaying = 0.0
        self._lock = threading.RLock()
        self._pending: dict[tuple, tuple[Any, str]] = {}     # (family, point) -> (future, why simulated)
        self._pool: Any = None

    def estimate(self, spec: TrainingSpec):
        """The estimate Result of ``spec`` (identical to ``memlens.estimate(spec)`` but for timings and ``data["scaling"]``)."""
        key, x = family_of(spec)
        self._write_logs(key)
        with self._lock:
            r = self._answer_now(key, spec, x)
            if r is not None:
                return r
            fut, why = self._pending[(key, x)]
        return self._finish(key, spec, x, fut, why)

    def _write_logs(self, key: tuple) -> None:
        """Before the lock: the logs a replay in family ``key`` will compare (so that the other
        threads ask for estimates while they are written)."""
        fam = self.families.get(key)
        if fam is not None:
            fam.write_logs()

    def _answer_now(self, key: tuple, spec: TrainingSpec, x: Point):
        """Under the lock: the Result if known or replayable; else start (or join) its simulation and return None."""
        fam = self.families.setdefault(key, Family())
        hit = fam.results.get(x)
        if hit is not None:
            return hit
        if x in fam.errors:
            raise fam.errors[x]
        if (key, x) in self._pending:
            return None
        regime, why = fam.regime_for(x)
        if regime is not None:
            progress.stage(f"{spec.describe()}: replaying the traces {regime._points()} at this size")
            t0 = time.perf_counter()
            try:
                sim = regime.simulation_at(spec, x)
            except _NoAnswer as e:
                why = str(e)
            else:
                r = self._result(sim, {"answer": "replayed", "traces": [_fmt(p) for p in fam.points()]})
                self.replays += 1
                self.seconds_replaying += time.perf_counter() - t0
                fam.results[x] = r
                return r
        self._pending[(key, x)] = (self._start(spec), why)
        return None

    def start(self, spec: TrainingSpec) -> None:
        """Fork the worker processes now (after importing what simulations of ``spec`` import).

        Call it from the main thread before starting threads that ask for estimates: a process
        forked while another thread holds a lock (an import of a module, say) starts with that
        lock held forever, and a worker that needs it hangs. Otherwise the first simulation forks."""
        if self.workers > 1:
            with self._lock:
                self._ensure_pool(spec)
                self._pool.submit(int).result()      # with "fork", the first submit launches every worker

    def stop_workers(self) -> None:
        """Simulate in this process from now on (a worker died, or autograd cannot run in a fork here)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            self.workers, self._pool = 1, None

    def _ensure_pool(self, spec: TrainingSpec) -> None:
        if self._pool is None:
            _warm(spec)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_worker_init)
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        for stream in (sys.stdout, sys.stderr):   # a forked worker must not flush a copy of unwritten output
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass

    def submit(self, fn: Callable, spec: TrainingSpec) -> Future:
        """``fn(spec)`` in a worker process (``fn`` a module-level function; what it returns is
        pickled back), or here with one worker. For estimates the replay does not serve (a sharded
        spec, one simulation per rank): they run beside the other simulations, not in this process."""
        if self.workers > 1:
            with self._lock:
                self._ensure_pool(spec)
                return self._pool.submit(fn, spec)
        fut: Future = Future()
        try:
            fut.set_result(fn(spec))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def _start(self, spec: TrainingSpec) -> Future:
        if self.workers > 1:
            self._ensure_pool(spec)
            return self._pool.submit(_simulate_in_worker, spec, dict(depth.CHECKED))
        fut: Future = Future()
        try:
            if self._simulate is None:
                from .simulate import simulate  # heavy: imports torch

                fut.set_result(simulate(spec))
            else:
                fut.set_result(self._simulate(spec))
        except MemlensError as e:
            fut.set_result(e)
        return fut

    def _finish(self, key: tuple, spec: TrainingSpec, x: Point, fut: Future, why: str):
        if self.workers > 1 and not fut.done():
            progress.stage(f"{spec.describe()}: simulating (worker processes)")
        try:
            sim = fut.result()
        except BrokenProcessPool:      # a worker died (killed for memory?): simulate here from now on
            sim = _ForkUnusable()
        result = None
        if isinstance(sim, _FromWorker):
            depth.CHECKED.update(sim.checked)
            sim, result = sim.sim, sim.result
        if isinstance(sim, _ForkUnusable):   # (or this process' autograd cannot run in a fork)
            with self._lock:
                self.stop_workers()
                self._pending[(key, x)] = (self._start(spec), why)
                fut = self._pending[(key, x)][0]
            sim = fut.result()
        with self._lock:
            self._pending.pop((key, x), None)
            fam = self.families[key]
            if x in fam.results:
                return fam.results[x]
            if isinstance(sim, MemlensError):
                fam.errors[x] = sim
                raise sim
            fam.add(Trace.of(sim, x))
            self.simulations += 1
            self.seconds_simulating += sim.seconds
            r = self._result(sim, {"answer": "simulated", "reason": why, "traces": [_fmt(p) for p in fam.points()]}, result)
            fam.results[x] = r
            return r

    @staticmethod
    def _result(sim, scaling: dict, result=None):
        """The Result of ``sim`` (``result``: made already, in the worker that simulated it)."""
        if result is not None:
            r = result
        else:
            progress.stage(f"{sim.spec.describe()}: replaying the allocator")
            r = simulation_result(sim, analyze(sim.log))
        r.data["scaling"] = scaling
        return r

    def prefetch(self, specs: list[TrainingSpec], on_done: Callable[[int, int, TrainingSpec], None] | None = None) -> None:
        """Answer ``specs`` (all their simulations started at once with workers); errors are kept for
        when each spec is asked for. ``on_done(i, n, spec)`` after each."""
        specs = list(dict.fromkeys(specs))
        self.begin(specs)
        for i, s in enumerate(specs, 1):
            if on_done:
                on_done(i, len(specs), s)
            try:
                self.estimate(s)
            except MemlensError:
                pass            # raised again when that spec is asked for

    def begin(self, specs: list[TrainingSpec]) -> None:
        """Start the simulations ``specs`` need (with workers; without, nothing) and return at once:
        the worker processes take them in this order, before anything asked for later."""
        if self.workers > 1:
            for s in dict.fromkeys(specs):
                key, x = family_of(s)
                self._write_logs(key)
                with self._lock:
                    try:
                        self._answer_now(key, s, x)
                    except MemlensError:
                        pass

    def trace_points(self, specs: list[TrainingSpec], level: int = 1) -> list[TrainingSpec]:
        """The specs to simulate first so that the others of ``specs`` can be replayed (:func:`design`
        per family), leaving out those already answered."""
        out = []
        for key, pts in self._by_family(specs).items():
            fam = self.families.get(key)
            for x in design(list(pts), level):
                if fam is None or (x not in fam.results and x not in fam.errors):
                    out.append(pts[x])
        return out

    @staticmethod
    def _by_family(specs: list[TrainingSpec]) -> dict[tuple, dict[Point, TrainingSpec]]:
        by_fam: dict[tuple, dict[Point, TrainingSpec]] = {}
        for s in specs:
            key, x = family_of(s)
            by_fam.setdefault(key, {}).setdefault(x, s)
        return by_fam

    def prepare(self, specs: list[TrainingSpec], progress: Callable[[int, int, TrainingSpec], None] | None = None) -> None:
        """Simulate the :meth:`trace_points` of ``specs`` (each is one of them, so nothing is wasted);
        where they leave some of ``specs`` unanswerable, the level-2 design's points too."""
        for level in (1, 2):
            todo = self.trace_points(specs, level)
            if level == 2:
                with self._lock:
                    need = {k for k, pts in self._by_family(specs).items()
                            if any(x not in self.families[k].results and self.families[k].regime_for(x)[0] is None for x in pts)}
                todo = [s for s in todo if family_of(s)[0] in need]
            self.prefetch(todo, progress)

    def stats(self) -> dict[str, Any]:
        return {"simulations": self.simulations, "replays": self.replays, "workers": self.workers,
                "simulate_seconds": round(self.seconds_simulating, 2), "replay_seconds": round(self.seconds_replaying, 2)}


def design(points: list[Point], level: int = 1) -> list[Point]:
    """Which of ``points`` (one family's) to simulate so the rest can be replayed.

    Level 1: the corners of the (b, L) range and one point off both middle lines (the check):
    enough for sizes of degree 1 in each axis (b x L x hidden). Level 2 adds a middle value on
    each axis (a 3 x 3 grid and the check): degree 2 (b x heads x L x L, a b x b matrix). All the
    points when that saves nothing. Batch size 1 is designed apart: size-1 dimensions change
    which ops copy (a tensor of batch 1 is often contiguous already), so its event sequence
    differs from batch >= 2.

    >>> design([(b, 512) for b in (2, 4, 8, 16, 32)])
    [(2, 512), (32, 512), (8, 512)]
    >>> design([(b, 512) for b in (2, 4, 8, 16, 32)], level=2)
    [(2, 512), (4, 512), (32, 512), (8, 512)]
    >>> grid = [(b, L) for b in (2, 4, 8, 16) for L in (128, 256, 512, 1024)]
    >>> len(design(grid)), len(design(grid, level=2))
    (5, 10)
    """
    ones = [p for p in points if p[0] == 1]
    rest = [p for p in points if p[0] != 1]
    if ones and rest:
        return design(ones, level) + design(rest, level)
    bs = sorted({p[0] for p in points})
    Ls = sorted({p[1] for p in points}, key=lambda v: (v is None, v))
    have = set(points)

    def inner(vals, v):
        return len(vals) < 3 or v not in (vals[0], vals[-1])

    cands = [p for p in points if inner(bs, p[0]) and inner(Ls, p[1])]
    mid = (len(bs) // 2, len(Ls) // 2)
    check = min(cands, key=lambda p: abs(bs.index(p[0]) - mid[0]) + abs(Ls.index(p[1]) - mid[1])) if cands else None

    def nodes(vals, avoid):
        out = [vals[0], vals[-1]]
        if level >= 2:
            middle = [v for v in vals[1:-1] if v != avoid]
            if middle:
                out.insert(1, min(middle, key=lambda v: abs(vals.index(v) - len(vals) // 2)))
        return list(dict.fromkeys(out))

    chosen = [(b, L) for b in nodes(bs, check and check[0]) for L in nodes(Ls, check and check[1]) if (b, L) in have]
    if check is not None:
        chosen.append(check)
    chosen = list(dict.fromkeys(chosen))
    return list(points) if len(chosen) >= len(points) else chosen
