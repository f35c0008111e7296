"""--config with an axolotl YAML or a TRL recipe: the exact spec fields, and each refusal's one line."""
from pathlib import Path

import pytest
import yaml

from memlens.cli.main import main
from memlens.core.errors import SpecError
from memlens.integrations import axolotl
from memlens.integrations.configs import read_config

FIX = Path(__file__).parents[1] / "fixtures"


def test_axolotl_lora_example():
    fields, notes, kind = read_config(FIX / "axolotl/lora-1b.yml")
    assert kind == "axolotl"
    assert fields == {"model": "llama-3.2-1b", "hf_trainer": True, "lora_rank": 16, "lora_alpha": 32.0, "lora_dropout": 0.05,
                      "lora_targets": ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"),
                      "batch_size": 2, "grad_accum": 2, "seq_len": 2048, "grad_checkpointing": True, "optimizer": "adamw-8bit",
                      "precision": "bf16-amp", "attn": "sdpa"}
    assert notes[0] == "axolotl base_model NousResearch/Llama-3.2-1B read as memlens' built-in llama-3.2-1b (the same config)"
    assert any(n.startswith("axolotl sample_packing: multipack rows of up to 2048 tokens, 2 per micro-batch") for n in notes)


def test_axolotl_qlora_all_linear_and_length_padded_to_64():
    fields, notes, _ = read_config(FIX / "axolotl/qlora-1b.yml")
    assert fields == {"model": "llama-3.2-1b", "hf_trainer": True, "lora_rank": 32, "qlora": True, "lora_alpha": 16.0,
                      "lora_targets": ("all-linear",), "batch_size": 2, "grad_accum": 4, "seq_len": 1024,
                      "grad_checkpointing": True, "optimizer": "adamw-8bit", "precision": "bf16-amp", "attn": "sdpa"}
    assert "axolotl sequence_len 1000: batches are padded to a multiple of 64, 1024 tokens at most" in notes


def test_axolotl_full_finetune_liger_fsdp2():
    fields, notes, _ = read_config(FIX / "axolotl/fft-8b-liger.yaml")
    assert fields == {"model": "llama-3.1-8b", "hf_trainer": True, "batch_size": 1, "grad_accum": 8, "seq_len": 8192,
                      "grad_checkpointing": True, "optimizer": "paged-adamw-8bit", "precision": "bf16-amp", "attn": "sdpa",
                      "max_grad_norm": 0.5, "liger": True, "sharding": "fsdp", "reshard_after_forward": True}
    assert any("give --world-size N" in n for n in notes)


def test_axolotl_grpo_with_vllm_colocate():
    fields, _, _ = read_config(FIX / "axolotl/grpo.yaml")
    assert fields == {"model": "qwen2.5-0.5b", "lora_rank": 8, "lora_targets": ("all-linear",), "batch_size": 4, "grad_accum": 1,
                      "seq_len": 512, "optimizer": "adamw-fused", "precision": "bf16-amp", "trainer": "grpo",
                      "num_generations": 4, "max_completion_length": 256, "beta": 0.04, "vllm_gpu_memory_utilization": 0.4}


def test_axolotl_precision_and_defaults():
    base = {"base_model": "gpt2", "micro_batch_size": 3, "batch_size": 12}
    f, _ = axolotl.spec_fields(base)
    assert f == {"model": "gpt2", "hf_trainer": True, "batch_size": 3, "grad_accum": 4, "optimizer": "adamw-fused", "precision": "fp32"}
    assert axolotl.spec_fields({**base, "bf16": "full"})[0]["precision"] == "bf16"
    assert axolotl.spec_fields({**base, "rl": "dpo"})[0]["trainer"] == "dpo"
    assert axolotl.spec_fields({**base, "eager_attention": True})[0]["attn"] == "eager"
    assert axolotl.model_of("some-org/Llama-3.2-1B") == "some-org/Llama-3.2-1B"     # not a known mirror: the id as given


def test_trl_recipe_takes_trl_defaults(tmp_path):
    """What a GRPO recipe does not write is GRPOConfig's default, as --trainer-args reads it."""
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model_name_or_path": "gpt2", "num_generations": 4, "per_device_train_batch_size": 8}))
    fields, _, _ = read_config(f)
    assert {k: fields[k] for k in ("trainer", "num_generations", "max_completion_length", "beta", "grad_checkpointing",
                                   "precision", "optimizer", "batch_size", "grad_accum")} == {
        "trainer": "grpo", "num_generations": 4, "max_completion_length": 512, "beta": 0.0, "grad_checkpointing": True,
        "precision": "amp-bf16", "optimizer": "adamw-fused", "batch_size": 8, "grad_accum": 1}


@pytest.mark.parametrize("extra,message", [
    ({"load_in_8bit": True}, "axolotl key load_in_8bit: 8-bit (LLM.int8) base weights are not modelled (QLoRA's 4-bit NF4 is: adapter qlora)"),
    ({"deepspeed": "deepspeed_configs/zero3_bf16.json"},
     "axolotl key deepspeed: DeepSpeed ZeRO is not modelled: memlens simulates PyTorch's own ZeRO (--sharding zero1/zero2/zero3)"),
    ({"fsdp": ["full_shard", "auto_wrap"]}, "axolotl key fsdp: FSDP1 (fsdp: [...] without fsdp_version: 2) is not modelled: FSDP2 is (fsdp_version: 2)"),
    ({"fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True}},
     "axolotl key fsdp_config.offload_params: FSDP's parameter offload is not modelled"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
     "axolotl key gradient_checkpointing_kwargs: use_reentrant true is not modelled"),
    ({"gradient_checkpointing": "offload"}, "axolotl key gradient_checkpointing: 'offload' (offloaded checkpoints) is not modelled"),
    ({"optimizer": "lion_8bit"}, "axolotl key optimizer: 'lion_8bit' is not one memlens models"),
    ({"adapter": "lora"}, "axolotl key adapter: lora without lora_r"),
    ({"adapter": "ia3", "lora_r": 8}, "axolotl key adapter: 'ia3' is not modelled (lora and qlora are)"),
    ({"load_in_4bit": True}, "axolotl key load_in_4bit without adapter qlora: 4-bit weights are trained only through QLoRA"),
    ({"rl": "kto"}, "axolotl key rl: 'kto' is not modelled (dpo and grpo are)"),
    ({"fp16": True}, "axolotl key fp16: fp16 under the Trainer's GradScaler over fp16 weights is not modelled"),
    ({"attn_implementation": "flex_attention"}, "axolotl key attn_implementation: 'flex_attention' is not modelled"),
    ({"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]},
     "axolotl key plugins: axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin is not modelled (the liger plugin is)"),
    ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rms_norm": True, "liger_glu_activation": True},
     "axolotl key liger_fused_linear_cross_entropy is off while other liger kernels are on: memlens models liger's kernels together"),
    ({"liger_rms_norm": True}, "axolotl key liger_rms_norm without the liger plugin does nothing in axolotl"),
    ({"context_parallel_size": 2}, "axolotl key context_parallel_size: context_parallel_size is not mapped (memlens models "
     "torch's ring attention: estimate with --world-size N --sharding fsdp --cp C)"),
    ({"tensor_parallel_size": 2}, "axolotl key tensor_parallel_size: tensor_parallel_size is not mapped (memlens models "
     "torchtitan's Llama TP plan: estimate with --world-size N --sharding fsdp --tp T)"),
    ({"dp_shard_size": 8}, "axolotl key dp_shard_size: dp_shard_size is not mapped (HSDP is modelled: estimate with "
     "--sharding hsdp --shard-size N)"),
    ({"some_new_key": 4}, "axolotl key some_new_key is not one memlens reads, and it may change memory"),
    ({"rl": "grpo", "trl": {"use_vllm": True, "vllm_mode": "server"}},
     "axolotl key trl.use_vllm with a vLLM server: its memory is on another GPU, not modelled here"),
])
def test_axolotl_refusals_are_one_line_naming_the_key(extra, message):
    with pytest.raises(SpecError) as e:
        axolotl.spec_fields({"base_model": "gpt2", "micro_batch_size": 1, **extra})
    assert e.value.message == message


def test_axolotl_ignores_keys_that_do_not_touch_a_step_and_empty_unknown_keys():
    f, _ = axolotl.spec_fields({"base_model": "gpt2", "learning_rate": 1e-4, "wandb_project": "x", "datasets": [{"path": "a"}],
                                "output_dir": "o", "num_epochs": 3, "some_new_key": None, "load_in_8bit": False})
    assert f == {"model": "gpt2", "hf_trainer": True, "optimizer": "adamw-fused", "precision": "fp32"}


def test_trl_sft_recipe():
    fields, notes, kind = read_config(FIX / "trl/sft_lora.yaml")
    assert kind == "trl"
    assert fields == {"model": "qwen2.5-0.5b", "attn": "sdpa", "lora_rank": 32, "lora_alpha": 16.0, "lora_dropout": 0.05,
                      "lora_targets": ("all-linear",), "batch_size": 4, "grad_accum": 4, "precision": "bf16-amp",
                      "grad_checkpointing": True, "optimizer": "adamw-fused", "max_grad_norm": 1.0, "compile": False,
                      "trainer": "sft", "seq_len": 2048, "packing": "bfd", "hf_trainer": True}
    assert notes[-1] == "TRL recipe read as a SFT recipe (bf16 weights as ModelConfig.dtype loads them)"


def test_trl_grpo_recipe():
    fields, _, _ = read_config(FIX / "trl/grpo.yaml")
    assert fields["trainer"] == "grpo" and fields["num_generations"] == 8 and fields["max_completion_length"] == 256
    assert fields["vllm_gpu_memory_utilization"] == 0.3 and fields["batch_size"] == 8 and fields["beta"] == 0.0


@pytest.mark.parametrize("extra,message", [
    ({"use_peft": True, "use_dora": True}, "TRL recipe key use_dora: DoRA adapters are not modelled"),
    ({"load_in_4bit": True}, "TRL recipe key load_in_4bit without use_peft: 4-bit weights are trained only through adapters"),
    ({"load_in_8bit": True}, "TRL recipe key load_in_8bit: 8-bit (LLM.int8) base weights are not modelled (4-bit NF4 QLoRA is: load_in_4bit)"),
    ({"attn_implementation": "flex_attention"}, "TRL recipe key attn_implementation: 'flex_attention' is not modelled"),
    ({"dtype": "float8"}, "TRL recipe key dtype: 'float8' is not float32, bfloat16, float16 or auto"),
    # the trainer config part goes through --trainer-args' reader (integrations/trl_args.py): its refusals
    ({"activation_offloading": True}, "activation_offloading=True: TRL's activation offloading moves saved tensors to "
                                      "the CPU with its own hooks, which memlens does not model"),
    ({"beta": 0.1, "use_weighting": True}, "use_weighting=True: WPO weights need a fifth per-token output of the fused "
                                           "head, which memlens does not model"),
    ({"num_generations": 4, "num_iterations": 2}, "num_iterations=2: several iterations over one generation, which "
                                                  "memlens does not model"),
])
def test_trl_recipe_refusals(tmp_path, extra, message):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model_name_or_path": "gpt2", **extra}))
    with pytest.raises(SpecError) as e:
        read_config(f)
    assert e.value.message == message


def test_memlens_spec_and_nameless_configs(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("model: gpt2\nbatch_size: 4\n")
    fields, notes, kind = read_config(f)
    assert (kind, fields["batch_size"], notes) == ("memlens", 4, [])
    f.write_text("batch_size: 4\n")
    with pytest.raises(SpecError, match="names no model"):
        read_config(f)


def test_cli_axolotl_config_refusal(tmp_path, capsys):
    cfg = tmp_path / "ax.yml"
    cfg.write_text("base_model: gpt2\nmicro_batch_size: 2\ndeepspeed: deepspeed_configs/zero2.json\n")
    assert main(["estimate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("ERROR: axolotl key deepspeed: DeepSpeed ZeRO is not modelled: memlens simulates PyTorch's own ZeRO "
                   "(--sharding zero1/zero2/zero3)  HINT: remove deepspeed to estimate without it")


def test_cli_axolotl_config_estimates_with_its_notes_and_flags_win(tmp_path, capsys):
    import json

    cfg = tmp_path / "ax.yml"
    cfg.write_text(f"base_model: {FIX / 'tiny-llama'}\nmicro_batch_size: 2\nsequence_len: 100\nlearning_rate: 1e-4\n")
    assert main(["estimate", "--config", str(cfg), "--batch-size", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["batch_size"] == 1 and out["spec"]["seq_len"] == 128 and out["spec"]["hf_trainer"] is True
    assert "axolotl sequence_len 100: batches are padded to a multiple of 64, 128 tokens at most" in out["notes"]
