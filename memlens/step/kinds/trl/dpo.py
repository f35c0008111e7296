"""TRL 1.16's DPOTrainer step (trl/trainer/dpo_trainer.py ``DPOTrainer._compute_loss``)::

    labels = input_ids.masked_fill(completion_mask == 0, -100)            # chosen rows, then rejected rows: 2B
    outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)    # outputs=("log_probs", "entropy",
    logps = outputs.log_probs[:, -seq_len:].sum(1)                        #          "mean_logits", "is_top1")
    chosen_logps, rejected_logps = logps.chunk(2)
    if precompute_ref_log_probs: ref_* from the batch
    else: with torch.no_grad():                                           # after the policy's forward: its
        ref_outputs = ref_model(..., fused_lm_head=True)                  # activations are alive meanwhile
        (under peft: self.model under use_adapter(adapter_name=None), the adapters disabled)
    loss = -logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()   # "sigmoid"; every loss type
    metrics: entropy * mask, mean_logits, is_top1 & mask (then .item())        # works on [B] or [B, T] tensors

The reference is a separate frozen copy for full fine-tuning (DPOTrainer.__init__ ``create_model_from_path(...,
dtype=self.model.dtype)``), none under LoRA or with precomputed log-probs (memlens.step.kinds.trl.common).
The reference phase is marked "reference".
"""
from __future__ import annotations

from .common import accumulate, compute_dtype, no_adapters, reference
from .fused_head import fused_forward

OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")   # DPOTrainer.__init__ (use_weighting adds one: refused)
BETA = 0.1


def _ref_logps(step, inputs, labels, rows, cols, cd, T):
    import torch  # heavy: torch, loaded on first use

    ref = reference(step)
    with torch.no_grad():
        with (no_adapters(step.model) if ref is None else _null()), step.autocast():
            out = fused_forward(step.model if ref is None else ref, inputs, labels, rows, cols, compute_dtype=cd)
        logps = out["log_probs"][:, -T:].sum(dim=1)
        del out
    return logps.chunk(2, dim=0)


def _null():
    import contextlib

    return contextlib.nullcontext()


def run(step, on_phase):
    import torch.nn.functional as F  # heavy: torch, loaded on first use

    batch, cd, spec = step.batch, compute_dtype(step), step.spec

    def micro(i):
        on_phase("forward")
        cm = batch["completion_mask"]
        labels = batch["input_ids"].masked_fill(cm == 0, -100)
        inputs = {"input_ids": batch["input_ids"]}   # the all-ones attention mask: skipped by transformers on the GPU
        rows, cols = batch["valid_rows"], batch["valid_cols"]
        with step.autocast():
            out = fused_forward(step.model, inputs, labels, rows, cols, outputs=OUTPUTS, compute_dtype=cd)
        shift = cm[..., 1:]
        T = shift.size(1)
        chosen, rejected = out["log_probs"][:, -T:].sum(dim=1).chunk(2, dim=0)
        if spec.precompute_ref_log_probs:
            ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            on_phase("reference")
            ref_c, ref_r = _ref_logps(step, inputs, labels, rows, cols, cd, T)
        delta = (chosen - ref_c) - (rejected - ref_r)
        loss = -F.logsigmoid(BETA * delta).mean()
        ent = (out["entropy"][:, -T:].detach() * shift).sum()
        chosen_top1 = out["is_top1"][:, -T:].chunk(2, dim=0)[0] & shift.chunk(2, dim=0)[0].bool()
        metrics = (ent, chosen_top1.sum(), out["mean_logits"][:, -T:].sum())
        del metrics, chosen_top1, ent, out, labels
        return loss

    return accumulate(step, on_phase, micro)
