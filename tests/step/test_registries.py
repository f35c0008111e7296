"""A step kind and an optimizer added through their registries alone (tests/step/toy_kind.py and
toy_optimizer.py, one file each) run through estimate, compare and fit like the built-in ones."""
import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.explore.compare import compare
from memlens.explore.fit import fit
from memlens.step.plan import resolve

import toy_kind  # noqa: E402 - registers the toy step kind (tests/step is on sys.path)
import toy_optimizer  # noqa: E402 - registers the toy optimizer

MiB = 2**20
W = 1024 * 1024 * 4          # tests.tiny_models:linear: one 1024 x 1024 fp32 weight


def test_the_plan_holds_the_registered_entries():
    plan = resolve(TrainingSpec(model="tests.tiny_models:linear", optimizer="toy-momentum", step_kind="toy-twice"))
    assert plan.kind is toy_kind.TWICE and plan.optimizer is toy_optimizer.TOY
    assert not plan.distributed and not plan.dp and not plan.compiled and plan.ranks == 1 and plan.batch_field == "batch_size"


def test_a_toy_optimizer_holds_one_buffer_per_parameter():
    spec = TrainingSpec(model="tests.tiny_models:linear", optimizer="toy-momentum")
    r = estimate(spec)
    sgd_m = estimate(spec.replace(optimizer="sgd-momentum"))
    assert r.peak_allocated_bytes == sgd_m.peak_allocated_bytes
    assert r.by_category["optimizer_state"] == W            # the momentum buffer of the one weight
    f = estimate(TrainingSpec(model="gpt2", optimizer="toy-momentum"), method="formula")   # the closed form reads its facts
    state = [t["bytes"] for t in f.data["optimizer_terms"] if t["name"] == "optimizer_state"]
    assert state == [4 * f.data["facts"]["trainable_param_count"]]


def test_a_toy_step_kind_runs_its_own_step():
    spec = TrainingSpec(model="tests.tiny_models:linear", batch_size=16, step_kind="toy-twice")
    twice = estimate(spec)
    once = estimate(spec.replace(step_kind=None))
    accum = estimate(spec.replace(step_kind=None, grad_accum=2))
    # two forward/backward passes per step: the second adds into the first's gradient, as accumulation does
    assert twice.peak_allocated_bytes == accum.peak_allocated_bytes >= once.peak_allocated_bytes
    assert twice.spec["step_kind"] == "toy-twice" and "step_kind" not in once.spec


def test_compare_and_fit_take_them():
    spec = TrainingSpec(model="tests.tiny_models:linear", batch_size=16, optimizer="toy-momentum", step_kind="toy-twice")
    c = compare(spec, ["checkpointing", "sgd"])
    rows = {r["technique"]: r for r in c.data["rows"]}
    assert rows["checkpointing"]["spec"]["step_kind"] == "toy-twice" == rows["sgd"]["spec"]["step_kind"]
    # a linear layer has nothing to checkpoint: the step as given; SGD drops exactly the momentum buffer
    assert rows["checkpointing"]["estimated_peak_allocated_bytes"] == estimate(spec).peak_allocated_bytes
    assert rows["checkpointing"]["estimated_peak_allocated_bytes"] - rows["sgd"]["estimated_peak_allocated_bytes"] == W
    r = fit(spec, 2**30, context_bytes=0, margin=0, plan=False)
    best = r.data["max_batch_size"]
    assert best > 16 and estimate(spec.replace(batch_size=best)).peak_reserved_bytes <= 2**30


def test_an_unregistered_step_kind_is_refused_in_one_line():
    with pytest.raises(SpecError, match="step kind 'toy-twise' is not registered") as e:
        resolve(TrainingSpec(model="tests.tiny_models:linear", step_kind="toy-twise"))
    assert "did you mean 'toy-twice'" in e.value.hint


# ---------------------------------------------------------------- a toy parallelism (tests/step/toy_parallel.py)
THREE = "tests.distributed.dist_models:three"     # bias-free 1024 -> 1024 -> 256 and a 256-value bias


@pytest.fixture(scope="module")
def toy_parallel():
    import toy_parallel  # noqa: PLC0415 - registers --sharding replicate2 (its wrapper too)

    return toy_parallel


def test_a_toy_parallelism_is_planned_from_its_registries(toy_parallel):
    plan = resolve(TrainingSpec(model=THREE, world_size=2, sharding="replicate2"))
    assert plan.wrapper is toy_parallel.ReplicateWrapper and plan.sharding is toy_parallel.REPLICATE2
    assert plan.distributed and plan.ranks == 2 and not plan.dp
    with pytest.raises(SpecError, match="--sharding replicate2 has no wrapper"):     # its registry entry: 2 ranks only
        resolve(TrainingSpec(model=THREE, world_size=4, sharding="replicate2"))


def test_a_toy_parallelism_runs_through_estimate_compare_and_fit(toy_parallel):
    spec = TrainingSpec(model=THREE, batch_size=16, world_size=2, sharding="replicate2", optimizer="sgd")
    one = estimate(spec.replace(world_size=1, sharding="none"))
    r = estimate(spec)
    # each rank holds a whole replica and trains its own micro-batch, with no buckets: one GPU's step, to the byte
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (one.peak_allocated_bytes, one.peak_reserved_bytes)
    assert r.data["strategy"] == "toy: 2 independent replicas"
    ddp = estimate(spec.replace(sharding="ddp"))
    assert ddp.peak_allocated_bytes > r.peak_allocated_bytes         # DDP's buckets: the toy's wrapper is what ran
    rows = {x["technique"]: x for x in compare(spec, ["fp32", "bf16"]).data["rows"]}
    assert rows["fp32"]["estimated_peak_allocated_bytes"] == r.peak_allocated_bytes
    assert rows["bf16"]["spec"]["sharding"] == "replicate2"
    assert rows["bf16"]["estimated_peak_allocated_bytes"] < r.peak_allocated_bytes
    f = fit(spec, 2**30, context_bytes=0, margin=0, plan=False, target_batch=64)
    assert f.data["world_size"] == 2 and f.data["per_gpu_target_batch"] == 32
    best = f.data["max_batch_size"]
    assert best > 16 and estimate(spec.replace(batch_size=best)).peak_reserved_bytes <= 2**30
