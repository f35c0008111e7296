"""memlens.guard(): the report built from a capture (a hand-built snapshot at an OOM), the files it
writes, the exception left as it was, the moments its hooks record; the real GPU path is in
test_guard_gpu.py and bench/gpu_oom.py."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

import guard_synthetic as syn
from memlens.core.errors import MemlensError
from memlens.core.payloads import UNSET, GuardPayload
from memlens.core.result import Result
from memlens.doctor.snapshot import load_snapshot, summarize_snapshot
from memlens.measure import guard as gmod
from memlens.measure.guard import Guard, build_report, classify_live_blocks

MiB = 2**20


def test_live_blocks_classified_and_summing_to_allocated():
    c = syn.capture()
    live = classify_live_blocks(c.snapshot, 0, c.known, c.moments, c.step)
    assert live.by_category == {
        "optimizer_state": 16 * MiB, "activations": 10 * MiB + 512, "parameters": 8 * MiB, "gradients": 8 * MiB,
        "temporaries": 4 * MiB, "workspace": 4 * MiB, "inputs": 2 * MiB}
    assert live.total_bytes == syn.ALLOCATED == sum(live.by_category.values())
    assert live.blocks == 10                                  # 9 in the large segment, the loss; none of device 1
    assert live.earlier_steps_bytes == 2 * MiB                # the step-1 tensor still live at step 3 (workspace)
    mods = {m["module"]: m for m in live.by_module}
    assert mods["blocks.1"]["by_category"] == {"activations": 4 * MiB, "temporaries": 4 * MiB}
    assert mods["blocks.0"]["by_category"] == {"parameters": 8 * MiB, "gradients": 8 * MiB, "activations": 6 * MiB,
                                               "workspace": 2 * MiB}
    assert mods["(model: loss and glue)"]["bytes"] == 512
    assert live.by_phase["forward (step 3)"] == 10 * MiB + 512 and live.by_phase["before the recorded history"] == 2 * MiB
    assert live.top_blocks[0]["size"] == 16 * MiB and live.top_blocks[0]["site"].endswith("train.py:42 train_step")


def test_history_off_leaves_activations_and_temporaries_unclassified():
    c = syn.capture()
    live = classify_live_blocks(c.snapshot, 0, c.known, {}, c.step, history=False)
    assert live.by_category["unclassified"] == 12 * MiB + 512 + 4 * MiB + 2 * MiB   # every block not known by address
    assert live.total_bytes == syn.ALLOCATED


def test_report_diagnosis_account_and_levers():
    r = build_report(syn.capture(), "CUDA out of memory. Tried to allocate 24.00 MiB.")
    d = r.data
    assert r.verb == "guard" and r.peak_allocated_bytes == syn.ALLOCATED
    assert d["categories_sum_bytes"] == d["allocated_bytes"] == syn.ALLOCATED and d["categories_error"] == 0
    acc = d["account"]
    assert acc["this_process_source"] == "message" and acc["this_process_bytes"] == 72 * MiB
    assert acc["non_pytorch_bytes"] == 6 * MiB and acc["unaccounted_bytes"] == 0
    assert acc["pytorch_reachable_bytes"] == 66 * MiB + 8 * MiB
    # 14 MiB cached + 8 MiB free < 24 MiB requested, nobody else on the GPU: the step is too big
    assert d["diagnosis"] == "capacity" and d["evidence"]["requested"] == 24 * MiB
    levers = {lv["name"]: lv for lv in d["levers"]}
    assert levers["halve-batch"]["shrinks_bytes"] == 10 * MiB + 512 + 4 * MiB + 2 * MiB
    assert levers["adamw-8bit"]["shrinks_bytes"] == 16 * MiB and levers["lora"]["fits"] is None
    assert any("spec=TrainingSpec" in n for n in r.notes)


def test_report_in_a_container_names_this_process_by_its_numbers():
    """NVML lists this process under a host PID that is not os.getpid(): the account still finds it."""
    r = build_report(syn.capture(pid=1, processes=[(31337, 72 * MiB), (555, 4 * MiB)]), "")
    acc = r.data["account"]
    assert acc["this_process_pid"] == 31337 and acc["this_process_source"] == "matched"
    assert acc["other_processes"] == [{"pid": 555, "used_bytes": 4 * MiB}]


def test_report_under_a_memory_fraction():
    r = build_report(syn.capture(allowed_bytes=60 * MiB), "")
    assert r.data["diagnosis"] == "memory_fraction_limit" and r.data["evidence"]["allowed"] == 60 * MiB


def test_levers_estimated_with_a_spec():
    from memlens.core.spec import TrainingSpec
    from memlens.core.result import Result

    def fake_estimate(spec):      # activations grow with the batch, the rest is fixed; reserved 8 MiB above allocated
        return Result(verb="estimate", peak_allocated_bytes=40 * MiB + spec.batch_size * 4 * MiB,
                      peak_reserved_bytes=48 * MiB + spec.batch_size * 4 * MiB,
                      by_category={"activations": spec.batch_size * 4 * MiB})

    r = build_report(syn.capture(), "", spec=TrainingSpec(model="gpt2", batch_size=8), estimate_fn=fake_estimate)
    levers = {o["name"]: o for o in r.data["levers"]}
    assert r.data["levers_estimated"] is True and r.spec["batch_size"] == 8
    halve = levers["halve micro-batch, double accumulation"]
    assert halve["changes"] == {"batch_size": 4, "grad_accum": 2} and halve["peak_allocated_bytes"] == 56 * MiB
    # budget = reserved + free = 74 MiB less the fit rule's margin (256 MiB minimum > 74 MiB: the budget itself);
    # the rule reads reserved: halving needs 64 MiB, checkpointing (nothing to checkpoint here) 80 MiB
    assert halve["fits"] is True and levers["checkpointing"]["fits"] is False


def test_handle_writes_the_three_files_and_notes_the_exception(tmp_path):
    g = Guard(out_dir=tmp_path / "oom")
    g.capture = syn.capture()
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 80.00 MiB")
    r = g.handle(exc)
    assert g.capture is None and not g.errors
    names = sorted(p.name for p in g.paths)
    assert names == ["oom_report.html", "oom_report.json", "oom_snapshot.pickle"]
    d = json.loads((tmp_path / "oom" / "oom_report.json").read_text())
    assert d["verb"] == "guard" and d["by_category"] == r.by_category and d["schema_version"] == "1"
    assert "oom_report.html" in exc.__notes__[0] and "capacity" in exc.__notes__[0]
    html = (tmp_path / "oom" / "oom_report.html").read_text()
    for words in ("Diagnosis: capacity", "optimizer_state", "blocks.1", "The GPU at the failure", "memory_viz"):
        assert words in html
    # the pickle is what _dump_snapshot writes: memlens' safe loader and PyTorch's own viewer read it
    snap = load_snapshot(tmp_path / "oom" / "oom_snapshot.pickle")
    assert summarize_snapshot(snap).allocated_bytes == syn.ALLOCATED + 20 * MiB        # both devices
    from torch.cuda import _memory_viz

    with open(tmp_path / "oom" / "oom_snapshot.pickle", "rb") as f:
        raw = pickle.load(f)
    assert "total_allocated" in _memory_viz.segsum(raw) and "raise OutOfMemoryError" in _memory_viz.trace(raw)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(raw) and "Allocator State" in _memory_viz.segment_plot(raw)


def test_the_exception_goes_on_and_only_ooms_are_reported(tmp_path, monkeypatch):
    g = Guard(out_dir=tmp_path / "o")
    monkeypatch.setattr(g, "start", lambda: g)
    monkeypatch.setattr(g, "stop", lambda: None)
    g.capture = syn.capture()
    with pytest.raises(ValueError):
        with g:
            raise ValueError("not memory")
    assert g.report is None and not (tmp_path / "o").exists()
    with pytest.raises(torch.OutOfMemoryError):
        with g:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 MiB.")
    assert g.report is not None and (tmp_path / "o" / "oom_report.json").is_file()

    calls = []

    @g
    def step(x):
        calls.append(x)
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError):
        step(3)
    assert calls == [3] and g.errors[-1].startswith("no capture at the failure")   # this one had no observer capture


def test_a_failing_report_never_hides_the_oom(tmp_path, monkeypatch):
    g = Guard(out_dir=tmp_path)
    g.capture = syn.capture(snapshot={"segments": "not a list"})
    assert g.handle(torch.OutOfMemoryError("x")) is None
    assert g.errors and g.errors[0].startswith("writing the report failed")


def test_bad_arguments_are_one_line():
    with pytest.raises(MemlensError, match="module_depth"):
        Guard(module_depth=-1)
    if not torch.cuda.is_available():
        with pytest.raises(MemlensError, match="needs a CUDA device"):
            Guard().start()


class _FakePeaks:
    """IntervalPeaks' moment numbering without CUDA: each moment calls the listeners."""

    available = True

    def __init__(self):
        self.listeners = []
        self.n = 0

    def start(self):
        pass

    def stop(self):
        pass

    def moment(self):
        self.n += 1
        for cb in self.listeners:
            cb(self.n)
        return self.n


def test_recorder_moments_follow_phases_steps_and_modules_to_the_depth():
    """The hooks label moments as profile does: forward, backward (per module, from the output's
    grad_fn), optimizer, between steps; modules deeper than module_depth count in their ancestor;
    only the last KEEP_STEPS steps' moments are kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gmod._Recorder(torch, torch.device("cpu"), model, opt, module_depth=1, history=False, max_entries=10)
    rec.peaks, rec.history, rec.device_type = _FakePeaks(), True, "cpu"
    rec.peaks.listeners.append(rec._on_moment)
    rec.start()
    try:
        for _ in range(5):
            x = torch.randn(3, 4)
            model(x).sum().backward()
            opt.step()
            known = rec.known(0)               # the state a failure in the optimizer step would read
            opt.zero_grad()
    finally:
        rec.stop()
    assert rec.inputs == (x.untyped_storage().data_ptr(),)
    assert sorted({c for c, _ in known.values()}) == ["gradients", "inputs", "parameters"]   # plain SGD keeps no state
    assert known[model[1].weight.untyped_storage().data_ptr()] == ("parameters", "1")
    assert ("gradients", "0") in known.values()                  # "0.0"'s gradients count in "0" at depth 1
    assert rec.handles == [] and rec.step == 6
    moments = list(rec.moments)
    steps = sorted({st for _, _, st, _ in moments})
    assert steps == [4, 5, 6]       # KEEP_STEPS = 3: the running step (6, after the last optimizer step) and two before
    step4 = [(ph, mod) for _, ph, st, mod in moments if st == 4]
    assert ("forward", "0") in step4 and ("forward", "1") in step4 and ("backward", "1") in step4
    assert ("backward", "0") in step4 and ("optimizer", "(optimizer)") in step4
    assert not any(mod.startswith("0.") for _, mod in step4)           # depth 1: "0.0" counts as "0"
    order = [ph for ph, _ in step4]
    assert order.index("backward") > order.index("forward") and order.index("optimizer") > order.index("backward")
    assert rec.module_name("0.0") == "0" and rec.module_name("") == "(model: loss and glue)"


def test_recorder_sees_a_batch_passed_by_keyword():
    """Hugging Face models are called with keywords (model(input_ids=..., labels=...))."""
    class KW(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, input_ids=None, labels=None):
            return ((self.lin(input_ids) - labels) ** 2).mean()

    m = KW()
    rec = gmod._Recorder(torch, torch.device("cpu"), m, None, module_depth=3, history=False, max_entries=10)
    rec.device_type = "cpu"
    rec.start()
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    m(input_ids=x, labels=y)
    rec.stop()
    assert set(rec.inputs) == {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    assert {v for v in rec.known(0).values() if v[0] == "inputs"} == {("inputs", "(inputs)")}


def test_moments_interleaved_with_another_recorder():
    """The profiler beside the guard takes moment numbers too: an entry labelled with one of its
    numbers belongs to the guard's moment running then (the last one before), and the profiler's own
    history record stays aligned with the numbers it did not take."""
    c = syn.capture()
    snap = c.snapshot
    trace = snap["device_traces"][0]
    for e in trace:                       # the backward temporary was labelled by the profiler's moment 34
        if e.get("addr") == syn.addr(44 * MiB) and e["action"] == "alloc":
            e["user_metadata"] = "memlens:34"
    live = classify_live_blocks(snap, 0, c.known, c.moments, c.step)
    assert live.by_category["temporaries"] == 4 * MiB        # 33 (backward, blocks.1) was running at 34

    from memlens.measure.history import HistoryRecorder, IntervalPeaks

    mine, other = IntervalPeaks(torch, torch.device("cpu"), own_history=False), IntervalPeaks(torch, torch.device("cpu"))
    rec = HistoryRecorder(torch, torch.device("cpu"), moments=mine)
    rec.set_phase("forward", 1)
    first = rec.rec.moment_base
    other.moment(), other.moment()
    rec.set_phase("backward", 1)
    n = mine.moment()
    assert len(rec.rec.moments) == n - first + 1
    assert rec.rec.moments[n - first - 1].phase == "backward" and rec.rec.moments[n - first - 3].phase == "forward"


def test_report_payload_typed_and_saved_back_the_same(tmp_path):
    r = build_report(syn.capture(), "CUDA out of memory. Tried to allocate 24.00 MiB.", module_depth=3)
    d = r.data
    assert type(d) is GuardPayload and d.extra == {}
    assert {n for n in d.names() if getattr(d, n) is UNSET} == set()      # every field filled
    assert d.device == "cuda:0" and d.allocated_bytes == d.categories_sum_bytes == syn.ALLOCATED
    assert d.live_blocks == 10 and d.earlier_steps_bytes == 2 * MiB and d.module_depth == 3 and d.levers
    back = Result.load(r.save(tmp_path / "oom_report.json"))
    assert type(back.data) is GuardPayload and back.data.to_dict() == json.loads(json.dumps(d.to_dict()))
