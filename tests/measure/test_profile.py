"""The profiler's library API on CPU (ledger mode): exact bytes computed by hand."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import memlens.measure.profiler as mp
from memlens.core.ledger import replay
from memlens.core.errors import MemlensError
from memlens.report.profile_report import report_html, timeline_csv, write_report
from memlens.core.result import Result

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "profile"

# Linear(4, 8) + Linear(8, 2): (4*8 + 8) + (8*2 + 2) = 58 float32 values
PARAM_BYTES = 58 * 4


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model


def run_loop(model, opt, steps=2, **kw):
    with mp.profile(model, opt, device="cpu", **kw) as prof:
        prof.mark("before loop")
        for _ in range(steps):
            x = torch.randn(3, 4)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return prof


def test_categories_exact_adamw():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    r = run_loop(model, opt).result
    assert r.verb == "profile"
    assert r.by_category["parameters"] == PARAM_BYTES
    assert r.by_category["gradients"] == PARAM_BYTES          # the peak is in the optimizer step: every grad is live
    # AdamW: exp_avg + exp_avg_sq per parameter, plus a float32 `step` scalar per parameter tensor (4 tensors)
    assert r.by_category["optimizer_state"] == 2 * PARAM_BYTES + 4 * 4
    assert r.by_category["inputs"] == 3 * 4 * 4               # the (3, 4) float32 batch
    assert sum(r.by_category.values()) == r.peak_allocated_bytes
    assert r.data["categories_error"] == 0.0
    assert r.data["peak_phase"] == "optimizer" and r.data["peak_step"] == 1
    assert r.data["theoretical_param_bytes"] == PARAM_BYTES
    assert r.data["param_count"] == 58


def test_sgd_has_no_state_and_phases_are_ordered():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = run_loop(model, opt, steps=3)
    r = prof.result
    assert r.by_category["optimizer_state"] == 0
    labels = [s["label"] for s in r.data["snapshots"]]
    assert labels[:2] == ["start", "before loop"]
    for step in (1, 2, 3):
        i = labels.index(f"step {step} forward")
        assert labels[i:i + 4] == [f"step {step} forward", f"step {step} backward", f"step {step} optimizer", f"step {step} end"]
    assert labels[-1] == "stop"
    assert [s["step"] for s in r.data["steps"]] == [1, 2, 3]
    assert set(r.by_phase) == {"forward", "backward", "optimizer"}
    # every phase's peak is at least what was allocated when it started, and the overall peak is the max
    assert r.peak_allocated_bytes == max(v["peak_allocated_bytes"] for v in r.by_phase.values())
    for s in r.data["snapshots"]:
        assert s["reserved_bytes"] == s["allocated_bytes"]    # CPU: no caching allocator


def test_snapshot_values_are_live_bytes():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = run_loop(model, opt, steps=1)
    snaps = {s["label"]: s for s in prof.result.data["snapshots"]}
    assert snaps["start"]["allocated_bytes"] == PARAM_BYTES
    # after zero_grad(set_to_none) the gradients are gone; the batch may be too
    assert snaps["stop"]["allocated_bytes"] <= PARAM_BYTES + 48


def test_modules_and_operations():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    r = run_loop(model, opt).result
    mods = {m["module"]: m for m in r.by_module}
    assert mods["0"]["by_category"]["parameters"] == (4 * 8 + 8) * 4
    assert mods["2"]["by_category"]["parameters"] == (8 * 2 + 2) * 4
    assert mods["0"]["forward_peak_bytes"] == 3 * 8 * 4        # its (3, 8) output
    assert mods["(optimizer)"]["by_category"]["optimizer_state"] == 2 * PARAM_BYTES + 16
    assert not any(m["lora"] for m in r.by_module)
    ops = r.data["by_operation"]
    assert set(ops) == {"start", "forward", "backward", "optimizer"}
    # the parameters existed before profiling; step 1's batch was made before its first forward
    assert ops["start"] == PARAM_BYTES + 3 * 4 * 4


def test_phases_mode_on_cpu_still_uses_the_ledger():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    r = run_loop(model, opt, mode="phases").result
    assert r.data["mode"] == "phases" and r.by_category["parameters"] == PARAM_BYTES


def test_without_optimizer_mark_and_phase():
    model = tiny()
    with mp.profile(model, device="cpu") as prof:
        prof.mark("one")
        prof.phase("forward")
        y = model(torch.randn(2, 4))
        prof.phase("end")
        del y
    labels = [s["label"] for s in prof.result.data["snapshots"]]
    assert labels == ["start", "one", "step 1 forward", "step 1 end", "stop"]


def test_no_model_at_all():
    with mp.profile(device="cpu") as prof:
        keep = torch.zeros(256)           # 1024 bytes, created under the ledger
        prof.mark("after zeros")
    s = {x["label"]: x for x in prof.result.data["snapshots"]}
    assert s["after zeros"]["allocated_bytes"] - s["start"]["allocated_bytes"] == 1024
    del keep


def test_result_before_stop_and_bad_mode():
    prof = mp.Profiler(tiny(), device="cpu")
    with pytest.raises(MemlensError):
        prof.result
    with pytest.raises(MemlensError, match="mode"):
        mp.Profiler(tiny(), device="cpu", mode="fast")
    with pytest.raises(MemlensError, match="CUDA"):
        mp.Profiler(tiny(), device="cpu", record_snapshot=True)
    with pytest.raises(MemlensError):
        mp.Profiler(tiny(), device="tpu")


def test_hooks_removed_after_stop():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = run_loop(model, opt, steps=1)
    n = len(prof.snapshots)
    model(torch.randn(1, 4)).sum().backward()
    opt.step()
    assert len(prof.snapshots) == n
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_result_json_roundtrip_and_report(tmp_path):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    r = run_loop(model, opt).result
    back = Result.from_dict(json.loads(r.to_json()))
    assert back.by_category == r.by_category and back.data["snapshots"] == r.data["snapshots"]
    paths = write_report(r, tmp_path)
    names = {p.name for p in paths}
    assert {"result.json", "timeline.csv", "snapshots.png", "timeline.png", "categories.png", "modules.png", "report.html"} <= names
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_lines = (tmp_path / "timeline.csv").read_text().splitlines()
    assert csv_lines[0].startswith("index,label,step,phase")
    assert len(csv_lines) == len(r.timeline) + 1
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4
    assert "http://" not in html and "https://" not in html and "<script" not in html   # self-contained, offline
    for word in ("Peak of every phase", "At the peak, by category", "optimizer_state", "Top modules"):
        assert word in html
    assert json.loads((tmp_path / "result.json").read_text())["verb"] == "profile"


def test_timeline_csv_and_html_of_a_minimal_result():
    r = Result(verb="profile", peak_allocated_bytes=2048, timeline=[
        {"label": "start", "step": 1, "phase": "start", "t_s": 0.0, "allocated_bytes": 1024, "reserved_bytes": 2048, "peak_allocated_bytes": 1024},
        {"label": "x", "step": 1, "phase": "mark", "t_s": 0.1, "allocated_bytes": 2048, "reserved_bytes": 2048, "peak_allocated_bytes": 2048}],
        data={"device": "cuda:0", "mode": "phases"})
    assert timeline_csv(r).splitlines()[2] == "1,x,1,mark,0.1,2048,2048,2048"
    html = report_html(r)
    assert html.count("data:image/png;base64,") == 2 and "By operation" not in html


def test_replay_ledger_rounding():
    from memlens.core.ledger import EventLog, round_size

    log = EventLog()
    log.alloc(1, 100, "parameters", log.module_id("a"), "start")
    log.phase("forward", 1)
    log.alloc(2, 1000, "temporaries", log.module_id("a"), "forward")
    log.tag(2, "activations")
    log.free(2)
    log.alloc(3, 10, "temporaries", log.module_id("b.lora_A.default"), "forward")
    raw = replay(log)
    assert raw.peak_allocated_bytes == 1100 and raw.by_category["activations"] == 1000
    cuda = replay(log, round_size)
    assert cuda.peak_allocated_bytes == 512 + 1024
    lora = [m for m in replay(log).by_module if m["lora"]]
    assert [m["module"] for m in lora] == ["b.lora_A.default"]


def test_committed_gpu_snapshot_fixture_parses():
    """A memory-history pickle written by `memlens profile --snapshot` on an H100 (trimmed frames)."""
    from memlens.doctor.snapshot import load_snapshot, summarize_snapshot

    truth = json.loads((FIX / "gpu_gpt2_memory_snapshot_truth.json").read_text())
    s = summarize_snapshot(load_snapshot(FIX / "gpu_gpt2_memory_snapshot.pickle"))
    assert s.allocated_bytes == truth["summary"]["allocated_bytes"]
    assert s.reserved_bytes == truth["summary"]["reserved_bytes"]
    assert s.inactive_split_bytes == truth["summary"]["inactive_split_bytes"]
    assert s.trace_entries == truth["summary"]["trace_entries"]
    # the trace's allocated timeline never exceeds the profile's measured peak
    assert max(p["allocated_bytes"] for p in s.timeline) <= truth["peak_allocated_bytes"]


def test_snapshot_pickle_is_plain_data():
    raw = (FIX / "gpu_gpt2_memory_snapshot.pickle").read_bytes()
    snap = pickle.loads(raw)
    assert isinstance(snap, dict) and snap["segments"] and snap["device_traces"]


def test_ledger_mode_on_cpu_matches_full():
    """On the CPU, full mode *is* the ledger; mode 'ledger' names it and gives the same bytes."""
    model = tiny()
    full = run_loop(model, torch.optim.AdamW(model.parameters(), lr=0.1), mode="full").result
    model = tiny()
    ledger = run_loop(model, torch.optim.AdamW(model.parameters(), lr=0.1), mode="ledger").result
    assert ledger.data["mode"] == "ledger" and ledger.by_category == full.by_category
    assert ledger.by_category["optimizer_state"] == 2 * PARAM_BYTES + 4 * 4


@pytest.mark.gpu
def test_load_on_cpu_then_move_to_the_gpu():
    from memlens.measure.runner import profile_spec
    from memlens.core.spec import TrainingSpec

    r, _ = profile_spec(TrainingSpec(model="gpt2", batch_size=1, seq_len=64), steps=1, warmup=0, device="cuda",
                        load_on_cpu=True)
    ml = r.data["model_load"]
    before = ml["before_allocated_bytes"]  # earlier GPU tests in this process may have left some
    assert ml["allocated_after_cpu_load_bytes"] - before < 1024 * 1024          # nothing on the GPU yet
    assert ml["allocated_after_move_bytes"] - before >= ml["theoretical_param_bytes"]  # .to(cuda) put the weights there
