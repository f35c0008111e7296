"""torchtitan as a source of settings (issue 37): its selective op AC policy, and the bench that sets its published
per-GPU figures beside memlens' per-rank estimate (bench/torchtitan_figures.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from memlens.models.checkpoint import torchtitan_policy


def _decisions(policy, ops, recompute=False):
    from torch.utils.checkpoint import CheckpointPolicy

    ctx = SimpleNamespace(is_recompute=recompute)
    return [policy(ctx, op) == CheckpointPolicy.MUST_SAVE for op in ops]


def test_torchtitan_op_ac_keeps_every_other_matmul_and_the_listed_ops():
    import torch

    aten = torch.ops.aten
    mm = aten.mm.default
    # a Llama block's forward: q, k, v, attention, o, gate, silu, up, mul, down
    block = [mm, mm, mm, aten._scaled_dot_product_flash_attention.default, mm, mm, aten.silu.default, mm, aten.mul.Tensor, mm]
    policy = torchtitan_policy()
    assert _decisions(policy, block) == [True, False, True, True, False, True, False, False, False, True]
    # recomputation counts its own matmuls from 1 again, so it keeps (and reuses) the same ones
    assert _decisions(policy, block, recompute=True) == [True, False, True, True, False, True, False, False, False, True]
    # cuDNN attention is not in torchtitan's list (torch picked flash on H100 in Dec 2024)
    assert _decisions(torchtitan_policy(), [aten._scaled_dot_product_cudnn_attention.default, aten.abs.default,
                                            torch.ops._c10d_functional.reduce_scatter_tensor.default]) == [False, True, True]


def test_the_bench_estimates_a_case_per_rank_on_the_96gb_h100_entry(request):
    from memlens.core import gpus

    # the bench registers its GPU in memlens' table: taken out again after, so no other test in this process sees it
    # (docs/budget.md's GPU table test compares every entry)
    request.addfinalizer(lambda: gpus.GPUS.pop("h100-96gb", None))
    bench = pytest.importorskip("bench.torchtitan_figures")
    spec = bench.tiny(next(c for c in bench.cases() if c["name"] == "t1-fsdp8-8b")["spec"])
    assert (spec["world_size"], spec["seq_len"], spec["checkpoint_policy"], spec["gpu"]) == (4, 64, "torchtitan-op", "h100-96gb")
    e = bench.estimate_case(spec)
    assert e["strategy"].startswith("FSDP2 fully_shard") and e["simulated_ranks"] == [0]
    assert e["max_reserved_bytes"] == e["peak_reserved_bytes"] > e["peak_allocated_bytes"]
    GPUS = gpus.GPUS
    assert not GPUS["h100-96gb"].cudnn_attention and GPUS["h100-96gb"].total_memory_bytes == GPUS["h100"].total_memory_bytes * 96 // 80


def test_loss_parallel_keeps_the_logits_vocabulary_sharded():
    """torchtitan's default with TP: lm_head's output stays Shard(-1) and the cross-entropy runs on the shards."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import simulate_rank

    spec = TrainingSpec(model="tests/fixtures/tiny-llama", batch_size=2, seq_len=32, world_size=4, sharding="fsdp", tp=2,
                        loss_parallel=True)
    sim = simulate_rank(spec, 0, steps=1)
    names = sim.log.modules
    fwd = [(names[ev.module], str(ev.op), ev.nbytes) for ev in sim.log.events if ev[0] == 0 and ev.phase == "forward"]
    B, L, V = 2, 32, 256
    # fp32 logits of half the vocabulary, their log-softmax alike; no all-gather of the logits (B x L x V x 4 bytes)
    assert ("lm_head", "aten.mm.default", B * L * V // 2 * 4) in fwd
    assert ("(model: loss and glue)", "aten._log_softmax.default", B * L * V // 2 * 4) in fwd
    assert not [e for e in fwd if "all_gather" in e[1] and e[2] == B * L * V * 4]
    assert "loss parallel" in sim.wrapper.applied[-1] and spec.describe().endswith("tp=2 loss-parallel")
