"""Tiny models for the profile tests (factories: ``tests.measure.profile_models:tiny_mlp``)."""
import torch


def tiny_mlp(spec=None):
    """Linear(4, 8) -> ReLU -> Linear(8, 2) on a (3, 4) batch: 58 parameters, 232 bytes in float32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.randn(3, 4)
