"""Steps 2.. written from step 1 (memlens.estimator.periodic) give the log of a full simulation,
event by event; where that cannot be shown, step 2 is simulated and the result says why."""
from pathlib import Path

import pytest
import torch

from memlens.core.events import PHASE
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.estimator.simulate import simulate

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
GPT2 = str(MODELS / "tiny-gpt2" / "config.json")
LLAMA = str(MODELS / "tiny-llama" / "config.json")
VIT = str(MODELS / "tiny-vit" / "config.json")


def canonical(log):
    """The events up to "done" with keys renamed in order of appearance (keys are opaque)."""
    names, out = {}, []
    for ev in log.events:
        if ev[0] == PHASE:
            out.append(tuple(ev))
            if ev[1] == "done":
                break
            continue
        out.append((ev[0], names.setdefault(ev[1], len(names))) + tuple(ev[2:]))
    return out, list(log.modules)


def assert_same_log(spec, written=True):
    full = simulate(spec, repeat=False)
    fast = simulate(spec)
    assert full.later_steps == "simulated (repeat=False)"
    if written:
        assert fast.later_steps == "written from step 1"
    assert canonical(fast.log) == canonical(full.log)
    return fast


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "sgd-momentum", "adafactor", "adamw-8bit"])
def test_optimizers_on_a_linear_layer(optimizer):
    assert_same_log(TrainingSpec(model="tests.tiny_models:linear", optimizer=optimizer))


@pytest.mark.parametrize("changes", [
    {},                                                     # fp32, dropout, efficient attention
    {"precision": "amp-fp16"},                              # GradScaler stand-in in the optimizer phase
    {"precision": "amp-bf16", "grad_checkpointing": True},  # recomputation in backward
    {"precision": "bf16", "grad_accum": 3},                 # three micro-batches per step
    {"lora_rank": 4},                                       # only adapters get gradients
], ids=["fp32", "amp-fp16", "amp-bf16-ckpt", "bf16-accum3", "lora"])
def test_tiny_gpt2(changes):
    fast = assert_same_log(TrainingSpec(model=GPT2, batch_size=2, seq_len=64, **changes))
    assert [s["step"] for s in estimate_steps(fast)] == [1, 2]


def estimate_steps(sim):
    from memlens.core.ledger import analyze

    return analyze(sim.log).steps


def test_tiny_llama_and_vit():
    assert_same_log(TrainingSpec(model=LLAMA, batch_size=2, seq_len=64, precision="bf16", optimizer="sgd-momentum"))
    assert_same_log(TrainingSpec(model=VIT, batch_size=3))


def test_three_steps():
    spec = TrainingSpec(model=GPT2, batch_size=2, seq_len=32)
    full, fast = simulate(spec, steps=3, repeat=False), simulate(spec, steps=3)
    assert fast.later_steps == "written from step 1"
    assert canonical(fast.log) == canonical(full.log)


class Caching(torch.nn.Module):
    """Keeps a tensor made in forward until the next forward replaces it (a module cache):
    it outlives step 1, so step 2 cannot be written from step 1."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.cache = None

    def forward(self, x):
        y = self.fc(x)
        self.cache = y.detach() * 2
        return y


def caching(spec=None):
    return Caching(), torch.randn(4, 64), lambda out, batch: out.sum()


def test_a_cache_that_outlives_step_one_forces_a_full_step_two():
    spec = TrainingSpec(model="tests.estimator.test_periodic:caching", optimizer="sgd")
    full, fast = simulate(spec, repeat=False), simulate(spec)
    assert fast.later_steps == "simulated (1 storage(s) made in step 1's forward or backward outlive it)"
    assert canonical(fast.log) == canonical(full.log)


def test_estimate_reports_how_later_steps_were_made():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="adamw"))
    assert r.data["later_steps"] == "written from step 1"


@pytest.mark.parametrize("model, changes", [
    (GPT2, {"grad_accum": 2}),
    (GPT2, {"grad_accum": 5}),
    (GPT2, {"grad_accum": 4, "precision": "amp-fp16", "max_grad_norm": 1.0}),   # scaled loss, unscale and clip
    (GPT2, {"grad_accum": 2, "optimizer": "adafactor", "hf_trainer": True}),
    (LLAMA, {"grad_accum": 3, "precision": "amp-bf16", "grad_checkpointing": True, "lora_rank": 4}),  # recompute stops early
    (LLAMA, {"grad_accum": 2, "precision": "bf16", "qlora": True, "lora_rank": 4}),
    (VIT, {"grad_accum": 2}),
    ("tests.tiny_models:own_step", {"grad_accum": 2}),
], ids=["gpt2-accum2", "gpt2-accum5", "gpt2-amp-fp16-clip-accum4", "gpt2-adafactor-trainer-accum2", "llama-ckpt-lora-accum3",
        "llama-qlora-accum2", "vit-accum2", "own-step-accum2"])
def test_micro_batches_two_to_k_written_from_the_first(model, changes):
    """Micro-batch 2 is micro-batch 1 with each incoming gradient freed where its accumulator
    returned (added into .grad instead of becoming it) and micro-batch 1's loss freed last."""
    sizes = {} if model.startswith("tests.") else {"batch_size": 2} if model == VIT else {"batch_size": 2, "seq_len": 64}
    fast = assert_same_log(TrainingSpec(model=model, **sizes, **changes))
    assert fast.later_micro_batches == f"2..{changes['grad_accum']} written from micro-batch 1"
    forwards = [ev for ev in fast.log.events if ev[0] == PHASE and ev[1] == "forward"]
    assert len(forwards) == 2 * changes["grad_accum"]       # every micro-batch of both steps is in the log


def test_a_copied_gradient_makes_micro_batch_two_simulated():
    """A gradient that arrives in another layout is copied by its accumulator in micro-batch 1 (and
    added in micro-batch 2): not micro-batch 1's events with a free, so micro-batch 2 is simulated,
    and micro-batches 3..k are written from it."""
    two = assert_same_log(TrainingSpec(model="tests.tiny_models:copied_grad", grad_accum=2))
    assert two.later_micro_batches == "simulated"
    ops = [str(ev[6]) for ev in two.log.events if ev[0] == 0 and ev[5] == "backward"]
    assert "aten.clone.default" in ops                     # the accumulator's copy is in the log
    three = assert_same_log(TrainingSpec(model="tests.tiny_models:copied_grad", grad_accum=3))
    assert three.later_micro_batches == "3..3 written from micro-batch 2"


def test_dp_sgd_steps_say_how_they_were_made():
    """DP-SGD's step 2 is written by memlens.estimator.periodic_dp (tests/estimator/test_periodic_dp.py):
    its physical batches before the last, where there are several (BatchMemoryManager's, which
    --grad-accum may not be combined with)."""
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd", dp=True, batch_size=8, physical_batch_size=4))
    assert r.data["later_steps"] == "physical batches before the last written from step 1"
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd", dp=True))
    assert r.data["later_steps"] == "simulated (one physical batch per step)"
