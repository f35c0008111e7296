"""fit, compare and sweep over several GPUs: the same per-rank estimate everywhere, the per-GPU micro-batch,
and measured cells spread over GPUs (issue 10)."""
from __future__ import annotations

import threading
import time

import pytest

from memlens.core.errors import MemlensError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

SPEC = TrainingSpec(model="tests.distributed.dist_models:blocks", batch_size=2, world_size=2, sharding="fsdp")


def test_one_sharded_spec_one_peak_through_every_verb(tmp_path):
    from memlens.explore.compare import compare
    from memlens.explore.core import CachedEstimator
    from memlens.explore.fit import fit
    from memlens.explore.sweep import Grid, sweep

    est = estimate(SPEC)
    cached = CachedEstimator()
    p = cached(SPEC)
    assert (p.peak_allocated_bytes, p.peak_reserved_bytes, p.peak_rank) == (est.peak_allocated_bytes, est.peak_reserved_bytes, 0)
    cmp = compare(SPEC, ["fp32"], estimator=cached).data["rows"][0]["estimated_peak_allocated_bytes"]
    sw = sweep(SPEC, Grid(batch_sizes=[2]), out=tmp_path / "sw", estimator=cached).data["rows"][0]
    assert cmp == sw["estimated_peak_allocated_bytes"] == est.peak_allocated_bytes
    assert sw["estimated_peak_rank"] == 0
    f = fit(SPEC, est.peak_allocated_bytes * 2, plan=False, context_bytes=0, margin=0, estimator=cached, cap=4).data
    assert f["world_size"] == 2 and f["predicted_peak_allocated_bytes"] == cached(SPEC.replace(batch_size=f["max_batch_size"])).peak_allocated_bytes


def test_fit_answers_the_per_gpu_micro_batch():
    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.fit import fit

    GiB = 2**30
    est = CachedEstimator(fn=lambda s: Point(s.batch_size * GiB, s.batch_size * GiB))   # 1 GiB per sample per GPU
    d = fit(SPEC.replace(world_size=4), "10GiB", target_batch=64, context_bytes=0, margin=0, plan=False, estimator=est).data
    # need = peak reserved = b GiB: 10 per GPU fit; 64 over 4 GPUs = 16 per GPU = 8 x 2
    assert (d["max_batch_size"], d["per_gpu_target_batch"], d["micro_batch_size"], d["grad_accum"]) == (10, 16, 8, 2)
    assert d["effective_batch_size"] == 64 and d["target_batch"] == 64
    with pytest.raises(MemlensError, match="does not split evenly"):
        fit(SPEC.replace(world_size=4), "10GiB", target_batch=30, context_bytes=0, margin=0, plan=False, estimator=est)


def test_fit_budget_loses_nccl_when_measured(monkeypatch):
    from memlens.core import gpus
    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.fit import fit

    est = CachedEstimator(fn=lambda s: Point(s.batch_size * 2**30, s.batch_size * 2**30))
    monkeypatch.setitem(gpus.NCCL_MEASURED, ("h100", 2), (2**30, "test"))
    d = fit(SPEC, "20GiB", plan=False, margin=0, estimator=est).data
    assert d["context_bytes"] == 740 * 2**20 + 2**30


def test_plan_entries_refuse_a_target_that_does_not_split():
    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.plan import Candidate, plan_entry

    est = CachedEstimator(fn=lambda s: Point(2**30, 2**30))
    e = plan_entry(TrainingSpec(model="m", batch_size=1), Candidate("x", {"world_size": 4, "sharding": "fsdp"}, "same math", ""),
                   est, 10 * 2**30, 30)
    assert not e.fits and "does not split evenly over 4 GPUs" in e.error


def test_measured_sweep_runs_one_cell_per_gpu_in_parallel(tmp_path, monkeypatch):
    import torch

    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.sweep import Grid, sweep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    lock = threading.Lock()
    live, most, seen = [0], [0], []

    def runner(spec, *, device, steps, timeout, memory_fraction, gpus=None):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
            seen.append((spec.batch_size, tuple(gpus)))
        time.sleep(0.2)
        with lock:
            live[0] -= 1
        if spec.batch_size == 8:
            return {"status": "oom", "error": "CUDA out of memory", "memory_measured": True}
        return {"status": "ok", "peak_allocated_bytes": spec.batch_size * 100, "peak_reserved_bytes": spec.batch_size * 200,
                "seconds": 0.1, "memory_measured": True}

    est = CachedEstimator(fn=lambda s: Point(s.batch_size, s.batch_size))
    one = TrainingSpec(model="m", batch_size=1)
    r = sweep(one, Grid(batch_sizes=[1, 2, 4, 8]), out=tmp_path / "s", measure=True, estimator=est, runner=runner, gpus=[0, 1, 2])
    rows = r.data["rows"]
    assert [x["batch_size"] for x in rows] == [1, 2, 4, 8]                       # grid order kept
    assert [x["status"] for x in rows] == ["ok", "ok", "ok", "oom"]
    assert rows[2]["peak_allocated_bytes"] == 400 and rows[3]["error"] == "CUDA out of memory"
    assert most[0] == 3 and all(len(g) == 1 for _, g in seen)                    # 3 GPUs busy at once, one each
    assert sorted(g[0] for _, g in seen[:3]) == [0, 1, 2]


def test_sweep_gpus_must_fit_the_world_size(tmp_path, monkeypatch):
    import torch

    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.sweep import Grid, sweep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    est = CachedEstimator(fn=lambda s: Point(1, 1))
    with pytest.raises(MemlensError, match="do not divide the 3 GPUs"):
        sweep(SPEC, Grid(batch_sizes=[1]), out=tmp_path / "a", measure=True, estimator=est, runner=lambda *a, **k: {}, gpus=[0, 1, 2])
    with pytest.raises(MemlensError, match="GPU 5 does not exist"):
        sweep(SPEC, Grid(batch_sizes=[1]), out=tmp_path / "b", measure=True, estimator=est, runner=lambda *a, **k: {}, gpus=[0, 5])
