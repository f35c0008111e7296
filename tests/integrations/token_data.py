"""A tiny causal-LM dataset for the Trainer tests: ``n`` samples of 16 token ids below 64, labels = inputs."""
from __future__ import annotations

import torch


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 8):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
