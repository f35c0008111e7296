"""The typed payloads of doctor oom, snapshot, stats and log: every field filled from a real input
(the GPU fixtures), nothing left in ``extra``, the JSON loaded back into the same payload and written
out the same, and an old JSON's unknown keys kept, its absent keys left absent."""
from __future__ import annotations

import json

import pytest
from doctor_support import FIXTURES, gpu_fixture

from memlens.core.payloads import (UNSET, DoctorLogPayload, DoctorOomPayload, DoctorSnapshotPayload,
                                   DoctorStatsPayload, Payload)
from memlens.core.result import Result
from memlens.core.spec import TrainingSpec
from memlens.doctor import diagnose_oom, doctor_log, doctor_snapshot, doctor_stats

GiB = 2**30


def _set(p: Payload) -> set[str]:
    return {n for n in p.names() if getattr(p, n) is not UNSET}


def _written(r: Result) -> dict:
    d = json.loads(r.to_json())
    d.pop("created_at")
    return d


def _round_trip(r: Result, tmp_path, cls: type[Payload]) -> Result:
    """Saved and loaded: the same payload class, the same JSON (keys in the same order)."""
    back = Result.load(r.save(tmp_path / "result.json"))
    assert type(back.data) is cls and back.data.extra == {}
    assert list(_written(back)) == list(_written(r)) and _written(back) == _written(r)
    return back


OOMS = ["plain", "fraction", "fragmentation", "other_process", "non_pytorch", "hidden_capacity", "hidden_fraction",
        "hidden_fragmentation", "hidden_other_process"]


@pytest.mark.parametrize("name", OOMS)
def test_oom_payload_every_field_from_a_real_message(name, tmp_path):
    text = gpu_fixture(f"gpu_oom_{name}.txt", "bench/gpu_oom.py").read_text()
    truth = json.loads((FIXTURES / f"gpu_oom_{name}.json").read_text())
    r = diagnose_oom(text)
    d = r.data
    assert isinstance(d, DoctorOomPayload) and d.extra == {}
    assert _set(d) == set(d.names()) - {"estimate"}          # every field but the configuration's estimate
    assert d.diagnosis == truth["expected_diagnosis"] and d.reasons and d.advice
    assert d.form == "torch>=2.1" and d.device_type == "cuda" and d.device_index == 0 and d.messages_found == 1
    # the message prints two decimals of GiB: within half a hundredth of a GiB of what the GPU run asked
    assert abs(d.requested_bytes - truth["requested_bytes"]) <= 0.005 * GiB
    assert d.evidence["requested"] == d.requested_bytes and d.account["total_bytes"] == d.total_capacity_bytes
    assert d.other_processes_bytes == sum(p["used_bytes"] for p in d.other_processes)
    assert list(d.to_dict())[:3] == ["diagnosis", "reasons", "advice"]   # the diagnosis leads the JSON, as before
    _round_trip(r, tmp_path, DoctorOomPayload)


def test_oom_payload_with_a_configuration_fills_the_estimate(tmp_path):
    def fake_estimate(spec):
        return Result(verb="estimate", peak_allocated_bytes=GiB + spec.batch_size * GiB // 4,
                      by_category={"activations": spec.batch_size * GiB // 4, "parameters": GiB})

    r = diagnose_oom((FIXTURES / "gpu_oom_plain.txt").read_text(), spec=TrainingSpec(model="gpt2", batch_size=8),
                     estimate_fn=fake_estimate)
    est = r.data.estimate
    assert est["estimated_peak_allocated_bytes"] == 3 * GiB and est["dominant_category"] == "activations"
    assert est["dominant_category_bytes"] == 2 * GiB and est["budget_bytes"] > 0 and est["fit_options"]
    assert list(_written(r))[-1] == "estimate"
    _round_trip(r, tmp_path, DoctorOomPayload)


def test_snapshot_payload_and_its_diff_from_the_gpu_snapshots(tmp_path):
    truth = json.loads(gpu_fixture("gpu_snapshot_truth.json").read_text())
    before, after = gpu_fixture("gpu_snapshot_step5.pickle"), gpu_fixture("gpu_snapshot_step15.pickle")
    alone = doctor_snapshot(before).data
    assert isinstance(alone, DoctorSnapshotPayload) and alone.extra == {}
    diff_fields = {"snapshot_after", "after_allocated_bytes", "after_reserved_bytes", "allocated_growth_bytes", "grown_sites"}
    assert _set(alone) == set(alone.names()) - diff_fields and not diff_fields & set(alone.to_dict())
    r = doctor_snapshot(before, diff_with=after)
    d = r.data
    assert _set(d) == set(d.names()) and d.extra == {}
    assert d.snapshot == str(before) and d.snapshot_after == str(after)
    assert d.reserved_unallocated_bytes == d.reserved_bytes - d.allocated_bytes and d.live_blocks == 22
    assert d.segments_count == 4 and d.timeline_axis == "time_us" and d.trace_entries > 0
    assert d.top_allocations[0]["size"] == max(a["size"] for a in d.top_allocations)
    leak = truth["leak_bytes_per_step"] * truth["steps_between"]
    assert d.allocated_growth_bytes == d.after_allocated_bytes - d.allocated_bytes == leak
    assert truth["leak_function"] in d.grown_sites[0]["site"] and d.grown_sites[0]["growth_bytes"] == leak
    _round_trip(r, tmp_path, DoctorSnapshotPayload)


def test_stats_payload_from_a_real_memory_stats_dump(tmp_path):
    path = gpu_fixture("gpu_memory_stats.json")
    raw = json.loads(path.read_text())
    r = doctor_stats(path)
    d = r.data
    assert isinstance(d, DoctorStatsPayload) and d.extra == {} and _set(d) == set(d.names())
    assert d.stats_file == str(path) and list(d.to_dict())[0] == "stats_file"
    assert d.allocated_bytes == raw["allocated_bytes.all.current"] and d.reserved_peak_bytes == raw["reserved_bytes.all.peak"]
    assert d.inactive_split_bytes == raw["inactive_split_bytes.all.current"] and d.num_ooms == raw["num_ooms"]
    assert d.num_alloc_retries == raw["num_alloc_retries"] and d.segments == raw["segment.all.current"]
    assert d.fragmentation == round(d.inactive_split_bytes / d.reserved_bytes, 4)
    assert [f["kind"] for f in d.findings] == ["fragmentation", "retries", "ooms"]
    assert r.peak_allocated_bytes == d.allocated_peak_bytes
    _round_trip(r, tmp_path, DoctorStatsPayload)


def test_log_payload_from_the_seed_log_and_a_watch_csv(tmp_path):
    r = doctor_log((FIXTURES / "seed_exercise_9_8.log").read_text(), capacity_bytes=24 * 10**9, source="train.log")
    d = r.data
    assert isinstance(d, DoctorLogPayload) and d.extra == {}
    assert _set(d) == set(d.names()) - {"notes_on_axis"} and "notes_on_axis" not in d.to_dict()
    assert d.source == "train.log" and d.source_format == "lines" and d.memory_key == "Memory" and d.x_axis == "step"
    assert d.readings == 9 and d.first_bytes == 18_200_000_000 and d.last_bytes == 24_200_000_000
    assert d.verdict == "leak" and d.pattern == "accelerating" and d.trend_model == "quadratic"
    assert len(d.trend_coefficients) == 3 and d.capacity_bytes == 24 * 10**9 and d.projected_oom_step == 900
    assert d.oom_observed_at == 1000.0 and len(d.interval_growth) == 8 and d.causes
    _round_trip(r, tmp_path, DoctorLogPayload)

    watch = doctor_log(gpu_fixture("gpu_watch_log.csv").read_text()).data
    assert watch.x_axis == "time_s" and watch.notes_on_axis.startswith("x is seconds")
    assert list(watch.to_dict())[-1] == "notes_on_axis"


@pytest.mark.parametrize("verb,cls", [("doctor.oom", DoctorOomPayload), ("doctor.snapshot", DoctorSnapshotPayload),
                                      ("doctor.stats", DoctorStatsPayload), ("doctor.log", DoctorLogPayload)])
def test_an_old_json_keeps_its_unknown_keys_and_leaves_absent_ones_absent(verb, cls, tmp_path):
    first, missing = cls.names()[:2]               # a field the old JSON has, and one it lacks
    old = {"verb": verb, first: "x", "field_of_another_version": {"a": 1}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = Result.load(tmp_path / "old.json")
    assert type(r.data) is cls and getattr(r.data, first) == "x" and getattr(r.data, missing) is UNSET
    assert r.data.extra == {"field_of_another_version": {"a": 1}}
    again = _written(r)
    assert missing not in again and again["field_of_another_version"] == {"a": 1}
    assert list(again)[-2:] == [first, "field_of_another_version"]
