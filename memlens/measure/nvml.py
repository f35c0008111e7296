"""Device memory of every GPU and process through NVML (nvidia-ml-py), and the OOM risk of its trend.

NVML sees what the driver sees: *used* memory per GPU and per process (PyTorch's reserved memory
plus the CUDA context and every other library), not PyTorch's allocated/reserved split.

The backend is a small protocol so that everything above it runs without a GPU:

>>> class Fake:
...     def device_count(self): return 1
...     def device_name(self, i): return "Fake GPU"
...     def memory(self, i): return (80 * 2**30, 60 * 2**30, 20 * 2**30)   # total, free, used
...     def processes(self, i): return [(4242, 20 * 2**30)]
...     def process_name(self, pid): return "python train.py"
...     def close(self): pass
>>> g = read_gpus(Fake())[0]
>>> g.used_bytes == 20 * 2**30, g.processes[0].pid
(True, 4242)
>>> oom_risk([(0.0, 10 * 2**30), (10.0, 20 * 2**30), (20.0, 30 * 2**30)], 80 * 2**30).seconds_to_full
50.0
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ..core.errors import NoDeviceError
from ..core.units import fmt_bytes


class NvmlBackend(Protocol):
    """What memlens needs from NVML; ``PynvmlBackend`` is the real one, tests pass fakes."""

    def device_count(self) -> int: ...
    def device_name(self, index: int) -> str: ...
    def memory(self, index: int) -> tuple[int, int, int]:
        """(total, free, used) bytes of the device."""
        ...
    def processes(self, index: int) -> list[tuple[int, int | None]]:
        """(pid, used bytes or None when the driver does not say) of processes on the device."""
        ...
    def process_name(self, pid: int) -> str: ...
    def close(self) -> None: ...


class PynvmlBackend:
    """NVML through nvidia-ml-py. Raises NoDeviceError (one line) when there is no driver."""

    def __init__(self) -> None:
        try:
            import pynvml  # optional: nvidia-ml-py (memlens[nvml])
        except ImportError:
            raise NoDeviceError("nvidia-ml-py is not installed, so NVML cannot be read",
                                hint="pip install 'memlens[nvml]' (needs an NVIDIA driver)") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NoDeviceError(f"no NVIDIA driver found: NVML could not start ({e})",
                                hint="memlens watch needs an NVIDIA GPU and driver; doctor and estimate work without one") from None
        except OSError as e:
            raise NoDeviceError(f"no NVIDIA driver found: {e}", hint="memlens watch needs an NVIDIA GPU and driver") from None

    def _handle(self, index: int):
        return self._nv.nvmlDeviceGetHandleByIndex(index)

    def device_count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def device_name(self, index: int) -> str:
        name = self._nv.nvmlDeviceGetName(self._handle(index))
        return name.decode() if isinstance(name, bytes) else str(name)

    def memory(self, index: int) -> tuple[int, int, int]:
        m = self._nv.nvmlDeviceGetMemoryInfo(self._handle(index))
        return int(m.total), int(m.free), int(m.used)

    def processes(self, index: int) -> list[tuple[int, int | None]]:
        h = self._handle(index)
        seen: dict[int, int | None] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(self._nv, fn)(h)
            except (self._nv.NVMLError, AttributeError):
                continue
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                # NVML_VALUE_NOT_AVAILABLE (2**64 - 1) when the driver hides per-process use (containers, WSL)
                seen[int(p.pid)] = int(used) if isinstance(used, int) and 0 <= used < 2**63 else None
        return sorted(seen.items())

    def process_name(self, pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
            if cmd:
                return cmd
        except OSError:
            pass
        try:
            name = self._nv.nvmlSystemGetProcessName(pid)
            return name.decode() if isinstance(name, bytes) else str(name)
        except self._nv.NVMLError:
            return "?"

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass


def open_backend() -> NvmlBackend:
    """The real NVML backend (the seam tests replace)."""
    return PynvmlBackend()


def process_used_bytes(backend: NvmlBackend, pid: int) -> int | None:
    """NVML's used memory of process ``pid`` summed over every GPU (None where the driver does not say)."""
    used = None
    for i in range(backend.device_count()):
        for p, u in backend.processes(i):
            if p == pid and u is not None:
                used = (used or 0) + u
    return used


@dataclass
class ProcessReading:
    """A process on a GPU: NVML's used memory for it (None when the driver does not report it)."""

    pid: int
    used_bytes: int | None
    name: str = "?"


@dataclass
class GpuReading:
    """One GPU's memory as NVML sees it: total, used, free; and its processes."""

    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: list[ProcessReading] = field(default_factory=list)

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["used_fraction"] = round(self.used_fraction, 4)
        return d


def read_gpus(backend: NvmlBackend, only: list[int] | None = None) -> list[GpuReading]:
    """Read every GPU (or those in ``only``) once."""
    out = []
    count = backend.device_count()
    if only:
        bad = [i for i in only if not 0 <= i < count]
        if bad:
            raise NoDeviceError(f"GPU {bad[0]} does not exist (this machine has {count})",
                                hint=f"use --gpu 0..{count - 1}" if count else "no GPU is visible")
    for i in only or range(count):
        total, free, used = backend.memory(i)
        procs = [ProcessReading(pid, used_b, backend.process_name(pid)) for pid, used_b in backend.processes(i)]
        out.append(GpuReading(i, backend.device_name(i), total, used, free, procs))
    return out


@dataclass
class Risk:
    """The OOM risk of a GPU from its recent trend: slope, time to full, level and a sentence."""

    level: str                     # "ok", "warn" or "critical"
    used_fraction: float
    slope_bytes_per_s: float | None
    seconds_to_full: float | None
    message: str


def oom_risk(history: list[tuple[float, int]], total_bytes: int, window_s: float = 60.0,
             warn_fraction: float = 0.90, warn_seconds: float = 600.0) -> Risk:
    """Risk from (time_s, used_bytes) readings: least-squares slope over the last ``window_s``.

    critical: >= 97% used or full within 60 s at the current slope; warn: >= ``warn_fraction``
    used or full within ``warn_seconds``; else ok. The seeds' exercise 9.4, done on NVML data.
    """
    if not history or total_bytes <= 0:
        return Risk("ok", 0.0, None, None, "no reading yet")
    t_last, used = history[-1]
    frac = used / total_bytes
    recent = [(t, u) for t, u in history if t >= t_last - window_s]
    slope = None
    if len(recent) >= 3:
        n = len(recent)
        mt = sum(t for t, _ in recent) / n
        mu = sum(u for _, u in recent) / n
        var = sum((t - mt) ** 2 for t, _ in recent)
        slope = sum((t - mt) * (u - mu) for t, u in recent) / var if var > 0 else None
    ttf = (total_bytes - used) / slope if slope and slope > 0 else None
    if ttf is not None and not math.isfinite(ttf):
        ttf = None
    if frac >= 0.97 or (ttf is not None and ttf <= 60):
        level = "critical"
    elif frac >= warn_fraction or (ttf is not None and ttf <= warn_seconds):
        level = "warn"
    else:
        level = "ok"
    parts = [f"{100 * frac:.0f}% used"]
    if slope is not None:
        parts.append(f"{'+' if slope >= 0 else '-'}{fmt_bytes(abs(slope))}/s")
    if ttf is not None:
        parts.append(f"full in {_duration(ttf)} at this rate")
    return Risk(level, frac, slope, ttf, ", ".join(parts))


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


#: Columns of ``memlens watch --log``: one row per GPU (no pid) and one per process.
CSV_COLUMNS = ("time_s", "gpu", "name", "pid", "process", "memory_used_bytes", "memory_total_bytes", "memory_free_bytes")


class Watcher:
    """Reads NVML on each ``sample()`` and keeps every GPU's used-memory history for the risk trend.

    >>> class NoGpu:
    ...     def device_count(self): return 0
    >>> Watcher(NoGpu(), clock=lambda: 0.0).sample()
    {'time_s': 0.0, 'gpus': []}
    """

    def __init__(self, backend: NvmlBackend, only: list[int] | None = None, window_s: float = 60.0,
                 warn_fraction: float = 0.90, warn_seconds: float = 600.0, clock=None):
        self.backend = backend
        self.only = only
        self.window_s = window_s
        self.warn_fraction = warn_fraction
        self.warn_seconds = warn_seconds
        self.clock = clock or time.monotonic
        self.t0: float | None = None
        self.history: dict[int, list[tuple[float, int]]] = {}

    def sample(self) -> dict[str, Any]:
        """One reading of every GPU with its risk: {"time_s", "gpus": [GpuReading dict + "risk"]}."""
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        t = now - self.t0
        gpus = []
        for g in read_gpus(self.backend, self.only):
            h = self.history.setdefault(g.index, [])
            h.append((t, g.used_bytes))
            del h[: max(0, len(h) - 10_000)]
            risk = oom_risk(h, g.total_bytes, self.window_s, self.warn_fraction, self.warn_seconds)
            gpus.append({**g.to_dict(), "risk": asdict(risk)})
        return {"time_s": round(t, 3), "gpus": gpus}


def csv_rows(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of CSV_COLUMNS for one ``Watcher.sample()``."""
    rows = []
    for g in sample["gpus"]:
        base = {"time_s": sample["time_s"], "gpu": g["index"], "name": g["name"],
                "memory_total_bytes": g["total_bytes"]}
        rows.append({**base, "pid": "", "process": "", "memory_used_bytes": g["used_bytes"],
                     "memory_free_bytes": g["free_bytes"]})
        for p in g["processes"]:
            rows.append({**base, "pid": p["pid"], "process": p["name"],
                         "memory_used_bytes": "" if p["used_bytes"] is None else p["used_bytes"], "memory_free_bytes": ""})
    return rows
