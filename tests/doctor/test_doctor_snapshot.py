"""`doctor snapshot` on hand-built snapshots (tests/doctor/doctor_synthetic.py) and bad files; `doctor stats`."""
from __future__ import annotations

import json
import pickle

import pytest
import doctor_synthetic as synthetic
from doctor_support import FIXTURES
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memlens.cli.main import main
from memlens.doctor.snapshot import (allocation_site, diff_snapshots, doctor_snapshot, load_snapshot, summarize_snapshot,
                                     validate_snapshot)
from memlens.doctor.stats import analyze_memory_stats, doctor_stats, normalize_stats
from memlens.core.errors import MemlensError

MIB = 2**20
BEFORE = FIXTURES / "synthetic_snapshot_before.pickle"
AFTER = FIXTURES / "synthetic_snapshot_after.pickle"


def test_committed_fixtures_match_the_builder():
    assert pickle.loads(BEFORE.read_bytes()) == synthetic.build(2)
    assert pickle.loads(AFTER.read_bytes()) == synthetic.build(5)


def test_summary_totals_and_top_allocations():
    s = summarize_snapshot(load_snapshot(BEFORE))
    # live: weights 64 + leak 8 + 8 (segment A) + AdamW 128 + 0.5 (small segment) MiB
    assert s.allocated_bytes == int(208.5 * MIB) and s.live_blocks == 5
    assert s.reserved_bytes == (94 + 128 + 2) * MIB
    assert s.inactive_split_bytes == int((10 + 4 + 1.5) * MIB)  # free pieces of segments still in use
    assert [a.size for a in s.top] == [128 * MIB, 64 * MIB, 8 * MIB, 8 * MIB, 512 * 1024]
    assert [a.site for a in s.top[:3]] == ["/home/me/proj/train.py:30 make_optimizer", "/home/me/proj/model.py:17 __init__",
                                           "/home/me/proj/train.py:42 train_step"]
    assert s.top[2].frames[0].endswith("torch/nn/modules/linear.py:125 forward")  # full Python stack kept
    assert s.sites[2] == {"site": "/home/me/proj/train.py:42 train_step", "bytes": int(16.5 * MIB), "blocks": 3}


def test_fragmentation_per_segment():
    s = summarize_snapshot(load_snapshot(BEFORE))
    seg_a = s.segments[0]
    assert (seg_a.total_size, seg_a.allocated_size, seg_a.inactive_size, seg_a.largest_inactive) == (94 * MIB, 80 * MIB, 14 * MIB, 10 * MIB)
    assert seg_a.fragmentation == pytest.approx(1 - 10 / 14)
    assert s.segments[1].fragmentation == 0.0 and s.segments[1].inactive_size == 0
    assert s.segments[2].segment_type == "small" and s.segments[2].fragmentation == 0.0


def test_allocated_timeline_is_anchored_at_the_snapshot_total():
    s = summarize_snapshot(load_snapshot(BEFORE))
    # trace: +16, +32, -32, -16, +8 MiB (net +8) ending at 208.5 MiB, so it starts at 200.5 MiB
    assert [p["allocated_bytes"] / MIB for p in s.timeline] == [216.5, 248.5, 216.5, 200.5, 208.5]
    assert [p["t"] for p in s.timeline] == [1100, 1200, 1300, 1400, 1500]
    assert s.trace_entries == 8 and s.oom_events == 1


def test_diff_shows_the_planted_leak():
    grown = diff_snapshots(load_snapshot(BEFORE), load_snapshot(AFTER))
    assert len(grown) == 1
    g = grown[0]
    assert g.site == "/home/me/proj/train.py:42 train_step"
    assert g.growth_bytes == 3 * 8 * MIB and (g.before_blocks, g.after_blocks) == (3, 6)


def test_cli_snapshot_with_diff_json_and_plot(tmp_path, capsys):
    assert main(["doctor", "snapshot", str(BEFORE), "--diff", str(AFTER), "--json", "--out", str(tmp_path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "doctor.snapshot"
    assert d["allocated_growth_bytes"] == 24 * MIB and d["grown_sites"][0]["growth_bytes"] == 24 * MIB
    assert d["top_allocations"][0]["size"] == 128 * MIB
    assert d["segments"][0]["fragmentation"] == round(1 - 10 / 14, 4)
    assert (tmp_path / "snapshot.png").stat().st_size > 10_000


def test_cli_snapshot_table(capsys):
    assert main(["doctor", "snapshot", str(BEFORE), "--diff", str(AFTER), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "top live allocations" in out and "make_optimizer" in out and "what grew (leak candidates)" in out
    assert "most fragmented segments" in out


def test_site_without_python_frames():
    assert allocation_site([{"filename": "??", "line": 0, "name": "c10::cuda::alloc"}]).startswith("(no Python frames")
    assert allocation_site([synthetic.TORCH_FRAME]) == "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py:125 forward"


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize("payload,message", [
    (b"", "is truncated"),
    (pickle.dumps(synthetic.build(2))[:200], "is truncated"),
    (b"not a pickle at all", "is not a valid pickle"),
    (pickle.dumps(Evil()), "is not a memory snapshot pickle (the pickle refers to builtins.print; refused"),
    (pickle.dumps([1, 2, 3]), "is not a memory snapshot (no 'segments' list)"),
    (pickle.dumps({"segments": [{"blocks": []}]}), "has a malformed segment"),
    (pickle.dumps({"segments": [{"total_size": 10, "blocks": [{"state": "inactive"}]}]}), "has a malformed block"),
    (pickle.dumps({"segments": [], "device_traces": {"a": 1}}), "has malformed device_traces"),
])
def test_bad_snapshots_one_line_exit_2(tmp_path, capsys, payload, message):
    f = tmp_path / "s.pickle"
    f.write_bytes(payload)
    assert main(["doctor", "snapshot", str(f)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("ERROR: ") and "HINT:" in err and err.count("\n") == 1


def test_missing_snapshot_and_bad_top(tmp_path, capsys):
    assert main(["doctor", "snapshot", str(tmp_path / "none.pickle")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "snapshot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["doctor", "snapshot", str(BEFORE), "--top", "0"]) == 2
    assert "argument --top: must be a whole number >= 1, got 0" in capsys.readouterr().err


def test_empty_snapshot_is_fine(tmp_path):
    f = tmp_path / "e.pickle"
    f.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    r = doctor_snapshot(f)
    assert r.data["allocated_bytes"] == 0 and r.timeline == [] and r.peak_allocated_bytes is None
    assert "no trace in the snapshot" in r.notes[0]


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.text(max_size=5), st.floats())
_frame = st.fixed_dictionaries({}, optional={"filename": st.one_of(st.text(max_size=10), st.just("x.py")), "line": _scalar, "name": _scalar})
_block = st.fixed_dictionaries({}, optional={
    "size": st.one_of(st.integers(0, 2**30), _scalar), "requested_size": _scalar, "address": _scalar,
    "state": st.one_of(st.sampled_from(["active_allocated", "inactive", "active_pending_free"]), _scalar),
    "frames": st.one_of(st.lists(st.one_of(_frame, _scalar), max_size=3), _scalar)})
_segment = st.fixed_dictionaries({}, optional={
    "total_size": st.one_of(st.integers(0, 2**30), _scalar), "address": _scalar, "device": _scalar,
    "segment_type": _scalar, "blocks": st.one_of(st.lists(st.one_of(_block, _scalar), max_size=4), _scalar)})
_trace = st.fixed_dictionaries({}, optional={"action": st.one_of(st.sampled_from(["alloc", "free_completed", "oom"]), _scalar),
                                             "size": _scalar, "time_us": _scalar})
_snapshot = st.one_of(_scalar, st.fixed_dictionaries({}, optional={
    "segments": st.one_of(st.lists(st.one_of(_segment, _scalar), max_size=4), _scalar),
    "device_traces": st.one_of(st.lists(st.lists(st.one_of(_trace, _scalar), max_size=5), max_size=2), _scalar)}))


@settings(max_examples=400, deadline=None)
@given(_snapshot, _snapshot)
def test_fuzz_snapshot_structures(a, b):
    try:
        sa, sb = validate_snapshot(a), validate_snapshot(b)
    except MemlensError as e:
        assert e.hint
        return
    summarize_snapshot(sa)
    diff_snapshots(sa, sb)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2000))
def test_fuzz_snapshot_bytes(tmp_path_factory, junk, cut):
    f = tmp_path_factory.mktemp("fz") / "s.pickle"
    good = BEFORE.read_bytes()
    f.write_bytes(good[:cut] + junk)
    try:
        load_snapshot(f)
    except MemlensError as e:
        assert e.hint


# ---------------------------------------------------------------- memory_stats

STATS = {
    "allocated_bytes.all.current": 6 * 2**30, "allocated_bytes.all.peak": 9 * 2**30,
    "reserved_bytes.all.current": 10 * 2**30, "reserved_bytes.all.peak": 12 * 2**30,
    "active_bytes.all.current": 6 * 2**30, "requested_bytes.all.current": 6 * 2**30 - 1000,
    "inactive_split_bytes.all.current": 3 * 2**30, "segment.all.current": 40,
    "num_alloc_retries": 4, "num_ooms": 1, "num_device_alloc": 50, "num_device_free": 10,
}


def test_stats_fragmentation_and_retries(tmp_path, capsys):
    f = tmp_path / "stats.json"
    f.write_text(json.dumps(STATS))
    r = doctor_stats(f)
    d = r.data
    assert d["fragmentation"] == 0.3 and d["cache_unused_fraction"] == 0.4
    assert d["reserved_unallocated_bytes"] == 4 * 2**30 and d["num_alloc_retries"] == 4
    assert [x["kind"] for x in d["findings"]] == ["fragmentation", "retries", "ooms"]
    assert r.peak_allocated_bytes == 9 * 2**30 and r.peak_reserved_bytes == 12 * 2**30
    assert main(["doctor", "stats", str(f)]) == 0
    out = capsys.readouterr().out
    assert "fragmentation 30%" in out and "cudaMalloc failed 4 time(s)" in out


def test_stats_nested_and_wrapped_forms():
    nested = {"allocated_bytes": {"all": {"current": 5, "peak": 7}}, "reserved_bytes": {"all": {"current": 10, "peak": 10}},
              "inactive_split_bytes": {"all": {"current": 0}}, "num_alloc_retries": 0, "num_ooms": 0}
    a = analyze_memory_stats(normalize_stats({"memory_stats": nested}))
    assert a["allocated_bytes"] == 5 and a["cache_unused_fraction"] == 0.5 and a["findings"][0]["kind"] == "healthy"


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not valid JSON (Expecting property name enclosed in double quotes at line 1)"),
    ("[1, 2]", "is not a torch.cuda.memory_stats() dump (not a JSON object)"),
    ('{"loss": 1.0}', "is not a torch.cuda.memory_stats() dump (no 'reserved_bytes.all.current')"),
    ("", "is not valid JSON"),
])
def test_bad_stats_one_line_exit_2(tmp_path, capsys, content, message):
    f = tmp_path / "s.json"
    f.write_text(content)
    assert main(["doctor", "stats", str(f)]) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT:" in err and err.count("\n") == 1


def test_stats_missing_file(capsys):
    assert main(["doctor", "stats", "/nonexistent/stats.json"]) == 2
    assert "stats file /nonexistent/stats.json does not exist" in capsys.readouterr().err


_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                     lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(
                         st.one_of(st.text(max_size=5), st.sampled_from(["allocated_bytes.all.current", "reserved_bytes.all.current",
                                                                         "inactive_split_bytes.all.current", "num_ooms"])), c, max_size=4)),
                     max_leaves=15)


@settings(max_examples=300, deadline=None)
@given(_json)
@example({"allocated_bytes.all.current": float("inf")})
@example({"reserved_bytes.all.current": float("nan"), "allocated_bytes.all.current": 5})
def test_fuzz_stats(data):
    try:
        a = analyze_memory_stats(normalize_stats(data))
    except MemlensError as e:
        assert e.hint
        return
    assert 0 <= a["cache_unused_fraction"] <= 1 or a["reserved_bytes"] < a["allocated_bytes"]
