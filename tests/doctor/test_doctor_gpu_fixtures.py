"""Fixtures captured on a real GPU by bench/gpu_doctor.py (torch >= 2.1 messages, snapshots, memory_stats, watch).

Each gpu_oom_<case>.txt has a gpu_oom_<case>.json holding the truth at the moment of the OOM
(requested size, torch.cuda.memory_stats(), cudaMemGetInfo, the other process): the parsed numbers
must be exactly PyTorch's printed rounding of those. Skipped, with the reason, while the files are absent.
"""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
from doctor_support import FIXTURES, format_size, gpu_fixture

from memlens.doctor.oom import diagnose, parse_oom
from memlens.doctor.snapshot import diff_snapshots, load_snapshot, summarize_snapshot
from memlens.doctor.stats import analyze_memory_stats, load_memory_stats

_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
CASES = ["plain", "fraction", "other_process", "fragmentation"]


def printed(n: int) -> int:
    """What PyTorch prints for n bytes, read back: the exact value a parser must return."""
    num, unit = format_size(n).split()
    return round(Fraction(num) * _UNIT[unit])


@pytest.mark.parametrize("case", CASES)
def test_gpu_oom_message_parsed_exactly(case):
    msg = parse_oom(gpu_fixture(f"gpu_oom_{case}.txt").read_text())
    truth = json.loads(gpu_fixture(f"gpu_oom_{case}.json").read_text())
    assert msg.form == "torch>=2.1" and msg.device_type == "cuda" and msg.device_index == 0
    assert msg.requested_bytes == printed(truth["requested_bytes"])
    assert msg.total_capacity_bytes == printed(truth["total_bytes"])
    assert msg.allocated_by_pytorch_bytes == printed(truth["allocated_bytes"])
    assert msg.reserved_unallocated_bytes == printed(truth["reserved_bytes"] - truth["allocated_bytes"])
    assert msg.this_process_bytes is not None and msg.this_process_bytes >= msg.reserved_by_pytorch_bytes * 0.99
    assert diagnose(msg).diagnosis == truth["expected_diagnosis"]


def test_gpu_oom_fraction_prints_the_allowed_limit():
    msg = parse_oom(gpu_fixture("gpu_oom_fraction.txt").read_text())
    truth = json.loads(gpu_fixture("gpu_oom_fraction.json").read_text())
    assert msg.allowed_bytes == printed(int(truth["fraction"] * truth["total_bytes"]))
    assert parse_oom(gpu_fixture("gpu_oom_plain.txt").read_text()).allowed_bytes is None


def test_gpu_oom_other_process_is_listed():
    msg = parse_oom(gpu_fixture("gpu_oom_other_process.txt").read_text())
    truth = json.loads(gpu_fixture("gpu_oom_other_process.json").read_text())
    other = {p.pid: p.used_bytes for p in msg.other_processes}
    assert truth["other_pid"] in other
    assert other[truth["other_pid"]] >= truth["other_gib"] * 2**30


def test_gpu_snapshots_top_allocations_and_planted_leak():
    before = load_snapshot(gpu_fixture("gpu_snapshot_step5.pickle"))
    after = load_snapshot(gpu_fixture("gpu_snapshot_step15.pickle"))
    truth = json.loads(gpu_fixture("gpu_snapshot_truth.json").read_text())
    s = summarize_snapshot(after)
    assert s.live_blocks > 0 and s.top and all(a.size > 0 for a in s.top)
    assert any(a.frames for a in s.top), "allocations carry their Python frames"
    assert s.reserved_bytes >= s.allocated_bytes > 0 and s.timeline
    grown = diff_snapshots(before, after)
    leak = grown[0]
    assert leak.site.endswith(truth["leak_function"])
    assert leak.growth_bytes == truth["steps_between"] * truth["leak_bytes_per_step"]
    assert leak.after_blocks - leak.before_blocks == truth["steps_between"]
    for p in ("gpu_snapshot_step5.pickle", "gpu_snapshot_step15.pickle"):
        assert (FIXTURES / p).stat().st_size < 2 * 2**20


def test_gpu_memory_stats_after_the_fragmentation_oom():
    """memory_stats() after bench/gpu_doctor.py's planted fragmentation (1 GiB segments, every other 64 MiB tensor freed,
    the rest of the device filled, then 128 MiB asked for): every cached-but-unallocated byte at the OOM is a planted
    64 MiB hole, so the fragmentation memlens reads must be (reserved - allocated) / reserved of the truth recorded at
    the OOM (gpu_oom_fragmentation.json), half of each 1 GiB segment; and three OOMs were raised (the end of each fill
    loop, then the request)."""
    a = analyze_memory_stats(load_memory_stats(gpu_fixture("gpu_memory_stats.json")))
    truth = json.loads(gpu_fixture("gpu_oom_fragmentation.json").read_text())
    holes = truth["reserved_bytes"] - truth["allocated_bytes"]
    assert holes > 0 and holes % (8 * 64 * 2**20) == 0          # 8 freed 64 MiB pieces a 1 GiB segment
    assert a.fragmentation == round(holes / truth["reserved_bytes"], 4)
    assert a.cache_unused_fraction == round(holes / truth["reserved_bytes"], 4)
    assert a.num_ooms == 3
    kinds = [f["kind"] for f in a.findings]
    assert "fragmentation" in kinds and "ooms" in kinds and "healthy" not in kinds


def test_gpu_watch_once_lists_the_holding_process():
    """The NVML figures the GPU run read (total, free, used, each process), fed again to memlens' Watcher through a
    backend that returns them: the sample it builds is the one `watch --once --json` wrote on the GPU, and the
    process that held 2 GiB is listed with at least that much (issue 35: this compared two fixtures before)."""
    from memlens.measure.nvml import Watcher

    d = json.loads(gpu_fixture("gpu_watch_once.json").read_text())
    truth = json.loads(gpu_fixture("gpu_watch_truth.json").read_text())
    gpus = {g["index"]: g for g in d["gpus"]}

    class Replay:        # the NVML backend protocol (memlens.measure.nvml.NvmlBackend), answering the saved figures
        def device_count(self): return len(gpus)
        def device_name(self, i): return gpus[i]["name"]
        def memory(self, i): return gpus[i]["total_bytes"], gpus[i]["free_bytes"], gpus[i]["used_bytes"]
        def processes(self, i): return [(p["pid"], p["used_bytes"]) for p in gpus[i]["processes"]]
        def process_name(self, pid): return next(p["name"] for g in gpus.values() for p in g["processes"] if p["pid"] == pid)
        def close(self): pass

    sample = Watcher(Replay(), clock=lambda: 0.0).sample()
    assert sample["gpus"] == d["gpus"]
    (g,) = sample["gpus"]
    assert g["risk"]["level"] == "ok" and g["risk"]["message"] == f"{100 * g['used_bytes'] / g['total_bytes']:.0f}% used"
    procs = {p["pid"]: p for p in g["processes"]}
    assert procs[truth["holder_pid"]]["used_bytes"] >= truth["holder_bytes"]   # 2 GiB of tensors + its CUDA context


def test_gpu_watch_log_reads_back_as_a_steady_series():
    """The `watch --log` CSV the GPU wrote while a process held 2 GiB: memlens reads one reading a device row, the
    first and last device totals, no growth between them, and the device total includes the holder's 2 GiB (the
    truth the GPU run recorded): every expected figure is read from the raw rows, not from another fixture."""
    import csv

    from memlens.doctor.log import doctor_log

    text = gpu_fixture("gpu_watch_log.csv").read_text()
    rows = list(csv.DictReader(text.splitlines(keepends=True)))
    device = [r for r in rows if not r["pid"]]
    truth = json.loads(gpu_fixture("gpu_watch_truth.json").read_text())
    r = doctor_log(text, capacity_bytes=int(device[0]["memory_total_bytes"]))
    d = r.data
    assert d["x_axis"] == "time_s" and d["memory_key"] == "memory_used_bytes" and d["readings"] == len(device)
    assert d["first_bytes"] == int(device[0]["memory_used_bytes"]) and d["last_bytes"] == int(device[-1]["memory_used_bytes"])
    assert [(g["from"], g["to"]) for g in d["interval_growth"]] == [
        (float(a["time_s"]), float(b["time_s"])) for a, b in zip(device, device[1:])]
    steady = len({r["memory_used_bytes"] for r in device}) == 1
    assert (d["verdict"] == "steady") == steady and d["growth_bytes_per_step"] == 0
    assert d["projected_oom_step"] is None and d["capacity_bytes"] == int(device[0]["memory_total_bytes"])
    holder = [r for r in rows if r["pid"] == str(truth["holder_pid"])]
    assert len(holder) == len(device) and all(int(r["memory_used_bytes"]) >= truth["holder_bytes"] for r in holder)
    assert d["first_bytes"] >= truth["holder_bytes"]


# ---------------------------------------------------------------- issue 14: bench/gpu_oom.py's captures
HIDDEN = ["hidden_fragmentation", "hidden_other_process", "hidden_fraction", "hidden_capacity"]
OOM_SCRIPT = "bench/gpu_oom.py"


def _pair(prefix: str, case: str) -> tuple[str, dict]:
    """(message, truth): synthetic ones are committed (tests/doctor/oom_synthetic_fixtures.py), GPU
    ones are bench/gpu_oom.py's captures (skipped while absent)."""
    if prefix == "synthetic":
        txt, js = FIXTURES / f"synthetic_oom_{case}.txt", FIXTURES / f"synthetic_oom_{case}.json"
    else:
        txt, js = gpu_fixture(f"gpu_oom_{case}.txt", OOM_SCRIPT), gpu_fixture(f"gpu_oom_{case}.json", OOM_SCRIPT)
    return txt.read_text(), json.loads(js.read_text())


def test_synthetic_oom_fixtures_are_what_the_generator_builds():
    import oom_synthetic_fixtures as gen

    for name, (text, truth) in gen.cases().items():
        assert (FIXTURES / f"synthetic_oom_{name}.txt").read_text() == text + "\n"
        assert json.loads((FIXTURES / f"synthetic_oom_{name}.json").read_text()) == truth


@pytest.mark.parametrize("prefix", ["synthetic", "gpu"])
@pytest.mark.parametrize("case", HIDDEN + ["non_pytorch"])
def test_oom_accounted_and_diagnosed(prefix, case):
    """Messages from an OOM in a process whose PID the message cannot match (a PID namespace or an
    LD_PRELOAD'ed getpid: this process is printed as "Process N"), and from a process holding 30 GiB
    outside PyTorch: the verdict the truth expects, this process recognized by its numbers."""
    text, truth = _pair(prefix, case)
    msg = parse_oom(text)
    assert msg.requested_bytes == printed(truth["requested_bytes"])
    assert msg.allocated_by_pytorch_bytes == printed(truth["allocated_bytes"])
    d = diagnose(msg)
    assert d.diagnosis == truth["expected_diagnosis"], d.reasons
    assert d.certain
    acc = d.account
    if truth["this_process_line"]:
        assert acc.this_process_source == "message"
    elif truth["process_lines"]:
        # the job is listed under a PID that is not its own: recognized, never blamed
        assert acc.this_process_source == "matched" and acc.this_process_pid is not None
        assert acc.this_process_pid != truth.get("other_pid")
        assert acc.non_pytorch_bytes is not None and acc.non_pytorch_bytes < 2 * 2**30
        if truth.get("other_pid"):
            assert [p["pid"] for p in acc.other_processes] == [truth["other_pid"]]
    if case == "non_pytorch":
        assert acc.non_pytorch_bytes >= truth["outside_pytorch_bytes"]
    total = acc.free_bytes + (acc.this_process_bytes or acc.pytorch_reserved_bytes) + acc.other_processes_bytes
    assert abs(acc.total_bytes - total) < 0.02 * acc.total_bytes        # the account balances


def test_gpu_oom_hidden_pid_really_hidden():
    """At least one GPU capture hid the PID (else the captures do not test what issue 14 asks), as memlens reads
    the message: no 'this process' line parsed, and the account finds this process among the listed ones by its
    numbers, under a PID that is not the one the capture ran as (issue 35: this read only the truth files before)."""
    hidden = []
    for case in HIDDEN:
        text, truth = _pair("gpu", case)
        msg = parse_oom(text)
        assert (msg.this_process_bytes is None) == (not truth["this_process_line"]), case
        if msg.this_process_bytes is None and msg.other_processes:
            acc = diagnose(msg).account
            assert acc.this_process_source == "matched", case
            hidden.append(case)
    assert hidden, [_pair("gpu", c)[1].get("hidden_method") for c in HIDDEN]
