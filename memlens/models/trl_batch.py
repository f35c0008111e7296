"""The batches TRL 1.16's collators hand a causal LM, at their worst case (every row at its length limit).

- SFT (``trl/trainer/sft_trainer.py`` ``DataCollatorForLanguageModeling.torch_call``): ``input_ids`` and ``labels``
  (a separate tensor: the collator pads the examples' labels, the input ids when they have none) and an
  ``attention_mask`` of ones, ``batch x seq_len``. Padding-free (``padding_free=True``, or ``packing=True`` with
  the ``bfd`` strategies, SFTTrainer.__init__): ONE row of ``batch x seq_len`` tokens with ``position_ids`` that
  restart at each sequence, ``labels`` -100 where ``position_ids == 0``, ``cu_seq_lens_q/k`` (int32) and ``seq_idx``
  (int32), no attention mask. ``bfd`` packs sequences into rows of up to ``max_length`` (``pack_dataset``), and the
  collator concatenates the ``batch`` rows: the worst case is every packed row full, one sequence each (the fewest
  sequence starts, so the most tokens in the loss). ``wrapped`` packing gives rows of exactly ``max_length``: the
  plain batch. With completion-only or assistant-only loss the first ``prompt_len`` tokens of each sequence are -100.
- DPO (``trl/trainer/dpo_trainer.py`` ``DataCollatorForPreference.torch_call``): the chosen rows then the rejected
  rows, ``2 x batch`` rows of ``prompt + completion`` tokens: ``input_ids``, ``attention_mask``, ``completion_mask``
  (0 on the prompt); with ``precompute_ref_log_probs`` also ``ref_chosen_logps`` / ``ref_rejected_logps`` (fp32, one
  per pair).
- GRPO (``trl/trainer/grpo_trainer.py`` ``_generate_single_turn``): the generation batch's prompts, left-padded:
  ``prompt_ids`` and ``prompt_mask``, ``batch x steps_per_generation`` rows of ``seq_len`` tokens (each prompt
  repeated ``num_generations`` times by TRL's sampler); the completions are made by the step.

Beside what the model takes, each batch carries ``valid_rows`` / ``valid_cols`` (int64): the positions of
``labels[:, 1:] != -100``, which TRL's fused LM head gathers with ``hidden_states[mask]`` (a data-dependent shape on
fake tensors; here the count is known from the batch's layout, so the same gather is an index with these).
"""
from __future__ import annotations

from typing import Any

from ..core.spec import TrainingSpec
from .adapt import mark_known


def loss_positions(rows: int, seq: int, first: int, per_row_seqs: int = 1, dev: dict | None = None):
    """(rows, cols) int64 of the shifted label positions in the loss: in each of ``rows`` rows, ``per_row_seqs``
    sequences of ``seq`` tokens whose labels count from position ``first`` of each sequence (>= 1: a row's first
    label is never predicted; a packed sequence's first is -100)."""
    import torch  # heavy: torch, loaded on first use

    dev = dev or {}
    k = seq - first                                        # loss tokens per sequence
    per_seq = torch.arange(first - 1, seq - 1, **dev)       # shifted column of each, in a sequence
    starts = torch.arange(per_row_seqs, **dev) * seq
    cols_row = (starts[:, None] + per_seq[None, :]).reshape(-1)
    cols = cols_row.repeat(rows)
    row_ids = torch.arange(rows, **dev).repeat_interleave(per_row_seqs * k)
    return row_ids, cols


def trl_batch(spec: TrainingSpec, vocab: int, L: int, dev: dict) -> dict[str, Any]:
    """The worst-case batch of ``spec.trainer`` (sft | dpo | grpo) over a ``vocab``-token model, ``L`` tokens a row."""
    import torch  # heavy: torch, loaded on first use

    B = spec.batch_size
    p = spec.prompt_len or 0
    first = max(p, 1)
    if spec.trainer == "grpo":
        G = B * (spec.steps_per_generation or spec.grad_accum)
        C = spec.max_completion_length
        batch = {"prompt_ids": torch.randint(0, vocab, (G, L), **dev), "prompt_mask": torch.ones(G, L, dtype=torch.long, **dev)}
        # the completion positions of a micro-batch's B rows of prompt + completion
        batch["valid_rows"], batch["valid_cols"] = loss_positions(B, L + C, L, dev=dev)
        return batch
    if spec.trainer == "dpo":
        rows = 2 * B
        mask = torch.ones(rows, L, dtype=torch.long, **dev)
        if p:
            mask[:, :p] = 0
        batch = {"input_ids": torch.randint(0, vocab, (rows, L), **dev), "attention_mask": torch.ones(rows, L, dtype=torch.long, **dev),
                 "completion_mask": mask}
        if spec.precompute_ref_log_probs:
            batch["ref_chosen_logps"] = torch.zeros(B, **dev)
            batch["ref_rejected_logps"] = torch.zeros(B, **dev)
        batch["valid_rows"], batch["valid_cols"] = loss_positions(rows, L, first, dev=dev)
        return batch
    padding_free = spec.padding_free or spec.packing in ("bfd", "bfd_split")
    if not padding_free:
        ids = torch.randint(0, vocab, (B, L), **dev)
        labels = ids.clone()
        if p:
            labels[:, :p] = -100
        batch = {"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.long, **dev), "labels": labels}
        batch["valid_rows"], batch["valid_cols"] = loss_positions(B, L, first, dev=dev)
        return batch
    T = B * L
    ids = torch.randint(0, vocab, (1, T), **dev)
    pos = mark_known(torch.arange(L, **dev).repeat(B)[None], "packed")
    labels = ids.clone()
    labels.view(B, L)[:, :first] = -100    # the collator: labels[position_ids == 0] = -100 (each sequence's start)
    cu = (torch.arange(B + 1, **dev) * L).to(torch.int32)
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
             "seq_idx": torch.arange(B, dtype=torch.int32, **dev).repeat_interleave(L)[None]}
    batch["valid_rows"], batch["valid_cols"] = loss_positions(1, L, first, per_row_seqs=B, dev=dev)
    return batch


__all__ = ["trl_batch", "loss_positions"]
