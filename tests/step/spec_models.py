"""Factories for the spec-field tests."""
import torch


def no_spec():
    """A factory that takes no spec: its batch is fixed (4 x 8)."""
    return torch.nn.Linear(8, 8), torch.randn(4, 8)
