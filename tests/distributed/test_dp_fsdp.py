"""DP-SGD ghost clipping over several GPUs, per rank: Opacus' FSDP2Wrapper + ``ghost_fsdp``
(--sharding fsdp) and DPDDP with ghost clipping (--sharding ddp), run as is on fake tensors under
a fake process group; the two backward passes and their FSDP collectives; the refusals."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("opacus")

from memlens.core.errors import SpecError  # noqa: E402
from memlens.core.spec import TrainingSpec  # noqa: E402
from memlens.estimator.ranks import estimate_ranks  # noqa: E402

B, T = 4, 16                          # physical batch x tokens of seq_blocks
RELU_OUT = B * T * 64 * 4             # ReLU's saved fp32 output (Linear b saves the same storage)
COEF = 512                            # the clipping coefficients (B fp32) backward 2's mul saves: one block
TINY_LLAMA = "tests/fixtures/tiny-llama"


def _spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tests.distributed.dist_models:seq_blocks", "optimizer": "sgd", "dp": True,
                           "batch_size": 8, "physical_batch_size": B, "world_size": 2, "sharding": "fsdp",
                           "grad_sample_mode": "ghost", **kw})


def _passes(r, rank=0):
    e = next(e for e in r.data["ranks"] if e.get("rank") == rank)
    return {(p["physical_batch"], p["pass"]): p for p in e["passes"]}


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_retained_graph_holds_the_activations_through_both_backward_passes(sharding):
    r = estimate_ranks(_spec(sharding=sharding))
    p = _passes(r)
    assert [k[1] for k in p if k[0] == 1] == ["forward", "backward 1", "backward 2", "clip"]
    # backward 1 runs with retain_graph=True: ReLU's output is still saved when backward 2 starts,
    # next to the coefficients it multiplies the per-sample losses by; backward 2 frees them all
    assert p[(1, "backward 1")]["terms_at_start"]["activations"] == RELU_OUT
    assert p[(1, "backward 2")]["terms_at_start"]["activations"] == RELU_OUT + COEF
    assert "activations" not in p[(1, "clip")]["terms_at_start"]
    assert "ghost clipping runs two backward passes" in r.notes[-1]


def test_ghost_fsdp_shards_every_layer_and_gathers_and_reduces_in_each_pass():
    r = estimate_ranks(_spec())
    w = r.data["wrapper"]
    assert w["wrapped_by"] == "opacus.utils.fsdp_utils.FSDP2Wrapper" and w["fsdp_groups"] == 3     # 2 Linears + root
    assert "ghost_fsdp" in " ".join(r.data["applied"]) and "FSDP2Wrapper" in r.data["strategy"]
    p = _passes(r)
    for name in ("backward 1", "backward 2"):       # each pass all-gathers both Linears and reduce-scatters their grads
        assert (p[(1, name)]["all_gathers"], p[(1, name)]["reduce_scatters"]) == (2, 2)
    assert (p[(1, "forward")]["all_gathers"], p[(1, "forward")]["reduce_scatters"]) == (2, 0)
    # each rank keeps half of each weight: (64 x 64 + 8 x 64) fp32 / 2; FSDPOptimizer's zero_grad
    # (set_to_none=False) keeps the sharded gradients from backward 1 into backward 2
    half = (64 * 64 + 8 * 64) * 4 // 2
    assert p[(1, "backward 2")]["terms_at_start"]["sharded parameters"] == half
    assert p[(1, "backward 2")]["terms_at_start"]["sharded gradients"] == half


@pytest.mark.parametrize("world", [2, 4])
def test_ghost_fsdp_on_a_tiny_llama_with_lora(world):
    r = estimate_ranks(TrainingSpec(model=TINY_LLAMA, dp=True, batch_size=4, physical_batch_size=2, seq_len=32,
                                    world_size=world, sharding="fsdp", grad_sample_mode="ghost", lora_rank=8,
                                    lora_targets=("q_proj", "v_proj"), precision="amp-bf16"))
    e = r.data["ranks"][0]
    assert e["ranks"] == list(range(world))                  # every dim 0 divides by 2 and 4
    p = _passes(r)
    for name in ("backward 1", "backward 2"):   # the LoRA A and B of q_proj and v_proj in 2 layers: 8 groups with grads
        assert p[(1, name)]["reduce_scatters"] == 8 and p[(1, name)]["all_gathers"] > 0
    assert e["terms"]["sharded parameters"] > 0 and e["terms"]["optimizer states (sharded)"] > 0
    assert "ghost_fsdp" in r.to_json()         # the result, passes included, is JSON


def test_sharded_parameters_halve_from_2_to_4_ranks():
    t = {n: _passes(estimate_ranks(_spec(world_size=n)))[(1, "backward 2")]["terms_at_start"]["sharded parameters"]
         for n in (2, 4)}
    assert t[2] == (64 * 64 + 8 * 64) * 4 // 2 and t[4] == (64 * 64 + 8 * 64) * 4 // 4


@pytest.mark.parametrize("world", [2, 4])
def test_dpddp_with_ghost_clipping(world):
    r = estimate_ranks(_spec(sharding="ddp", world_size=world))
    assert [e["ranks"] for e in r.data["ranks"]] == [[0], list(range(1, world))]
    a0, a1 = (e["by_phase"]["optimizer"]["peak_allocated_bytes"] for e in r.data["ranks"])
    assert a0 - a1 == (64 * 64 + 8 * 64) * 4     # rank 0 alone makes p.grad = summed_grad + noise: a new gradient per weight
    assert _passes(r, 1)[(1, "backward 2")]["terms_at_start"]["activations"] == RELU_OUT + COEF


@pytest.mark.parametrize("kw, words", [
    (dict(sharding="zero1"), "Opacus runs DPDDP"),
    (dict(sharding="zero2"), "reshard_after_forward"),
    (dict(grad_sample_mode="hooks"), "needs --grad-sample-mode ghost"),
])
def test_refusals_are_one_line(kw, words):
    with pytest.raises(SpecError) as e:
        estimate_ranks(_spec(**kw))
    assert words in e.value.message and "\n" not in e.value.message and e.value.hint


def test_tied_embeddings_are_refused_under_ghost_fsdp(tmp_path):
    cfg = json.loads(open(f"{TINY_LLAMA}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(SpecError) as e:
        estimate_ranks(TrainingSpec(model=str(tmp_path), dp=True, batch_size=2, seq_len=16, world_size=2, sharding="fsdp",
                                    grad_sample_mode="ghost", lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert "tied parameters" in e.value.message and "\n" not in e.value.message and "untied" in e.value.hint


@pytest.mark.parametrize("args, words", [
    (["--sharding", "zero1", "--grad-sample-mode", "ghost"], "DP-SGD with --sharding zero1"),
    (["--sharding", "fsdp", "--grad-sample-mode", "ghost", "--physical-batch-size", "16"], "physical"),
])
def test_cli_bad_input_exits_2_with_one_line(args, words, capsys, monkeypatch):
    """The CLI's main() in this process (a fresh interpreter would only import torch again: the refusal is the
    plan's, before any simulation)."""
    import os

    from memlens.cli.main import main

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = main(["estimate", "--model", "tests.distributed.dist_models:seq_blocks", "--dp", "--batch-size", "8",
                 "--world-size", "2", *args])
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING: transformers")]
    assert words in stderr and len([ln for ln in lines if ln.lower().startswith(("error", "memlens"))]) <= 1, stderr


def test_ghost_fsdp_shards_on_the_simulation_mesh_on_a_gpu_machine(monkeypatch):
    """Opacus' FSDP2Wrapper calls fully_shard without a mesh; its default is a mesh on the machine's accelerator (CUDA
    on a GPU machine, where `profile --compare-estimate` simulates): the simulation's own mesh must be used."""
    import importlib

    mod = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    names = [n for n in ("_init_default_mesh", "_init_default_fully_shard_mesh") if hasattr(mod, n)]
    assert names

    def accelerator_mesh(*a, **k):
        raise AssertionError("fully_shard made its default (accelerator) mesh")

    for n in names:
        monkeypatch.setattr(mod, n, accelerator_mesh)
    r = estimate_ranks(_spec())
    assert r.peak_allocated_bytes > 0
