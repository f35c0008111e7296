"""Checkpoint a chosen set of a model's blocks (partial activation checkpointing), without editing its code.

The blocks are the model's one stack of repeated layers (a ``ModuleList``/``Sequential`` whose entries
share one class: a decoder's layers, a ViT's blocks). How a block is checkpointed:

- a transformers ``GradientCheckpointingLayer`` (every HF decoder/encoder layer in transformers 5.x):
  its own switch, ``layer.gradient_checkpointing``, on for the chosen layers and off for the others,
  with ``_gradient_checkpointing_func = checkpoint(use_reentrant=False)``. That is what
  ``gradient_checkpointing_enable`` sets on every layer (and what its ``every_n_layers`` sets on some),
  so the chosen layers run exactly as under whole checkpointing and the others as without it;
- any other module: its ``forward`` replaced (on the instance) by one that calls
  ``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)`` through the same
  ``_gradient_checkpointing_func`` attribute (the simulation re-enters its CUDA emulation there),
  in training with gradients on, as transformers' layers do; module hooks stay outside.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from ..core.errors import MemlensError, SpecError
from ..core.spec import parse_checkpoint_layers


def _is_hf_layer(m) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer  # heavy: transformers, loaded on first use
    except ImportError:       # transformers is optional for plain PyTorch models
        return False
    return isinstance(m, GradientCheckpointingLayer)


def find_blocks(model) -> tuple[str, Any]:
    """(name, list) of the model's block stack: the ModuleList/Sequential of transformers layers, else the one
    of one class holding the most parameters. Refused in one line when there is none, or several alike."""
    import torch  # heavy: loaded when a model is built (models/build.py imports this module at its top)

    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and len(mod) >= 1 and len({type(m) for m in mod}) == 1:
            params = sum(p.numel() for p in mod.parameters())
            if params:
                found.append((name, mod, params, _is_hf_layer(mod[0])))
    hf = [f for f in found if f[3]]
    if len(hf) > 1:
        raise MemlensError(f"the model has {len(hf)} stacks of transformers layers ({', '.join(f[0] for f in hf)}): which "
                           "blocks a number names is ambiguous", hint="checkpoint all of them (--grad-checkpointing)")
    if hf:
        return hf[0][0], hf[0][1]
    found = [f for f in found if not any(g is not f and f[0].startswith(g[0] + ".") and g[2] >= f[2] for g in found)]
    if not found:
        raise MemlensError(f"no block stack found in {type(model).__name__}: no ModuleList or Sequential of modules of one "
                           "class with parameters", hint="put the repeated blocks in an nn.ModuleList")
    found.sort(key=lambda f: -f[2])
    if len(found) > 1 and found[1][2] == found[0][2]:
        raise MemlensError(f"{type(model).__name__} has several block stacks of the same size ({found[0][0]}, {found[1][0]})",
                           hint="checkpoint all of them, or call memlens.apply on the submodule that holds the stack")
    return found[0][0], found[0][1]


def chosen_indices(choice: Any, n: int, label: str = "the model") -> list[int]:
    """The block indices a checkpoint_layers choice names, in a stack of ``n`` blocks.

    >>> chosen_indices("all", 4), chosen_indices(2, 4), chosen_indices([3, 1], 4), chosen_indices(0, 4)
    ([0, 1, 2, 3], [0, 1], [1, 3], [])
    """
    v = parse_checkpoint_layers(choice)
    if v is None:
        return list(range(n))
    if isinstance(v, int):
        if v > n:
            raise SpecError(f"checkpoint-layers {v} is more than the {n} blocks of {label}", hint=f"use at most {n} (or all)")
        return list(range(v))
    bad = [i for i in v if i >= n]
    if bad:
        raise SpecError(f"block index {bad[0]} is out of range: {label} has {n} blocks (0 to {n - 1})",
                        hint=f"give indices from 0 to {n - 1}")
    return list(v)


def _wrap(block) -> None:
    import torch  # heavy (see find_blocks)
    from torch.utils.checkpoint import checkpoint  # heavy: torch, loaded on first use

    if getattr(block, "_memlens_forward", None) is not None:
        return
    forward = block.forward
    block._memlens_forward = forward
    block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)

    def forward_checkpointed(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return block._gradient_checkpointing_func(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    block.forward = forward_checkpointed


def _unwrap(block) -> None:
    if getattr(block, "_memlens_forward", None) is not None:
        del block.forward
        block._memlens_forward = None


def checkpoint_blocks(model, choice: Any) -> list[str]:
    """Checkpoint the blocks ``choice`` names ("all", the first N, or indices) and no others; the names of the
    blocks checkpointed."""
    label, blocks = find_blocks(model)
    keep = set(chosen_indices(choice, len(blocks), label or type(model).__name__))
    done = []
    for i, block in enumerate(blocks):
        name = f"{label}.{i}" if label else str(i)
        if _is_hf_layer(block):
            block.gradient_checkpointing = i in keep
            if i in keep and getattr(block, "_gradient_checkpointing_func", None) is None:
                from torch.utils.checkpoint import checkpoint  # heavy (see find_blocks)

                block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        elif i in keep:
            _wrap(block)
        else:
            _unwrap(block)
        if i in keep:
            done.append(name)
    return done


PLAN_KEYS = ("checkpoint_layers",)


def apply(model, plan: dict | Any) -> list[str]:
    """Apply a plan to a Hugging Face or plain PyTorch model, without editing its code; the names of the blocks
    checkpointed (``[]``: none).

    ``plan``: ``{"checkpoint_layers": N}`` (the first N blocks, as ``memlens fit --least-recompute`` prints it),
    a list of block indices, or "all"; or a Result of ``memlens fit --least-recompute`` (its plan). A transformers
    model is switched on as ``gradient_checkpointing_enable(use_reentrant=False)`` does, then the layers not
    chosen are switched off (so the chosen layers run exactly as under whole checkpointing, the others as
    without it); any other model's chosen blocks get their forward wrapped in
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    >>> import memlens                                               # doctest: +SKIP
    >>> memlens.apply(model, {"checkpoint_layers": 12})              # doctest: +SKIP
    ['model.layers.0', ..., 'model.layers.11']
    """
    data = getattr(plan, "data", plan)
    if isinstance(data, Mapping) and isinstance(data.get("recompute_plan"), dict):   # a fit --least-recompute Result (or its JSON)
        plan = data["recompute_plan"].get("apply")
        if plan is None:
            raise MemlensError("this fit found no number of checkpointed blocks that fits", hint="a smaller batch or a larger GPU")
    if not isinstance(plan, dict):
        raise MemlensError(f"a plan is a mapping such as {{'checkpoint_layers': 8}}, got {type(plan).__name__}",
                           hint="memlens.apply(model, {'checkpoint_layers': 8})")
    unknown = [k for k in plan if k not in PLAN_KEYS]
    if unknown:
        raise MemlensError(f"plan key {unknown[0]!r} is not one memlens applies ({', '.join(PLAN_KEYS)})",
                           hint="memlens.apply(model, {'checkpoint_layers': 8})")
    if "checkpoint_layers" not in plan:
        return []
    choice = plan["checkpoint_layers"]
    label, blocks = find_blocks(model)
    keep = chosen_indices(choice, len(blocks), label or type(model).__name__)   # refused before anything changes
    if keep and _is_hf_layer(blocks[0]) and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return checkpoint_blocks(model, keep)
