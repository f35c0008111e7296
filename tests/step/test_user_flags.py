"""--lora-dropout, --pad-fraction, --kbit-prep: what each adds, in bytes worked out by hand."""
from __future__ import annotations

import json

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.step.prepare import prepare

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "image_size": 32, "patch_size": 8,
       "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "num_labels": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, cfg in (("llama", LLAMA), ("vit", VIT)):
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = str(d)
    return out


def _one_line(e):
    return e.value.hint and "\n" not in e.value.render()


# ---------------------------------------------------------------- --lora-dropout
def test_lora_dropout_saves_a_bool_mask_and_the_dropped_input():
    """One adapted Linear(64, 32) on a hidden state of 8 x 16 x 64 fp32: peft's nn.Dropout before lora_A keeps
    CUDA's bool mask (B*T*in bytes) and lora_A saves the dropped copy (B*T*in*4) instead of the input the
    step holds anyway: + 8*16*64*(1 + 4) = 40960 bytes at the end of forward."""
    base = TrainingSpec(model="tests.tiny_models:hidden_linear", lora_rank=4, lora_targets=("0",), optimizer="sgd")
    r0, r1 = estimate(base), estimate(base.replace(lora_dropout=0.1))
    B, T, d_in = 8, 16, 64
    assert (r1.by_phase["forward"]["peak_allocated_bytes"] - r0.by_phase["forward"]["peak_allocated_bytes"]
            == B * T * d_in * 1 + B * T * d_in * 4)
    assert any("dropout 0.1" in a for a in r1.data["applied"])
    p = prepare(base.replace(lora_dropout=0.1), fake=True)
    assert p.model.base_model.model[0].lora_dropout["default"].p == 0.1


def test_lora_dropout_is_checked():
    with pytest.raises(SpecError, match="needs --lora-rank") as e:
        TrainingSpec(model="gpt2", lora_dropout=0.05)
    assert _one_line(e)
    for bad in (1.0, -0.1, "x"):
        with pytest.raises(SpecError, match="lora-dropout must be"):
            TrainingSpec(model="gpt2", lora_rank=8, lora_dropout=bad)
    s = TrainingSpec(model="gpt2", lora_rank=8, lora_dropout=0.05)
    assert s.to_dict()["lora_dropout"] == 0.05 and "lora_dropout" not in TrainingSpec(model="gpt2").to_dict()
    assert TrainingSpec.from_dict(s.to_dict()) == s and "lora-dropout=0.05" in s.describe()


# ---------------------------------------------------------------- --pad-fraction
def test_pad_fraction_puts_a_right_padded_mask_in_the_batch(models):
    p = prepare(TrainingSpec(model=models["llama"], batch_size=2, seq_len=64, pad_fraction=0.25), device="cpu")
    mask, labels = p.batch["attention_mask"], p.batch["labels"]
    assert mask.shape == (2, 64) and int(mask.sum()) == 2 * 48 and mask[:, 48:].eq(0).all()
    assert labels[:, 48:].eq(-100).all() and labels[:, :48].eq(p.batch["input_ids"][:, :48]).all()
    assert "attention_mask" not in prepare(TrainingSpec(model=models["llama"], seq_len=64), device="cpu").batch


def test_pad_fraction_takes_flash_away(models):
    """SDPA with the 4D mask transformers builds from padding cannot run flash (A100, bf16: efficient instead);
    on the H100 cuDNN attention takes masks (measured), so the backend stays."""
    base = TrainingSpec(model=models["llama"], batch_size=2, seq_len=64, precision="bf16", gpu="a100-80gb")
    r0, r1 = estimate(base), estimate(base.replace(pad_fraction=0.25))
    assert r0.data["attention_backends"] == ["flash"] and r1.data["attention_backends"] == ["efficient"]
    assert r1.peak_allocated_bytes > r0.peak_allocated_bytes
    h100 = estimate(base.replace(gpu="h100", pad_fraction=0.25))
    assert h100.data["attention_backends"] == ["cudnn"]


def test_pad_fraction_is_refused_off_text(models):
    with pytest.raises(SpecError, match="pad-fraction") as e:
        estimate(TrainingSpec(model=models["vit"], pad_fraction=0.25))
    assert _one_line(e)
    with pytest.raises(SpecError, match="pad-fraction") as e:
        estimate(TrainingSpec(model="tests.tiny_models:linear", pad_fraction=0.25))
    assert _one_line(e)
    with pytest.raises(SpecError, match="pad-fraction must be"):
        TrainingSpec(model="gpt2", pad_fraction=1)


# ---------------------------------------------------------------- --kbit-prep
def test_kbit_prep_casts_what_is_not_4bit_to_fp32(models):
    """Llama, hidden 256, vocab 128, 2 layers, untied head, QLoRA r8 on q,v (fp32 adapters either way:
    2 layers x 2 modules x (8*256 + 256*8) x 4 = 65536 bytes). bf16 -> fp32: embeddings and lm_head
    128*256 x 2 -> x 4 bytes each, the 5 RMSNorm weights 256 x 2 (one 512-byte block) -> 256 x 4 (two)."""
    base = TrainingSpec(model=models["llama"], batch_size=2, seq_len=64, lora_rank=8, qlora=True)
    r0, r1 = estimate(base), estimate(base.replace(kbit_prep=True))
    lora = 2 * 2 * (8 * 256 + 256 * 8) * 4
    # the 4-bit weights count as parameters too (the same packed bytes with and without the preparation)
    packed = r0.by_category["parameters"] - (2 * 128 * 256 * 2 + 5 * 512 + lora)
    assert packed > 0
    assert r1.by_category["parameters"] == 2 * 128 * 256 * 4 + 5 * 1024 + lora + packed
    assert any("prepare_model_for_kbit_training" in a for a in r1.data["applied"])


def test_kbit_prep_enables_checkpointing_and_input_grads(models):
    p = prepare(TrainingSpec(model=models["llama"], seq_len=32, lora_rank=8, qlora=True, kbit_prep=True), fake=True)
    base = p.model.get_base_model()
    assert base.model.layers[0].gradient_checkpointing
    assert base.get_input_embeddings().weight.dtype.is_floating_point and str(base.lm_head.weight.dtype) == "torch.float32"
    assert getattr(base, "_require_grads_hook", None) is not None


def test_kbit_prep_needs_qlora():
    with pytest.raises(SpecError, match="--qlora") as e:
        TrainingSpec(model="gpt2", lora_rank=8, kbit_prep=True)
    assert _one_line(e)
    s = TrainingSpec(model="gpt2", lora_rank=8, qlora=True, kbit_prep=True)
    assert TrainingSpec.from_dict(s.to_dict()) == s and "kbit-prep" in s.describe()
    assert "kbit_prep" not in TrainingSpec(model="gpt2").to_dict()


def test_cli_flags_reach_the_spec():
    import argparse

    from memlens.cli.common import add_spec_args, spec_from_args

    ap = argparse.ArgumentParser()
    add_spec_args(ap)
    s = spec_from_args(ap.parse_args(["--model", "gpt2", "--lora-rank", "8", "--lora-dropout", "0.05", "--qlora",
                                      "--kbit-prep", "--pad-fraction", "0.1"]))
    assert (s.lora_dropout, s.kbit_prep, s.pad_fraction) == (0.05, True, 0.1)


@pytest.mark.parametrize("fields, words", [
    ({"lora_rank": 8, "lora_dropout": 0.05}, "--lora-dropout"),
    ({"pad_fraction": 0.25}, "--pad-fraction"),
    ({"loss": "criterion-fp32"}, "--loss criterion-fp32"),
    ({"keep_outputs": True}, "--keep-outputs"),
])
def test_the_closed_form_refuses_what_it_has_no_terms_for(fields, words):
    from memlens.core.errors import MemlensError
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    with pytest.raises(MemlensError) as e:
        estimate(TrainingSpec(model="gpt2", **fields), method="formula")
    assert words in e.value.message and "\n" not in e.value.render() and "simulation" in e.value.hint


def test_the_kv_cache_of_a_training_forward_is_simulated():
    """transformers' DynamicCache cat's each layer's K and V into new (B, H, T, d) tensors, which the attention
    kernel then keeps for backward. GPT-2's query stays a view of its fused (B, T, 3H) c_attn output either way,
    so with the cache the two copies are extra: 2 x B*T*H fp32 per layer. (GPT-NeoX's query is a new rotary
    tensor, so there --no-cache keeps the whole projection alive through V's view instead: measured on an H100,
    bench/results/newuser_accuracy.md.)"""
    base = TrainingSpec(model="gpt2", batch_size=8, seq_len=512)
    with_cache, without = estimate(base.replace(use_cache=True)), estimate(base.replace(use_cache=False))
    assert "config.use_cache = False" in without.data["applied"]
    layers, B, T, H = 12, 8, 512, 768
    assert with_cache.by_category["activations"] - without.by_category["activations"] == layers * 2 * B * T * H * 4
