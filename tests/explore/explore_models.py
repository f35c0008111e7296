"""Tiny factory models for the explore tests (``explore_models:tiny`` etc.; tests/explore on the path).

Each factory takes the TrainingSpec and returns (model, batch): a 2-layer MLP language model over
a 64-token vocabulary, so that an estimate or a real CPU step takes well under a second.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, fail_over: int | None = None, sleep: float = 0.0,
                 die: bool = False, checkpoint: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.l1 = nn.Linear(hidden, 4 * hidden)
        self.l2 = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.fail_over, self.sleep, self.die, self.checkpoint = fail_over, sleep, die, checkpoint

    def block(self, h):
        return h + self.l2(torch.relu(self.l1(h)))

    def forward(self, input_ids, labels):
        b = input_ids.shape[0]
        if self.die:
            os._exit(3)                       # a crash: the process vanishes without a result
        if self.sleep:
            time.sleep(self.sleep)            # a hang: the trial's timeout must fire
        if self.fail_over is not None and b > self.fail_over:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} GiB (fake, batch {b})")
        h = self.emb(input_ids)
        if self.checkpoint:
            from torch.utils.checkpoint import checkpoint

            h = checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}


def _batch(spec):
    L = spec.seq_len or 16
    ids = torch.randint(0, 64, (spec.batch_size, L))
    return {"input_ids": ids, "labels": ids}


def tiny(spec):
    return TinyLM(checkpoint=spec.grad_checkpointing), _batch(spec)


def oom_over_4(spec):
    """'Runs out of memory' above batch 4 (raises torch.OutOfMemoryError like CUDA would)."""
    return TinyLM(fail_over=4), _batch(spec)


def sleepy(spec):
    return TinyLM(sleep=60), _batch(spec)


def dies(spec):
    return TinyLM(die=True), _batch(spec)
