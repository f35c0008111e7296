"""``timm:NAME`` and ``torchvision:NAME`` models, built by the library's own constructors.

The constructor runs in the ambient device context (the meta device for estimates: no weights,
no download: ``pretrained=False`` / ``weights=None``), so the model is exactly the library's.
Its batch is ``{"x": images, "labels": classes}``: ``forward(x)`` takes the images (both
libraries name the argument ``x``) and the loss is ``F.cross_entropy(logits, labels)``, as a
classification training script computes it. Input size: timm's ``pretrained_cfg["input_size"]``,
else 224 (torchvision's classification weights are trained at 224, bigger for a few models:
give ``--image-size``).
"""
from __future__ import annotations

import contextlib
from typing import Any

from ..core.errors import ModelSourceError, SpecError, sentences
from ..core.spec import TrainingSpec
from .adapt import Built, apply_freeze, apply_lora, torch_dtype
from .checkpoint import checkpoint_blocks, offload_blocks
from .source import ModelSource

DEFAULT_IMAGE_SIZE = 224


def construct(source: ModelSource):
    """The library's model (random init, no weights) in the ambient device context."""
    lib, _, name = source.name.partition(":")
    try:
        if lib == "timm":
            import timm  # optional: timm (memlens[vision])

            return timm.create_model(name, pretrained=False)
        import torchvision  # optional: torchvision (memlens[vision])

        return torchvision.models.get_model(name, weights=None)
    except ModelSourceError:
        raise
    except Exception as e:  # noqa: BLE001 - any constructor failure is one line
        raise ModelSourceError(f"{lib} cannot build {name!r}: {type(e).__name__}: {sentences(e)}",
                               hint="check the name, or use pkg.module:factory") from None


def input_size(model, source: ModelSource, spec: TrainingSpec) -> int:
    if spec.image_size:
        return spec.image_size
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    return int(size[-1]) if size else DEFAULT_IMAGE_SIZE


def num_classes(model) -> int:
    n = getattr(model, "num_classes", None)
    if isinstance(n, int) and n > 0:
        return n
    for attr in ("fc", "classifier", "head", "heads"):
        m = getattr(model, attr, None)
        mods = [m] + (list(m.modules()) if m is not None and hasattr(m, "modules") else [])
        for mm in reversed(mods):
            if hasattr(mm, "out_features"):
                return int(mm.out_features)
    return 1000


def cross_entropy(out, batch):
    import torch.nn.functional as F  # heavy: torch, loaded on first use

    logits = out[0] if isinstance(out, (tuple, list)) else out
    return F.cross_entropy(logits, batch["labels"])


def build_vision_module(spec: TrainingSpec, source: ModelSource, device: Any):
    """Model (dtype, freezing, checkpointing, LoRA applied) and its ``{"x", "labels"}`` batch."""
    import torch  # heavy: torch, loaded on first use

    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    dtype = torch_dtype(spec.param_dtype)
    with ctx:
        model = construct(source)
        model.to(dtype)
        S = input_size(model, source, spec)
        n = num_classes(model)
        batch = {"x": torch.randn(spec.batch_size, 3, S, S, dtype=dtype), "labels": torch.randint(0, n, (spec.batch_size,))}
    model.train()
    apply_freeze(model, spec.freeze)
    if spec.checkpoint_layers is not None or (spec.grad_checkpointing and spec.checkpoint_policy != "full"):
        # some blocks, or all with a policy timm's own switch has not: wrapped one by one (models/checkpoint.py)
        checkpoint_blocks(model, spec.checkpoint_layers, spec.checkpoint_policy)
    elif spec.grad_checkpointing:
        if not hasattr(model, "set_grad_checkpointing"):
            raise SpecError(f"{source.name} has no gradient checkpointing switch", hint="drop --grad-checkpointing (timm models have one)")
        model.set_grad_checkpointing(True)
    if spec.offload_layers is not None:
        offload_blocks(model, spec.offload_layers)
    if spec.lora_rank:
        if not spec.lora_targets:
            raise SpecError("LoRA on a timm/torchvision model needs --lora-targets", hint="name its linear/conv modules, e.g. --lora-targets qkv,proj")
        model = apply_lora(model, spec)
    if spec.seq_len:
        raise SpecError(f"--seq-len does not apply to the image model {source.name}", hint="drop --seq-len; --image-size sets the input")
    return Built(model, batch, cross_entropy, None, S, forward_keys=frozenset({"x"}))
