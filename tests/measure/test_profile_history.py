"""Full mode on CUDA from the allocator's history: the trace analysis (pure) and the hooks (on CPU)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

import memlens.measure.profiler as mp
from memlens.core.ledger import replay
from memlens.core.ledger import round_size
from memlens.measure.history import OPTIMIZER, OUTSIDE, HistoryRecord, HistoryRecorder, Moment, history_to_log

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "profile"


def entry(action: str, addr: int, size: int, meta: str) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "user_metadata": meta}


def synthetic() -> tuple[list[dict], HistoryRecord]:
    """One step of a 2-module model, sizes chosen so every block rounds to a known multiple of 512."""
    rec = HistoryRecord(
        modules=["0", "1", OUTSIDE, OPTIMIZER],
        moments=[Moment("start", 1, 2), Moment("forward", 1, 0), Moment("forward", 1, 1), Moment("backward", 1, 1),
                 Moment("optimizer", 1, 3), Moment("between steps", 2, 2)],
        # the batch (256 B, live since before the start), the gradient, the optimizer state
        observations=[(1, "inputs", ((0x9000, 256),)), (4, "gradients", ((0xC000, 1600),)),
                      (5, "optimizer_state", ((0xE000, 6000),))],
        start_blocks=[(0x1000, 1000, "parameters", 0), (0x2000, 600, "parameters", 1)],
        # 1024 + 1024 of parameters, a 4096-byte cuBLAS-like workspace, the 512-byte batch
        start_allocated=1024 + 1024 + 4096 + 512,
    )
    trace = [
        entry("segment_alloc", 0xA000, 2 << 20, "1"),
        entry("alloc", 0xA000, 2000, "1"),            # activation of module 0: 2048
        entry("alloc", 0xB000, 100, "2"),             # forward temporary of module 1: 512
        entry("free_requested", 0xB000, 100, "2"),
        entry("free_completed", 0xB000, 100, "2"),
        entry("alloc", 0xC000, 1600, "3"),            # gradient (module 1's backward): 2048
        entry("alloc", 0xD000, 3000, "3"),            # backward temporary: 3072
        entry("free_requested", 0xA000, 2000, "3"),
        entry("free_requested", 0xD000, 3000, ""),    # no metadata: the last moment seen (3)
        entry("alloc", 0xE000, 6000, "4"),            # optimizer state: 6144
        entry("alloc", 0xF000, 512, "4"),             # optimizer temporary: 512  <- the peak
        entry("free_requested", 0xF000, 512, "4"),
        entry("free_requested", 0x5000, 1000, "5"),   # part of the workspace, freed: -1024
    ]
    return trace, rec


def test_synthetic_trace_exact_bytes():
    trace, rec = synthetic()
    log, counts = history_to_log(trace, rec)
    assert counts == {"entries": 11, "unknown_frees": 1}
    v = replay(log, round_size)
    assert v.peak_allocated_bytes == 1024 + 1024 + 4096 + 512 + 2048 + 6144 + 512 == 15360
    assert (v.peak_phase, v.peak_step) == ("optimizer", 1)
    cats = {k: b for k, b in v.by_category.items() if b}
    assert cats == {"parameters": 2048, "workspace": 4096, "inputs": 512, "gradients": 2048,
                    "optimizer_state": 6144, "temporaries": 512}
    assert v.by_phase_allocated == {"start": 6656, "backward": 2048, "optimizer": 6656}
    mods = {m["module"]: m for m in v.by_module}
    assert mods["1"]["by_category"] == {"parameters": 1024, "gradients": 2048}
    assert mods["0"]["forward_peak_bytes"] == 2048 and mods["1"]["forward_peak_bytes"] == 512
    assert mods["1"]["backward_peak_bytes"] == 2048 + 3072
    assert mods[OPTIMIZER]["bytes"] == 6144 + 512 and mods[OUTSIDE]["bytes"] == 4096 + 512
    # the timeline ends with the workspace block freed
    assert v.timeline[-1]["allocated_bytes"] == 15360 - 512 - 1024


def test_activation_freed_before_the_peak_is_not_counted():
    trace, rec = synthetic()
    v = replay(history_to_log(trace, rec)[0], round_size)
    assert v.by_category["activations"] == 0       # module 0's activation was freed in backward


def test_committed_gpu_trace_replays_to_the_measured_peak():
    """The H100 GPT-2 pickle: alloc sizes are requested bytes; rounded to 512 they give the peak
    within 0.1% (large blocks the allocator did not split count a little more)."""
    snap = pickle.loads((FIX / "gpu_gpt2_memory_snapshot.pickle").read_bytes())
    truth = json.loads((FIX / "gpu_gpt2_memory_snapshot_truth.json").read_text())
    trace = snap["device_traces"][0]
    assert any(e["action"] == "alloc" and e["size"] % 512 for e in trace)     # requested, not block, sizes
    live_end = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    net = sum(round_size(e["size"]) * (1 if e["action"] == "alloc" else -1)
              for e in trace if e["action"] in ("alloc", "free_requested"))
    log, counts = history_to_log(trace, HistoryRecord(start_allocated=live_end - net))
    v = replay(log, round_size)
    assert counts["entries"] == 1910
    assert v.peak_allocated_bytes == 2559998976
    assert abs(v.peak_allocated_bytes - truth["peak_allocated_bytes"]) / truth["peak_allocated_bytes"] < 1e-3
    assert v.by_category["workspace"] == live_end - net == 1564480000


def test_committed_gpu_history_reproduces_the_device_result():
    """A full-mode profile recorded on an H100 (GPT-2 b1 L32 fp32, AdamW, its step after one warmup):
    the allocator trace and the hooks' record replay to the categories the device reported, the
    peak within 0.1% of max_memory_allocated(), and every backward allocation inside a module."""
    raw = pickle.loads((FIX / "gpu_gpt2_history.pickle").read_bytes())
    truth = json.loads((FIX / "gpu_gpt2_history_truth.json").read_text())
    rec = HistoryRecord.from_dict(raw["record"])
    trace = raw["device_traces"][0]
    log, counts = history_to_log(trace, rec)
    assert counts == {"entries": truth["history"]["entries"], "unknown_frees": 0}
    v = replay(log, round_size)
    peak = truth["peak_allocated_bytes"]
    assert (peak - v.peak_allocated_bytes) / peak < 1e-3
    cats = {k: b for k, b in v.by_category.items() if b}
    want = {k: b for k, b in truth["by_category"].items() if b and k != "unattributed"}
    assert cats == want
    assert sum(cats.values()) + truth["by_category"]["unattributed"] == peak
    # GPT-2 small: 124,439,808 float32 parameters, as many gradient values, two Adam moments each
    assert cats["parameters"] == cats["gradients"] == 124_439_808 * 4
    assert cats["optimizer_state"] == 2 * 124_439_808 * 4       # the `step` counters live on the CPU
    assert v.peak_phase == truth["peak_phase"] == "optimizer"
    mods = {m["module"]: m for m in v.by_module}
    for m in truth["top_modules"]:
        assert {k: mods[m["module"]][k] for k in m} == m
    # allocations labelled: every alloc carries a moment, and none in backward is outside the model
    labelled = [rec.moments[int(e["user_metadata"])] for e in trace if e["action"] == "alloc"]
    outside = rec.modules.index(OUTSIDE)
    assert not [m for m in labelled if m.phase == "backward" and m.module == outside]


def test_recorder_moments_follow_modules_and_backward(monkeypatch):
    """The hooks on a CPU model (the allocator's metadata calls faked): which module each moment
    names in forward and in backward."""
    metas: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_setMemoryMetadata", metas.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_get_memory_metadata", lambda: "")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    rec = HistoryRecorder(torch, torch.device("cuda", 0), model)
    rec.start()
    try:
        rec.set_phase("forward", 1)
        y = model(torch.randn(3, 4)).sum()
        rec.set_phase("backward", 1)
        y.backward()
    finally:
        rec.stop()
    names = rec.rec.modules
    seq = [(m.phase, names[m.module]) for m in rec.rec.moments]
    root = "(model: loss and glue)"
    assert seq[:3] == [("start", OUTSIDE), ("forward", OUTSIDE), ("forward", root)]
    fwd = [n for p, n in seq if p == "forward"]
    assert fwd == [OUTSIDE, root, "0", root, "1", root, "2", root, OUTSIDE]
    bwd = [n for p, n in seq if p == "backward"]
    # backward enters the modules in reverse; the root's output is module 2's, which keeps it
    assert bwd == [OUTSIDE, "2", "1", "0"]
    assert metas == [f"memlens:{rec.rec.moment_base + i}" for i in range(len(seq))] + [""]
    assert not rec._handles
