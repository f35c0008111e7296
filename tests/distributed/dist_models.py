"""Tiny factory models for the per-rank tests (`--model tests.distributed.dist_models:blocks`)."""
import torch


class Blocks(torch.nn.Module):
    """An embedding-free stack: in (64 -> 64), 2 blocks of 64 x 64 + bias, out (64 -> 6): a ModuleList FSDP2 wraps block by block."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, 64, bias=False)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])
        self.out = torch.nn.Linear(64, 6, bias=False)      # 6 rows: over 4 ranks 2, 2, 2, 0

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.out(x)


def blocks(spec=None):
    model = Blocks()
    b = spec.batch_size if spec is not None else 4
    return model, torch.randn(b, 64), lambda out, batch: out.float().pow(2).mean()


def three(spec=None):
    """Bias-free 1024 -> 1024 -> 256 (4 MiB and 1 MiB of fp32 weights) and a 256-value bias: hand-checked DDP buckets."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 256))
    b = spec.batch_size if spec is not None else 4
    return model, torch.randn(b, 1024), lambda out, batch: out.sum()


def seq_blocks(spec=None):
    """Sequences through bias-free 64 -> 64, ReLU, 64 -> 8 (fp32); one loss per sample (the sum of
    its outputs), as ghost clipping needs: ReLU saves its B x T x 64 output, which Linear b saves
    too (one storage): the activation a retained graph keeps from backward 1 into backward 2."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(), torch.nn.Linear(64, 8, bias=False))
    b = spec.batch_size if spec is not None else 4
    t = spec.seq_len if spec is not None and spec.seq_len else 16
    return model, torch.randn(b, t, 64), lambda out, batch: out.sum(dim=(1, 2))
