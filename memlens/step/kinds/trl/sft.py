"""TRL 1.16's SFTTrainer step (trl/trainer/sft_trainer.py ``SFTTrainer.compute_loss``), on top of the Trainer's
(transformers Trainer.training_step, accelerate's autocast-wrapped forward)::

    inputs["use_cache"] = False
    outputs = model(**inputs, fused_lm_head=True)        # add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1"))
    per_token_loss = -outputs.log_probs                  # loss_type "nll" (zero on ignored positions)
    loss = per_token_loss.sum() / num_tokens             # num_items_in_batch, else label_mask.sum()
    # metrics: label_mask.sum(), entropy.detach().sum(), is_top1.sum() -> .item() (scalars: no logits anywhere)
    accelerator.backward(loss / gradient_accumulation_steps)

SFTConfig's own defaults (gradient checkpointing on, bf16 over fp32 weights, ``adamw_torch_fused`` from
TrainingArguments) come from ``--trainer-args`` (memlens.integrations.trainer_args). The batch is the collator's
(memlens.models.trl_batch): padding-free rows pass ``position_ids`` (transformers builds the packed-sequence mask
from them, masking_utils ``find_packed_sequence_indices``: a block-diagonal ``[1, 1, T, T]`` boolean mask, so SDPA
runs its kernel with a mask); the attention mask of ones of a padded batch is not passed on (transformers skips an
all-ones mask on the GPU, the worst case has no padding).
"""
from __future__ import annotations

from .common import accumulate, compute_dtype
from .fused_head import fused_forward

OUTPUTS = ("log_probs", "entropy", "is_top1")     # SFTTrainer.__init__: add_fused_lm_head(outputs=...)


def model_inputs(batch: dict) -> dict:
    """What reaches the backbone: input_ids (and position_ids of a padding-free row; cu_seq_lens_* and seq_idx are
    for flash / linear attention and are ignored by SDPA)."""
    return {k: batch[k] for k in ("input_ids", "position_ids") if k in batch}


def run(step, on_phase):
    batch, cd = step.batch, compute_dtype(step)

    def micro(i):
        on_phase("forward")
        with step.autocast():
            out = fused_forward(step.model, model_inputs(batch), batch["labels"], batch["valid_rows"], batch["valid_cols"],
                                outputs=OUTPUTS, compute_dtype=cd)
        loss = (-out["log_probs"]).sum() / out["label_mask"].sum().clamp(min=1)
        metrics = (out["label_mask"].sum(), out["entropy"].detach().sum(), out["is_top1"].sum())   # then .item()
        del metrics, out
        return loss

    return accumulate(step, on_phase, micro)
