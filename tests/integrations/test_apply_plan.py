"""MemlensCallback(apply_plan=...): a least-recompute plan applied inside the HF Trainer and Lightning (CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from memlens.core.errors import MemlensError
from tests.integrations.token_data import TokenDataset

transformers = pytest.importorskip("transformers")



def _train(tmp_path, name, **cb_kwargs):
    from memlens.integrations.hf import MemlensCallback

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=2,
                                          logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                                          optim="adamw_torch", disable_tqdm=True)
    cb = MemlensCallback(profile=False, **cb_kwargs)
    transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb]).train()
    return model, cb


@pytest.mark.slow
def test_trainer_applies_the_plan_and_trains_the_same(tmp_path):
    plain, _ = _train(tmp_path, "plain")
    plan_file = tmp_path / "result.json"        # the shape `memlens fit --least-recompute --out DIR` writes
    plan_file.write_text(json.dumps({"verb": "fit", "recompute_plan": {"apply": {"checkpoint_layers": 2, "checkpoint_policy": "selective"}}}))
    model, cb = _train(tmp_path, "plan", apply_plan=str(plan_file))
    assert list(cb.applied) == ["transformer.h.0", "transformer.h.1"] and cb.applied.policy == "selective"
    assert [layer.gradient_checkpointing for layer in model.transformer.h] == [True, True, False]
    for (n, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n           # checkpointing changes memory, not the training


def test_bad_plan_refused_when_the_callback_is_made():
    from memlens.integrations.hf import MemlensCallback

    with pytest.raises(MemlensError, match="plan key 'checkpoint_blocks' is not one memlens applies"):
        MemlensCallback(apply_plan={"checkpoint_blocks": 2})
    with pytest.raises(MemlensError, match="cannot read a plan from"):
        MemlensCallback(apply_plan="/nonexistent/result.json")


def test_lightning_applies_the_plan(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from memlens.integrations.lightning import MemlensCallback

    class Blocks(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(3))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            for b in self.blocks:
                x = b(x)
            return x.pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 4)), batch_size=3)
    cb = MemlensCallback(profile=False, apply_plan={"checkpoint_layers": [1], "offload_layers": [2]})
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], default_root_dir=str(tmp_path))
    module = Blocks()
    trainer.fit(module, loader)
    assert list(cb.applied) == ["blocks.1"] and cb.applied.offloaded == ["blocks.2"]
