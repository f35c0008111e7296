"""`sweep`: a grid over batch size x sequence length x LoRA rank x physical batch x technique,
estimated or measured (its CSV and table: memlens.report.sweep_text; its pictures: memlens.report.sweep_plots).

The Opacus profiler's flags map onto it (seeds/004): ``--batch_sizes`` -> ``batch_sizes``,
``--seq_lengths`` -> ``seq_lens``, ``--lora_ranks`` -> ``lora_ranks``,
``--max_physical_batch_sizes`` -> ``physical_batch_sizes`` (DP-SGD; cells with a physical batch
larger than the batch are skipped, as the profiler requires), ``--num_steps`` -> ``steps``,
``--results_dir`` -> ``out``.

Every finished cell is appended to ``results.jsonl`` (flushed and fsynced) at once; ``resume``
skips the cells already there, so a sweep killed at any point (kill -9 included) loses nothing
but the cell that was running. Measured cells run in fresh subprocesses with a timeout: an OOM,
a crash or a hang marks that cell and the sweep goes on.

>>> from memlens.core.spec import TrainingSpec
>>> g = Grid(batch_sizes=[1, 2], seq_lens=[128], techniques=["fp32", "amp-bf16"])
>>> [c.key for c in grid_cells(TrainingSpec(model="gpt2"), g)]
['t=fp32,b=1,L=128', 't=fp32,b=2,L=128', 't=amp-bf16,b=1,L=128', 't=amp-bf16,b=2,L=128']
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core import progress as core_progress
from ..core.errors import MemlensError
from ..core.fits import RULE, Budget, fits, optional_budget
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..measure.trial import run_trial
from ..step.plan import resolve as resolve_step
from .compare import technique_spec
from .core import CachedEstimator, predict_step_time

RESULTS = "results.jsonl"


@dataclass
class Grid:
    """Axes of a sweep; an empty axis means "the spec's own value"."""

    batch_sizes: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    lora_ranks: list[int] = field(default_factory=list)
    physical_batch_sizes: list[int] = field(default_factory=list)
    techniques: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Cell:
    key: str                      # stable id, used by resume
    params: dict[str, Any]        # technique, batch_size, seq_len, lora_rank, physical_batch_size
    spec: TrainingSpec | None     # None: the combination is invalid (``skip`` says why)
    skip: str | None = None


def grid_cells(spec: TrainingSpec, grid: Grid) -> list[Cell]:
    """All cells in a fixed order (technique, LoRA rank, physical batch, seq len, batch)."""
    techs = grid.techniques or [None]
    ranks = grid.lora_ranks or [None]
    pbs = grid.physical_batch_sizes or [None]
    seqs = grid.seq_lens or [None]
    bss = grid.batch_sizes or [None]
    cells = []
    for t in techs:
        for r in ranks:
            for pb in pbs:
                for L in seqs:
                    for b in bss:
                        params = {"technique": t, "batch_size": b if b is not None else spec.batch_size,
                                  "seq_len": L if L is not None else spec.seq_len, "lora_rank": r, "physical_batch_size": pb}
                        key = ",".join(f"{k}={v}" for k, v in (("t", t), ("r", r), ("pb", pb), ("b", b), ("L", L)) if v is not None)
                        changes: dict[str, Any] = {}
                        if b is not None:
                            changes["batch_size"] = b
                        if L is not None:
                            changes["seq_len"] = L
                        if r is not None:
                            changes["lora_rank"] = r
                        if pb is not None:
                            changes["dp"] = True
                            changes["physical_batch_size"] = pb
                        try:
                            s = spec.replace(**changes)
                            if t is not None:
                                s = technique_spec(s, t)
                        except MemlensError as e:
                            cells.append(Cell(key or "base", params, None, e.message))
                            continue
                        cells.append(Cell(key or "base", params, s))
    return cells


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """Finished cells by key. A torn last line (the writer was killed mid-write) is ignored."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "key" in rec:
            done[rec["key"]] = rec
    return done


def _drop_torn_tail(path: Path) -> None:
    """A writer killed mid-line leaves a line without its newline: cut it so the next append starts clean."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, rec: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def sweep(spec: TrainingSpec, grid: Grid, *, out: str | Path, measure: bool = False, resume: bool = False,
          device: str = "cuda", steps: int = 3, timeout: float = 600, budget: int | str | Budget | None = None,
          estimator: CachedEstimator | None = None, runner=None, gpus: list[int] | None = None, detailed: bool = False,
          progress: Callable[[int, int, str, dict | None], None] | None = None, margin: float | int | str | None = None,
          context_bytes: int | str | None = None, budget_bytes: int | None = None) -> Result:
    """Run (or estimate) every cell of ``grid`` and return all rows in grid order.

    ``budget`` (``margin``, ``context_bytes``): the one fit rule of fit and compare (:mod:`memlens.core.fits`,
    ``Budget.make`` with the spec's GPU): estimated cells get ``estimated_fits`` (peak reserved <= budget - CUDA
    context - margin) and status ``oom-estimated`` when they do not fit. Measured cells on CUDA run under
    ``set_per_process_memory_fraction((budget - context) / total)``, the memory the caching allocator can have
    (as ``fit --verify``), so cells above it OOM. ``budget_bytes``: the same as ``budget`` (an older name).

    ``gpus`` (measured): the GPUs to spread the cells over, each cell in its own subprocess on its
    own GPU (``CUDA_VISIBLE_DEVICES``), as many cells at once as there are GPUs; a cell for several
    GPUs (``world_size``) runs under torchrun on that many of them. Rows are appended as cells
    finish; the result keeps grid order.

    ``detailed`` (the Opacus profiler's detailed mode): each cell also gets ``detail``, its peak by
    category, phase and component, from the estimate (``source: estimate``) or, measured, from a
    full-mode profile of the trial.
    """
    b = optional_budget(budget if budget is not None else budget_bytes, margin=margin, context_bytes=context_bytes, gpu=spec.gpu)
    cells = grid_cells(spec, grid)
    if not cells:
        raise MemlensError("the grid is empty", hint="give at least one value per axis, e.g. --batch-sizes 1,2,4")
    runnable = [c for c in cells if c.spec is not None]
    if not runnable:
        raise MemlensError(f"no valid cell in the grid ({cells[0].skip})", hint="e.g. physical batch sizes must be <= batch sizes")
    if gpus is not None:
        check_gpu_list(gpus, {_gpus_of(c.spec) for c in runnable}, measure)
    path, done = _open_results(Path(out), resume, cells)
    done_before = bool(done)
    est = estimator or CachedEstimator()
    frac = _memory_fraction(b, device) if measure else None
    fin = _Finish(path, done, len(cells), progress)
    est.prepare([c.spec for c in cells if c.spec is not None and c.key not in done],
                progress=lambda i, n, s: core_progress.advance(0, len(cells), f"tracing {i}/{n}: {s.describe()}"))
    todo, errors = _estimate_cells(cells, fin, est, b, measure, detailed)
    if not measure and not done_before and errors and len(errors) == len(runnable):
        path.unlink(missing_ok=True)   # no cell could be estimated: the spec itself is wrong, said in one line
        raise errors[0]
    run = runner or run_trial

    def measure_cell(c: Cell, rec: dict[str, Any], cell_gpus: list[int] | None) -> None:
        kw: dict[str, Any] = {"gpus": cell_gpus} if cell_gpus is not None else {}
        if detailed:
            kw["detailed"] = True
        t = run(c.spec, device=device, steps=steps, timeout=timeout, memory_fraction=frac, **kw)
        rec.update(status=t["status"], peak_allocated_bytes=t.get("peak_allocated_bytes"),
                   peak_reserved_bytes=t.get("peak_reserved_bytes"), step_seconds=t.get("seconds"),
                   losses=t.get("losses"), timeline=t.get("timeline") or [], memory_measured=t.get("memory_measured", False))
        for k in ("error", "detail", "ranks", "peak_rank", "gpus"):
            if t.get(k) is not None:
                rec[k] = t[k]
        fin(c, _closed(rec))

    if gpus is None or not todo:
        for c, rec in todo:
            measure_cell(c, rec, None)
    else:
        _run_on_gpus(todo, gpus, measure_cell)
    return _sweep_result(spec, grid, [done[c.key] for c in cells], est, b, measure, device, path, frac, detailed, steps, gpus)


def _gpus_of(spec: TrainingSpec) -> int:
    """GPUs a cell's job takes (its step plan's world size)."""
    return resolve_step(spec, refuse=False).world_size


def _open_results(out: Path, resume: bool, cells: list[Cell]) -> tuple[Path, dict[str, dict[str, Any]]]:
    """(the results file under ``out``, the cells it holds finished): refused in one line when it holds another sweep,
    or finished cells without ``resume``; a torn last line dropped."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MemlensError(f"cannot create output directory {out}: {e.strerror}", hint="choose a writable out directory") from None
    path = out / RESULTS
    done = read_results(path)
    if done and not resume:
        raise MemlensError(f"{path} already holds {len(done)} finished cells", hint="add --resume to continue that sweep, or choose another --out")
    if resume and done:
        _check_same_sweep(done, cells)
    _drop_torn_tail(path)
    return path, done


def _memory_fraction(b: Budget | None, device: str) -> float | None:
    """The share of the GPU a measured cell may have under the budget (None: no budget, or not CUDA)."""
    if b is None or not device.startswith("cuda"):
        return None
    import torch  # heavy: torch, loaded on first use

    return min(1.0, (b.budget_bytes - b.context_bytes) / torch.cuda.get_device_properties(0).total_memory)


class _Finish:
    """A cell finished: its row appended to the results file (and kept), the progress told (one thread at a time)."""

    def __init__(self, path: Path, done: dict[str, dict[str, Any]], total: int, progress) -> None:
        self.path, self.done, self.total, self.progress = path, done, total, progress
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self, c: Cell, rec: dict[str, Any] | None) -> None:
        with self.lock:
            if rec is not None:
                _append(self.path, rec)
                self.done[c.key] = rec
            self.n += 1
            if self.progress:
                self.progress(self.n, self.total, c.key, rec)


def _estimate_cells(cells: list[Cell], fin: _Finish, est: CachedEstimator, b: Budget | None, measure: bool,
                    detailed: bool) -> tuple[list[tuple[Cell, dict[str, Any]]], list[MemlensError]]:
    """Estimate every cell not done before (estimated cells finish here); returns the cells left to measure, with
    their rows, and the estimates' errors."""
    todo: list[tuple[Cell, dict[str, Any]]] = []
    errors: list[MemlensError] = []
    for c in cells:
        if c.key in fin.done:
            fin(c, None)
            continue
        core_progress.advance(fin.n, fin.total, c.key)
        rec: dict[str, Any] = {"key": c.key, **c.params}
        if c.spec is None:
            rec.update(status="skipped", error=c.skip)
            fin(c, rec)
            continue
        rec["spec"] = c.spec.to_dict()
        rec["_t0"] = time.perf_counter()
        err = _estimate_cell(c, rec, est, b, measure, detailed)
        if err is not None:
            errors.append(err)
        if measure:
            todo.append((c, rec))
        else:
            fin(c, _closed(rec))
    return todo, errors


def _sweep_result(spec, grid, rows, est, b, measure, device, path, frac, detailed, steps, gpus) -> Result:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    data = {"rows": rows, "grid": grid.to_dict(), "measured": measure, "device": device if measure else None,
            "estimator": est.stats(), "results_path": str(path), "status_counts": counts, "budget_bytes": None,
            **(b.to_dict() if b is not None else {}), "memory_fraction": frac, "detailed": detailed, "steps": steps}
    if gpus is not None:
        data["gpus"] = list(gpus)
    return Result(verb="sweep", spec=spec.to_dict(), notes=[
        "peak_allocated_bytes: measured max_memory_allocated; estimated_*: memlens estimate of the same cell",
        "status: ok | oom | timeout | crash | skipped (invalid combination) | oom-estimated (estimated peak reserved above "
        "the usable memory: budget - CUDA context - margin, the fit rule of fit and compare)"]
        + ([f"fits: {RULE}: {b.describe()}"] + ([b.warning] if b.warning else []) if b is not None else []), data=data)


def _estimate_cell(c: Cell, rec: dict[str, Any], est: CachedEstimator, budget: Budget | None, measure: bool,
                   detailed: bool = False) -> MemlensError | None:
    try:
        p = est(c.spec)
        rec.update(estimated_peak_allocated_bytes=p.peak_allocated_bytes, estimated_peak_reserved_bytes=p.peak_reserved_bytes,
                   predicted_step_seconds=predict_step_time(c.spec, p).seconds)
        if p.peak_rank is not None:
            rec["estimated_peak_rank"] = p.peak_rank
        if budget is not None:   # the one rule: peak reserved <= budget - CUDA context - margin
            rec["estimated_fits"] = fits(p, budget).fits
        if not measure:
            rec["status"] = "ok" if budget is None or rec["estimated_fits"] else "oom-estimated"
            rec["timeline"] = [dict(pt) for pt in p.timeline]
            if detailed:
                rec["detail"] = {"source": "estimate", "peak_allocated_bytes": p.peak_allocated_bytes,
                                 "by_category": {k: v for k, v in (p.by_category or {}).items() if v},
                                 "by_phase": {k: v.get("peak_allocated_bytes", 0) for k, v in (p.by_phase or {}).items()},
                                 "by_component": [dict(x) for x in p.by_component]}
    except MemlensError as e:
        rec.update(estimated_peak_allocated_bytes=None, estimate_error_message=e.message)
        if not measure:
            rec["status"] = "error"
        return e
    return None


def _closed(rec: dict[str, Any]) -> dict[str, Any]:
    rec["seconds_taken"] = round(time.perf_counter() - rec.pop("_t0"), 3)
    return rec


def check_gpu_list(gpus: list[int], world_sizes: set[int], measure: bool) -> None:
    """One line for a GPU list that cannot run the cells: no --measure, GPUs that do not exist or
    repeat, or a world size that does not divide the GPUs given."""
    if not measure:
        raise MemlensError("--gpus spreads measured cells over GPUs", hint="add --measure, or drop --gpus")
    if not gpus or len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise MemlensError(f"--gpus {','.join(map(str, gpus))} must list distinct GPU indices", hint="e.g. --gpus 0,1,2,3")
    try:
        import torch  # heavy: torch, loaded on first use

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        have = 0
    missing = [g for g in gpus if g >= have]
    if missing:
        raise MemlensError(f"GPU {missing[0]} does not exist (this machine has {have})",
                           hint=f"use --gpus {','.join(map(str, range(have))) or '0'}" if have else "run on a machine with GPUs")
    for ws in sorted(world_sizes):
        if len(gpus) % ws:
            raise MemlensError(f"cells of --world-size {ws} do not divide the {len(gpus)} GPUs given",
                               hint=f"give a multiple of {ws} GPUs with --gpus")


def _run_on_gpus(todo: list, gpus: list[int], measure_cell) -> None:
    """Run the measured cells on the GPUs, as many at once as free GPUs allow (each cell takes
    ``world_size`` of them), each in its own subprocess."""
    free = list(gpus)
    cond = threading.Condition()
    errors: list[BaseException] = []

    def worker(c, rec, mine):
        try:
            measure_cell(c, rec, mine)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            with cond:
                free.extend(mine)
                cond.notify_all()

    threads = []
    for c, rec in todo:
        need = _gpus_of(c.spec)
        with cond:
            cond.wait_for(lambda: len(free) >= need or errors)
            if errors:
                break
            mine = [free.pop(0) for _ in range(need)]
        t = threading.Thread(target=worker, args=(c, rec, mine), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _check_same_sweep(done: dict[str, dict[str, Any]], cells: list[Cell]) -> None:
    keys = {c.key for c in cells}
    foreign = [k for k in done if k not in keys]
    if foreign and len(foreign) == len(done):
        raise MemlensError(f"the results to resume are from another grid (e.g. cell {foreign[0]!r})",
                           hint="resume with the same grid flags, or choose another --out")
    for c in cells:
        rec = done.get(c.key)
        if rec and c.spec is not None and rec.get("spec") and TrainingSpec.from_dict(rec["spec"]) != c.spec:
            raise MemlensError(f"cell {c.key!r} in the results has another spec", hint="resume with the same spec flags, or choose another --out")
