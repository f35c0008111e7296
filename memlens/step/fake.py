"""Fake tensors for a simulated step: a meta-built model and batch swapped for fake CPU tensors of the same
shapes, and the small tree helpers the step uses for real batches too."""
from __future__ import annotations

from typing import Any

from ..models.adapt import KNOWN, mark_known
from ..models.vlm import fake_constant


def materialize_on_fake(model, fake_mode):
    """Swap every meta tensor of a model for a fake CPU tensor of the same shape (ties kept)."""
    import torch  # heavy: torch, loaded on first use

    memo: dict[int, Any] = {}
    cpu = torch.device("cpu")
    wrap = fake_mode.fake_tensor_converter.from_meta_and_device

    def fake_of(t):
        hit = memo.get(id(t))
        if hit is None:
            # a fresh contiguous meta tensor wrapped as a fake CPU tensor: what torch.empty under the
            # fake mode returns, without dispatching an op for each of a 70B model's parameters
            new = wrap(fake_mode, torch.empty(t.shape, dtype=t.dtype, device="meta"), cpu)
            hit = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
            memo[id(t)] = hit
        return hit

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                mod._parameters[name] = fake_of(p)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = fake_of(b)
        for name, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and v.device.type == "meta":
                setattr(mod, name, fake_of(v))
    return model


def fake_batch(batch: Any, fake_mode) -> Any:
    """The batch's meta tensors as fake CPU tensors (one tensor used twice stays one)."""
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

    memo: dict[int, Any] = {}

    def conv(t):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            if id(t) not in memo:
                known = fake_constant(t, fake_mode)   # a VLM batch's index tensors: values the model's Python reads
                if known is not None:
                    memo[id(t)] = known
                else:
                    with fake_mode:
                        memo[id(t)] = _keep_known(t, torch.empty(t.shape, dtype=t.dtype, device="cpu"))
            return memo[id(t)]
        return t

    return tree_map(conv, batch)


def tensors(obj) -> list:
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def to_device(batch, dev):
    import torch  # heavy: torch, loaded on first use
    from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

    return tree_map(lambda t: _keep_known(t, t.to(dev)) if isinstance(t, torch.Tensor) and t.device != dev else t, batch)


def _keep_known(old, new):
    """``new`` with what is known of ``old``'s values (:func:`memlens.models.adapt.mark_known`)."""
    known = getattr(old, KNOWN, None)
    return mark_known(new, known) if known else new
