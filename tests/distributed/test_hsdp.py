"""HSDP (--sharding hsdp --shard-size S): FSDP2 run as is on a replicate x shard DeviceMesh under the fake
process group, per rank, for 8 fake ranks (issue 37)."""
from __future__ import annotations

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator.ranks import estimate_ranks, simulate_rank

MODEL = "tests.distributed.dist_models:blocks"
HSDP = TrainingSpec(model=MODEL, world_size=8, sharding="hsdp", shard_size=4)


def _setup_parameter_bytes(log) -> int:
    return sum(ev[2] for ev in log.events if ev[0] == 0 and ev[3] == "parameters" and ev[5] == "setup")


@pytest.fixture(scope="module")
def collectives():
    """Rank 5 of 2 x 4 simulated with torch.distributed's reduce-scatter and all-reduce recorded."""
    import torch.distributed as dist

    seen: list[tuple[str, int, object]] = []
    # FSDP2's DefaultReduceScatter: dist.reduce_scatter_single in torch 2.13, reduce_scatter_tensor before
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    rs, ar = getattr(dist, name), dist.all_reduce

    def reduce_scatter(*a, **k):
        out = k.get("output", k.get("output_tensor", a[0] if a else None))
        seen.append(("reduce_scatter", k["group"].size(), out))
        return rs(*a, **k)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(("all_reduce", group.size(), tensor))
        return ar(tensor, op=op, group=group, async_op=async_op)

    mp = pytest.MonkeyPatch()
    mp.setattr(dist, name, reduce_scatter)
    mp.setattr(dist, "all_reduce", all_reduce)
    try:
        sim = simulate_rank(HSDP, 5)
    finally:
        mp.undo()
    return sim, seen


def test_each_rank_holds_shards_over_its_shard_group_not_the_world(collectives):
    sim, _ = collectives
    # inp 64x64, out 6x64 (no bias), 2 blocks of 64x64 + 64, fp32: ceil(dim0 / 4) rows, as FSDP2 over 4 GPUs (not 8)
    assert _setup_parameter_bytes(sim.log) == 16 * 64 * 4 + 2 * 64 * 4 + 2 * (16 * 64 * 4 + 16 * 4)
    assert sim.wrapper.facts["mesh"] == {"replicate": 2, "shard": 4}
    assert "on a 2 x 4 DeviceMesh (replicate x shard)" in sim.wrapper.applied[0]


def test_gradients_reduce_scatter_in_the_shard_group_then_all_reduce_in_place_across_replicas(collectives):
    _, seen = collectives
    rs = [(n, t) for kind, n, t in seen if kind == "reduce_scatter"]
    ar = [(n, t) for kind, n, t in seen if kind == "all_reduce"]
    # 3 groups (2 blocks + the root) x 2 steps, each reduce-scatter over 4 ranks followed by an all-reduce over 2
    assert len(rs) == len(ar) == 6
    assert {n for n, _ in rs} == {4} and {n for n, _ in ar} == {2}
    # the all-reduce runs on the reduce-scatter's own output (in place: foreach_reduce allocates no buffer for it)
    assert all(a is r for (_, a), (_, r) in zip(ar, rs))
    # block: (64 x 64 + 64) / 4 values; root: inp 64 x 64 / 4 + out's 2 padded rows x 64
    assert [t.numel() for _, t in rs[:3]] == [1040, 1040, 1024 + 128]


def test_rank_groups_follow_the_shard_index_and_the_replicate_dim_costs_nothing():
    hsdp = estimate_ranks(HSDP)
    fsdp = estimate_ranks(TrainingSpec(model=MODEL, world_size=4, sharding="fsdp"))
    # out's 6 rows over 4 shards: 2, 2, 2, 0 -> shard index 3 (ranks 3 and 7) holds less
    assert [(e["rank"], e["ranks"]) for e in hsdp.data["ranks"]] == [(0, [0, 1, 2, 4, 5, 6]), (7, [3, 7])]
    h = {e["rank"]: e for e in hsdp.data["ranks"]}
    f = {e["rank"]: e for e in fsdp.data["ranks"]}
    # AdamW states in 512-byte blocks: inp 4096, 2 x (4096 + 512), out 512 (shard 3: none), twice
    assert h[0]["term_maxima"]["optimizer states (sharded)"] == 2 * (4096 + 2 * (4096 + 512) + 512)
    assert h[7]["term_maxima"]["optimizer states (sharded)"] == 2 * (4096 + 2 * (4096 + 512))
    for hr, fr in ((0, 0), (7, 3)):   # a replica holds what FSDP2 over its 4 GPUs holds
        assert (h[hr]["peak_allocated_bytes"], h[hr]["peak_reserved_bytes"]) == (f[fr]["peak_allocated_bytes"], f[fr]["peak_reserved_bytes"])
    assert hsdp.data["job"]["peak_allocated_bytes_sum"] == 6 * h[0]["peak_allocated_bytes"] + 2 * h[7]["peak_allocated_bytes"]
    assert HSDP.effective_batch_size == 8 * HSDP.batch_size


def test_a_1024_rank_hsdp_job_simulates_one_rank_per_shard_index_on_this_cpu():
    spec = TrainingSpec(model=MODEL, world_size=1024, sharding="hsdp", shard_size=8)
    sim = simulate_rank(spec, 1023)
    assert sim.wrapper.facts["mesh"] == {"replicate": 128, "shard": 8}
    # shard index 7 of 8: inp 8 rows, blocks 8 rows + 8 bias values, out's 6 rows end at shard 5 but every
    # rank's shard storage is padded to ceil(6 / 8) = 1 row (FSDP2's padded sharded data)
    assert _setup_parameter_bytes(sim.log) == 8 * 64 * 4 + 2 * (8 * 64 * 4 + 8 * 4) + 1 * 64 * 4


@pytest.mark.parametrize("fields, message", [
    ({"sharding": "hsdp"}, "--sharding hsdp needs --shard-size N: the GPUs each parameter is sharded over (replicated "
                           "across the world / N groups)"),
    ({"sharding": "hsdp", "shard_size": 3}, "--shard-size 3 must divide the 8 data-parallel GPUs and lie between 2 and 4"),
    ({"sharding": "hsdp", "shard_size": 8}, "--shard-size 8 must divide the 8 data-parallel GPUs and lie between 2 and 4"),
    ({"sharding": "fsdp", "shard_size": 4}, "--shard-size is HSDP's shard group"),
    ({"sharding": "hsdp", "shard_size": 2, "pp": 2}, "--pp 2 composes with FSDP2 over each stage's data-parallel GPUs "
                                                     "(torchtitan's PP x FSDP), not with --sharding hsdp"),
    ({"sharding": "ddp", "tp": 2}, "--tp 2 composes with FSDP2 (torchtitan's 2D: TP within a group, FSDP2 across), not "
                                   "with --sharding ddp"),
    ({"sharding": "fsdp", "tp": 3}, "--tp 3 must divide --world-size 8 and leave at least 2 data-parallel ranks"),
    ({"sharding": "fsdp", "tp": 0}, "--tp must be a whole number >= 1, got 0"),
])
def test_mesh_fields_that_cannot_go_together_are_refused_in_one_line(fields, message):
    with pytest.raises(SpecError) as e:
        TrainingSpec(model=MODEL, world_size=8, **fields)
    assert e.value.message == message


def test_mesh_fields_round_trip_and_stay_out_of_plain_specs():
    spec = TrainingSpec(model=MODEL, world_size=16, sharding="hsdp", shard_size=4, tp=2)
    assert spec.to_dict()["shard_size"] == 4 and spec.to_dict()["tp"] == 2
    assert TrainingSpec.from_dict(spec.to_dict()) == spec
    assert TrainingSpec.from_dict({"model": MODEL, "world_size": "16", "sharding": "hsdp", "shard_size": "4"}).shard_size == 4
    assert not {"shard_size", "tp", "cp", "pp"} & set(TrainingSpec(model=MODEL, world_size=2, sharding="fsdp").to_dict())
    assert spec.effective_batch_size == 8 and spec.describe().endswith("hsdpx16 shard=4 tp=2")


def test_the_closed_form_shards_over_the_shard_group_and_refuses_tp():
    from memlens.core.errors import MemlensError
    from memlens.estimator import estimate

    gpt2 = "tests/fixtures/models/tiny-gpt2"
    hsdp = estimate(TrainingSpec(model=gpt2, seq_len=32, world_size=16, sharding="hsdp", shard_size=8), method="formula")
    fsdp = estimate(TrainingSpec(model=gpt2, seq_len=32, world_size=8, sharding="fsdp"), method="formula")
    assert hsdp.by_category == fsdp.by_category
    with pytest.raises(MemlensError, match=r"^--method formula does not model tensor parallel \(--tp 2"):
        estimate(TrainingSpec(model="tests/fixtures/tiny-llama", world_size=4, sharding="fsdp", tp=2), method="formula")
