"""TRL 1.16's SFT, DPO and GRPO steps (memlens.step.kinds.trl) on a tiny Llama: the collators' batches, the fused
LM head's allocations, the reference model, GRPO's generation, and estimate / compare / fit through them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlens.core.errors import SpecError
from memlens.core.gpus import gpu_facts
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.models.trl_batch import trl_batch
from memlens.step.kinds.trl.fused_head import TOKEN_CHUNK, VOCAB_CHUNK, chunked_log_probs

LLAMA = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-llama" / "config.json")
PARAM_BYTES = 883200      # the tiny Llama's fp32 parameters (220800 values; its embedding and head untied)


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(model=LLAMA, **{"batch_size": 2, "seq_len": 64, **kw})


# ---------------------------------------------------------------- batches (real values on the CPU)
@pytest.mark.parametrize("kw", [dict(trainer="sft"), dict(trainer="sft", prompt_len=10), dict(trainer="sft", packing="bfd"),
                                dict(trainer="sft", packing="bfd", prompt_len=10), dict(trainer="sft", padding_free=True),
                                dict(trainer="sft", packing="wrapped"), dict(trainer="dpo"), dict(trainer="dpo", prompt_len=20)])
def test_loss_positions_are_the_labels_not_ignored(kw):
    """valid_rows / valid_cols (the gather TRL does with hidden_states[labels[:, 1:] != -100]) are exactly the
    positions of the collator's labels that are not -100, in order."""
    s = spec(**kw)
    b = trl_batch(s, 1000, 64, {})
    labels = b["labels"] if "labels" in b else b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    assert torch.equal(rows, b["valid_rows"]) and torch.equal(cols, b["valid_cols"])
    p = kw.get("prompt_len", 0)
    per_seq = 64 - max(p, 1)
    assert rows.numel() == (2 * 2 if kw["trainer"] == "dpo" else 2) * per_seq


def test_bfd_packing_is_one_padding_free_row_with_position_ids():
    """TRL's default packing: one row of batch x max_length tokens, position ids restarting at each sequence,
    labels -100 at each start, cu_seq_lens int32, no attention mask (DataCollatorForLanguageModeling)."""
    b = trl_batch(spec(trainer="sft", packing="bfd", batch_size=3), 1000, 8, {})
    assert b["input_ids"].shape == (1, 24) and "attention_mask" not in b
    assert b["position_ids"][0].tolist() == list(range(8)) * 3
    assert (b["labels"][0, ::8] == -100).all() and (b["labels"][0, 1:8] != -100).all()
    assert b["cu_seq_lens_q"].tolist() == [0, 8, 16, 24] and b["cu_seq_lens_q"].dtype == torch.int32


def test_dpo_batch_is_chosen_then_rejected():
    b = trl_batch(spec(trainer="dpo", prompt_len=5, precompute_ref_log_probs=True), 1000, 16, {})
    assert b["input_ids"].shape == (4, 16) and b["completion_mask"][:, :5].sum() == 0 and b["completion_mask"][:, 5:].all()
    assert b["ref_chosen_logps"].shape == (2,) == b["ref_rejected_logps"].shape


def test_grpo_batch_is_the_generation_batch_of_prompts():
    b = trl_batch(spec(trainer="grpo", batch_size=4, num_generations=4, grad_accum=2, max_completion_length=8), 1000, 16, {})
    assert b["prompt_ids"].shape == (8, 16)                       # batch x steps_per_generation (= grad_accum)
    assert b["valid_cols"].tolist() == list(range(15, 23)) * 4    # a micro-batch's completion positions


# ---------------------------------------------------------------- the fused head: no logits
class Sizes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.sizes.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_chunked_log_probs_allocate_one_tile_never_the_logits():
    """TRL's ChunkedLogProbFunction: the largest buffer is one [min(N, 4096), 32768] tile in the compute dtype
    (forward and backward); no [N, V] tensor; the head's gradient is an fp32 [V, H] accumulator."""
    N, H, V = 10, 8, 40000
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    with Sizes() as m:
        lp, ent, _, _, top1 = chunked_log_probs(hidden, weight, None, torch.zeros(N, dtype=torch.long), torch.float32,
                                                ("log_probs", "entropy", "is_top1"))
        (lp.sum() + ent.sum()).backward()
    shapes = [s for _, s, _ in m.sizes]
    assert (min(N, TOKEN_CHUNK), VOCAB_CHUNK) in shapes and (N, V) not in shapes
    assert max(torch.Size(s).numel() for s in shapes) == max(N * VOCAB_CHUNK, V * H)   # the tile, or the fp32 grad_weight
    assert (V, H) in shapes                                         # grad_weight (fp32 zeros)
    made = [s for f, s, _ in m.sizes if "empty" in f]
    assert made.count((N, VOCAB_CHUNK)) == 2                        # mm_buf in forward, again in backward
    assert top1.dtype == torch.bool and lp.shape == (N,)


# ---------------------------------------------------------------- estimates
@pytest.fixture(scope="module")
def results():
    cases = {"sft": dict(trainer="sft"), "sft-bfd": dict(trainer="sft", packing="bfd"),
             "dpo": dict(trainer="dpo"), "dpo-pre": dict(trainer="dpo", precompute_ref_log_probs=True),
             "dpo-lora": dict(trainer="dpo", lora_rank=8), "dpo-lora-pre": dict(trainer="dpo", lora_rank=8, precompute_ref_log_probs=True),
             "grpo": dict(trainer="grpo", batch_size=8, max_completion_length=16),
             "grpo-beta": dict(trainer="grpo", batch_size=8, max_completion_length=16, beta=0.04),
             "grpo-vllm": dict(trainer="grpo", batch_size=8, max_completion_length=16, vllm_gpu_memory_utilization=0.3),
             "grpo-ckpt": dict(trainer="grpo", batch_size=8, max_completion_length=16, grad_checkpointing=True)}
    return {k: estimate(spec(**v)) for k, v in cases.items()}


def test_dpo_reference_copy_adds_exactly_the_parameters(results):
    r = results
    assert r["dpo"].by_category["parameters"] - r["dpo-pre"].by_category["parameters"] == PARAM_BYTES
    assert r["dpo-lora"].by_category["parameters"] == r["dpo-lora-pre"].by_category["parameters"]   # adapters disabled
    assert "reference" in r["dpo"].by_phase and "reference" in r["dpo-lora"].by_phase and "reference" not in r["dpo-pre"].by_phase
    assert any("reference model" in a for a in r["dpo"].data["applied"])


def test_grpo_phases_and_reference_with_beta(results):
    r = results
    assert "generation" in r["grpo"].by_phase
    assert r["grpo-beta"].by_category["parameters"] - r["grpo"].by_category["parameters"] == PARAM_BYTES


def test_grpo_generation_holds_the_kv_cache(results):
    """The generation's peak holds every layer's keys and values for the 8 rows' prompt + completion (fp32 here):
    2 layers x (K, V) x 8 rows x 2 kv heads x (64 + 15) cached tokens x 16 dims x 4 bytes at the last step."""
    gen = results["grpo"].by_phase["generation"]["peak_allocated_bytes"]
    cache = 2 * 2 * 8 * 2 * (64 + 15) * 16 * 4
    assert gen >= PARAM_BYTES + cache


def test_grpo_generation_runs_without_checkpointing(results):
    """TRL generates with gradient checkpointing disabled (unwrap_model_for_generation); transformers <= 5.17 drops
    a checkpointed layer's cache in training mode even under no_grad, which made the decode step find no keys.
    With checkpointing the generation allocates what it does without (nothing is checkpointed there)."""
    gen = {k: results[k].by_phase["generation"]["peak_allocated_bytes"] for k in ("grpo", "grpo-ckpt")}
    assert gen["grpo-ckpt"] == gen["grpo"]


def test_checkpointing_off_fills_the_cache_and_restores_the_switches():
    """The path transformers 5.15-5.17 take (GradientCheckpointingLayer in training mode): with the switches off the
    prefill writes every layer's cache; after, each switch is as it was (one layer left off stays off)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from memlens.step.kinds.trl.grpo import checkpointing_off

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    layers = model.model.layers
    layers[1].gradient_checkpointing = False
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), checkpointing_off(model):
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        model(input_ids=torch.zeros((2, 5), dtype=torch.long), past_key_values=cache, use_cache=True)
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(2, 2, 5, 16)] * len(layers)
    assert [b.gradient_checkpointing for b in layers] == [True, False]


def test_vllm_share_is_reported_and_counted_by_the_fit_rule(results):
    r = results["grpo-vllm"]
    share = int(0.3 * gpu_facts("h100").total_memory_bytes)
    assert r.data["outside_allocator_bytes"] == share
    assert r.data["fit"]["need_bytes"] == r.peak_reserved_bytes + share


def test_packed_row_runs_sdpa_with_the_packed_mask(results):
    """transformers builds the block-diagonal mask from packed position_ids: SDPA with a mask (efficient kernel)."""
    assert results["sft-bfd"].data["attention_backends"] == ["efficient"]
    assert results["sft"].data["attention_backends"] != ["efficient"]


def test_sft_tile_is_in_the_forward_peak(results):
    """The fused head's [min(N, 4096), 32768] fp32 tile (N = 2 x 63 loss tokens) is alive in the forward."""
    tile = 2 * 63 * VOCAB_CHUNK * 4
    r = results["sft"]
    assert r.by_phase["forward"]["peak_allocated_bytes"] >= PARAM_BYTES + tile


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(trainer="sft", packing="bfd"), dict(trainer="dpo", lora_rank=8),
                                dict(trainer="grpo", batch_size=8, max_completion_length=8)])
def test_compare_and_fit_run_on_trl_steps(kw):
    from memlens.explore.compare import compare
    from memlens.explore.fit import fit

    s = spec(**kw)
    rows = compare(s, ["fp32", "amp-bf16", "checkpointing"]).data["rows"]
    assert all(r["estimated_peak_allocated_bytes"] for r in rows)
    f = fit(s, "300MiB", context_bytes=0, margin=0, plan=False)     # GRPO: 80 (5 probes; at 600 MiB 184 in 10)
    assert f.data["max_batch_size"] >= 1
    if kw["trainer"] == "grpo":
        assert f.data["max_batch_size"] % 8 == 0 and all(t["batch"] % 8 == 0 for t in f.data["estimates"])


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw, words", [
    (dict(packing="bfd"), "--packing is a setting of TRL's SFT trainer"),
    (dict(trainer="dpo", packing="bfd"), "--packing is a setting of TRL's SFT trainer"),
    (dict(trainer="sft", beta=0.1), "--beta is a setting of TRL's GRPO trainer"),
    (dict(trainer="grpo", batch_size=8, prompt_len=4), "--prompt-len is a setting of TRL's SFT/DPO trainer"),
    (dict(trainer="sft", prompt_len=64), "prompt-len 64 leaves no token"),
    (dict(trainer="grpo", batch_size=3), "not divisible by num_generations 8"),
    (dict(trainer="grpo", batch_size=2, num_generations=1), "num-generations must be at least 2"),
    (dict(trainer="grpo", batch_size=8, vllm_gpu_memory_utilization=1.5), "vllm-gpu-memory-utilization must be"),
    (dict(trainer="sft", packing="best"), "packing 'best' is not one of"),
    (dict(trainer="ppo"), "trainer 'ppo' is not one of"),
])
def test_spec_refusals(kw, words):
    with pytest.raises(SpecError) as e:
        spec(**kw)
    assert words in e.value.message and e.value.hint and "\n" not in e.value.render()


@pytest.mark.parametrize("kw, words", [
    (dict(trainer="sft", dp=True, lora_rank=8), "--dp with TRL's SFT trainer is not modelled"),
    (dict(trainer="dpo", compile=True), "--compile with TRL's DPO trainer"),
    (dict(trainer="sft", pad_fraction=0.25), "--pad-fraction with TRL's SFT trainer"),
    (dict(trainer="sft", world_size=2, sharding="ddp"), "is not simulated per rank"),
])
def test_kind_refusals(kw, words):
    with pytest.raises(SpecError) as e:
        estimate(spec(**kw))
    assert words in e.value.message and e.value.hint and "\n" not in e.value.render()


def test_hf_trainer_is_trainer_hf_and_round_trips():
    a, b = TrainingSpec(model="gpt2", hf_trainer=True), TrainingSpec(model="gpt2", trainer="hf")
    assert a == b and a.trainer == "hf" and "trainer" not in a.to_dict() and a.describe().endswith("trainer")
    g = spec(trainer="grpo", batch_size=8, beta=0.04)
    assert g.hf_trainer and TrainingSpec.from_dict(g.to_dict()) == g and "grpo-g8-c512-beta0.04" in g.describe()


@pytest.mark.parametrize("kw", [dict(trainer="sft", packing="bfd"), dict(trainer="dpo"), dict(trainer="dpo", lora_rank=4),
                                dict(trainer="grpo", batch_size=4, num_generations=4, max_completion_length=4, beta=0.04)])
def test_the_same_step_runs_on_a_real_device(kw):
    """The kinds' run() on real CPU tensors (what profile runs on a GPU; on the CPU the head's values are not computed,
    fused_head.py): one step runs to its scalar loss, the reference model beside the policy where it should be."""
    from memlens.step.prepare import prepare

    step = prepare(spec(**{**kw, "seq_len": 16}), device="cpu", seed=0)
    loss = step.run()
    assert loss is not None and loss.dim() == 0
    assert len(step.frozen) == (1 if kw["trainer"] != "sft" and not kw.get("lora_rank") else 0)
