"""Tensor parallel x FSDP2 (--tp N): torch's parallelize_module with torchtitan's Llama plan, then fully_shard on
the data-parallel sub-mesh, run as is on fake tensors under the fake process group (issue 37)."""
from __future__ import annotations

from collections import Counter

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator.ranks import estimate_ranks, simulate_rank

LLAMA = "tests/fixtures/tiny-llama"     # H 64, MLP 128, 4 heads of 16, 2 kv heads, vocab 256, 2 layers, untied, fp32
TP = TrainingSpec(model=LLAMA, batch_size=2, seq_len=32, world_size=8, sharding="fsdp", tp=2)


@pytest.fixture(scope="module")
def rank7():
    return simulate_rank(TP, 7, steps=1)      # one step: DTensor's dispatch makes a TP step slow to simulate


def _allocs(log, phase, step=1):
    return [ev for ev in log.events if ev[0] == 0 and ev.phase == phase]


def test_each_rank_holds_its_tp_shard_sharded_again_over_the_data_parallel_ranks(rank7):
    # rank 7 = (dp 3, tp 1) of 4 x 2. TP: q 32, k 16, v 16 rows (colwise), o 64 x 32 (rowwise), gate/up 64 rows, down
    # 64 x 64, embed/lm_head 128 vocab rows, norms whole; FSDP2 then keeps a quarter of each TP shard's rows (fp32)
    layer = (8 + 4 + 4) * 64 * 4 + 16 * 32 * 4 + 3 * 16 * 64 * 4 + 2 * 16 * 4
    setup = sum(ev.nbytes for ev in _allocs(rank7.log, "setup") if ev.category == "parameters")
    assert setup == 32 * 64 * 4 + 2 * layer + 16 * 4 + 32 * 64 * 4 == 53568
    assert rank7.wrapper.facts["mesh"] == {"dp_shard": 4, "tp": 2}
    assert rank7.wrapper.shard_index(7) == 3


def test_activations_are_split_as_torchtitans_plan_splits_them(rank7):
    names = rank7.log.modules
    fwd = [(names[ev.module], str(ev.op), ev.nbytes) for ev in _allocs(rank7.log, "forward")]
    B, L, H = 2, 32, 64
    # sequence parallel: the norm computes on L/2 tokens; the attention input is all-gathered to the whole sequence;
    # q_proj (colwise) outputs 2 of the 4 heads; o_proj's partial sums are reduce-scattered back to L/2 tokens
    assert ("model.layers.0.input_layernorm", "aten.pow.Tensor_Scalar", B * L // 2 * H * 4) in fwd
    assert ("model.layers.0.self_attn", "_c10d_functional.all_gather_into_tensor.default", B * L * H * 4) in fwd
    assert ("model.layers.0.self_attn.q_proj", "aten.mm.default", B * L * H // 2 * 4) in fwd
    assert ("model.layers.0.self_attn", "_c10d_functional.reduce_scatter_tensor.default", B * L // 2 * H * 4) in fwd
    # lm_head: its input all-gathered, then its vocab-sharded logits all-gathered whole by its output hook (no loss parallel)
    assert ("lm_head", "_c10d_functional.all_gather_into_tensor.default", B * L * H * 4) in fwd
    assert ("(model: loss and glue)", "_c10d_functional.all_gather_into_tensor.default", B * L * 256 * 4) in fwd


def test_waiting_on_a_collective_allocates_nothing(rank7):
    # On CUDA _c10d_functional.wait_tensor returns its input; its Meta kernel returns empty_like(input), which cost
    # the TP x FSDP2 step on 4 H200s one more logits-sized segment (+6.5% reserved) until the tracker answered it
    names = rank7.log.modules
    assert not [ev for ev in rank7.log.events if ev[0] == 0 and "wait_tensor" in str(ev.op)]
    B, L, V = 2, 32, 256
    logits = [(names[ev.module], str(ev.op).split(".")[1], ev.nbytes) for ev in _allocs(rank7.log, "forward")
              if names[ev.module] in ("lm_head", "(model: loss and glue)") and ev.nbytes >= B * L * V // 2 * 4
              and str(ev.op) != "aten.empty.memory_format"]      # FSDP2's all-gather buffers: not the logits
    # the rank's vocab half (mm), then the whole logits gathered along dim 0 and laid out along the vocab (cat), fp32
    assert logits == [("lm_head", "mm", B * L * V // 2 * 4), ("(model: loss and glue)", "all_gather_into_tensor", B * L * V * 4),
                      ("(model: loss and glue)", "cat", B * L * V * 4), ("(model: loss and glue)", "_log_softmax", B * L * V * 4)]


def test_the_collectives_of_one_step_are_the_plans(rank7):
    ops = Counter((ev.phase, str(ev.op).split(".")[1]) for ev in rank7.log.events
                  if ev[0] == 0 and str(ev.op).startswith("_c10d_functional") and "wait" not in str(ev.op))
    # Forward: an all-gather into attention and into the MLP per layer, the lm_head's input and its logits;
    # a reduce-scatter out of each and out of the embedding. Backward: the transposes, and an all-reduce of each
    # sequence-parallel norm weight's partial gradient (2 per layer + the final norm)
    assert ops == {("forward", "all_gather_into_tensor"): 6, ("forward", "reduce_scatter_tensor"): 5,
                   ("backward", "reduce_scatter_tensor"): 5, ("backward", "all_gather_into_tensor"): 5, ("backward", "all_reduce"): 5}


def test_tp_composes_with_hsdp_and_every_rank_of_an_even_model_is_alike():
    r = estimate_ranks(TrainingSpec(model=LLAMA, batch_size=2, seq_len=32, world_size=8, sharding="hsdp", shard_size=2, tp=2))
    assert [(e["rank"], e["ranks"]) for e in r.data["ranks"]] == [(0, list(range(8)))]
    assert r.data["wrapper"]["mesh"] == {"replicate": 2, "shard": 2, "tp": 2}
    assert r.data["strategy"] == "FSDP2 x TP: tensor parallel over 2 GPUs, FSDP2 over 2, replicated 2 times (HSDP)"
    assert TrainingSpec(model=LLAMA, world_size=8, sharding="hsdp", shard_size=2, tp=2).effective_batch_size == 4


@pytest.mark.parametrize("fields, message", [
    ({"model": "tests/fixtures/models/tiny-gpt2"}, "--tp applies torchtitan's Llama plan (embed_tokens, q/k/v/o_proj, "
     "gate/up/down_proj, the two layer norms, norm, lm_head) and GPT2LMHeadModel has no model.embed_tokens"),
    ({"tp": 4}, "--tp 4: the model's 2 key/value heads do not split evenly over 4 GPUs"),
])
def test_a_model_the_plan_cannot_split_is_refused_in_one_line(fields, message):
    spec = TP.replace(**fields)
    with pytest.raises(SpecError) as e:
        simulate_rank(spec, 0)
    assert e.value.message == message


def test_lora_and_dp_sgd_with_tp_are_refused():
    with pytest.raises(SpecError, match=r"^--tp 2 with --lora-rank: torchtitan's TP plan shards nn.Linear"):
        TP.replace(lora_rank=8)
    with pytest.raises(SpecError, match=r"^DP-SGD with --sharding fsdp --tp 2: Opacus' ghost_fsdp wraps a 1D FSDP2 mesh"):
        TP.replace(dp=True, grad_sample_mode="ghost")


def test_a_tied_embedding_stays_tied_under_tp(tmp_path):
    """parallelize_module gives embed_tokens and lm_head a DTensor each: memlens ties them again (both vocab-sharded)."""
    import json

    cfg = json.loads(open(f"{LLAMA}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    sim = simulate_rank(TrainingSpec(model=str(tmp_path), batch_size=2, seq_len=32, world_size=4, sharding="fsdp", tp=2), 0, steps=1)
    model = sim.wrapper.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and sim.wrapper.facts["tied_embeddings"]
    # 2 x 2: one 256 / 2 / 2 = 64-row embedding shard (fp32), not two
    layer = (16 + 8 + 8) * 64 * 4 + 32 * 32 * 4 + 3 * 32 * 64 * 4 + 2 * 32 * 4
    setup = sum(ev.nbytes for ev in _allocs(sim.log, "setup") if ev.category == "parameters")
    assert setup == 64 * 64 * 4 + 2 * layer + 32 * 4
