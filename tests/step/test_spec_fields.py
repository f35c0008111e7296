"""Every TrainingSpec field is applied by the prepared step or refused with one line (issue: no
verb may silently ignore a field), and one spec gives one peak through every verb."""
from __future__ import annotations

import dataclasses
import json

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 128, "n_positions": 128,
        "n_embd": 64, "n_layer": 2, "n_head": 4}
VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "image_size": 32, "patch_size": 8,
       "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "num_labels": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, cfg in (("gpt2", GPT2), ("vit", VIT)):
        p = d / name
        p.mkdir()
        (p / "config.json").write_text(json.dumps(cfg))
        out[name] = str(p)
    return out


def _peak(spec):
    r = estimate(spec)
    return r.peak_allocated_bytes, r


_BASES: dict[str, tuple] = {}     # a base spec's estimate, made once for the module's tests (many share a base)


def _base_peak(spec):
    key = json.dumps(spec.to_dict(), sort_keys=True, default=str)
    if key not in _BASES:
        _BASES[key] = _peak(spec)
    return _BASES[key]


# field -> (model key, value); applied means: the peak moves, or (for fields with no memory effect) the
# prepared step lists the setting it applied
APPLIED = {
    "batch_size": ("gpt2", 2), "seq_len": ("gpt2", 64), "image_size": ("vit", 64), "precision": ("gpt2", "bf16"),
    "grad_checkpointing": ("gpt2", True), "attn": ("gpt2", "eager"), "optimizer": ("gpt2", "sgd"),
    "lora_rank": ("gpt2", 8), "freeze": ("gpt2", ("wte",)), "grad_accum": ("gpt2", 2),
    "gpu": ("gpt2", "a100-80gb"), "hf_trainer": ("gpt2", True), "compile": ("gpt2", True),
    "loss": ("gpt2", "criterion-fp32"), "keep_outputs": ("gpt2", True), "pad_fraction": ("gpt2", 0.25),
    "checkpoint_layers": ("gpt2", 1), "use_cache": ("gpt2", False), "offload_layers": ("gpt2", 1),
    "ema": ("gpt2", True),
    "trainer": ("gpt2", "sft"),
}
REFUSED = {  # field -> (model key, value, words of the error)
    "target_len": ("gpt2", 16, "target"),
    "images_per_sample": ("gpt2", 2, "vision-language"),
    "world_size": ("gpt2", 2, "world-size"),
    "offload_optimizer": ("gpt2", True, "offload"),
    "step_kind": ("gpt2", "no-such-kind", "step kind"),   # a registered kind runs (tests/step/test_registries.py)
    "liger": ("gpt2", True, "no patch for model_type 'gpt2'"),   # applied to llama/qwen: tests/models/test_liger.py
    "lengths": ("gpt2", "no-such-lengths.txt", "lengths"),   # read and estimated: tests/estimator/test_lengths_estimate.py
    "cp": ("gpt2", 2, "context parallel"),
    "pp": ("gpt2", 2, "pipeline stages"),      # applied to Llama: tests/distributed/test_pp.py
    **{name: ("gpt2", v, "pipeline parallel") for name, v in (("pp_schedule", "gpipe"), ("pp_stage", 0), ("virtual_stages", 2),
                                                             ("pp_microbatches", 2))},     # without --pp
}
WITH_OTHERS = {  # fields that only mean something with another one
    "lora_alpha": ("gpt2", {"lora_rank": 8}, 64.0), "lora_targets": ("gpt2", {"lora_rank": 8}, ("c_fc",)),
    "qlora": ("gpt2", {"lora_rank": 8}, True),
    "lora_dropout": ("gpt2", {"lora_rank": 8}, 0.05),
    "kbit_prep": ("gpt2", {"lora_rank": 8, "qlora": True}, True),
    "physical_batch_size": ("gpt2", {"dp": True, "lora_rank": 8, "batch_size": 4}, 2),
    "sharding": ("gpt2", {"world_size": 2, "sharding": "ddp"}, "fsdp"),
    "reshard_after_forward": ("gpt2", {"world_size": 2, "sharding": "fsdp"}, False),
    "gradient_as_bucket_view": ("gpt2", {"world_size": 2, "sharding": "ddp"}, True),
    "bucket_cap_mb": ("gpt2", {"world_size": 2, "sharding": "ddp"}, 1.0),
    "shard_size": ("gpt2", {"world_size": 8, "sharding": "hsdp", "shard_size": 4}, 2),
    # GPT-2 has no Llama-style modules for torchtitan's plan: refused (applied to Llama: tests/distributed/test_tp.py)
    "tp": ("gpt2", {"world_size": 4, "sharding": "fsdp"}, 2),
    "loss_parallel": ("gpt2", {"world_size": 4, "sharding": "fsdp", "tp": 2}, True),    # applied: test_torchtitan.py
    # Opacus has grad samplers for LoRA's Linear layers (GPT-2's Conv1D would need functorch)
    "dp": ("gpt2", {"lora_rank": 8}, True),
    "grad_sample_mode": ("gpt2", {"dp": True, "lora_rank": 8}, "ghost"),
    "max_grad_norm": ("gpt2", {"dp": True, "lora_rank": 8}, 0.5),
    "noise_multiplier": ("gpt2", {"dp": True, "lora_rank": 8}, 0.3),
    "checkpoint_policy": ("gpt2", {"grad_checkpointing": True}, "selective"),
    # TRL's trainers (tests/step/test_trl_kinds.py)
    "packing": ("gpt2", {"trainer": "sft"}, "bfd"), "padding_free": ("gpt2", {"trainer": "sft"}, True),
    "prompt_len": ("gpt2", {"trainer": "sft"}, 8), "precompute_ref_log_probs": ("gpt2", {"trainer": "dpo"}, True),
    **{name: ("gpt2", {"trainer": "grpo", "batch_size": 8, "max_completion_length": 8}, v)
       for name, v in (("num_generations", 4), ("max_completion_length", 16), ("beta", 0.04), ("steps_per_generation", 2),
                       ("vllm_gpu_memory_utilization", 0.3))},
}


def test_every_field_is_covered():
    names = {f.name for f in dataclasses.fields(TrainingSpec)} - {"model"}
    assert names == set(APPLIED) | set(REFUSED) | set(WITH_OTHERS)


@pytest.mark.parametrize("name", sorted(APPLIED))
def test_field_is_applied(name, models):
    key, value = APPLIED[name]
    base = TrainingSpec(model=models[key], seq_len=32 if key == "gpt2" else None)
    p0, r0 = _base_peak(base)
    p1, r1 = _peak(base.replace(**{name: value}))
    assert p1 != p0 or r1.data["applied"] != r0.data["applied"], f"{name}={value!r} changed nothing"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_field_is_refused_in_one_line(name, models):
    key, value, words = REFUSED[name]
    with pytest.raises(SpecError) as e:
        estimate(TrainingSpec(model=models[key], **{name: value}))
    assert words in e.value.message.lower() and e.value.hint and "\n" not in e.value.render()


@pytest.mark.parametrize("name", sorted(WITH_OTHERS))
def test_dependent_field_is_applied_or_refused(name, models):
    key, others, value = WITH_OTHERS[name]
    base = TrainingSpec(model=models[key], seq_len=32, **others)
    try:
        p1, r1 = _peak(base.replace(**{name: value}))
    except SpecError as e:
        assert e.hint and "\n" not in e.render()
        return
    p0, r0 = _base_peak(base)
    assert p1 != p0 or r1.data["applied"] != r0.data["applied"], f"{name}={value!r} changed nothing"


def test_seq_len_on_a_vision_model_and_image_size_on_text_are_refused(models):
    with pytest.raises(SpecError, match="patches"):
        estimate(TrainingSpec(model=models["vit"], seq_len=64))
    with pytest.raises(SpecError, match="image-size"):
        estimate(TrainingSpec(model=models["gpt2"], image_size=64))


def test_factory_without_spec_refuses_shape_flags():
    with pytest.raises(SpecError, match="takes no spec"):
        estimate(TrainingSpec(model="tests.step.spec_models:no_spec", seq_len=64))
    estimate(TrainingSpec(model="tests.step.spec_models:no_spec"))        # nothing to apply: fine


def test_factory_precision_is_applied():
    """bf16 weights for a factory: its 1024 x 1024 fp32 weight becomes 2 bytes per value."""
    fp32 = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd"))
    bf16 = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd", precision="bf16"))
    assert fp32.by_category["parameters"] == 1024 * 1024 * 4
    assert bf16.by_category["parameters"] == 1024 * 1024 * 2


def test_one_spec_one_peak_through_every_verb(models, tmp_path):
    from memlens.explore.compare import compare
    from memlens.explore.fit import fit
    from memlens.explore.sweep import Grid, sweep

    spec = TrainingSpec(model=models["gpt2"], batch_size=2, seq_len=32)
    est = estimate(spec).peak_allocated_bytes
    cmp = compare(spec, ["fp32"]).data["rows"][0]["estimated_peak_allocated_bytes"]
    sw = sweep(spec, Grid(batch_sizes=[2]), out=tmp_path / "sw").data["rows"][0]["estimated_peak_allocated_bytes"]
    f = fit(spec, est * 4, plan=False, context_bytes=0, margin=0)
    at = estimate(spec.replace(batch_size=f.data["max_batch_size"])).peak_allocated_bytes
    assert est == cmp == sw
    assert f.data["predicted_peak_allocated_bytes"] == at
