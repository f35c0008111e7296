"""Python: every verb that takes a TrainingSpec takes its fields as keywords too (issue 34, "What to build" 6).

The bullet: `memlens.estimate(model="gpt2", batch_size=8)` raised TypeError (only a TrainingSpec worked)."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

import memlens
from memlens import TrainingSpec
from memlens.core.errors import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parent / "explore"))
from explore_support import fake_estimator  # noqa: E402 - the explore tests' fixed fake estimator

VERBS = ("estimate", "compare", "sweep", "fit", "fit_batch_size", "profile_spec", "diagnose_oom")


def test_estimate_takes_spec_fields_as_the_bullet_wrote_it():
    by_fields = memlens.estimate(model="gpt2", batch_size=8, method="formula")
    by_spec = memlens.estimate(TrainingSpec(model="gpt2", batch_size=8), method="formula")
    assert by_fields.peak_allocated_bytes == by_spec.peak_allocated_bytes > 0
    assert by_fields.spec == by_spec.spec


def test_fields_change_a_spec_given_too_and_a_dict_is_a_spec():
    a = memlens.estimate(TrainingSpec(model="gpt2", batch_size=2), method="formula", batch_size=8)
    b = memlens.estimate({"model": "gpt2", "batch_size": 8}, method="formula")
    c = memlens.estimate(TrainingSpec(model="gpt2", batch_size=8), method="formula")
    assert a.peak_allocated_bytes == b.peak_allocated_bytes == c.peak_allocated_bytes


@pytest.mark.parametrize("verb", VERBS)
def test_an_unknown_field_is_the_specs_error(verb):
    with pytest.raises(SpecError) as e:
        args = (lambda b: None,) if verb == "fit_batch_size" else ("OOM",) if verb == "diagnose_oom" else ()
        getattr(memlens, verb)(*args, model="gpt2", batch_sise=8)
    assert e.value.message == "unknown spec field 'batch_sise'" and e.value.hint == "did you mean 'batch_size'?"


def test_no_spec_at_all_is_one_line():
    with pytest.raises(SpecError) as e:
        memlens.estimate()
    assert e.value.render() == ("ERROR: estimate needs a spec  HINT: e.g. memlens.estimate(model='gpt2', batch_size=8), "
                                "or a TrainingSpec")


def test_compare_fit_and_sweep_take_fields(tmp_path):
    r = memlens.compare(model="fake", batch_size=8, seq_len=512, techniques=["fp32", "bf16"], estimator=fake_estimator())
    assert [x["technique"] for x in r.data["rows"]] == ["fp32", "bf16"] and r.spec["batch_size"] == 8
    f = memlens.fit(model="fake", seq_len=512, budget="16GiB", plan=False, estimator=fake_estimator())
    assert f.data["max_batch_size"] > 0 and f.spec["seq_len"] == 512
    from memlens.explore.sweep import Grid

    s = memlens.sweep(model="fake", seq_len=512, grid=Grid(batch_sizes=[1, 2]), out=tmp_path, estimator=fake_estimator())
    assert [x["key"] for x in s.data["rows"]] == ["b=1", "b=2"]


def test_diagnose_oom_takes_fields_for_its_optional_spec():
    msg = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.93 GiB total capacity; 3.00 GiB already allocated; "
           "1.00 GiB free; 5.90 GiB reserved in total by PyTorch)")
    assert memlens.diagnose_oom(msg).verb == memlens.diagnose_oom(msg, spec=None).verb   # no fields: as before
    r = memlens.diagnose_oom(msg, model="gpt2", batch_size=2, estimate_fn=lambda s: memlens.estimate(s, method="formula"))
    assert r.spec["model"] == "gpt2" and r.spec["batch_size"] == 2


@pytest.mark.parametrize("verb", VERBS)
def test_the_signature_and_docstring_are_the_verbs(verb):
    f = getattr(memlens, verb)
    assert f.__doc__ and "spec" in inspect.signature(f).parameters
