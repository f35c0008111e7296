"""`Monitor`: a background thread that samples PyTorch's allocated/reserved memory while you train,
alerts above a threshold (with the largest live tensors at that moment) and keeps the history.

The seeds' ``MemoryMonitor`` done properly: no printing from the thread (alerts go to a callback and
to ``monitor.alerts``), one dump per threshold crossing, storages counted once, a plot and a CSV
that ``memlens doctor log`` reads back.

    from memlens import Monitor
    with Monitor(interval=0.5, threshold=0.9, on_alert=lambda a: print(a.message)) as mon:
        train()
    mon.plot("memory.png"); mon.save_csv("memory.csv")

Without CUDA, pass ``sampler=`` (any callable returning (allocated, reserved) bytes) and ``capacity_bytes=``:

>>> import itertools
>>> counter = itertools.count()
>>> mon = Monitor(interval=0.001, threshold=0.5, capacity_bytes=100, dump_device="cpu",
...               sampler=lambda: (min(10 * next(counter), 100), 100))
>>> _ = mon.start(); import time; time.sleep(0.2); _ = mon.stop()
>>> mon.alerts[0].allocated_bytes >= 50, len(mon.history) > 5
(True, True)
"""
from __future__ import annotations

import csv
import gc
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..core.errors import MemlensError, NoDeviceError
from ..core.units import fmt_bytes, parse_bytes
from ..report.monitor_plot import plot_monitor


@dataclass
class MemoryReading:
    """One sample: seconds since start, PyTorch's allocated and reserved bytes."""

    time_s: float
    allocated_bytes: int
    reserved_bytes: int


@dataclass
class TensorInfo:
    """A live tensor's storage: bytes, shape, dtype, device and whether autograd holds it."""

    bytes: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool
    grad_fn: str | None


@dataclass
class Alert:
    """Allocated memory crossed the threshold; the top tensors at that moment."""

    time_s: float
    allocated_bytes: int
    threshold_bytes: int
    top_tensors: list[TensorInfo] = field(default_factory=list)

    @property
    def message(self) -> str:
        top = ", ".join(f"{fmt_bytes(t.bytes)} {list(t.shape)} {t.dtype}" for t in self.top_tensors[:3])
        return (f"allocated {fmt_bytes(self.allocated_bytes)} >= threshold {fmt_bytes(self.threshold_bytes)} "
                f"at {self.time_s:.1f}s" + (f"; largest tensors: {top}" if top else ""))


def top_tensors(n: int = 5, device: str = "cuda") -> list[TensorInfo]:
    """The ``n`` largest live tensors on ``device`` type ("cuda", "cpu"), each storage counted once."""
    import torch  # heavy: torch, loaded on first use

    seen: set[tuple[str, int]] = set()
    out: list[TensorInfo] = []
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key in seen or storage.data_ptr() == 0:
                continue
            seen.add(key)
            out.append(TensorInfo(storage.nbytes(), tuple(obj.shape), str(obj.dtype).replace("torch.", ""),
                                  str(obj.device), bool(obj.requires_grad),
                                  type(obj.grad_fn).__name__ if obj.grad_fn is not None else None))
        except (RuntimeError, ReferenceError, AttributeError, NotImplementedError):
            continue  # fake, sparse or otherwise storage-less tensors
    out.sort(key=lambda t: -t.bytes)
    return out[:n]


SETTLE_S = 0.02   # how long an alert waits before it lists the live tensors (Monitor._alert)


class Monitor:
    """Sample memory every ``interval`` seconds in a daemon thread.

    threshold: a fraction of ``capacity_bytes`` (0.9), or a size ("20GiB" or a number of bytes > 1).
    on_alert: called (in the monitor thread) with an ``Alert`` each time allocated memory crosses
    the threshold upward; errors it raises are kept in ``monitor.errors``, never kill the thread.
    dump_top: how many of the largest tensors to record in each alert (0: none).
    sampler: a callable returning (allocated, reserved) bytes; default torch.cuda on ``device``.
    """

    def __init__(self, interval: float = 1.0, threshold: float | int | str = 0.9, capacity_bytes: int | None = None,
                 on_alert: Callable[[Alert], None] | None = None, dump_top: int = 5, device: int | None = None,
                 sampler: Callable[[], tuple[int, int]] | None = None, dump_device: str = "cuda",
                 max_history: int = 100_000):
        if interval <= 0:
            raise MemlensError("Monitor interval must be positive", hint="e.g. Monitor(interval=0.5)")
        self.interval = interval
        self.threshold = threshold
        self.capacity_bytes = capacity_bytes
        self.on_alert = on_alert
        self.dump_top = dump_top
        self.device = device
        self.sampler = sampler
        self.dump_device = dump_device
        self.max_history = max_history
        self.history: list[MemoryReading] = []
        self.alerts: list[Alert] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threshold_bytes: int | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Monitor":
        if self._thread is not None:
            raise MemlensError("Monitor is already running", hint="call stop() before start() again")
        if self.sampler is None:
            self.sampler = self._cuda_sampler()
        self._threshold_bytes = self._resolve_threshold()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="memlens-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "Monitor":
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ sampling
    def _cuda_sampler(self) -> Callable[[], tuple[int, int]]:
        import torch  # heavy: torch, loaded on first use

        if not torch.cuda.is_available():
            raise NoDeviceError("Monitor needs CUDA to read torch.cuda memory",
                                hint="pass sampler=lambda: (allocated, reserved) and capacity_bytes= to watch something else")
        dev = self.device if self.device is not None else torch.cuda.current_device()
        if self.capacity_bytes is None:
            self.capacity_bytes = torch.cuda.get_device_properties(dev).total_memory
        return lambda: (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))

    def _resolve_threshold(self) -> int:
        t = self.threshold
        if isinstance(t, str):
            return parse_bytes(t)
        if isinstance(t, (int, float)) and 0 < t <= 1:
            if not self.capacity_bytes:
                raise MemlensError("a fractional threshold needs capacity_bytes",
                                   hint="pass capacity_bytes=, or a size such as threshold='20GiB'")
            return int(t * self.capacity_bytes)
        if isinstance(t, (int, float)) and t > 1:
            return int(t)
        raise MemlensError(f"threshold {t!r} is neither a fraction in (0, 1] nor a size", hint="e.g. threshold=0.9 or '20GiB'")

    def _loop(self) -> None:
        t0 = time.monotonic()
        above = False
        while not self._stop.is_set():
            try:
                allocated, reserved = self.sampler()
            except Exception as e:  # keep the training alive whatever the sampler does
                self.errors.append(e)
                break
            now = time.monotonic() - t0
            self.history.append(MemoryReading(round(now, 6), int(allocated), int(reserved)))
            if len(self.history) > self.max_history:
                del self.history[: len(self.history) - self.max_history]
            if allocated >= self._threshold_bytes and not above:
                self._alert(now, int(allocated))
            above = allocated >= self._threshold_bytes
            self._stop.wait(self.interval)

    def _alert(self, now: float, allocated: int) -> None:
        tensors: list[TensorInfo] = []
        if self.dump_top:
            # the allocator's counters move inside the call that allocates, before its Python tensor exists: give that
            # call a moment (the wait releases the GIL) so the tensor that crossed is among those listed
            self._stop.wait(min(self.interval, SETTLE_S))
            try:
                tensors = top_tensors(self.dump_top, self.dump_device)
            except Exception as e:
                self.errors.append(e)
        alert = Alert(round(now, 6), allocated, self._threshold_bytes, tensors)
        self.alerts.append(alert)
        if self.on_alert is not None:
            try:
                self.on_alert(alert)
            except Exception as e:
                self.errors.append(e)

    # ------------------------------------------------------------ results
    @property
    def peak_allocated_bytes(self) -> int:
        return max((r.allocated_bytes for r in self.history), default=0)

    def save_csv(self, path: str | Path) -> Path:
        """time_s, allocated_bytes, reserved_bytes per sample (``memlens doctor log`` reads it)."""
        path = Path(path)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["time_s", "allocated_bytes", "reserved_bytes"])
            for r in list(self.history):
                w.writerow([r.time_s, r.allocated_bytes, r.reserved_bytes])
        return path

    def plot(self, path: str | Path) -> Path:
        """PNG of allocated and reserved over time, with the threshold and the alerts (drawn by
        :func:`memlens.report.monitor_plot.plot_monitor`)."""
        return plot_monitor(list(self.history), self._threshold_bytes, self.alerts, path)


class StepTrend:
    """Memory per step and where its trend goes: the seeds' exercise 9.4 (a least-squares line over
    a sliding window of steps, as ``AdaptiveMemoryManager.predict_oom_risk``), on bytes per step.

    ``record(step, end_bytes, peak_bytes)``: memory left allocated at the end of the step (what a
    leak grows) and the process' running peak then. :meth:`predicted_peak` extrapolates the peak
    ``steps_ahead`` steps by the slope of the end-of-step memory; it is only trusted while the running
    peak is rising (this step set a new high, so the running peak *is* this step's peak): after a
    smaller micro-batch the old high is stale, and nothing is predicted until memory grows past it.

    >>> t = StepTrend(window=5)
    >>> for s in range(1, 6):
    ...     t.record(s, 1000 + 100 * s, 5000 + 100 * s)
    >>> t.slope(), t.predicted_peak(10)
    (100.0, 6500)
    >>> t.reset(); t.predicted_peak(10) is None
    True
    """

    def __init__(self, window: int = 10, min_points: int = 3):
        if window < 2 or min_points < 2:
            raise MemlensError("a trend needs a window of at least 2 steps", hint="e.g. StepTrend(window=10)")
        self.window = window
        self.min_points = min_points
        self.points: list[tuple[float, int, int]] = []

    def reset(self) -> None:
        self.points.clear()

    def record(self, step: float, end_bytes: int, peak_bytes: int) -> None:
        self.points.append((float(step), int(end_bytes), int(peak_bytes)))
        del self.points[:-self.window]

    def slope(self) -> float | None:
        """Bytes per step of the end-of-step memory over the window (None: too few steps)."""
        pts = self.points
        if len(pts) < self.min_points:
            return None
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        var = sum((p[0] - mx) ** 2 for p in pts)
        return sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var > 0 else None

    def rising(self) -> bool:
        """Did the last step set a new running peak (so the running peak is that step's own)?"""
        return len(self.points) >= 2 and self.points[-1][2] > self.points[-2][2]

    def predicted_peak(self, steps_ahead: int) -> int | None:
        """The peak ``steps_ahead`` steps on, if the trend is growing and the peak is current; else None."""
        s = self.slope()
        if s is None or s <= 0 or not self.rising():
            return None
        return int(self.points[-1][2] + s * steps_ahead)
