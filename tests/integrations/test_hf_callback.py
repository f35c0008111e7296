"""MemlensCallback inside a real transformers Trainer on a tiny GPT-2 (CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.token_data import TokenDataset

transformers = pytest.importorskip("transformers")



@pytest.mark.parametrize("mode", ["phases", "full"])
def test_trainer_callback(tmp_path, mode):
    from memlens.integrations.hf import MemlensCallback

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=3,
                                          logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                                          optim="adamw_torch", disable_tqdm=True)
    cb = MemlensCallback(mode=mode, out_dir=tmp_path / "prof")
    transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb]).train()
    r = cb.result
    assert r.verb == "profile" and r.data["integration"] == "transformers.Trainer"
    labels = [s["label"] for s in r.data["snapshots"]]
    for step in (1, 2, 3):
        assert f"step {step} forward" in labels and f"step {step} backward" in labels
        assert f"step {step} optimizer" in labels and f"step {step} end" in labels
    assert len(r.data["steps"]) == 3
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert r.by_category["parameters"] == param_bytes
    assert r.by_category["optimizer_state"] >= 2 * param_bytes      # AdamW moments (+ step scalars)
    assert (tmp_path / "prof" / "report.html").is_file()
