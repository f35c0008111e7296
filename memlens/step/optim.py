"""The optimizer a TrainingSpec names, as torch (or bitsandbytes) runs it.

On fake tensors (``simulate=True``) the CPU stands for CUDA, so the implementation is the one
PyTorch picks by default on CUDA (foreach), and CUDA-only optimizers get memory-faithful stand-ins.
"""
from __future__ import annotations

from ..core.errors import SpecError
from ..core.spec import TrainingSpec


def make_optimizer(spec: TrainingSpec, model, simulate: bool = False):
    """The optimizer the spec names, over trainable parameters.

    ``simulate``: fake CPU tensors stand for CUDA ones, so ask for the implementation PyTorch picks
    by default on CUDA (foreach), and use memory-faithful stand-ins for CUDA-only optimizers.
    """
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SpecError("no trainable parameters", hint="check --freeze patterns (everything is frozen)")
    lr = 1e-4
    fe = {"foreach": True} if simulate else {}
    name = spec.optimizer
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **fe)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **fe)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **fe)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **fe)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise SpecError("torch.optim.Adafactor needs torch >= 2.5", hint="upgrade torch or use --optimizer adamw")
        return torch.optim.Adafactor(params, lr=1e-2, **fe)
    if name == "adamw-8bit":
        if not simulate:
            try:
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(params, lr=lr)
            except ImportError:
                raise SpecError("--optimizer adamw-8bit needs bitsandbytes on a GPU", hint="pip install bitsandbytes") from None
        from ..models.quant import AdamW8bitSim  # memory-faithful stand-in (bitsandbytes needs a GPU)

        return AdamW8bitSim(params, lr=lr)
    raise AssertionError(name)
