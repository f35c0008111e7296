"""MemlensCallback inside a real Lightning Trainer on a tiny module (CPU)."""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def test_lightning_callback(tmp_path):
    from memlens.integrations.lightning import MemlensCallback

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=3)
    cb = MemlensCallback(mode="full", out_dir=tmp_path / "prof")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), loader)
    r = cb.result
    assert r.data["integration"] == "lightning.Trainer"
    labels = [s["label"] for s in r.data["snapshots"]]
    for step in (1, 2, 3):
        i = labels.index(f"step {step} forward")
        assert labels[i:i + 4] == [f"step {step} forward", f"step {step} backward", f"step {step} optimizer", f"step {step} end"]
    assert r.by_category["parameters"] == 58 * 4
    assert r.by_category["optimizer_state"] == 2 * 58 * 4 + 16
    assert (tmp_path / "prof" / "report.html").is_file()
