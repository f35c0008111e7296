"""Selective checkpointing and activation offload (issue 26): the simulation keeps exactly the hand-counted bytes,
counts what is recomputed and moved, ``memlens.apply`` changes neither loss nor gradients, and bad input is one line."""
from __future__ import annotations

import copy

import pytest
import torch

import memlens
from memlens.cli.main import main
from memlens.core.errors import MemlensError, SpecError
from memlens.core.gpus import gpu_facts
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from tests.models.checkpoint_support import lm_loss_and_grads, loss_and_grads, tiny_llama
from tests.tiny_models import blocks

# tests.tiny_models.blocks: 4 blocks of Linear(64->256) -> GELU -> Linear(256->64), a 16 x 64 fp32 batch.
# Per block autograd saves: the block input x (16x64: 4 KiB), W1^T (256x64: 64 KiB; not in block 0, whose input
# needs no gradient), the GELU input a (16x256: 16 KiB), the second Linear's input g (16 KiB) and W2^T (64 KiB).
X, A, W = 16 * 64 * 4, 16 * 256 * 4, 256 * 64 * 4
MODEL = "tests.tiny_models:blocks"


def _run(**kw):
    r = estimate(TrainingSpec(model=MODEL, **kw))
    return r.by_phase["forward"]["peak_allocated_bytes"], r.data.get("activation_plan")


@pytest.mark.parametrize("choice, k", [(1, 1), (2, 2), (3, 3), ((0, 2), 2)])
def test_selective_keeps_matmul_outputs_and_recomputes_gelu(choice, k):
    base, _ = _run()
    full, fplan = _run(checkpoint_layers=choice)
    sel, splan = _run(checkpoint_layers=choice, checkpoint_policy="selective")
    assert base - full == k * 2 * A          # full: a and g of each checkpointed block gone
    assert base - sel == k * A               # selective: a (an addmm output) kept, g (GELU) recomputed
    ck = splan["checkpoint"]
    assert ck["policy"] == "selective" and ck["recompute_flops"] == 0 and ck["recompute_bytes"] == k * A
    # full: the first Linear and the GELU again; the second Linear's inputs are back by then (non-reentrant early stop)
    assert fplan["checkpoint"]["recompute_flops"] == k * 2 * 16 * 64 * 256
    assert fplan["checkpoint"]["recompute_bytes"] == k * 2 * A


@pytest.mark.parametrize("choice, freed, host", [
    ((0, 1), 2 * 2 * A + X, (X + 2 * A + W) + (X + 2 * A + 2 * W)),    # block 0's input is the batch, kept anyway
    ((1, 2), 2 * 2 * A + 2 * X, 2 * (X + 2 * A + 2 * W)),
    ((0,), 2 * A, X + 2 * A + W),
])
def test_offload_frees_the_blocks_saved_tensors(choice, freed, host):
    # the last block is not offloaded: the forward peaks in it, with the offloaded blocks' saved tensors off the GPU
    base, _ = _run()
    peak, plan = _run(offload_layers=list(choice))
    assert base - peak == freed
    off = plan["offload"]
    assert off["host_bytes"] == host
    assert off["transfer_seconds_each_way"] == round(host / gpu_facts("h100").pcie_bytes_per_s, 6)


def test_offloaded_tensors_come_back_in_backward():
    r = estimate(TrainingSpec(model=MODEL, offload_layers="all"))
    assert r.by_phase["backward"]["peak_allocated_bytes"] > 0 and r.data["activation_plan"]["offload"]["tensors"] == 19


@pytest.mark.parametrize("plan", [
    {"checkpoint_layers": "all", "checkpoint_policy": "selective"},
    {"offload_layers": "all"},
    {"checkpoint_layers": [0, 2], "checkpoint_policy": "selective", "offload_layers": [1, 3]},
])
def test_apply_leaves_loss_and_grads_unchanged(plan):
    torch.manual_seed(0)
    model, x, _ = blocks()
    wrapped = copy.deepcopy(model)
    done = memlens.apply(wrapped, plan)
    assert done.offloaded == (["blocks.0", "blocks.1", "blocks.2", "blocks.3"] if plan.get("offload_layers") == "all"
                              else [f"blocks.{i}" for i in plan.get("offload_layers", [])])
    (l0, g0), (l1, g1) = loss_and_grads(model, x), loss_and_grads(wrapped, x)
    assert torch.allclose(l0, l1) and all(torch.allclose(a, b) for a, b in zip(g0, g1))


def test_apply_hf_selective_and_offload():
    model = tiny_llama()
    wrapped = copy.deepcopy(model)
    done = memlens.apply(wrapped, {"checkpoint_layers": 2, "checkpoint_policy": "selective", "offload_layers": [2, 3]})
    assert done == ["model.layers.0", "model.layers.1"] and done.offloaded == ["model.layers.2", "model.layers.3"]
    ids = torch.randint(0, 64, (2, 16))
    outs = [lm_loss_and_grads(m, ids) for m in (model, wrapped)]
    assert torch.allclose(outs[0][0], outs[1][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs[0][1], outs[1][1]))


@pytest.mark.parametrize("plan, words", [
    ({"offload_layers": [7]}, "block index 7 is out of range: blocks has 4 blocks"),
    ({"checkpoint_policy": "selective"}, "checkpoint_policy 'selective' without checkpointed blocks"),
    ({"offload": 2}, "plan key 'offload' is not one memlens applies"),
    ({"checkpoint_layers": 2, "offload_layers": 1}, "block blocks.0 would be both checkpointed and offloaded"),
])
def test_apply_refuses_in_one_line(plan, words):
    model, _, _ = blocks()
    with pytest.raises((MemlensError, SpecError)) as e:
        memlens.apply(model, plan)
    assert words in str(e.value) and "\n" not in str(e.value) and e.value.hint


def test_spec_refuses_policy_without_checkpointing_and_round_trips():
    with pytest.raises(SpecError, match="without checkpointing"):
        TrainingSpec(model="gpt2", checkpoint_policy="selective")
    s = TrainingSpec(model="gpt2", checkpoint_layers=[0, 1], checkpoint_policy="selective", offload_layers="2,3")
    assert TrainingSpec.from_dict(s.to_dict()) == s and s.offload_layers == (2, 3)
    assert s.describe() == "gpt2 b=1 fp32 ckpt=[0,1]-selective offload=[2,3] adamw"


def _one_line(capsys, *argv):
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("ERROR: ") and "  HINT: " in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (("--offload-activations", "9"), "offload-activations 9 is more than the 4 blocks of blocks"),
    (("--offload-activations", "1,9"), "block index 9 is out of range"),
    (("--checkpoint-policy", "selective"), "--checkpoint-policy selective without checkpointing"),
    (("--grad-checkpointing", "--offload-activations", "1"), "a block both checkpointed and offloaded"),
    (("--checkpoint-layers", "2", "--checkpoint-policy", "selective", "--compile"), "with --compile"),
])
def test_cli_refuses_in_one_line(capsys, argv, words):
    assert words in _one_line(capsys, "estimate", "--model", MODEL, *argv)
