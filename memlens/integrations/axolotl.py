"""An axolotl YAML -> TrainingSpec fields, as axolotl would train (its schema: src/axolotl/utils/schemas/).

axolotl trains with its AxolotlTrainer (a transformers Trainer: ``hf_trainer``), or TRL's DPO/GRPO trainers with
``rl``. What memlens reads:

====================================  ==========================================================================
axolotl                               TrainingSpec
====================================  ==========================================================================
base_model                            model (a built-in name when the id, or a NousResearch/unsloth mirror of it, is one)
adapter lora / qlora (+load_in_4bit)  lora_rank = lora_r, qlora
lora_alpha, lora_dropout              lora_alpha, lora_dropout
lora_target_modules                   lora_targets; lora_target_linear: true -> "all-linear" (peft's shorthand)
micro_batch_size                      batch_size
gradient_accumulation_steps           grad_accum (or batch_size // micro_batch_size, as axolotl normalizes it)
sequence_len                          seq_len, rounded up to a multiple of 64 (the collator's pad_to_multiple_of:
                                      64 x ceil(sequence_len / 64) with pad_to_sequence_len, 64 without: the worst batch)
sample_packing                        nothing more: multipack rows are micro_batch_size x sequence_len (below)
gradient_checkpointing (+kwargs)      grad_checkpointing (non-reentrant, axolotl's default); reentrant refused
optimizer                             optimizer (Trainer names: memlens.core.optimizers.HF_OPTIM_ALIASES)
bf16 true/auto, bf16 full, fp16       precision bf16-amp (weights loaded in bf16, Trainer autocast), bf16; fp16 refused
attn_implementation / flash_attention sdpa (flash_attention_2: SDPA's flash kernel is the same FA2 algorithm), eager
max_grad_norm, torch_compile          max_grad_norm, compile
rl dpo / grpo (+ trl: section)        trainer dpo / grpo, beta, num_generations, max_completion_length, vLLM colocate
liger plugin (rms_norm, glu,          liger (liger-kernel's patched model)
fused_linear_cross_entropy)
fsdp_version 2 / fsdp_config          sharding fsdp (reshard_after_forward; activation_checkpointing); --world-size N
====================================  ==========================================================================

Sample packing is not TRL's bfd. axolotl's ``MultipackBatchSampler`` groups samples into ``micro_batch_size`` bins of at
most ``sequence_len`` tokens each; ``V2BatchSamplerDataCollatorForSeq2Seq`` concatenates each bin into ONE row (attention
mask numbering the samples 1, 2, ...; position ids restarting per sample) and pads the rows to ``sequence_len``
(``pad_to_sequence_len``, which axolotl turns on with packing). The model thus sees ``micro_batch_size`` rows of
``sequence_len`` tokens, not TRL's single padding-free row of all of them: memlens simulates that plain
(micro_batch_size, sequence_len) step; the flash-attention varlen path axolotl patches in is simulated as SDPA's flash
kernel over full rows (same memory order: no L x L matrix).

Keys that change memory in ways memlens does not model are refused in one line naming the key; keys that do not touch
one step's memory (datasets, learning rate, logging, saving, wandb...) are ignored; a key memlens does not know, set to a
value, is refused too (it might change memory), so nothing is silently dropped.
"""
from __future__ import annotations

import math
from typing import Any

from ..core.errors import SpecError
from ..core.optimizers import HF_OPTIM_ALIASES
from ..models import registry

# keys that do not change the memory of one training step (data, schedule, logging, saving, hub, tokenizer set-up)
IGNORED = frozenset("""
datasets test_datasets val_set_size dataset_prepared_path push_dataset_to_hub dataset_processes dataset_num_proc
dataset_exact_deduplication shuffle_merged_datasets shuffle_before_merging_datasets pretraining_dataset streaming
output_dir learning_rate lr_scheduler lr_scheduler_kwargs warmup_ratio warmup_steps cosine_min_lr_ratio
cosine_constant_lr_ratio lr_quadratic_warmup eta_min weight_decay adam_beta1 adam_beta2 adam_epsilon adam_eps adam_beta3
optim_args num_epochs max_steps logging_steps saves_per_epoch save_steps save_strategy save_total_limit save_only_model
save_safetensors save_first_step evals_per_epoch eval_steps eval_strategy evaluation_strategy eval_sample_packing
eval_batch_size eval_table_size eval_max_new_tokens eval_causal_lm_metrics do_causal_lm_eval do_bench_eval
early_stopping_patience seed strict debug resume_from_checkpoint auto_resume_from_checkpoints hub_model_id hub_strategy
wandb_project wandb_entity wandb_watch wandb_name wandb_log_model wandb_run_id wandb_mode use_wandb use_tensorboard
use_mlflow mlflow_tracking_uri mlflow_experiment_name use_comet use_swanlab swanlab_project swanlab_mode
swanlab_log_completions swanlab_experiment_name swanlab_description swanlab_workspace swanlab_log_model
swanlab_completion_max_buffer swanlab_completion_log_interval trackio_space_id trackio_run_name trackio_project_name
use_otel_metrics otel_metrics_port otel_metrics_host loss_watchdog_threshold loss_watchdog_patience
special_tokens chat_template chat_template_jinja eot_tokens default_system_message tokenizer_type tokenizer_config
tokenizer_use_fast tokenizer_legacy tokenizer_use_mistral_common tokenizer_padding_side processor_type model_type
trust_remote_code revision_of_model base_model_config base_model_ignore_patterns hf_use_auth_token lora_model_dir
train_on_inputs group_by_length remove_unused_columns skip_prepare_dataset tf32 ddp ddp_timeout ddp_bucket_cap_mb
ddp_find_unused_parameters ddp_broadcast_buffers local_rank world_size device device_map low_cpu_mem_usage
torchdistx_path gpu gpu_count node_count project_name branch secrets volumes provider timeout timeout_preprocess
memory memory_preprocess dockerfile_commands dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor
dataloader_drop_last sequence_len_overflow excess_length_strategy min_sample_len sample_packing_eff_est
sample_packing_group_size sample_packing_bin_size sample_packing_sequentially multipack_real_batches
pretrain_multipack_attn curriculum_sampling total_num_tokens peft_use_rslora lora_fan_in_fan_out rl_beta orpo_alpha
dpo_beta trl plugins liger_rope pad_to_sequence_len sample_packing eval_sample_packing torch_compile_backend
flash_attn_compile_kwargs use_ray ray_num_workers ray_run_name is_preprocess fix_untrained_tokens
""".split())

# keys whose memory effect memlens does not model: refused when set (to a value other than off)
REFUSED = {
    "load_in_8bit": "8-bit (LLM.int8) base weights are not modelled (QLoRA's 4-bit NF4 is: adapter qlora)",
    "gptq": "GPTQ-quantized weights are not modelled", "gptq_groupsize": "GPTQ-quantized weights are not modelled",
    "gptq_model_v1": "GPTQ-quantized weights are not modelled",
    "activation_offloading": "axolotl's activation offloading (TRL's offloader on CUDA streams) is not modelled",
    "layer_offloading": "layer offloading is not modelled",
    "lora_modules_to_save": "fully trained copies of modules next to LoRA (modules_to_save) are not modelled",
    "peft_use_dora": "DoRA adapters are not modelled", "lora_mlp_kernel": "axolotl's fused LoRA kernels are not modelled",
    "lora_qkv_kernel": "axolotl's fused LoRA kernels are not modelled", "lora_o_kernel": "axolotl's fused LoRA kernels are not modelled",
    "lora_target_parameters": "LoRA on raw parameters (target_parameters) is not modelled",
    "unfrozen_parameters": "unfrozen_parameters (train only matching parameters) is not read: use --freeze PATTERN",
    "context_parallel_size": "context_parallel_size is not mapped (memlens models torch's ring attention: estimate with "
                             "--world-size N --sharding fsdp --cp C)",
    "tensor_parallel_size": "tensor_parallel_size is not mapped (memlens models torchtitan's Llama TP plan: estimate with --world-size N --sharding fsdp --tp T)",
    "expert_parallel_size": "expert parallelism is not modelled", "sequence_parallel_degree": "sequence parallelism is not modelled",
    "dp_shard_size": "dp_shard_size is not mapped (HSDP is modelled: estimate with --sharding hsdp --shard-size N)",
    "dp_replicate_size": "dp_replicate_size is not mapped (HSDP is modelled: estimate with --sharding hsdp --shard-size N)",
    "tiled_mlp": "tiled MLP is not modelled", "relora": "ReLoRA is not modelled", "lisa_n_layers": "LISA is not modelled",
    "qat": "quantization-aware training is not modelled", "fp8": "FP8 training is not modelled",
    "use_kernels": "hub kernels (use_kernels) are not modelled", "quantize_moe_experts": "quantized MoE experts are not modelled",
    "use_scattermoe": "ScatterMoE kernels are not modelled", "use_sonicmoe": "SonicMoE kernels are not modelled",
    "experts_implementation": "a custom MoE experts implementation is not modelled",
    "cut_cross_entropy": "Cut Cross Entropy's fused loss is not modelled (liger's fused linear cross entropy is: the liger plugin)",
    "flash_attn_cross_entropy": "flash-attn's cross entropy is not modelled", "flash_attn_rms_norm": "flash-attn's RMSNorm is not modelled",
    "flash_attn_fuse_mlp": "flash-attn's fused MLP is not modelled", "flash_attn_fuse_qkv": "flash-attn's fused QKV is not modelled",
    "flash_optimum": "BetterTransformer attention is not modelled", "xformers_attention": "xformers attention is not modelled",
    "sage_attention": "SageAttention is not modelled", "flex_attention": "flex attention is not modelled",
    "s2_attention": "shifted-sparse attention is not modelled", "reward_model": "reward-model training is not modelled",
    "process_reward_model": "process reward models are not modelled", "max_packed_sequence_len": "max_packed_sequence_len packing is not modelled",
    "model_config": "config overrides (model_config) are not read", "overrides_of_model_config": "config overrides are not read",
    "resize_token_embeddings_to_32x": "resized token embeddings are not modelled", "tokens": "added tokens (an embedding resize) are not modelled",
    "float16": "fp16 weights are not modelled for a Trainer step", "fp16": "fp16 under the Trainer's GradScaler over fp16 weights is not modelled",
    "liger_cross_entropy": "liger's (unfused) cross entropy alone is not modelled (liger_fused_linear_cross_entropy is)",
    "liger_rms_norm_gated": "liger's gated RMSNorm is not modelled", "use_eaft": "the EAFT loss is not modelled",
    "deepspeed": "DeepSpeed ZeRO is not modelled: memlens simulates PyTorch's own ZeRO (--sharding zero1/zero2/zero3)",
    "fsdp": "FSDP1 (fsdp: [...] without fsdp_version: 2) is not modelled: FSDP2 is (fsdp_version: 2)",
    "gemma4_hybrid_attn_impl": "a hybrid attention implementation is not modelled", "fused_attn_kernel": "fused attention kernels are not modelled",
    "llama4_linearized_experts": "linearized experts are not modelled", "reinit_weights": "reinitialized weights are not read",
    "ebft": "EBFT is not modelled", "diffusion": "axolotl's diffusion LM training is not modelled", "vllm": "a vLLM server section is read only with rl grpo",
    "batch_flattening": "batch flattening (padding-free batches) is not modelled for axolotl's trainer",
    "embeddings_skip_upcast": "embedding upcasting choices are not modelled",
}

LIGER_PLUGINS = ("axolotl.integrations.liger.LigerPlugin", "axolotl.integrations.liger.plugin.LigerPlugin")
LIGER_REQUIRED = ("liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")
MIRRORS = ("nousresearch", "unsloth")        # orgs that republish the reference models' configs unchanged
ATTN = {"flash_attention_2": "sdpa", "sdpa": "sdpa", "eager": "eager"}
RL = ("dpo", "grpo")


def looks_like_axolotl(d: dict) -> bool:
    """An axolotl config: it names ``base_model`` (memlens specs say ``model``, TRL recipes ``model_name_or_path``)."""
    return isinstance(d, dict) and "base_model" in d and "model" not in d


def _on(v: Any) -> bool:
    return v not in (None, False, "", [], {}, 0) and str(v).lower() not in ("false", "no", "off", "none", "0")


def model_of(base_model: str) -> str:
    """The built-in name for a Hugging Face id (or a mirror of one), else the id as given.

    >>> model_of("meta-llama/Llama-3.2-1B"), model_of("NousResearch/Llama-3.2-1B"), model_of("NousResearch/Meta-Llama-3.1-8B")
    ('llama-3.2-1b', 'llama-3.2-1b', 'llama-3.1-8b')
    """
    doc = registry.get(base_model)
    if doc is not None:
        return doc["name"]
    org, _, name = str(base_model).partition("/")
    if org.lower() in MIRRORS and name:
        for cand in (name, name[5:] if name.lower().startswith("meta-") else None):
            doc = registry.get(cand) if cand else None
            if doc is not None:
                return doc["name"]
    return base_model


def _check_keys(d: dict) -> None:
    for key, value in d.items():
        if key in REFUSED and _on(value):
            if (key == "fsdp" and str(d.get("fsdp_version")) == "2") or (key == "vllm" and str(d.get("rl")).lower() == "grpo"):
                continue
            raise SpecError(f"axolotl key {key}: {REFUSED[key]}", hint=f"remove {key} to estimate without it")
        if key.startswith("liger_") or key in REFUSED or key in IGNORED or key in HANDLED:
            continue
        if _on(value):
            raise SpecError(f"axolotl key {key} is not one memlens reads, and it may change memory",
                            hint=f"remove {key} to estimate without it (docs/configs.md lists what is read)")


HANDLED = frozenset("""base_model adapter load_in_4bit lora_r lora_alpha lora_dropout lora_target_modules lora_target_linear
micro_batch_size gradient_accumulation_steps batch_size sequence_len pad_to_multiple_of gradient_checkpointing
gradient_checkpointing_kwargs optimizer bf16 bfloat16 attn_implementation flash_attention sdp_attention eager_attention
max_grad_norm torch_compile torch_compile_mode rl fsdp_version fsdp_config torch_dtype""".split())


def spec_fields(d: dict) -> tuple[dict[str, Any], list[str]]:
    """(TrainingSpec fields, notes) of an axolotl config mapping."""
    _check_keys(d)
    out: dict[str, Any] = {"model": model_of(str(d["base_model"])), "hf_trainer": True}
    notes: list[str] = []
    if out["model"] != d["base_model"]:
        notes.append(f"axolotl base_model {d['base_model']} read as memlens' built-in {out['model']} (the same config)")
    out.update(_adapter(d))
    if out.get("qlora"):
        notes.append("axolotl qlora: peft's prepare_model_for_kbit_training runs, then axolotl casts norms and embeddings "
                     "back to the training dtype (loaders/model.py): simulated as QLoRA with bf16 non-quantized weights, "
                     "without --kbit-prep's fp32 copies")
    mb = d.get("micro_batch_size")
    if mb is not None:
        out["batch_size"] = int(mb)
    accum = d.get("gradient_accumulation_steps") or (int(d["batch_size"]) // int(mb or 1) if d.get("batch_size") else None)
    if accum:
        out["grad_accum"] = int(accum)
    out.update(_length(d, notes))
    out.update(_checkpointing(d))
    optim = str(d.get("optimizer") or "adamw_torch_fused")
    if optim.lower() not in HF_OPTIM_ALIASES:
        raise SpecError(f"axolotl key optimizer: {optim!r} is not one memlens models", hint=f"use one of {', '.join(HF_OPTIM_ALIASES)}")
    out["optimizer"] = HF_OPTIM_ALIASES[optim.lower()]
    out["precision"] = _precision(d, notes)
    out.update(_attention(d, notes))
    if d.get("max_grad_norm") is not None:
        out["max_grad_norm"] = float(d["max_grad_norm"]) or None
    if _on(d.get("torch_compile")):
        out["compile"] = True
    out.update(_rl(d))
    out.update(_liger(d, notes))
    out.update(_fsdp(d))
    if "sharding" in out:
        notes.append("axolotl fsdp_version 2: --sharding fsdp (FSDP2 fully_shard per block); the GPU count comes from the "
                     "launcher, not the config: give --world-size N")
    if "trainer" in out:
        out.pop("hf_trainer")
    return out, notes


def _adapter(d: dict) -> dict:
    adapter = d.get("adapter")
    if not adapter:
        if _on(d.get("load_in_4bit")):
            raise SpecError("axolotl key load_in_4bit without adapter qlora: 4-bit weights are trained only through QLoRA",
                            hint="add adapter: qlora (with lora_r)")
        return {}
    if adapter not in ("lora", "qlora"):
        raise SpecError(f"axolotl key adapter: {adapter!r} is not modelled (lora and qlora are)", hint="use adapter: lora or qlora")
    if d.get("lora_r") is None:
        raise SpecError(f"axolotl key adapter: {adapter} without lora_r", hint="add lora_r: 16")
    out: dict[str, Any] = {"lora_rank": int(d["lora_r"])}
    if adapter == "qlora" or _on(d.get("load_in_4bit")):
        out["qlora"] = True
    if d.get("lora_alpha") is not None:
        out["lora_alpha"] = float(d["lora_alpha"])
    if d.get("lora_dropout"):
        out["lora_dropout"] = float(d["lora_dropout"])
    if _on(d.get("lora_target_linear")):
        out["lora_targets"] = ("all-linear",)        # peft's shorthand: every Linear but the output head
    elif d.get("lora_target_modules"):
        t = d["lora_target_modules"]
        out["lora_targets"] = tuple([t] if isinstance(t, str) else t)
    return out


def _length(d: dict, notes: list[str]) -> dict:
    if d.get("sequence_len") is None:
        return {}
    n = int(d["sequence_len"])
    multiple = int(d.get("pad_to_multiple_of") or 64)
    padded = multiple * math.ceil(n / multiple)      # axolotl's collator: pad_to_multiple_of (core/builders/causal.py)
    if padded != n:
        notes.append(f"axolotl sequence_len {n}: batches are padded to a multiple of {multiple}, {padded} tokens at most")
    if _on(d.get("sample_packing")):
        notes.append(f"axolotl sample_packing: multipack rows of up to {n} tokens, {d.get('micro_batch_size', 1)} per micro-batch, "
                     f"each padded to {padded} (not TRL's one padding-free row): simulated as that plain step")
    return {"seq_len": padded}


def _checkpointing(d: dict) -> dict:
    gc = d.get("gradient_checkpointing")
    if isinstance(gc, str) and gc.lower() not in ("true", "false"):
        raise SpecError(f"axolotl key gradient_checkpointing: {gc!r} (offloaded checkpoints) is not modelled",
                        hint="use gradient_checkpointing: true")
    kw = d.get("gradient_checkpointing_kwargs") or {}
    if _on(gc) and isinstance(kw, dict) and _on(kw.get("use_reentrant")):
        raise SpecError("axolotl key gradient_checkpointing_kwargs: use_reentrant true is not modelled",
                        hint="memlens models non-reentrant checkpointing, axolotl's default (use_reentrant: false)")
    return {"grad_checkpointing": True} if _on(gc) else {}


def _precision(d: dict, notes: list[str]) -> str:
    bf16 = d.get("bf16", d.get("bfloat16"))
    if str(bf16).lower() == "full":
        return "bf16"          # bf16 weights, no autocast (axolotl: bf16_full_eval, torch_dtype bf16)
    if str(bf16).lower() == "auto":
        notes.append("axolotl bf16: auto read as bf16 (a GPU with bf16: Ampere or newer)")
    if bf16 is True or str(bf16).lower() in ("auto", "true"):
        return "bf16-amp"      # loaded in bf16 (resolve_dtype), the Trainer's bf16 autocast over it ("auto": a bf16 GPU)
    return "fp32"


def _attention(d: dict, notes: list[str]) -> dict:
    impl = d.get("attn_implementation")
    if impl is None:
        impl = ("flash_attention_2" if _on(d.get("flash_attention")) else "eager" if _on(d.get("eager_attention"))
                else "sdpa" if _on(d.get("sdp_attention")) else None)
    if impl is None:
        return {}
    if impl not in ATTN:
        raise SpecError(f"axolotl key attn_implementation: {impl!r} is not modelled", hint="use sdpa, flash_attention_2 or eager")
    if impl == "flash_attention_2":
        notes.append("axolotl flash_attention_2: simulated as SDPA's flash kernel (the same FlashAttention-2 algorithm: "
                     "no L x L matrix, a logsumexp per row)")
    return {"attn": ATTN[impl]}


def _rl(d: dict) -> dict:
    rl = d.get("rl")
    if not rl:
        return {}
    if str(rl).lower() not in RL:
        raise SpecError(f"axolotl key rl: {rl!r} is not modelled (dpo and grpo are)", hint="use rl: dpo or rl: grpo")
    out: dict[str, Any] = {"trainer": str(rl).lower()}
    trl = d.get("trl") or {}
    if out["trainer"] == "grpo":
        for key in ("num_generations", "max_completion_length", "beta"):
            if trl.get(key) is not None:
                out[key] = trl[key]
        if _on(trl.get("use_vllm")):
            if trl.get("vllm_mode") != "colocate":
                raise SpecError("axolotl key trl.use_vllm with a vLLM server: its memory is on another GPU, not modelled here",
                                hint="use trl.vllm_mode: colocate, or drop use_vllm (HF generate)")
            out["vllm_gpu_memory_utilization"] = float((d.get("vllm") or {}).get("gpu_memory_utilization") or 0.9)
    return out


def _liger(d: dict, notes: list[str]) -> dict:
    plugins = d.get("plugins") or []
    other = [p for p in plugins if p not in LIGER_PLUGINS]
    if other:
        raise SpecError(f"axolotl key plugins: {other[0]} is not modelled (the liger plugin is)", hint=f"remove {other[0]} from plugins")
    on = [k for k in LIGER_REQUIRED if _on(d.get(k))]
    if not plugins:
        if on:
            raise SpecError(f"axolotl key {on[0]} without the liger plugin does nothing in axolotl", hint=f"add plugins: [{LIGER_PLUGINS[0]}]")
        return {}
    if len(on) != len(LIGER_REQUIRED):
        missing = next(k for k in LIGER_REQUIRED if k not in on)
        if not on:
            return {}
        raise SpecError(f"axolotl key {missing} is off while other liger kernels are on: memlens models liger's kernels together",
                        hint=f"set {missing}: true (or turn every liger_* key off)")
    if not _on(d.get("liger_rope")):
        notes.append("axolotl liger without liger_rope: simulated with liger's RoPE too (its memory is that of the eager RoPE)")
    return {"liger": True}


def _fsdp(d: dict) -> dict:
    if str(d.get("fsdp_version")) != "2":
        if d.get("fsdp_config"):
            raise SpecError("axolotl key fsdp_config without fsdp_version: 2: FSDP1 is not modelled", hint="set fsdp_version: 2 (FSDP2)")
        return {}
    cfg = {k[5:] if k.startswith("fsdp_") else k: v for k, v in (d.get("fsdp_config") or {}).items()}   # fsdp_x or x
    if _on(cfg.get("offload_params")) or _on(cfg.get("cpu_offload")):
        raise SpecError("axolotl key fsdp_config.offload_params: FSDP's parameter offload is not modelled", hint="remove offload_params")
    out: dict[str, Any] = {"sharding": "fsdp"}
    if cfg.get("reshard_after_forward") is not None:
        out["reshard_after_forward"] = cfg["reshard_after_forward"]
    if _on(cfg.get("activation_checkpointing")):
        out["grad_checkpointing"] = True
    return out


