"""MemlensCallback(fit_budget="auto") on a CPU Trainer: one clear MemlensError, not an AssertionError."""
from __future__ import annotations

import pytest

from tests.integrations.token_data import TokenDataset

transformers = pytest.importorskip("transformers")



def test_auto_budget_on_the_cpu_says_it_needs_cuda(tmp_path):
    from memlens.core.errors import MemlensError
    from memlens.integrations.hf import MemlensCallback

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                                          logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    cb = MemlensCallback(profile=False, fit_budget="auto")
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=TokenDataset(4), callbacks=[cb])
    with pytest.raises(MemlensError) as e:
        trainer.train()
    assert str(e.value) == ('fit_budget="auto" reads the free memory of the CUDA device the Trainer trains on, '
                            "and this Trainer trains on cpu")
    assert 'fit_budget="24GiB"' in e.value.hint and "\n" not in e.value.render()
