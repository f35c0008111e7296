"""A long accumulation is bounded: at most WRITTEN_MICRO_BATCHES micro-batches are written into the log, the rest
repeat them, and every number memlens reports is the one of the same step written in full."""
from pathlib import Path

import pytest

from memlens.core.events import PHASE
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate, periodic

# the timeline is sampled from the log, which is shorter: every other field is the same
SAME = {"created_at": 0, "later_micro_batches": 0, "simulate_seconds": 0, "timeline": 0}
GPT2 = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-gpt2" / "config.json")


@pytest.mark.slow
@pytest.mark.parametrize("model, changes, label", [
    (GPT2, {"batch_size": 2, "seq_len": 32, "grad_accum": 12},
     "2..5 written from micro-batch 1, 6..12 as those (not written)"),
    (GPT2, {"batch_size": 2, "seq_len": 32, "grad_accum": 12, "precision": "amp-fp16", "max_grad_norm": 1.0},
     "2..5 written from micro-batch 1, 6..12 as those (not written)"),
    ("tests.tiny_models:copied_grad", {"grad_accum": 12}, "3..6 written from micro-batch 2, 7..12 as those (not written)"),
], ids=["gpt2", "gpt2-amp-fp16-clip", "copied-grad"])
def test_an_elided_accumulation_reports_what_the_full_one_does(monkeypatch, model, changes, label):
    spec = TrainingSpec(model=model, **changes)
    monkeypatch.setattr(periodic, "WRITTEN_MICRO_BATCHES", 1000)
    full = estimate(spec)
    monkeypatch.setattr(periodic, "WRITTEN_MICRO_BATCHES", 4)
    short = estimate(spec)
    assert full.data["later_micro_batches"].endswith(f"..12 written from micro-batch {1 if model == GPT2 else 2}")
    assert short.data["later_micro_batches"] == label
    assert short.to_dict() | SAME == \
        full.to_dict() | SAME


def test_a_hundred_thousand_micro_batches_write_eight(monkeypatch):
    from memlens.estimator.simulate import simulate

    sim = simulate(TrainingSpec(model=GPT2, batch_size=1, seq_len=16, grad_accum=100_000))
    assert sim.later_micro_batches == "2..9 written from micro-batch 1, 10..100000 as those (not written)"
    forwards = [ev for ev in sim.log.events if ev[0] == PHASE and ev[1] == "forward"]
    assert len(forwards) == 2 * 9          # micro-batch 1 and 8 written ones, in each of the two steps


def test_micro_batches_simulated_one_by_one_are_bounded():
    """Under a multi-GPU wrapper each micro-batch is a whole simulation: above 32 the estimate is refused."""
    from memlens.core.errors import SpecError

    with pytest.raises(SpecError) as e:
        estimate(TrainingSpec(model=GPT2, batch_size=1, seq_len=16, world_size=2, sharding="ddp", grad_accum=33))
    assert e.value.message == ("--grad-accum 33: here each micro-batch is simulated in full (a multi-GPU wrapper's hooks "
                               "keep state), at most 32 are")


def test_a_world_size_above_1024_is_refused():
    from memlens.core.errors import SpecError

    with pytest.raises(SpecError) as e:
        TrainingSpec(model="gpt2", world_size=100_000, sharding="fsdp")
    assert e.value.message == ("--world-size 100000 is above the 1,024 ranks memlens models (DDP, ZeRO, FSDP2, HSDP, "
                               "FSDP2 x TP)")
    assert TrainingSpec(model="gpt2", world_size=1024, sharding="fsdp").world_size == 1024


def test_fit_refuses_a_target_batch_above_a_million_per_gpu():
    from memlens.core.errors import MemlensError
    from memlens.explore.fit import fit

    with pytest.raises(MemlensError) as e:
        fit(TrainingSpec(model=GPT2), "16GiB", target_batch=100_000_000)
    assert e.value.message == ("target batch 100,000,000 is 100,000,000 samples per GPU, above the 1,000,000 fit "
                               "searches (the largest micro-batch memlens simulates)")
