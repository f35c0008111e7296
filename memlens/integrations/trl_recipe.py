"""A TRL recipe YAML (``trl sft --config recipe.yaml``) -> TrainingSpec fields.

A recipe is one flat mapping that TRL's ``TrlParser`` splits into ``ScriptArguments`` / ``DatasetMixtureConfig``
(datasets: ignored here), ``ModelConfig`` (trl/trainer/model_config.py: read here) and the trainer's config
(``SFTConfig``, ``DPOConfig`` or ``GRPOConfig``: TrainingArguments plus the trainer's own fields).

ModelConfig               TrainingSpec
========================  =====================================================================================
model_name_or_path        model (a built-in name when the id, or a NousResearch/unsloth mirror of it, is one)
dtype                     the weights' precision the trainer config's bf16/fp16 go over (ModelConfig's default
                          float32; "auto": the config's dtype)
attn_implementation       attn (flash_attention_2: SDPA's flash kernel, the same algorithm; sdpa; eager)
use_peft + lora_r ...     lora_rank, lora_alpha (default 32), lora_dropout (default 0.05), lora_target_modules
load_in_4bit              qlora (with use_peft)
========================  =====================================================================================

The trainer config part (everything but ModelConfig and ScriptArguments) is read as ``--trainer-args`` reads a
TRL config (trainer_args.spec_fields, integrations/trl_args.py): TRL 1.16's defaults and its refusals.

Which trainer: ``trl sft``/``trl dpo``/``trl grpo`` name it on the command line, not in the file; memlens reads it from
the fields only one of them has (GRPO: num_generations, max_completion_length, use_vllm, ...; DPO: beta,
precompute_ref_log_probs, ...; else SFT), or from ``trainer`` given by the caller.
"""
from __future__ import annotations

from typing import Any

from ..core.errors import SpecError
from . import trainer_args
from .axolotl import model_of

MODEL_CONFIG = ("model_name_or_path", "model_revision", "dtype", "torch_dtype", "attn_implementation", "use_peft", "lora_r",
                "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save",
                "lora_task_type", "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type",
                "use_bnb_nested_quant", "bnb_4bit_quant_storage", "trust_remote_code")
SCRIPT_ARGS = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
               "ignore_bias_buffers", "datasets", "streaming", "test_split_size", "gradient_checkpointing_use_reentrant")
REFUSED = {
    "load_in_8bit": "8-bit (LLM.int8) base weights are not modelled (4-bit NF4 QLoRA is: load_in_4bit)",
    "use_dora": "DoRA adapters are not modelled", "lora_modules_to_save": "fully trained module copies (modules_to_save) are not modelled",
    "lora_target_parameters": "LoRA on raw parameters (target_parameters) is not modelled",
    "use_bnb_nested_quant": "nested (double) 4-bit quantization is not modelled", "bnb_4bit_quant_storage": "a 4-bit storage dtype is not modelled",
}
GRPO_ONLY = ("num_generations", "max_completion_length", "use_vllm", "vllm_mode", "reward_weights", "steps_per_generation",
             "generation_batch_size", "vllm_gpu_memory_utilization", "num_iterations", "epsilon", "temperature")
DPO_ONLY = ("precompute_ref_log_probs", "f_divergence_type", "use_weighting", "rpo_alpha", "ld_alpha", "discopop_tau",
            "label_smoothing", "precompute_ref_batch_size")
ATTN = {"flash_attention_2": "sdpa", "sdpa": "sdpa", "eager": "eager", None: None}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def looks_like_trl_recipe(d: dict) -> bool:
    return isinstance(d, dict) and "model_name_or_path" in d and "model" not in d


def trainer_of(d: dict) -> str:
    """sft, dpo or grpo, from the fields only that trainer's config has.

    >>> trainer_of({"num_generations": 4}), trainer_of({"beta": 0.1}), trainer_of({"packing": True})
    ('grpo', 'dpo', 'sft')
    """
    if any(k in d for k in GRPO_ONLY):
        return "grpo"
    if any(k in d for k in DPO_ONLY) or "beta" in d:
        return "dpo"
    return "sft"


def model_fields(d: dict, notes: list[str]) -> tuple[dict[str, Any], str]:
    """The ModelConfig part: (spec fields, the weights' precision)."""
    for key, why in REFUSED.items():
        if d.get(key) not in (None, False, [], ""):
            raise SpecError(f"TRL recipe key {key}: {why}", hint=f"remove {key} to estimate without it")
    name = str(d["model_name_or_path"])
    out: dict[str, Any] = {"model": model_of(name)}
    if out["model"] != name:
        notes.append(f"TRL model_name_or_path {name} read as memlens' built-in {out['model']} (the same config)")
    dtype = str(d.get("dtype", d.get("torch_dtype")) or "float32").replace("torch.", "")
    if dtype == "auto":
        weights = trainer_args.weights_of_model(out["model"])
    elif dtype in DTYPES:
        weights = DTYPES[dtype]
    else:
        raise SpecError(f"TRL recipe key dtype: {dtype!r} is not float32, bfloat16, float16 or auto", hint="e.g. dtype: bfloat16")
    attn = d.get("attn_implementation")
    if attn not in ATTN:
        raise SpecError(f"TRL recipe key attn_implementation: {attn!r} is not modelled", hint="use sdpa, flash_attention_2 or eager")
    if ATTN[attn]:
        out["attn"] = ATTN[attn]
    if attn == "flash_attention_2":
        notes.append("attn_implementation flash_attention_2: simulated as SDPA's flash kernel (the same FlashAttention-2 algorithm)")
    if d.get("use_peft"):
        out["lora_rank"] = int(d.get("lora_r", 16))
        out["lora_alpha"] = float(d.get("lora_alpha", 32))
        out["lora_dropout"] = float(d.get("lora_dropout", 0.05))
        t = d.get("lora_target_modules")
        if t:
            out["lora_targets"] = tuple([t] if isinstance(t, str) else t)
        if d.get("load_in_4bit"):
            out["qlora"] = True
    elif d.get("load_in_4bit"):
        raise SpecError("TRL recipe key load_in_4bit without use_peft: 4-bit weights are trained only through adapters",
                        hint="add use_peft: true (QLoRA)")
    return out, weights


def trainer_fields(d: dict, trainer: str, weights: str) -> dict[str, Any]:
    """The SFTConfig / DPOConfig / GRPOConfig part, read as ``--trainer-args`` reads a TRL config
    (trainer_args.spec_fields over integrations/trl_args.py): TRL 1.16's defaults for the fields not written
    (gradient checkpointing on, bf16 unless fp16, adamw_torch_fused, max_length 1024, num_generations 8, ...), and
    its refusals (a field of another config, activation_offloading, vLLM's server mode, ...)."""
    return trainer_args.spec_fields(d, weights, trainer=trainer)


def spec_fields(d: dict, trainer: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(TrainingSpec fields, notes) of a TRL recipe mapping."""
    notes: list[str] = []
    trainer = trainer or trainer_of(d)
    out, weights = model_fields(d, notes)
    rest = {k: v for k, v in d.items() if k not in MODEL_CONFIG and k not in SCRIPT_ARGS}
    out.update(trainer_fields(rest, trainer, weights))
    notes.append(f"TRL recipe read as a {trainer.upper()} recipe ({weights} weights as ModelConfig.dtype loads them)")
    return out, notes
