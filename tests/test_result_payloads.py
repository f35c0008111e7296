"""Result payloads: each verb's data is its typed payload; the adaptive payload as the plain loop, the
Hugging Face and the Lightning runners fill it (each its own fields, in the JSON order they always
wrote), saved and loaded back to the same JSON; an old JSON's unknown keys kept."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from memlens.core.payloads import (PAYLOADS, UNSET, AdaptivePayload, DoctorLogPayload, DoctorOomPayload,
                                   DoctorSnapshotPayload, DoctorStatsPayload, GuardPayload, Payload)
from memlens.core.result import Result
from memlens.explore.adaptive import adaptive_batch
from memlens.integrations.hf_oom import TrainerOom
from memlens.integrations.lightning_oom import LightningOom


def _written(r: Result) -> dict:
    d = json.loads(r.to_json())
    d.pop("created_at")
    return d


def _own_keys(r: Result) -> list[str]:
    return list(r.data.to_dict())


def _round_trip(r: Result, tmp_path) -> Result:
    back = Result.load(r.save(tmp_path / "result.json"))
    assert type(back.data) is type(r.data) and back.data.extra == {}
    assert list(_written(back)) == list(_written(r)) and _written(back) == _written(r)
    return back


def test_every_verb_has_its_payload_and_a_dict_becomes_it():
    assert {v: PAYLOADS[v] for v in ("doctor.oom", "doctor.log", "doctor.snapshot", "doctor.stats", "guard", "adaptive")} == {
        "doctor.oom": DoctorOomPayload, "doctor.log": DoctorLogPayload, "doctor.snapshot": DoctorSnapshotPayload,
        "doctor.stats": DoctorStatsPayload, "guard": GuardPayload, "adaptive": AdaptivePayload}
    r = Result(verb="adaptive", data={"micro_batch": 4, "ooms_recovered": 1})
    assert type(r.data) is AdaptivePayload and r.data.micro_batch == 4 and r.data.steps is UNSET
    assert type(Result(verb="no such verb", data={"a": 1}).data) is Payload


def test_adaptive_payload_from_a_plain_loop_that_ran_out_of_memory(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(mb):                       # a CUDA-style OOM above 4 rows
        if mb["x"].shape[0] > 4:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 MiB. ({mb['x'].shape[0]} rows)")
        return model(mb["x"]).pow(2).mean()

    ab = adaptive_batch(opt, micro_batch=16, trend=False)
    for _ in range(2):
        ab.step({"x": torch.randn(16, 4)}, loss)
    r = ab.result
    d = r.data
    assert type(d) is AdaptivePayload and d.extra == {}
    assert (d.micro_batch, d.effective_batch, d.accumulation, d.steps) == (4, 16, 4, 2)
    assert (d.ooms_recovered, d.windows_redone, d.start_fit, d.trend) == (2, 0, None, None)
    assert [(c["micro_batch_from"], c["micro_batch_to"], c["reason"]) for c in d.changes] == [(16, 8, "oom"), (8, 4, "oom")]
    assert _own_keys(r) == ["micro_batch", "effective_batch", "accumulation", "steps", "ooms_recovered", "windows_redone",
                            "changes", "start_fit", "trend"]
    assert r.notes == [ab.changes[0].describe(), ab.changes[1].describe()]
    _round_trip(r, tmp_path)


def test_adaptive_payload_of_the_hf_and_lightning_runners(tmp_path):
    hf_trainer = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=2), state=SimpleNamespace(global_step=0))
    hf = TrainerOom(hf_trainer, adaptive=True, guard=None, micro_batch=4)
    hf.policy.size(8)                   # a dataloader batch of 8 rows seen
    r = hf.result
    d = r.data
    assert (d.micro_batch, d.per_device_batch, d.accumulation_per_batch, d.gradient_accumulation_steps) == (4, 8, 2, 2)
    assert d.integration == "transformers.Trainer" and d.guard_report is None and d.changes == []
    assert _own_keys(r) == ["micro_batch", "per_device_batch", "accumulation_per_batch", "gradient_accumulation_steps",
                            "ooms_recovered", "windows_redone", "changes", "start_fit", "integration", "guard_report"]
    _round_trip(r, tmp_path)

    pl = LightningOom(SimpleNamespace(accumulate_grad_batches=3, global_step=0), None, adaptive=True, guard=None,
                      micro_batch=4)
    pl.policy.size(8)
    r = pl.result
    d = r.data
    assert (d.micro_batch, d.batch_size, d.accumulate_grad_batches, d.integration) == (4, 8, 3, "lightning.Trainer")
    assert d.effective_batch is UNSET and d.start_fit is UNSET            # not the Lightning runner's: absent
    assert _own_keys(r) == ["micro_batch", "batch_size", "accumulate_grad_batches", "ooms_recovered", "windows_redone",
                            "changes", "integration", "guard_report"]
    _round_trip(r, tmp_path)


def test_an_old_adaptive_json_keeps_an_unknown_key(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"verb": "adaptive", "micro_batch": 2, "retired_field": [1, 2]}))
    r = Result.load(tmp_path / "old.json")
    assert r.data.micro_batch == 2 and r.data.extra == {"retired_field": [1, 2]}
    assert _own_keys(r) == ["micro_batch", "retired_field"]
