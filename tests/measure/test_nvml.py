"""NVML readings, OOM risk and `memlens watch` through a fake backend; the no-driver path; the real GPU."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from memlens.cli.main import main
from memlens.doctor.log import doctor_log
from memlens.core.errors import NoDeviceError
from memlens.measure import nvml
from memlens.measure.nvml import Watcher, csv_rows, oom_risk, read_gpus

GIB = 2**30


class FakeNvml:
    """Two GPUs; GPU 0's use grows by ``step`` bytes each reading; one process hides its use (None)."""

    def __init__(self, used0: int = 20 * GIB, step: int = 0):
        self.used0, self.step, self.reads, self.closed = used0, step, 0, False

    def device_count(self):
        return 2

    def device_name(self, i):
        return "NVIDIA H100 80GB HBM3"

    def memory(self, i):
        total = 80 * GIB
        used = self.used0 + self.step * self.reads if i == 0 else GIB
        if i == 0:
            self.reads += 1
        return total, total - used, used

    def processes(self, i):
        return [(4242, 18 * GIB), (777, None)] if i == 0 else []

    def process_name(self, pid):
        return {4242: "python train.py", 777: "jupyter"}[pid]

    def close(self):
        self.closed = True


def test_process_used_bytes_sums_gpus_and_keeps_unknown_none():
    from memlens.measure.nvml import process_used_bytes

    class TwoGpus(FakeNvml):
        def processes(self, i):
            return [(4242, 18 * GIB), (777, None)] if i == 0 else [(4242, 2 * GIB)]

    assert process_used_bytes(TwoGpus(), 4242) == 20 * GIB
    assert process_used_bytes(TwoGpus(), 777) is None        # the driver hides it
    assert process_used_bytes(TwoGpus(), 1) is None          # not on any GPU


def test_read_gpus():
    gpus = read_gpus(FakeNvml())
    assert [g.index for g in gpus] == [0, 1]
    g = gpus[0]
    assert (g.total_bytes, g.used_bytes, g.free_bytes) == (80 * GIB, 20 * GIB, 60 * GIB) and g.used_fraction == 0.25
    assert [(p.pid, p.used_bytes, p.name) for p in g.processes] == [(4242, 18 * GIB, "python train.py"), (777, None, "jupyter")]
    assert [g.index for g in read_gpus(FakeNvml(), only=[1])] == [1]
    with pytest.raises(NoDeviceError, match="GPU 5 does not exist"):
        read_gpus(FakeNvml(), only=[5])


@pytest.mark.parametrize("history,level,ttf", [
    ([(0, 10 * GIB)], "ok", None),
    ([(0, 10 * GIB), (1, 10 * GIB), (2, 10 * GIB)], "ok", None),
    ([(0, 73 * GIB), (1, 73 * GIB), (2, 73 * GIB)], "warn", None),  # 91% used
    ([(0, 78 * GIB), (1, 78 * GIB), (2, 78 * GIB)], "critical", None),  # 97.5% used
    ([(0, 10 * GIB), (10, 11 * GIB), (20, 12 * GIB)], "warn", 680.0),  # 68 GiB free at 0.1 GiB/s
    ([(0, 10 * GIB), (1, 20 * GIB), (2, 30 * GIB)], "critical", 5.0),
])
def test_oom_risk_levels(history, level, ttf):
    r = oom_risk(history, 80 * GIB, warn_seconds=1000)
    assert r.level == level
    assert r.seconds_to_full == (pytest.approx(ttf) if ttf is not None else None)


def test_oom_risk_uses_only_the_window():
    # fast growth long ago, flat in the last 60 s: no time to full
    history = [(t, t * GIB) for t in range(10)] + [(100 + t, 10 * GIB) for t in range(10)]
    r = oom_risk(history, 80 * GIB)
    assert r.slope_bytes_per_s == 0 and r.seconds_to_full is None and r.level == "ok"


def test_watcher_keeps_history_and_warns():
    clock = iter(range(0, 100, 10))
    w = Watcher(FakeNvml(used0=10 * GIB, step=GIB), warn_seconds=1000, clock=lambda: float(next(clock)))
    samples = [w.sample() for _ in range(3)]
    g0 = samples[-1]["gpus"][0]
    assert samples[-1]["time_s"] == 20.0 and g0["used_bytes"] == 12 * GIB
    assert g0["risk"]["level"] == "warn" and g0["risk"]["seconds_to_full"] == pytest.approx(680.0)
    assert "full in 11 min at this rate" in g0["risk"]["message"]
    assert len(w.history[0]) == 3 and samples[-1]["gpus"][1]["risk"]["level"] == "ok"


def test_csv_rows_roundtrip_through_doctor_log(tmp_path):
    clock = iter(range(0, 1000, 10))
    w = Watcher(FakeNvml(used0=10 * GIB, step=GIB), clock=lambda: float(next(clock)))
    rows = [r for _ in range(6) for r in csv_rows(w.sample())]
    assert rows[0] == {"time_s": 0.0, "gpu": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * GIB, "pid": "",
                       "process": "", "memory_used_bytes": 10 * GIB, "memory_free_bytes": 70 * GIB}
    assert rows[2]["memory_used_bytes"] == ""  # the process NVML does not report
    f = tmp_path / "w.csv"
    with f.open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=nvml.CSV_COLUMNS)
        wr.writeheader()
        wr.writerows(rows)
    d = doctor_log(f.read_text(), capacity_bytes=80 * GIB).data
    assert d["verdict"] == "leak" and d["growth_bytes_per_step"] == GIB // 10 and d["projected_oom_step"] == 700


# ---------------------------------------------------------------- the CLI with a fake backend

@pytest.fixture
def fake(monkeypatch):
    backend = FakeNvml(used0=70 * GIB, step=GIB)
    monkeypatch.setattr(nvml, "open_backend", lambda: backend)
    return backend


def test_watch_once_json(fake, capsys):
    assert main(["watch", "--once", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "watch" and [g["index"] for g in d["gpus"]] == [0, 1]
    assert d["gpus"][0]["processes"][0] == {"pid": 4242, "used_bytes": 18 * GIB, "name": "python train.py"}
    assert d["gpus"][0]["risk"]["level"] == "ok" and d["notes"] == []
    assert fake.closed


def test_watch_count_log_and_warning(fake, tmp_path, capsys):
    log = tmp_path / "mem.csv"
    assert main(["watch", "--count", "4", "--interval", "0.01", "--json", "--log", str(log), "--gpu", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    last = json.loads(lines[-1])
    assert last["gpus"][0]["used_bytes"] == 73 * GIB and last["gpus"][0]["risk"]["level"] == "critical"
    assert last["notes"][0].startswith("GPU 0: 91% used")
    rows = list(csv.DictReader(log.open()))
    assert len(rows) == 4 * 3 and rows[0]["memory_used_bytes"] == str(70 * GIB)
    assert main(["watch", "--once", "--log", str(log)]) == 0  # appends without a second header
    assert sum(1 for line in log.read_text().splitlines() if line.startswith("time_s")) == 1


def test_watch_table(fake, capsys):
    assert main(["watch", "--once"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and "4242 python train.py" in out and "70.00 GiB" in out


@pytest.mark.parametrize("argv,message", [
    (["watch", "--interval", "0"], "ERROR: argument --interval: must be a number > 0, got 0"),
    (["watch", "--count", "0"], "ERROR: argument --count: must be a whole number >= 1, got 0"),
    (["watch", "--warn-fraction", "2"], "ERROR: --warn-fraction must be in (0, 1]"),
    (["watch", "--once", "--gpu", "7"], "ERROR: GPU 7 does not exist (this machine has 2)"),
    (["watch", "--once", "--log", "/nonexistent/dir/m.csv"], "ERROR: cannot write the log /nonexistent/dir/m.csv"),
])
def test_watch_bad_flags(fake, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "HINT:" in err and err.count("\n") == 1


# ---------------------------------------------------------------- no driver

def test_no_driver_is_one_line_exit_2(monkeypatch, capsys):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert main(["watch", "--once", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("ERROR: no NVIDIA driver found: NVML could not start (NVML Shared Library Not Found)  "
                            "HINT: memlens watch needs an NVIDIA GPU and driver; doctor and estimate work without one\n")


def test_no_nvidia_ml_py(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(["watch", "--once"]) == 2
    assert capsys.readouterr().err.startswith("ERROR: nvidia-ml-py is not installed")


# ---------------------------------------------------------------- the real thing

def _gpu_and_nvml() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        nvml.PynvmlBackend().close()
        return True
    except NoDeviceError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_and_nvml(), reason="needs CUDA and an NVIDIA driver (NVML)")
def test_real_watch_once_json_lists_this_process():
    import torch

    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # noqa: F841 - hold memory while watching
    r = subprocess.run([sys.executable, "-m", "memlens.cli.main", "watch", "--once", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    import os

    assert any(p["pid"] == os.getpid() for g in d["gpus"] for p in g["processes"])
