"""Context parallel x FSDP2 (--cp N): torchtitan's mesh, each rank's share of the sequence, and torch's own ring
attention (_templated_ring_attention and its backward) run on fake tensors under the fake process group (issue 37)."""
from __future__ import annotations

from collections import Counter

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator.ranks import estimate_ranks, simulate_rank

LLAMA = "tests/fixtures/tiny-llama"     # H 64, MLP 128, 4 heads of 16, 2 kv heads, vocab 256, 2 layers, untied
# bf16 compute (FSDP2 MixedPrecisionPolicy): on an H100 SDPA runs cuDNN attention, which the ring takes
CP2 = TrainingSpec(model=LLAMA, batch_size=2, seq_len=64, world_size=4, sharding="fsdp", cp=2, precision="amp-bf16")
B, L, H, KV, D = 2, 64, 4, 2, 16


@pytest.fixture(scope="module")
def cp2():
    """Ranks 0 and 1 of 2 (dp_shard) x 2 (cp): the first and the last place in the ring."""
    return {r: simulate_rank(CP2, r, steps=1) for r in (0, 1)}


def _events(log, layer="model.layers.0.self_attn"):
    names = log.modules
    return [(ev.phase, str(ev.op), ev.nbytes) for ev in log.events if ev[0] == 0 and names[ev.module] == layer]


def test_fsdp2_shards_over_dp_shard_x_cp_and_each_rank_holds_its_share_of_the_sequence(cp2):
    sim = cp2[0]
    assert sim.wrapper.facts["mesh"] == {"dp_shard": 2, "cp": 2} and sim.wrapper.facts["fsdp_over"] == 4
    assert sim.wrapper.facts["tokens_per_rank"] == L // 2
    # fp32 shards over 4 ranks (dp_shard x cp), as FSDP2 over 4 GPUs: embed/lm_head 64 rows, q 16, k/v 8, o 16,
    # gate/up 32, down 16 rows, norms 16 values
    layer = (16 + 8 + 8 + 16) * 64 * 4 + 2 * 32 * 64 * 4 + 16 * 128 * 4 + 2 * 16 * 4
    setup = sum(ev.nbytes for ev in sim.log.events if ev[0] == 0 and ev.phase == "setup" and ev.category == "parameters")
    assert setup == 2 * 64 * 64 * 4 + 2 * layer + 16 * 4
    # q_proj runs on L / 2 tokens: bf16 (B, L/2, 64)
    assert ("forward", "aten.mm.default", B * L // 2 * H * D * 2) in _events(sim.log, "model.layers.0.self_attn.q_proj")


def test_ring_attention_forward_gathers_every_ranks_keys_and_values_and_merges_in_fp32(cp2):
    fwd = [e for e in _events(cp2[0].log) if e[0] == "forward"]
    kv = B * KV * (L // 2) * D * 2                    # one rank's keys (bf16), its values alike
    q = B * H * (L // 2) * D * 2
    # the flat K/V of this rank (cat), then all-gathered from the 2 CP ranks (_AllGatherRotater)
    assert ("forward", "aten.cat.default", 2 * kv) in fwd
    assert ("forward", "_c10d_functional.all_gather_into_tensor.default", 2 * 2 * kv) in fwd
    # step 0: the kernel's output and fp32 statistics over the local queries, the output upcast (convert_to_f32)
    assert ("forward", "aten.empty.memory_format", B * H * (L // 2) * 4) in fwd
    assert ("forward", "aten._to_copy.default", 2 * q) in fwd
    # rank 0 at step 1: half its queries against the other rank's keys (partial), merged back with a cat of the
    # fp32 output halves, and the merged output cast back to bf16
    assert ("forward", "aten.empty.memory_format", q // 2) in fwd
    assert ("forward", "aten.cat.default", 2 * q) in fwd
    assert fwd.count(("forward", "aten._to_copy.default", q)) == 2     # step 1's output upcast, the final cast


def test_ring_attention_backward_rotates_fp32_kv_gradients_every_step(cp2):
    bwd = Counter(e for e in _events(cp2[1].log) if e[0] == "backward")
    kv = B * KV * (L // 2) * D * 2
    q = B * H * (L // 2) * D * 2
    # fp32 zero accumulators for dq, dk, dv; the K/V all-gather again; one all-to-all of the flat fp32 dK/dV per step
    assert bwd[("backward", "aten.zeros_like.default", 2 * q)] == 1
    assert bwd[("backward", "aten.zeros_like.default", 2 * kv)] == 2
    assert bwd[("backward", "_c10d_functional.all_gather_into_tensor.default", 2 * 2 * kv)] == 1
    assert bwd[("backward", "_c10d_functional.all_to_all_single.default", 2 * 2 * kv)] == 2


@pytest.mark.parametrize("rank", [0, 3])
def test_four_ranks_the_first_attends_half_its_queries_the_last_half_the_keys(rank):
    sim = simulate_rank(CP2.replace(cp=4), rank, steps=1)
    ev = Counter(_events(sim.log))
    kv, q = B * KV * (L // 4) * D * 2, B * H * (L // 4) * D * 2        # per tensor, bf16: 2048 and 4096 bytes
    assert ev[("forward", "_c10d_functional.all_gather_into_tensor.default", 4 * 2 * kv)] == 1
    assert ev[("backward", "_c10d_functional.all_gather_into_tensor.default", 4 * 2 * kv)] == 1
    assert ev[("backward", "_c10d_functional.all_to_all_single.default", 2 * 2 * kv)] == 4    # fp32 dK/dV, every step
    if rank == 0:   # steps 1-3: half the queries (a bf16 half-output upcast), merged into the fp32 output by a cat each
        assert ev[("forward", "aten.cat.default", 2 * q)] == 3 and ev[("forward", "aten._to_copy.default", q)] == 4
    else:           # steps 1-3: all the queries against the first half of each rank's keys: full outputs, no partial cat
        assert ev[("forward", "aten.cat.default", 2 * q)] == 0 and ev[("forward", "aten._to_copy.default", 2 * q)] == 4


def test_rank_groups_are_the_first_and_last_place_in_the_ring():
    r2 = estimate_ranks(CP2, steps=1)
    assert [(e["rank"], e["ranks"]) for e in r2.data["ranks"]] == [(0, [0, 2]), (1, [1, 3])]
    assert r2.data["strategy"] == "FSDP2 x CP: context parallel over 2 GPUs (ring attention), FSDP2 over dp_shard x cp = 4"
    r4 = estimate_ranks(CP2.replace(cp=4), steps=1)
    assert [(e["rank"], e["ranks"]) for e in r4.data["ranks"]] == [(0, [0]), (3, [3]), (None, [1, 2])]
    assert r4.data["wrapper"]["mesh"] == {"dp_shard": 1, "cp": 4} and r4.data["wrapper"]["tokens_per_rank"] == 16


def test_a_cp_group_shares_one_micro_batch_and_the_spec_round_trips():
    spec = TrainingSpec(model=LLAMA, batch_size=2, seq_len=64, world_size=16, sharding="fsdp", cp=2, tp=2)
    assert spec.effective_batch_size == 2 * 16 // 4
    assert TrainingSpec.from_dict(spec.to_dict()) == spec and spec.describe().endswith("fsdpx16 tp=2 cp=2")


@pytest.mark.parametrize("fields, message", [
    ({"sharding": "ddp"}, "--cp 2 composes with FSDP2 over dp_shard x cp (torchtitan's mesh), not with --sharding ddp"),
    ({"sharding": "hsdp", "shard_size": 3, "world_size": 6}, "--shard-size 3 with --cp 2: HSDP shards each parameter over "
                                                              "dp_shard x cp GPUs, so --shard-size must be a multiple of 2"),
    ({"cp": 3, "world_size": 4}, "--cp 3 must divide --world-size 4"),
    ({"seq_len": 66}, "--cp 2: the sequence of 66 tokens does not split into 2 x 2 equal chunks (torch's head-tail load "
                      "balancing of causal attention)"),
    ({"attn": "eager"}, "--cp 2 with --attn eager: torch's ring attention replaces SDPA only"),
    ({"pad_fraction": 0.25}, "--cp 2 with --pad-fraction: the ring takes causal attention without a padding mask"),
    ({"pp": 2}, "--pp 2 with --cp: pipeline stages are modelled with FSDP2 alone"),
])
def test_what_cp_does_not_go_with_is_refused_in_one_line(fields, message):
    with pytest.raises(SpecError) as e:
        CP2.replace(**fields)
    assert e.value.message == message


def test_attention_the_ring_cannot_take_is_refused_in_one_line():
    # fp32 grouped-query attention runs CUDA's math path (the memory-efficient kernel takes no enable_gqa)
    with pytest.raises(SpecError) as e:
        simulate_rank(CP2.replace(precision="fp32"), 0, steps=1)
    assert e.value.message == ("--cp: torch's load-balanced ring attention takes causal SDPA without a mask through the "
                               "cuDNN, flash or memory-efficient kernel, and this model's attention has the math path")


def test_cp_composes_with_tp_and_lora():
    # 2 x 2 x 2 (dp_shard x cp x tp): TP's q/k/v hold half the heads, so the ring gathers 2 ranks' K/V of 1 kv head
    sim = simulate_rank(CP2.replace(world_size=8, tp=2), 0, steps=1)
    assert sim.wrapper.facts["mesh"] == {"dp_shard": 2, "cp": 2, "tp": 2} and sim.wrapper.facts["fsdp_over"] == 4
    fwd = _events(sim.log)
    assert ("forward", "_c10d_functional.all_gather_into_tensor.default", 2 * 2 * (B * 1 * (L // 2) * D * 2)) in fwd
    lora = simulate_rank(CP2.replace(lora_rank=4), 1, steps=1)       # peft's LoRA leaves SDPA to the ring
    assert ("forward", "_c10d_functional.all_gather_into_tensor.default", 2 * 2 * (B * KV * (L // 2) * D * 2)) in _events(lora.log)


@pytest.mark.parametrize("policy, backward_gathers, merged", [("full", 4, 0), ("torchtitan-op", 2, 2)])
def test_selective_checkpointing_keeps_the_merged_attention_not_the_ring(policy, backward_gathers, merged):
    """On the GPU selective AC sees one aten attention op (the ring runs inside torch's CP handler): it keeps the merged
    output and logsumexp once per layer, and its recomputation does not run the forward ring again; full AC does."""
    sim = simulate_rank(CP2.replace(grad_checkpointing=True, checkpoint_policy=policy), 0, steps=1)
    ev = Counter((e.phase, str(e.op), e.nbytes) for e in sim.log.events if e[0] == 0)
    kv, q = B * KV * (L // 2) * D * 2, B * H * (L // 2) * D * 2
    assert ev[("backward", "_c10d_functional.all_gather_into_tensor.default", 2 * 2 * kv)] == backward_gathers
    assert ev[("forward", "aten.clone.default", B * H * (L // 2) * 4)] == merged      # the kept fp32 logsumexp, per layer
    assert ev[("forward", "aten.clone.default", q)] == 2 + merged                       # HF's output transpose, and the kept output


def test_hsdp_replicas_of_dp_shard_x_cp_hold_what_fsdp2_over_that_group_holds():
    hsdp = estimate_ranks(CP2.replace(world_size=8, sharding="hsdp", shard_size=4), steps=1)
    fsdp = estimate_ranks(CP2, steps=1)
    assert hsdp.data["wrapper"]["mesh"] == {"replicate": 2, "dp_shard": 2, "cp": 2}
    assert [(e["rank"], e["ranks"]) for e in hsdp.data["ranks"]] == [(0, [0, 2, 4, 6]), (1, [1, 3, 5, 7])]
    assert ([(e["peak_allocated_bytes"], e["peak_reserved_bytes"]) for e in hsdp.data["ranks"]]
            == [(e["peak_allocated_bytes"], e["peak_reserved_bytes"]) for e in fsdp.data["ranks"]])
    assert CP2.replace(world_size=8, sharding="hsdp", shard_size=4).effective_batch_size == 2 * 8 // 2


def test_the_step_time_prices_one_attention_kernel_per_ring_step(cp2):
    # rank 0 of a 2-way ring runs the fused kernel twice a layer (its own chunk, then the other's K/V): 2 layers,
    # 2 steps, forward and backward, each on its L/2 queries against L/2 keys
    tr = cp2[0].timing
    attn = Counter(f.kind for _, _, f in tr.rows if f.kind in ("attn_fwd", "attn_bwd"))
    assert attn == {"attn_fwd": 2 * 2, "attn_bwd": 2 * 2}
    f = next(f for _, _, f in tr.rows if f.kind == "attn_fwd")
    assert (f.seq, f.hd, f.causal) == (L // 2, D, True)
