"""`memlens.Monitor`: the background thread with a fake sampler (CPU), alerts, top tensors, CSV and plot."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from memlens.doctor.log import doctor_log
from memlens.core.errors import MemlensError, NoDeviceError
from memlens.measure.monitor import Monitor, top_tensors

MIB = 2**20


class Ramp:
    """allocated = values[i] on the i-th call (the last value repeats); reserved = allocated + 1 MiB."""

    def __init__(self, values):
        self.values, self.i = values, 0
        self.done = threading.Event()

    def __call__(self):
        v = self.values[min(self.i, len(self.values) - 1)]
        self.i += 1
        if self.i >= len(self.values):
            self.done.set()
        return v, v + MIB


def _run(mon: Monitor, ramp: Ramp) -> Monitor:
    # returns as soon as the sampler has given its last value; an alert's top-tensor dump walks every live object of
    # this process (a test worker holds torch, transformers and the models of earlier tests): on a loaded 2-core
    # machine that took more than 5 s once, so the bound is only there to end a test whose thread died
    with mon:
        assert ramp.done.wait(120)
    return mon


def test_alert_once_per_crossing_with_top_tensors():
    big = torch.empty(3 * MIB, dtype=torch.uint8)  # noqa: F841 - the largest CPU tensor alive
    view = big[:10]  # noqa: F841 - a view of it: its storage counted once
    seen = []
    ramp = Ramp([10, 50, 95, 99, 80, 96, 97])
    mon = _run(Monitor(interval=0.001, threshold=0.9, capacity_bytes=100, on_alert=seen.append, dump_device="cpu",
                       sampler=ramp), ramp)
    assert [a.allocated_bytes for a in mon.alerts] == [95, 96]  # up at 95, down at 80, up again at 96
    assert seen == mon.alerts and mon.alerts[0].threshold_bytes == 90
    top = mon.alerts[0].top_tensors
    assert top[0].bytes == 3 * MIB and top[0].shape == (3 * MIB,) and top[0].dtype == "uint8" and top[0].device == "cpu"
    assert sum(1 for t in top if t.bytes == 3 * MIB) == 1
    assert "allocated 95 B >= threshold 90 B" in mon.alerts[0].message
    assert mon.history[0].allocated_bytes == 10 and mon.history[0].reserved_bytes == 10 + MIB
    assert mon.peak_allocated_bytes == 99 and mon.errors == []


def test_an_alert_lists_the_tensor_whose_allocation_crossed():
    # the allocator's counters move inside the call that allocates, before its Python tensor exists (a real CUDA run
    # on an H200 listed no tensor at all): the sampler reports the crossing, then the "allocating" thread makes its
    # tensor; the alert, taken a moment later, names it
    crossed, made = threading.Event(), {}

    def sampler():
        crossed.set()
        return 100, 100

    with Monitor(interval=0.5, threshold="50B", dump_device="cpu", sampler=sampler) as mon:
        assert crossed.wait(60)
        made["x"] = torch.empty(5 * MIB + 3, dtype=torch.uint8)
        deadline = time.monotonic() + 60
        while not mon.alerts and time.monotonic() < deadline:
            time.sleep(0.005)
    assert mon.alerts and mon.alerts[0].top_tensors[0].bytes == 5 * MIB + 3


def test_threshold_as_size_and_no_dump():
    ramp = Ramp([MIB, 2 * MIB, 3 * MIB])
    mon = _run(Monitor(interval=0.001, threshold="2MiB", dump_top=0, sampler=ramp), ramp)
    assert [a.allocated_bytes for a in mon.alerts] == [2 * MIB] and mon.alerts[0].top_tensors == []


def test_callback_errors_never_kill_the_thread():
    def boom(alert):
        raise ValueError("user bug")

    ramp = Ramp([0, 100, 0, 100, 0])
    mon = _run(Monitor(interval=0.001, threshold=50, on_alert=boom, dump_top=0, sampler=ramp), ramp)
    assert len(mon.alerts) == 2 and [type(e) for e in mon.errors] == [ValueError, ValueError]


def test_sampler_failure_stops_sampling_quietly():
    def broken():
        raise RuntimeError("CUDA error")

    mon = Monitor(interval=0.001, threshold=50, sampler=broken).start()
    time.sleep(0.05)
    mon.stop()
    assert mon.history == [] and isinstance(mon.errors[0], RuntimeError)


def test_history_is_bounded_and_csv_reads_back(tmp_path):
    ramp = Ramp([i * MIB for i in range(50)])
    mon = _run(Monitor(interval=0.001, threshold=10**12, sampler=ramp, max_history=20), ramp)
    assert len(mon.history) == 20
    path = mon.save_csv(tmp_path / "m.csv")
    lines = path.read_text().splitlines()
    assert lines[0] == "time_s,allocated_bytes,reserved_bytes" and len(lines) >= 21
    d = doctor_log(path.read_text()).data
    assert d["x_axis"] == "time_s" and d["memory_key"] == "allocated_bytes" and d["verdict"] == "leak"


def test_plot(tmp_path):
    ramp = Ramp([10, 20, 95, 30])
    mon = _run(Monitor(interval=0.001, threshold=0.9, capacity_bytes=100, sampler=ramp, dump_top=0), ramp)
    assert mon.plot(tmp_path / "m.png").stat().st_size > 5_000


@pytest.mark.parametrize("kwargs,message", [
    (dict(threshold=0.9), "a fractional threshold needs capacity_bytes"),
    (dict(threshold=-3, capacity_bytes=10), "threshold -3 is neither a fraction in (0, 1] nor a size"),
    (dict(threshold="lots"), "cannot read size 'lots'"),
])
def test_bad_thresholds(kwargs, message):
    with pytest.raises(MemlensError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Monitor(sampler=lambda: (0, 0), **kwargs).start()


def test_bad_interval_and_double_start():
    with pytest.raises(MemlensError, match="interval must be positive"):
        Monitor(interval=0)
    mon = Monitor(interval=0.01, threshold=5, sampler=lambda: (0, 0)).start()
    with pytest.raises(MemlensError, match="already running"):
        mon.start()
    mon.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_no_cuda_without_sampler():
    with pytest.raises(NoDeviceError, match="Monitor needs CUDA"):
        Monitor().start()


def test_top_tensors_skips_meta_and_counts_storage_once():
    m = torch.empty(10**9, device="meta")  # noqa: F841 - no storage: ignored
    a = torch.ones(1000, 1000)
    views = [a[i] for i in range(5)]  # noqa: F841
    top = top_tensors(50, "cpu")
    assert sum(1 for t in top if t.bytes == 4 * 10**6) == 1
    assert all(t.device == "cpu" for t in top)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_monitor_alerts_with_the_tensor():
    alerts = []
    base = torch.cuda.memory_allocated()  # earlier GPU tests in this process may have left some
    with Monitor(interval=0.01, threshold=f"{base + 64 * MIB}B", on_alert=alerts.append) as mon:
        x = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
        time.sleep(0.2)
    assert alerts and alerts[0].top_tensors[0].bytes >= 128 * MIB and mon.peak_allocated_bytes >= base + 128 * MIB
    del x
