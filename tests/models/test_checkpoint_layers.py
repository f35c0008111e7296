"""Partial activation checkpointing (``checkpoint_layers``) and ``memlens.apply``: the estimate saves exactly
the chosen blocks' activations but their inputs, and the wrapping changes neither loss nor gradients."""
from __future__ import annotations

import copy

import pytest
import torch

import memlens
from memlens.core.errors import MemlensError, SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.estimator.depth import why_not
from memlens.models.checkpoint import checkpoint_blocks
from memlens.step.plan import resolve as plan_of
from tests.models.checkpoint_support import lm_loss_and_grads, loss_and_grads, tiny_llama
from tests.tiny_models import blocks

# tests.tiny_models.blocks: 4 blocks of Linear(64->256), GELU, Linear(256->64) on a 16 x 64 fp32 batch. A block
# that is not checkpointed keeps, besides its input x (kept anyway: the previous block's output), the GELU's
# input a and output g: 2 x 16 x 256 x 4 B = 32 KiB. A checkpointed block keeps only its input.
PER_BLOCK = 2 * 16 * 256 * 4


def _forward_peak(choice) -> int:
    spec = TrainingSpec(model="tests.tiny_models:blocks", checkpoint_layers=choice)
    return estimate(spec).by_phase["forward"]["peak_allocated_bytes"]


@pytest.mark.parametrize("choice, k", [(1, 1), (2, 2), (3, 3), ((0, 2), 2), ((1,), 1)])
def test_k_blocks_save_their_activations_but_inputs(choice, k):
    # the last block is never checkpointed here, so the forward peaks at the same op with k blocks' a and g fewer
    assert _forward_peak(0) - _forward_peak(choice) == k * PER_BLOCK


def test_all_equals_grad_checkpointing():
    a = estimate(TrainingSpec(model="tests.tiny_models:blocks", checkpoint_layers="all"))
    assert a.spec["grad_checkpointing"] is True and "checkpoint_layers" not in a.spec


def test_wrapping_leaves_loss_and_grads_unchanged():
    torch.manual_seed(0)
    model, x, _ = blocks()
    wrapped = copy.deepcopy(model)
    names = memlens.apply(wrapped, {"checkpoint_layers": [1, 3]})
    assert names == ["blocks.1", "blocks.3"]
    assert [getattr(b, "_memlens_forward", None) is not None for b in wrapped.blocks] == [False, True, False, True]
    l0, g0 = loss_and_grads(model, x)
    l1, g1 = loss_and_grads(wrapped, x)
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert memlens.apply(wrapped, {"checkpoint_layers": 0}) == []       # undone
    assert all(getattr(b, "_memlens_forward", None) is None for b in wrapped.blocks)


def test_hf_layers_switched_one_by_one():
    model = tiny_llama()
    wrapped = copy.deepcopy(model)
    assert memlens.apply(wrapped, {"checkpoint_layers": 2}) == ["model.layers.0", "model.layers.1"]
    assert [layer.gradient_checkpointing for layer in wrapped.model.layers] == [True, True, False, False]
    ids = torch.randint(0, 64, (2, 16))
    outs = [lm_loss_and_grads(m, ids) for m in (model, wrapped)]
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(outs[0][1], outs[1][1]))


def test_bad_input_one_line():
    model, _, _ = blocks()
    with pytest.raises(SpecError, match="checkpoint-layers 5 is more than the 4 blocks of blocks"):
        memlens.apply(model, {"checkpoint_layers": 5})
    with pytest.raises(SpecError, match="block index 4 is out of range"):
        checkpoint_blocks(model, [0, 4])
    with pytest.raises(MemlensError, match="no block stack found"):
        memlens.apply(torch.nn.Linear(2, 2), {"checkpoint_layers": 1})
    with pytest.raises(MemlensError, match="not one memlens applies"):
        memlens.apply(model, {"layers": 1})
    with pytest.raises(SpecError, match="checkpoint-layers must be"):
        TrainingSpec(model="gpt2", checkpoint_layers="first")


def test_subset_is_simulated_whole():
    from memlens.models.source import resolve

    src = resolve("llama-3.1-8b")
    assert why_not(plan_of(TrainingSpec(model="llama-3.1-8b", grad_checkpointing=True), source=src), src) is None
    assert "checkpoint-layers" in why_not(plan_of(TrainingSpec(model="llama-3.1-8b", checkpoint_layers=4), source=src), src)


def test_some_blocks_under_compile_or_dp_are_refused_in_one_line():
    from memlens.core.errors import SpecError
    from memlens.core.spec import TrainingSpec
    from memlens.step.plan import resolve

    with pytest.raises(SpecError, match="--checkpoint-layers with --compile"):
        resolve(TrainingSpec(model="gpt2", checkpoint_layers=2, compile=True))
    with pytest.raises(SpecError, match="grad-checkpointing with --dp"):
        resolve(TrainingSpec(model="gpt2", checkpoint_layers=2, dp=True, lora_rank=8))
