"""TRL 1.16's ``SFTConfig``, ``DPOConfig`` and ``GRPOConfig`` -> TrainingSpec fields (``--trainer-args``).

Which config a file is: ``--trainer`` when given, else the fields only one of them has (``to_json_string`` writes
every field; a YAML names some): GRPOConfig's ``num_generations``, DPOConfig's ``precompute_ref_log_probs``,
SFTConfig's ``packing``... A file with TrainingArguments fields only is the Trainer's (memlens.integrations.
trainer_args); one whose fields SFT and DPO share alone (``max_length``) needs ``--trainer``. Absent fields take
TRL's defaults, read from the installed trl's dataclasses, else from :data:`FALLBACK` (TRL 1.16; a test checks the
two agree). TRL's configs change three TrainingArguments defaults: ``gradient_checkpointing=True`` and
``bf16=None`` (True unless fp16, TrlBaseConfig.__post_init__); the optimizer stays ``adamw_torch_fused``.

=====================================  ==========================================================================
TRL field                              TrainingSpec
=====================================  ==========================================================================
max_length (SFT, DPO)                  seq_len (the rows' length limit; the worst case: every row at it)
packing + packing_strategy (SFT)       packing ("bfd" / "bfd_split" / "wrapped")
padding_free (SFT)                     padding_free
precompute_ref_log_probs (DPO)         precompute_ref_log_probs
num_generations, max_completion_       num_generations, max_completion_length, beta, steps_per_generation
length, beta, steps_per_generation /   (generation_batch_size / (per_device_train_batch_size x GPUs))
generation_batch_size (GRPO)
use_vllm + vllm_mode="colocate" +      vllm_gpu_memory_utilization
vllm_gpu_memory_utilization (GRPO)
use_liger_kernel                       liger (TRL 1.16 applies liger's layer kernels only: it turns fused linear
                                       cross-entropy off, its own fused LM head computes the log-probs)
=====================================  ==========================================================================

Refused in one line (they change memory in a way memlens does not model): SFT's ``loss_type="dft"``,
``activation_offloading``, an integer ``pad_to_multiple_of``; DPO's ``use_weighting``, ``padding_free``; GRPO's
``num_iterations > 1`` (its generation is reused), vLLM's server mode, ``cast_lm_head_to_fp32``,
``top_entropy_quantile < 1``, transformers' paged / continuous-batching generation, a ``cache_implementation``.
The rest (loss types, learning rates, reward settings, logging) does not touch one step's memory: read, ignored.
"""
from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from ..core.errors import SpecError
from ..core.spec import TrainingSpec

CONFIGS = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}

# TRL 1.16's defaults of the fields memlens reads (trl/trainer/{sft,dpo,grpo}_config.py, base_config.py)
_COMMON = {"gradient_checkpointing": True, "bf16": None, "activation_offloading": False, "pad_to_multiple_of": "auto",
           "use_liger_kernel": False}
FALLBACK: dict[str, dict[str, Any]] = {
    "sft": {**_COMMON, "max_length": 1024, "packing": False, "packing_strategy": "bfd", "padding_free": False,
            "completion_only_loss": None, "assistant_only_loss": False, "loss_type": "nll"},
    "dpo": {**_COMMON, "max_length": 1024, "padding_free": False, "precompute_ref_log_probs": False, "loss_type": ["sigmoid"],
            "use_weighting": False},
    "grpo": {**{k: v for k, v in _COMMON.items() if k != "activation_offloading"}, "num_generations": 8,
             "max_completion_length": 512, "beta": 0.0, "steps_per_generation": None, "generation_batch_size": None,
             "use_vllm": False, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "num_iterations": 1,
             "cast_lm_head_to_fp32": False, "top_entropy_quantile": 1.0, "use_transformers_paged": False,
             "use_transformers_continuous_batching": False, "cache_implementation": None, "loss_type": "dapo",
             "vllm_importance_sampling_correction": True},
}
# the fields each config adds to TrainingArguments (TRL 1.16), to tell a file's config without trl installed
_OWN = {
    "sft": "model_init_kwargs trust_remote_code router_aux_loss_coef chat_template_path dataset_text_field dataset_kwargs "
           "dataset_num_proc eos_token max_length truncation_mode shuffle_dataset packing packing_strategy padding_free "
           "pad_to_multiple_of eval_packing completion_only_loss assistant_only_loss loss_type activation_offloading pad_token",
    "dpo": "model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout dataset_num_proc max_length "
           "truncation_mode padding_free pad_to_multiple_of precompute_ref_log_probs precompute_ref_batch_size loss_type "
           "loss_weights ld_alpha f_divergence_type f_alpha_divergence_coef label_smoothing beta use_weighting discopop_tau "
           "activation_offloading sync_ref_model ref_model_mixup_alpha ref_model_sync_steps pad_token",
    "grpo": "model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32 num_generations "
            "num_generations_eval max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of "
            "generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs "
            "repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode "
            "vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout "
            "vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta num_iterations "
            "epsilon delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg "
            "vespo_lambda_neg importance_sampling_level reward_weights multi_objective_aggregation scale_rewards loss_type "
            "mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile "
            "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target "
            "max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode "
            "vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold "
            "use_bias_correction_kl log_completions log_multimodal num_completions_to_print log_unique_prompts "
            "log_completions_hub_repo use_transformers_continuous_batching transformers_continuous_batching_config "
            "use_transformers_paged vllm_importance_sampling_cap",
}
FALLBACK_OWN = {k: frozenset(v.split()) for k, v in _OWN.items()}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
              "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")   # DPOTrainer._compute_loss


def _config_class(trainer: str):
    try:
        import trl  # optional: trl, for its own defaults
    except ImportError:
        return None
    return getattr(trl, CONFIGS[trainer], None)


def own_fields(trainer: str) -> frozenset[str]:
    """The fields ``trainer``'s config adds to TrainingArguments (the installed trl's, else TRL 1.16's)."""
    cls = _config_class(trainer)
    if cls is None:
        return FALLBACK_OWN[trainer]
    from transformers import TrainingArguments  # heavy: transformers, loaded on first use

    base = {f.name for f in fields(TrainingArguments)}
    return frozenset(f.name for f in fields(cls) if f.name not in base)


def trl_defaults(trainer: str) -> dict[str, Any]:
    """TRL's defaults of the fields memlens reads for ``trainer`` (the installed trl's, else :data:`FALLBACK`)."""
    cls = _config_class(trainer)
    if cls is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in FALLBACK[trainer].items()}
    out = {}
    for f in fields(cls):
        if f.name in FALLBACK[trainer]:
            out[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return out


def detect(d: dict[str, Any], given: str | None) -> str:
    """"hf", "sft", "dpo" or "grpo": ``given`` (checked against the file), else the config whose own fields hold
    every TRL field the file names."""
    owns = {t: own_fields(t) for t in CONFIGS}
    named = {k for k in d if any(k in o for o in owns.values())}
    if given in (None, "hf"):
        fits = [t for t in CONFIGS if named and named <= owns[t]]
        if given == "hf" and named:
            raise SpecError(f"--trainer hf, but the trainer args name TRL fields ({', '.join(sorted(named)[:3])})",
                            hint="give --trainer sft, dpo or grpo (the config the file was written from)")
        if not named or given == "hf":
            return "hf"
        if len(fits) == 1:
            return fits[0]
        if not fits:
            raise SpecError(f"the trainer args mix fields of several TRL configs ({', '.join(sorted(named)[:4])})",
                            hint="write one SFTConfig, DPOConfig or GRPOConfig (to_json_string) per file")
        raise SpecError(f"the trainer args could be a {' or a '.join(CONFIGS[t] for t in fits)} (fields {', '.join(sorted(named))})",
                        hint="say which with --trainer " + " or --trainer ".join(fits))
    alien = sorted(named - owns[given])
    if alien:
        raise SpecError(f"--trainer {given}, but the trainer args name {alien[0]!r}, which {CONFIGS[given]} has not",
                        hint=f"give the --trainer of the config the file was written from, or drop {alien[0]}")
    return given


def _truthy(v: Any) -> bool:
    return bool(v) and str(v).lower() not in ("false", "no", "0", "none", "")


def whole(a: dict[str, Any], key: str, lowest: int = 1) -> int:
    """A whole-number field of a config file, or one line saying it is not one."""
    v = a.get(key)
    try:
        n = int(v) if not isinstance(v, bool) and (not isinstance(v, float) or v.is_integer()) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < lowest:
        raise SpecError(f"{key} must be a whole number >= {lowest}, got {v!r}", hint=f"e.g. {key}: 8")
    return n


def number(a: dict[str, Any], key: str) -> float:
    v = a.get(key)
    try:
        return float(v) if not isinstance(v, bool) else float("nan")
    except (TypeError, ValueError):
        raise SpecError(f"{key} must be a number, got {v!r}", hint=f"e.g. {key}: 0.1") from None


def _refuse(key: str, value: Any, why: str, hint: str) -> None:
    raise SpecError(f"{key}={value!r}: {why}, which memlens does not model", hint=hint)


def trl_fields(a: dict[str, Any], trainer: str) -> dict[str, Any]:
    """The TRL part of the spec from a config mapping ``a`` already merged over TRL's defaults."""
    if _truthy(a.get("activation_offloading")):
        _refuse("activation_offloading", True, "TRL's activation offloading moves saved tensors to the CPU with its own hooks",
                "drop it (memlens' --offload-activations models save_on_cpu)")
    pad = a.get("pad_to_multiple_of")
    if pad not in (None, "auto", "none", "None", "null"):
        _refuse("pad_to_multiple_of", pad, "rows padded to a multiple", "leave it at 'auto' (None on CUDA)")
    out: dict[str, Any] = {"trainer": trainer}
    if trainer in ("sft", "dpo") and a.get("max_length") is not None:
        out["seq_len"] = whole(a, "max_length")
    if trainer == "sft":
        if str(a.get("loss_type")) != "nll":
            _refuse("loss_type", a.get("loss_type"), "SFT's DFT loss weights each token by its probability", "use loss_type: nll")
        if _truthy(a.get("packing")):
            out["packing"] = str(a.get("packing_strategy") or "bfd")
        if _truthy(a.get("padding_free")):
            out["padding_free"] = True
    elif trainer == "dpo":
        kinds = a.get("loss_type") or ["sigmoid"]
        for k in [kinds] if isinstance(kinds, str) else kinds:
            if k not in DPO_LOSSES:
                raise SpecError(f"DPO loss_type {k!r} is not one of TRL 1.16's", hint=f"one of {', '.join(DPO_LOSSES)}")
        for key, why in (("use_weighting", "WPO weights need a fifth per-token output of the fused head"),
                         ("padding_free", "DPO's padding-free rows")):
            if _truthy(a.get(key)):
                _refuse(key, True, why, f"set {key}: false")
        if _truthy(a.get("precompute_ref_log_probs")):
            out["precompute_ref_log_probs"] = True
    else:
        out.update(_grpo_fields(a))
    if _truthy(a.get("use_liger_kernel")):
        if "liger" not in {f.name for f in fields(TrainingSpec)}:
            raise SpecError("use_liger_kernel=True: this memlens has no liger-kernel model (the spec field liger)",
                            hint="set use_liger_kernel: false, or use a memlens with --liger")
        out["liger"] = True
    return out


def _grpo_fields(a: dict[str, Any]) -> dict[str, Any]:
    for key, bad, why in (("num_iterations", lambda v: whole(a, "num_iterations") != 1, "several iterations over one generation"),
                          ("cast_lm_head_to_fp32", _truthy, "an fp32 copy of the LM head"),
                          ("top_entropy_quantile", lambda v: number(a, "top_entropy_quantile") < 1, "the high-entropy token mask"),
                          ("use_transformers_paged", _truthy, "transformers' paged generation"),
                          ("use_transformers_continuous_batching", _truthy, "transformers' continuous batching"),
                          ("cache_implementation", lambda v: v is not None, "a KV cache other than DynamicCache")):
        if bad(a.get(key)):
            _refuse(key, a.get(key), why, f"leave {key} at its default")
    out: dict[str, Any] = {"num_generations": whole(a, "num_generations"),
                           "max_completion_length": whole(a, "max_completion_length"), "beta": number(a, "beta")}
    if a.get("steps_per_generation") is not None:
        out["steps_per_generation"] = whole(a, "steps_per_generation")
    elif a.get("generation_batch_size") is not None:
        gbs, per = whole(a, "generation_batch_size"), whole(a, "per_device_train_batch_size")
        if gbs % per:   # GRPOConfig.__post_init__ (one process)
            raise SpecError(f"generation_batch_size {gbs} is not a multiple of per_device_train_batch_size {per}",
                            hint="as GRPOConfig requires")
        out["steps_per_generation"] = gbs // per
    if _truthy(a.get("use_vllm")):
        if a.get("vllm_mode") != "colocate":
            _refuse("vllm_mode", a.get("vllm_mode"), "vLLM on a server of its own", "use vllm_mode: colocate, or use_vllm: false")
        if not _truthy(a.get("vllm_importance_sampling_correction")):
            _refuse("vllm_importance_sampling_correction", False, "vLLM without the policy's own log-probs",
                    "leave it at its default (true)")
        out["vllm_gpu_memory_utilization"] = number(a, "vllm_gpu_memory_utilization")
    return out


__all__ = ["detect", "trl_defaults", "trl_fields", "own_fields", "FALLBACK", "FALLBACK_OWN", "whole"]
