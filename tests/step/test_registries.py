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
