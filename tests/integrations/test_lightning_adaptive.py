"""Adaptive micro-batching inside a real Lightning Trainer (CPU, a fake OOM source): started with a
batch twice too large, the run ends with the weights of the run started at the right size with twice
the accumulation; refusals; the callback cleans up after an OOM it cannot absorb."""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from memlens.core.errors import MemlensError  # noqa: E402
from memlens.integrations.lightning import MemlensCallback  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, limit: int = 10**9, manual: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.limit = limit
        self.losses: list[float] = []
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 8.00 MiB. (fake, {x.shape[0]} rows)")
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _fit(tmp_path, batch, accumulate, *, adaptive=False, limit=10**9, manual=False, steps=3):
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
    module = Tiny(limit, manual)
    cb = MemlensCallback(profile=False, adaptive=adaptive, trend=False)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         accumulate_grad_batches=accumulate, default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    return module, cb, trainer


def test_started_twice_too_large_ends_like_the_right_size(tmp_path):
    m, cb, trainer = _fit(tmp_path, 8, 2, adaptive=True, limit=4)
    ref, _, _ = _fit(tmp_path, 4, 4)
    assert [(c.micro_batch_from, c.micro_batch_to, c.reason) for c in cb.oom.policy.changes] == [(8, 4, "oom")]
    assert trainer.global_step == 3 and trainer.accumulate_grad_batches == 2
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # the loss Lightning sees for a batch of 8 is the mean of its two halves (each a batch of the reference);
    # on_train_batch_end gets it divided by accumulate_grad_batches (2 here, 4 there)
    assert m.losses[0] * 2 == pytest.approx((ref.losses[0] * 4 + ref.losses[1] * 4) / 2, rel=1e-5)
    assert "training_step" not in vars(m)


def test_the_oom_goes_on_at_the_smallest_micro_batch_and_the_module_is_restored(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="fake, 1 rows"):
        _fit(tmp_path, 4, 1, adaptive=True, limit=0)


def test_manual_optimization_is_refused(tmp_path):
    with pytest.raises(MemlensError, match="automatic optimization"):
        _fit(tmp_path, 4, 1, adaptive=True, manual=True)
