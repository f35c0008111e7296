"""Memory per step from a training log: steady or leaking, how fast, and when it hits the GPU's capacity.

Understood inputs (one reader, the format is recognized from the text):

- plain lines: ``Step 300: Loss=1.98, Memory=18.9GB``, ``iter 300 | mem 18900 MB``,
  ``[step 300] allocated: 18.9 GiB``;
- Hugging Face Trainer: ``{'loss': 1.98, ..., 'step': 300, 'gpu_mem_gb': 18.9}`` lines, JSON lines,
  or a ``trainer_state.json`` (its ``log_history``);
- Lightning: ``metrics.csv`` of the CSVLogger (a ``step`` column and memory columns such as
  DeviceStatsMonitor's ``allocated_bytes.all.current``) and progress-bar lines (``... 300/1000 [..., gpu_mem=18.9]``);
- memlens' own CSV (``memlens watch --log``, ``Monitor.save_csv``: ``time_s`` and ``*_bytes`` columns).

Sizes follow ``memlens.core.units``: GB = 10**9 bytes, GiB = 2**30. A number without a unit takes
it from its key (``mem_gb``, ``allocated_bytes``) or, failing that, from ``unit``
(default: GiB below 1024, MiB below 10**6, bytes above, and the result says so).

>>> s = read_memory_log("Step 1: Memory=1.0GB\\nStep 2: Memory=1.0GB\\nStep 3: Memory=1.0GB\\nStep 4: Memory=1.0GB")
>>> analyze_memory(s).verdict
'steady'
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import MemlensError
from ..core.payloads import DoctorLogPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .advice import log_causes
from .sizes import size_to_bytes, unit_factor

_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_MEM_KEY = re.compile(
    r"(?:max_)?(?:gpu_|cuda_|torch_)?(?:mem(?:ory)?|allocated|reserved|vram|peak)[A-Za-z0-9_./-]*",
    re.IGNORECASE,
)
_MEM_PAIR = re.compile(
    rf"""(?P<key>\b{_MEM_KEY.pattern})['"]?\s*(?:[:=]|\s)\s*['"]?(?P<num>{_NUM})\s*(?P<unit>[KMGT]i?B|bytes|B)?\b""",
    re.IGNORECASE,
)
_STEP = re.compile(r"\b(?:global_step|step|iteration|iter|it)['\"]?\s*[:=#]?\s*['\"]?(\d+)\b", re.IGNORECASE)
_PROGRESS = re.compile(r"\|\s*(\d+)/\d+\s*\[")
_EPOCH_PROGRESS = re.compile(r"Epoch (\d+)\b.*?\|\s*(\d+)/(\d+)\s*\[")
_OOM = re.compile(r"out of memory|\bOOM\b", re.IGNORECASE)
_STEP_COLUMNS = ("step", "global_step", "iteration", "iter", "trainer/global_step")
_TIME_COLUMNS = ("time_s", "elapsed_s", "time")
_KEY_PRIORITY = ("alloc", "mem", "peak", "reserv", "used")


@dataclass
class MemorySeries:
    """Memory readings of one key, ordered by step (or by seconds when ``x_name`` is "time_s")."""

    x: list[float]
    bytes: list[int]
    x_name: str = "step"
    key: str = "memory"
    source_format: str = "lines"
    oom_observed_at: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class LogAnalysis:
    """What the series says. Sizes in bytes; rates in bytes per step (or per second)."""

    verdict: str                      # "leak", "falling" or "steady"
    pattern: str                      # "accelerating", "linear", "stepwise", "decelerating", "falling", "dropped" or "steady"
    growth_bytes_per_step: float      # slope of a straight line through the readings
    current_growth_bytes_per_step: float  # slope of the fitted trend at the last reading
    accelerating: bool
    acceleration_bytes_per_step2: float
    model: str                        # "quadratic" or "linear": the trend used to project
    coefficients: list[float]         # bytes = c0 + c1*x (+ c2*x^2)
    projected_oom_step: int | None
    steps_to_oom: int | None
    capacity_bytes: int | None
    warmup_readings_skipped: int
    interval_growth: list[dict[str, float]]
    causes: list[str]
    notes: list[str] = field(default_factory=list)

    def predict(self, x: float) -> float:
        return sum(c * x**i for i, c in enumerate(self.coefficients))


# ---------------------------------------------------------------- reading

def read_memory_log(text: str, unit: str | None = None, gpu: int | None = None) -> MemorySeries:
    """Memory readings found in a log's text; MemlensError if there are fewer than 3."""
    if not isinstance(text, str) or not text.strip():
        raise MemlensError("the log is empty", hint="pass a training log with memory readings, e.g. 'Step 300: Memory=18.9GB'")
    if unit is not None and unit_factor(unit) is None:
        raise MemlensError(f"unknown unit {unit!r}", hint="use one of bytes, KiB, MiB, GiB, KB, MB, GB")
    stripped = text.lstrip()
    series = None
    if stripped[:1] in "{[":
        series = _from_json(stripped, unit)
    if series is None and _looks_like_csv(text):
        series = _from_csv(text, unit, gpu)
    if series is None:
        series = _from_lines(text, unit)
    if len(series.x) < 3:
        raise MemlensError(
            f"found {len(series.x)} memory reading(s) in the log; at least 3 are needed",
            hint="log memory every N steps, e.g. 'Step 300: Memory=18.9GB' (torch.cuda.memory_allocated())",
        )
    return series


class _Values:
    """Readings collected per memory key, with the unit guess noted once."""

    def __init__(self, unit: str | None):
        self.unit = unit
        self.by_key: dict[str, list[tuple[float, int]]] = {}
        self.guessed = False

    def add(self, key: str, x: float, num: str, unit: str | None) -> None:
        try:
            value = float(num)
        except ValueError:
            return
        if not math.isfinite(value) or value < 0:
            return
        u = unit or _unit_from_key(key) or self.unit
        if u is None:
            self.guessed = True
            u = "GiB" if value < 1024 else "MiB" if value < 1e6 else "bytes"
        try:
            b = size_to_bytes(repr(value), u)
        except ValueError:
            return
        self.by_key.setdefault(key, []).append((x, b))

    def series(self, x_name: str, fmt: str, oom_at: float | None, numbered: bool) -> MemorySeries:
        if not self.by_key:
            return MemorySeries([], [], x_name, "memory", fmt, oom_at)
        key = max(self.by_key, key=lambda k: (len(self.by_key[k]), -_priority(k)))
        points: dict[float, int] = {}
        for x, b in self.by_key[key]:
            points[x] = b  # the last reading of a step wins
        xs = sorted(points)
        notes = []
        if self.guessed:
            notes.append("memory values without a unit were read as GiB (< 1024), MiB (< 10^6) or bytes; pass --unit to say")
        if numbered:
            notes.append("the log has no step numbers: readings are numbered 1, 2, 3, ...")
        if len(self.by_key) > 1:
            notes.append(f"memory keys found: {', '.join(sorted(self.by_key))}; analysed {key!r}")
        return MemorySeries(xs, [points[x] for x in xs], x_name, key, fmt, oom_at, notes)


def _priority(key: str) -> int:
    k = key.lower()
    return next((i for i, p in enumerate(_KEY_PRIORITY) if p in k), len(_KEY_PRIORITY))


def _unit_from_key(key: str) -> str | None:
    k = key.lower()
    for suffix, unit in (("gib", "GiB"), ("mib", "MiB"), ("gb", "GB"), ("mb", "MB"), ("bytes", "bytes")):
        if re.search(rf"(?:^|[_./-]){suffix}(?:$|[_./-])|{suffix}$", k):
            return unit
    return None


def _from_lines(text: str, unit: str | None) -> MemorySeries:
    values = _Values(unit)
    oom_at = None
    numbered = False
    last_x = 0.0
    lines_with_readings = 0
    for line in text.splitlines():
        x = _line_step(line)
        if _OOM.search(line):
            oom_at = x if x is not None else last_x
            continue
        pairs = list(_MEM_PAIR.finditer(line))
        if not pairs:
            continue
        lines_with_readings += 1
        if x is None:
            numbered = True
            x = float(lines_with_readings)
        last_x = x
        for m in pairs:
            values.add(_clean_key(m.group("key")), x, m.group("num"), m.group("unit"))
    return values.series("step", "lines", oom_at, numbered)


def _line_step(line: str) -> float | None:
    """The step a line is about: 'step 300', 'iter=300', or a progress bar's 'Epoch e: ...| i/n ['."""
    m = _EPOCH_PROGRESS.search(line)
    if m:
        return float(int(m.group(1)) * int(m.group(3)) + int(m.group(2)))
    m = _STEP.search(line) or _PROGRESS.search(line)
    return float(m.group(1)) if m else None


def _clean_key(key: str) -> str:
    return key.strip("'\" ").rstrip("./-_")


def _from_records(records: list[Any], unit: str | None, fmt: str) -> MemorySeries | None:
    values = _Values(unit)
    numbered = False
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            continue
        step = next((rec[k] for k in _STEP_COLUMNS if isinstance(rec.get(k), (int, float))), None)
        if step is None:
            numbered = True
            step = i + 1
        for k, v in rec.items():
            if isinstance(v, bool) or not isinstance(v, (int, float, str)) or not _is_memory_column(str(k)):
                continue
            num, u = _split_value(v)
            if num is not None:
                values.add(str(k), float(step), num, u)
    if not values.by_key:
        return None
    return values.series("step", fmt, None, numbered)


def _split_value(v: Any) -> tuple[str | None, str | None]:
    m = re.fullmatch(rf"\s*({_NUM})\s*([A-Za-z]*)\s*", str(v))
    if not m or (m.group(2) and unit_factor(m.group(2)) is None):
        return None, None
    return m.group(1), m.group(2) or None


def _from_json(text: str, unit: str | None) -> MemorySeries | None:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                continue
        return _from_records(records, unit, "jsonl") if records else None
    if isinstance(data, dict) and isinstance(data.get("log_history"), list):
        return _from_records(data["log_history"], unit, "trainer_state")
    if isinstance(data, list):
        return _from_records(data, unit, "json")
    return None


def _is_memory_column(name: str) -> bool:
    """A key or column holding memory in use ('gpu_mem', '.../allocated_bytes.all.current'), not capacity or free."""
    low = name.lower()
    return bool(_MEM_KEY.search(name)) and not any(w in low for w in ("total", "free", "num_", "count"))


def _looks_like_csv(text: str) -> bool:
    """A header row with a step (or time) column and a memory column."""
    first = text.strip().splitlines()[0]
    try:
        cells = [c.strip().lower() for c in next(csv.reader([first]))]
    except (csv.Error, StopIteration):
        return False
    has_x = any(c in _STEP_COLUMNS + _TIME_COLUMNS for c in cells)
    return len(cells) >= 2 and has_x and any(_is_memory_column(c) for c in cells)


def _from_csv(text: str, unit: str | None, gpu: int | None) -> MemorySeries | None:
    try:
        rows = list(csv.DictReader(io.StringIO(text.strip())))
    except csv.Error:
        return None
    if not rows or rows[0] is None:
        return None
    cols = [c for c in (rows[0].keys() or []) if c]
    x_col = next((c for c in cols if c.strip().lower() in _STEP_COLUMNS), None)
    x_name = "step"
    if x_col is None:
        x_col = next((c for c in cols if c.strip().lower() in _TIME_COLUMNS), None)
        x_name = "time_s"
    mem_cols = [c for c in cols if c != x_col and _is_memory_column(c)]
    if x_col is None or not mem_cols:
        return None
    if gpu is None and "gpu" in cols:
        gpu = next((int(r["gpu"]) for r in rows if (r.get("gpu") or "").strip().isdigit()), None)
    values = _Values(unit)
    for r in rows:
        if gpu is not None and "gpu" in r and (r.get("gpu") or "").strip() != str(gpu):
            continue
        if "pid" in r and (r.get("pid") or "").strip():
            continue  # memlens watch: per-process rows; the GPU's own rows have no pid
        try:
            x = float(r.get(x_col) or "")
        except ValueError:
            continue
        for c in mem_cols:
            num, u = _split_value(r.get(c) or "")
            if num is not None:
                values.add(c.strip(), x, num, u)
    if not values.by_key:
        return None
    s = values.series(x_name, "csv", None, False)
    if gpu is not None:
        s.notes.append(f"GPU {gpu} analysed")
    return s


# ---------------------------------------------------------------- analysis

def _polyfit(x: list[float], y: list[float], degree: int) -> tuple[list[float], float]:
    """Least-squares polynomial (numpy scales x internally); coefficients in powers of x, and the RSS."""
    from numpy.polynomial import Polynomial  # heavy: numpy, loaded on first use

    p = Polynomial.fit(x, y, degree)
    coef = [float(c) for c in p.convert().coef] + [0.0] * degree
    rss = float(sum((p(xi) - yi) ** 2 for xi, yi in zip(x, y)))
    return coef[: degree + 1], rss


def _skip_warmup(x: list[float], y: list[float]) -> int:
    """Leading readings that jump far more than the rest (model load, optimizer state creation)."""
    n = len(y)
    if n < 5:
        return 0
    skip = 0
    while skip < n // 5:
        rest = sorted(abs(y[i + 1] - y[i]) for i in range(skip + 1, n - 1))
        median = rest[len(rest) // 2] if rest else 0
        jump = y[skip + 1] - y[skip]
        if abs(jump) > 4 * median and abs(jump) > 0.01 * max(y):
            skip += 1
        else:
            break
    return skip


def analyze_memory(series: MemorySeries, capacity_bytes: int | None = None) -> LogAnalysis:
    """Steady or leaking; growth rate, acceleration, projected OOM step for ``capacity_bytes``.

    Rules: a leak is a rise of the straight-line fit over the run of at least 3x the scatter
    around it and at least max(16 MiB, 0.2% of the level), still rising over the last half.
    Memory is ``falling`` when the line falls by as much (pattern "falling" if it still falls over
    the last half, else "dropped": it fell, then levelled off); else it is steady.
    It accelerates when a parabola fits much better (F > 10), curves upward and the fitted
    slope at the end is at least 1.5x the slope at the start; then the parabola projects the
    OOM, otherwise the straight line. The projected step is the first whole step after the
    last reading at which the trend reaches the capacity.
    """
    skip = _skip_warmup(series.x, series.bytes)
    x, y = series.x[skip:], [float(b) for b in series.bytes[skip:]]
    n = len(x)
    notes = list(series.notes)
    if skip:
        notes.append(f"skipped {skip} warm-up reading(s) before {series.x_name} {x[0]:g}")
    lin, rss_lin = _polyfit(x, y, 1)
    slope = lin[1]
    span = x[-1] - x[0]
    growth = slope * span
    scatter = math.sqrt(rss_lin / max(n - 2, 1))
    level = sorted(y)[n // 2]
    half = [i for i in range(n) if x[i] >= x[0] + span / 2]
    late_slope = _polyfit([x[i] for i in half], [y[i] for i in half], 1)[0][1] if len(half) >= 2 else slope
    leak = growth > 3 * scatter and growth >= max(16 * 1024**2, 0.002 * level) and late_slope > 0
    falling = not leak and -growth > 3 * scatter and -growth >= max(16 * 1024**2, 0.002 * level)

    quad, rss_quad = _polyfit(x, y, 2) if n >= 4 else (lin + [0.0], rss_lin)
    a = quad[2]
    start_slope = quad[1] + 2 * a * x[0]
    end_slope = quad[1] + 2 * a * x[-1]
    f_stat = (rss_lin - rss_quad) / (rss_quad / (n - 3)) if n >= 4 and rss_quad > 0 else (math.inf if rss_lin > 0 else 0.0)
    accelerating = bool(leak and n >= 4 and a > 0 and f_stat > 10 and end_slope >= 1.5 * max(start_slope, 0) and end_slope > 0)
    decelerating = bool(leak and n >= 4 and a < 0 and f_stat > 10)

    deltas = [y[i + 1] - y[i] for i in range(n - 1)]
    flat = sum(1 for d in deltas if abs(d) <= max(1024**2, 0.001 * level))
    if falling:
        pattern = "falling" if late_slope < 0 else "dropped"     # still falling at the end, or fell and levelled off
    elif not leak:
        pattern = "steady"
    elif accelerating:
        pattern = "accelerating"
    elif flat >= 0.6 * len(deltas):
        pattern = "stepwise"
    elif decelerating:
        pattern = "decelerating"
    else:
        pattern = "linear"

    coef = quad if accelerating else lin + [0.0]
    model = "quadratic" if accelerating else "linear"
    analysis = LogAnalysis(
        verdict="leak" if leak else "falling" if falling else "steady", pattern=pattern,
        growth_bytes_per_step=slope,
        current_growth_bytes_per_step=end_slope if accelerating else slope,
        accelerating=accelerating, acceleration_bytes_per_step2=2 * a if accelerating else 0.0,
        model=model, coefficients=coef[:3] if accelerating else coef[:2],
        projected_oom_step=None, steps_to_oom=None, capacity_bytes=capacity_bytes,
        warmup_readings_skipped=skip,
        interval_growth=[
            {"from": x[i], "to": x[i + 1], "bytes_per_step": (y[i + 1] - y[i]) / (x[i + 1] - x[i])}
            for i in range(n - 1) if x[i + 1] > x[i]
        ],
        causes=log_causes(pattern if pattern != "decelerating" else "linear"),
        notes=notes,
    )
    if capacity_bytes is not None and leak:
        _project(analysis, x[-1], capacity_bytes, series.bytes[-1])
    return analysis


def _project(a: LogAnalysis, last_x: float, capacity: int, last_bytes: int) -> None:
    if last_bytes >= capacity or a.predict(last_x) >= capacity:
        a.projected_oom_step = int(math.ceil(last_x))
        a.steps_to_oom = 0
        a.notes.append(f"memory is already at the capacity of {fmt_bytes(capacity)}")
        return
    c = a.coefficients
    if len(c) == 3 and c[2] != 0:
        disc = c[1] ** 2 - 4 * c[2] * (c[0] - capacity)
        if disc < 0:
            return
        roots = [(-c[1] + s * math.sqrt(disc)) / (2 * c[2]) for s in (1, -1)]
        ahead = [r for r in roots if r > last_x]
        if not ahead:
            return
        root = min(ahead)
    elif c[1] > 0:
        root = (capacity - c[0]) / c[1]
    else:
        return
    step = math.ceil(root - 1e-9)
    a.projected_oom_step = int(step)
    a.steps_to_oom = int(step - math.ceil(last_x))


def doctor_log(text: str, capacity_bytes: int | None = None, unit: str | None = None, gpu: int | None = None,
               source: str | None = None) -> Result:
    """The ``doctor log`` verb as a function: read the series, analyse it, return a Result."""
    series = read_memory_log(text, unit=unit, gpu=gpu)
    # A series that crosses the capacity is projected (memory "already at the capacity"); one whose
    # every reading is above it never ran on such a GPU: a wrong --capacity or unit, not a leak.
    low, peak = min(series.bytes), max(series.bytes)
    if capacity_bytes is not None and low > capacity_bytes * 1.001:   # 0.1%: the log's printed rounding
        raise MemlensError(
            f"the log's readings are {fmt_bytes(low)} to {fmt_bytes(peak)}, all above the stated capacity "
            f"{fmt_bytes(capacity_bytes)}: a GPU cannot hold more than its memory",
            hint="give --capacity the GPU's whole memory (e.g. 24GiB, 80GiB), or --unit if the log's numbers are not in the unit read")
    a = analyze_memory(series, capacity_bytes)
    data = DoctorLogPayload(
        source=source,
        source_format=series.source_format,
        memory_key=series.key,
        x_axis=series.x_name,
        readings=len(series.x),
        first_bytes=series.bytes[0],
        last_bytes=series.bytes[-1],
        verdict=a.verdict,
        pattern=a.pattern,
        growth_bytes_per_step=round(a.growth_bytes_per_step),
        current_growth_bytes_per_step=round(a.current_growth_bytes_per_step),
        accelerating=a.accelerating,
        acceleration_bytes_per_step2=a.acceleration_bytes_per_step2,
        trend_model=a.model,
        trend_coefficients=a.coefficients,
        capacity_bytes=capacity_bytes,
        projected_oom_step=a.projected_oom_step,
        steps_to_oom=a.steps_to_oom,
        oom_observed_at=series.oom_observed_at,
        warmup_readings_skipped=a.warmup_readings_skipped,
        interval_growth=a.interval_growth,
        causes=a.causes,
    )
    if series.x_name == "time_s":
        data.notes_on_axis = "x is seconds: growth is per second and projected_oom_step is a time in seconds"
    timeline = [{series.x_name: x, "allocated_bytes": b} for x, b in zip(series.x, series.bytes)]
    return Result(verb="doctor.log", data=data, timeline=timeline, notes=a.notes)


def read_text(path: str | Path, what: str) -> str:
    """A text file's content or MemlensError naming the problem."""
    p = Path(path)
    try:
        return p.read_text(errors="replace")
    except FileNotFoundError:
        raise MemlensError(f"{what} {p} does not exist", hint="check the path") from None
    except IsADirectoryError:
        raise MemlensError(f"{what} {p} is a directory", hint="pass a file") from None
    except OSError as e:
        raise MemlensError(f"cannot read {what} {p}: {e.strerror}", hint="check the path and its permissions") from None
