"""An FSDP2 rank of a deep model has its layers written from 3- and 4-layer models (memlens.estimator.depth),
as one GPU's step does: the per-rank estimate is the whole model's simulation to the byte (every rank's peaks,
categories, phases, terms and timeline), while DDP and ZeRO-1, whose buckets and optimizer shards are cut by
bytes over the whole model, stay simulated whole."""
import json

import pytest

from memlens.core.spec import TrainingSpec
from memlens.estimator import depth
from memlens.estimator.ranks import estimate_ranks
from memlens.models.source import resolve
from memlens.step.plan import resolve as plan_of
from tests.estimator.test_depth import LLAMA, deep


def _comparable(r) -> dict:
    d = dict(r.data)
    # the step time of a written model repeats its template layer's priced ops; ops charged outside the layer stack but
    # run once per layer (host dispatch of a few ops) are not repeated: compared within 1% (test below), not to the bit
    for k in ("simulate_seconds", "estimate_seconds", "later_layers", "scaling", "seconds", "step_time", "step_seconds"):
        d.pop(k, None)
    d["ranks"] = [{k: v for k, v in e.items() if k != "simulate_seconds"} for e in d["ranks"]]
    return {"peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
            "by_category": r.by_category, "by_phase": r.by_phase, "by_module": r.by_module, "timeline": r.timeline,
            "data": json.loads(json.dumps(d, default=str))}


@pytest.mark.parametrize("changes", [
    {"world_size": 8, "sharding": "zero2", "precision": "bf16"},
    {"world_size": 8, "sharding": "zero2", "precision": "bf16", "grad_accum": 3},
    {"world_size": 4, "sharding": "fsdp", "precision": "amp-bf16"},
    {"world_size": 3, "sharding": "zero3", "precision": "bf16", "lora_rank": 4},       # uneven shards: ranks 0 and 2
    {"world_size": 8, "sharding": "zero2", "precision": "bf16", "optimizer": "adafactor"},   # a per-parameter loop
], ids=["zero2", "zero2-accum3", "fsdp-amp", "zero3-lora-uneven", "zero2-adafactor"])
@pytest.mark.slow
def test_fsdp_ranks_written_equal_the_whole_model(tmp_path, monkeypatch, changes):
    # 6 layers (depth writes from 10 on; lowered here): layers 5 and 6 written from 3 and 4, the whole model's reference
    # simulations half as long
    monkeypatch.setattr(depth, "MIN_LAYERS", 6)
    model = deep(tmp_path, LLAMA, 6)
    spec = TrainingSpec(model=model, batch_size=2, seq_len=32, **changes)
    assert depth.why_not(plan_of(spec, source=resolve(model)), resolve(model)) is None
    depth.CHECKED.clear()
    fast = estimate_ranks(spec)
    assert "written from" in fast.data["later_layers"], fast.data["later_layers"]
    fast2 = estimate_ranks(spec.replace(batch_size=3))        # a later size of the family: from 4 layers, checked
    assert fast2.data["later_layers"].startswith("written from 4 layers"), fast2.data["later_layers"]
    monkeypatch.setattr(depth, "why_not", lambda spec, source: "whole (the test's reference)")
    whole = estimate_ranks(spec)
    whole2 = estimate_ranks(spec.replace(batch_size=3))
    assert whole.data["later_layers"].startswith("simulated")
    assert _comparable(fast) == _comparable(whole)
    assert _comparable(fast2) == _comparable(whole2)
    for a, b in ((fast, whole), (fast2, whole2)):
        assert a.data["step_seconds"] == pytest.approx(b.data["step_seconds"], rel=0.01)
        assert a.data["step_time"]["parts"]["forward"] == pytest.approx(b.data["step_time"]["parts"]["forward"], rel=1e-9)


@pytest.mark.parametrize("sharding", ["ddp", "zero1"])
@pytest.mark.slow
def test_ddp_and_zero1_ranks_are_simulated_whole(tmp_path, sharding):
    model = deep(tmp_path, LLAMA)
    assert depth.why_not(plan_of(TrainingSpec(model=model, world_size=2, sharding=sharding), source=resolve(model)), resolve(model)).startswith("several GPUs with DDP")
