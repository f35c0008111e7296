"""Tiny factory models for tests (`--model tests.tiny_models:linear`)."""
import torch


def linear(spec=None):
    """One bias-free 1024x1024 linear layer; batch of 16 (or the spec's) x 1024 fp32; loss = sum of outputs."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False))
    batch = 16 if spec is None or spec.batch_size == 1 else spec.batch_size
    x = torch.randn(batch, 1024)
    return model, x, lambda out, batch: out.sum()


def mlp(spec=None):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(4, 64)
    return model, x


def seq_linear(spec=None):
    """A bias-free 64x32 linear layer over sequences: batch of 8 (or the spec's) x 16 (or --seq-len)
    tokens x 64 fp32; one loss per sample (the sum of its outputs), as Opacus' ghost clipping needs."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    batch = 8 if spec is None or spec.batch_size == 1 else spec.batch_size
    x = torch.randn(batch, (spec.seq_len if spec is not None and spec.seq_len else 16), 64)
    return model, x, lambda out, batch: out.sum(dim=(1, 2))
