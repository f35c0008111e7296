"""FSDP2 run as is on fake tensors under a fake process group, for 2 and 4 ranks (issue 10)."""
from __future__ import annotations

import pytest

from memlens.core.ledger import analyze
from memlens.core.spec import TrainingSpec
from memlens.estimator.ranks import estimate_ranks, simulate_rank

MODEL = "tests.distributed.dist_models:blocks"


def _setup_parameter_bytes(log) -> int:
    return sum(ev[2] for ev in log.events if ev[0] == 0 and ev[3] == "parameters" and ev[5] == "setup")


@pytest.mark.parametrize("n, shards", [
    # inp 64x64, out 6x64 (no bias), 2 blocks of 64x64 + 64, fp32; every rank holds ceil(dim0 / N) rows
    (2, 32 * 64 * 4 + 3 * 64 * 4 + 2 * (32 * 64 * 4 + 32 * 4)),
    (4, 16 * 64 * 4 + 2 * 64 * 4 + 2 * (16 * 64 * 4 + 16 * 4)),
])
def test_each_rank_holds_padded_dim0_shards(n, shards):
    sim = simulate_rank(TrainingSpec(model=MODEL, world_size=n, sharding="fsdp"), 0)
    assert _setup_parameter_bytes(sim.log) == shards
    assert sim.wrapper.facts["blocks"] == 2


def test_uneven_shards_make_two_rank_groups_and_rank_3_holds_less_state():
    # out has 6 rows: over 4 ranks 2, 2, 2, 0; every other dim 0 divides by 4
    r = estimate_ranks(TrainingSpec(model=MODEL, world_size=4, sharding="fsdp"))
    ranks = {e["rank"]: e for e in r.data["ranks"]}
    assert [(e["rank"], e["ranks"]) for e in r.data["ranks"]] == [(0, [0, 1, 2]), (3, [3])]
    # AdamW states in 512-byte blocks: inp 4096, 2 x (4096 + 512), out 512 (rank 3: none), twice
    assert ranks[0]["term_maxima"]["optimizer states (sharded)"] == 2 * (4096 + 2 * (4096 + 512) + 512)
    assert ranks[3]["term_maxima"]["optimizer states (sharded)"] == 2 * (4096 + 2 * (4096 + 512))
    assert r.data["peak_rank"] == 0 and r.peak_allocated_bytes == ranks[0]["peak_allocated_bytes"]
    assert r.data["rank_imbalance_bytes"] == ranks[0]["peak_allocated_bytes"] - ranks[3]["peak_allocated_bytes"] >= 0
    job = r.data["job"]
    assert job["peak_allocated_bytes_sum"] == 3 * ranks[0]["peak_allocated_bytes"] + ranks[3]["peak_allocated_bytes"]


def test_collectives_allocate_on_their_own_streams():
    sim = simulate_rank(TrainingSpec(model=MODEL, world_size=2, sharding="fsdp"), 1)
    streams = {ev[8] for ev in sim.log.events if ev[0] == 0}
    assert streams == {0, 1, 2}
    assert sim.wrapper.facts["streams"] == {"0": "default", "1": "all_gather_copy_in", "2": "reduce_scatter"}
    # the reduce-scatter output becomes the sharded gradients: allocated on the reduce-scatter stream
    tags = {ev[1]: ev[2] for ev in sim.log.events if ev[0] == 2}
    grads = {ev[8] for ev in sim.log.events if ev[0] == 0 and tags.get(ev[1]) == "gradients" and ev[5] == "backward"
             and ev[1] not in sim.wrapper.unsharded_grad_keys}
    assert grads == {2}


def test_reshard_after_forward_false_keeps_blocks_gathered_through_forward():
    fsdp = analyze(simulate_rank(TrainingSpec(model=MODEL, world_size=2, sharding="fsdp"), 0).log)
    zero2 = analyze(simulate_rank(TrainingSpec(model=MODEL, world_size=2, sharding="zero2"), 0).log)
    assert zero2.by_phase["forward"]["peak_allocated_bytes"] > fsdp.by_phase["forward"]["peak_allocated_bytes"]


def test_local_shard_optimizer_allocates_what_the_dtensor_one_does(monkeypatch):
    """The simulation steps the optimizer over the local shards; stepping the DTensors gives the same log."""
    from memlens.step.parallel import fsdp
    from memlens.step.parallel.base import Wrapper

    spec = TrainingSpec(model=MODEL, world_size=4, sharding="fsdp")
    local = simulate_rank(spec, 3)
    monkeypatch.setattr(fsdp.FSDPWrapper, "make_optimizer", Wrapper.make_optimizer)
    dtensor = simulate_rank(spec, 3)
    a, b = analyze(local.log), analyze(dtensor.log)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes, a.by_category) == (b.peak_allocated_bytes, b.peak_reserved_bytes, b.by_category)
    sizes = lambda log: sorted(ev[2] for ev in log.events if ev[0] == 0)   # noqa: E731
    assert sizes(local.log) == sizes(dtensor.log)


TINY_GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 128, "n_positions": 64,
             "n_embd": 64, "n_layer": 2, "n_head": 4}


def test_mixed_precision_gathers_in_bf16_and_keeps_fp32_shards(tmp_path):
    import json
    import math

    import transformers

    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    spec = TrainingSpec(model=str(tmp_path), batch_size=1, seq_len=32, world_size=2, sharding="fsdp", precision="amp-bf16")
    r = estimate_ranks(spec)
    e = r.data["ranks"][0]
    assert "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" in " ".join(r.data["applied"])
    assert not any(a.startswith("autocast") for a in r.data["applied"])          # the policy casts, not autocast
    import torch

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))
    block = lambda n: (n + 511) // 512 * 512                                       # noqa: E731 - allocator blocks
    shards = [block(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * 4) for p in model.parameters()]
    assert e["term_maxima"]["sharded parameters"] == sum(shards)                   # fp32 padded shards
    assert e["term_maxima"]["optimizer states (sharded)"] == 2 * sum(shards)       # fp32 AdamW states of the same rows
    # the root (tied embedding, never resharded after forward) is gathered in bf16 on top of a block
    assert e["term_maxima"]["gathered parameters"] > block(128 * 64 * 2)


def test_a_rank_built_for_fsdp_on_a_device_keeps_tied_embeddings_tied(tmp_path):
    """The device path builds under accelerate's init_empty_weights, which unties transformers 5
    models; a rank must hold one embedding as the simulation does (2 x H200: +5 embedding shards)."""
    import json

    from memlens.step.parallel.fsdp import FSDPWrapper
    from memlens.models.source import resolve
    from memlens.step.prepare import build_for_sharding

    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    spec = TrainingSpec(model=str(tmp_path), batch_size=1, seq_len=32, world_size=2, sharding="fsdp")
    model = build_for_sharding(spec, resolve(spec.model), FSDPWrapper(spec, fake=False, rank=0, world_size=2)).model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == 128 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
