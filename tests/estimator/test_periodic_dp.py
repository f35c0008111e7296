"""DP-SGD's later steps written from the first (memlens.estimator.periodic_dp): the physical batches
before the last one of step n give the log of a full simulation, event by event; where that cannot
be shown, step n is simulated in full and the result says why."""
import pytest

from memlens.core.events import ALLOC, FREE, PHASE, TAG
from memlens.core.spec import TrainingSpec
from memlens.estimator.simulate import simulate
from tests.estimator.test_periodic import LLAMA, canonical

pytest.importorskip("opacus")

WRITTEN = "physical batches before the last written from step 1"
LINEAR = "tests.tiny_models:linear"


def same_log(spec, steps=2):
    full, fast = simulate(spec, repeat=False, steps=steps), simulate(spec, steps=steps)
    assert full.later_steps == "simulated (repeat=False)"
    assert canonical(fast.log) == canonical(full.log)
    return fast


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("model, changes", [
    (LINEAR, {"optimizer": "sgd", "physical_batch_size": 4}),            # two physical batches: batch 1 written
    (LINEAR, {"optimizer": "adamw", "physical_batch_size": 3}),          # 3 + 3 + 2: batches 1 and 2 written
    (LINEAR, {"optimizer": "adamw", "physical_batch_size": 2, "keep_outputs": False}),  # 4 batches, nothing held
    # the held outputs (logits, the model's loss, the key/value cache) freed by step n's first forward
    (LLAMA, {"physical_batch_size": 3, "seq_len": 32, "lora_rank": 4, "precision": "bf16"}),
    (LLAMA, {"physical_batch_size": 3, "seq_len": 32, "lora_rank": 4, "precision": "amp-bf16", "loss": "criterion-fp32"}),
    # ghost clipping keeps each parameter's per-sample norms until the next backward replaces them: step n's
    # first backward frees step n-1's where batch 2's freed batch 1's
    (LLAMA, {"physical_batch_size": 2, "seq_len": 32, "lora_rank": 4, "precision": "bf16", "grad_sample_mode": "ghost"}),
    (LLAMA, {"physical_batch_size": 4, "seq_len": 32, "lora_rank": 4, "precision": "bf16", "grad_sample_mode": "ghost",
             "keep_outputs": False}),
], ids=["linear-sgd-2x4", "linear-adamw-3+3+2", "linear-drop-outputs-4x2", "llama-lora-bf16", "llama-lora-amp-criterion",
        "llama-ghost-4x2", "llama-ghost-drop-outputs-2x4"])
def test_physical_batches_before_the_last_written(model, changes, steps):
    sim = same_log(TrainingSpec(model=model, dp=True, batch_size=8, **changes), steps)
    assert sim.later_steps == WRITTEN
    forwards = [ev for ev in sim.log.events if ev[0] == PHASE and ev[1] == "forward"]
    k = -(-8 // changes["physical_batch_size"])
    assert len(forwards) == steps * min(k, 3)          # first two and the last of every step are in the log


def test_one_physical_batch_is_simulated():
    sim = same_log(TrainingSpec(model=LINEAR, optimizer="adamw", dp=True, batch_size=8))
    assert sim.later_steps == "simulated (one physical batch per step)"


def test_the_host_dataset_is_not_counted():
    """The logical batch is the data loader's dataset, on the host in a real run: only each physical
    batch's copy is counted. What is alive at the end: the weight (4 MiB), cuBLAS' two workspaces and
    the last physical batch's output, which the loop holds (4 x 1024 fp32)."""
    sim = simulate(TrainingSpec(model=LINEAR, optimizer="sgd", dp=True, batch_size=8, physical_batch_size=4))
    alive = {}
    for ev in sim.log.events:
        if ev[0] == ALLOC:
            alive[ev[1]] = (ev[2], ev[3])
        elif ev[0] == FREE:
            alive.pop(ev[1], None)
    assert sorted(alive.values()) == [(4 * 1024 * 4, "temporaries"), (1024 * 1024 * 4, "parameters"),
                                      (32 * 2**20, "workspace"), (32 * 2**20, "workspace")]
    sizes = {ev[1]: ev[2] for ev in sim.log.events if ev[0] == ALLOC}
    inputs = [sizes[ev[1]] for ev in sim.log.events if ev[0] == TAG and ev[2] == "inputs"]
    assert inputs == [4 * 1024 * 4] * 4                 # 2 steps x 2 physical batches, each copied over
