"""A toy optimizer, added through the optimizer registry alone: SGD with momentum under another name,
whose facts (one buffer per trainable parameter, no step temporary) the closed form reads."""
import torch

from memlens.core.optimizers import Optimizer, register_optimizer


def build(groups, spec, model, simulate):
    return torch.optim.SGD(groups, lr=1e-3, momentum=0.5, foreach=True)


TOY = register_optimizer(Optimizer("toy-momentum", state_bytes=lambda numel, nbytes: nbytes, build=build))
