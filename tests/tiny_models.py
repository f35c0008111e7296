"""Tiny factory models for tests (`--model tests.tiny_models:linear`)."""
import torch


def linear(spec=None):
    """One bias-free 1024x1024 linear layer; batch of 16 x 1024 fp32; loss = sum of outputs."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False))
    x = torch.randn(16, 1024)
    return model, x, lambda out, batch: out.sum()


def mlp(spec=None):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(4, 64)
    return model, x
