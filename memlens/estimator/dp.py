"""DP-SGD (Opacus) memory on fake tensors.

Opacus' GradSampleModule computes, during backward, a per-sample gradient ``grad_sample`` of shape
(physical batch, *parameter shape) for every trainable parameter, next to the ordinary ``.grad``.
The DP optimizer's pre-step clips them into ``summed_grad`` (one parameter-sized tensor), adds
Gaussian noise (a parameter-sized temporary) and replaces ``.grad``; ``zero_grad`` drops the
per-sample gradients. With ``--physical-batch-size`` (Opacus' BatchMemoryManager), only that many
samples are materialized at once: the simulated micro-batch is the physical batch.
"""
from __future__ import annotations

import torch


class PerSampleGradients:
    """Allocates what Opacus allocates, at the moments it does (see the module docstring)."""

    def __init__(self, tracker, batch: int):
        self.tracker = tracker
        self.batch = batch
        self.samples: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def on_grad(self, p: torch.nn.Parameter) -> None:
        gs = torch.empty((self.batch, *p.shape), dtype=p.dtype, device=p.device)
        self.tracker.retag(gs, "per_sample_gradients")
        self.samples.append((p, gs))

    def clip_and_noise(self) -> None:
        for p, _ in self.samples:
            summed = torch.empty_like(p)
            noise = torch.empty_like(p)
            p.grad = summed
            del noise
        self.samples.clear()
