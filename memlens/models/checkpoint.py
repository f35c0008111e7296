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

The checkpoint policy (``checkpoint_policy``): "full" recomputes a checkpointed block's whole forward in
backward; "selective" passes ``context_fn = create_selective_checkpoint_contexts(selective_policy)``, so the
outputs of the matmul, attention and convolution ops (:data:`SELECTIVE_SAVE_OPS`) are kept (MUST_SAVE) and
everything else is recomputed (PREFER_RECOMPUTE). "torchtitan-op" is torchtitan's own "selective op" policy
(torchtitan/parallelisms/parallelize_llama.py ``_apply_ac_to_transformer_block`` in its Dec 2024 benchmarks, the same
rule in torchtitan/distributed/activation_checkpoint.py today): it keeps the outputs of ``_save_list`` - ``aten.mm``
but only the odd ones of each block's forward (the 1st, 3rd, 5th, 7th: q, v, gate and down projections of a
Llama block; the count restarts in recomputation), the flash and memory-efficient attention kernels, the TP
reduce-scatter, ``abs`` and ``max`` (Float8's amax) - and recomputes the rest. "selective" keeps every matmul,
so it holds 3 more projection outputs per block than torchtitan does (k, o and up in a Llama block).

Activation offload (``offload_layers``): a chosen block's forward runs under
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (pinned only where CUDA is available): every tensor
autograd saves in it (parameters too) is copied to host memory in forward and back to the device, one copy
per use, in backward. A block is checkpointed or offloaded, never both: a checkpointed block saves its
tensors through checkpoint's own hooks, which take the place of save_on_cpu's, so it would offload nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from ..core.errors import MemlensError, SpecError
from ..core.spec import parse_checkpoint_layers, parse_offload_layers


def _is_hf_layer(m) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer  # heavy: transformers, loaded on first use
    except ImportError:       # transformers is optional for plain PyTorch models
        return False
    return isinstance(m, GradientCheckpointingLayer)


def find_blocks(model) -> tuple[str, Any]:
    """(name, list) of the model's block stack: the ModuleList/Sequential of transformers layers (of several, a VLM's
    vision tower and language model or an encoder and a decoder, the one holding the most parameters), else the one
    of one class holding the most parameters. Refused in one line when there is none, or several alike."""
    import torch  # heavy: loaded when a model is built (models/build.py imports this module at its top)

    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and len(mod) >= 1 and len({type(m) for m in mod}) == 1:
            params = sum(p.numel() for p in mod.parameters())
            if params:
                found.append((name, mod, params, _is_hf_layer(mod[0])))
    hf = sorted((f for f in found if f[3]), key=lambda f: -f[2])
    if len(hf) > 1 and hf[1][2] == hf[0][2]:
        raise MemlensError(f"the model has {len(hf)} stacks of transformers layers of the same size ({hf[0][0]}, {hf[1][0]}): "
                           "which blocks a number names is ambiguous", hint="checkpoint all of them (--grad-checkpointing)")
    if hf:   # several (a VLM's vision tower and language model, an encoder and a decoder): the one with the most parameters
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


def chosen_indices(choice: Any, n: int, label: str = "the model", flag: str = "checkpoint-layers") -> list[int]:
    """The block indices a checkpoint_layers choice names, in a stack of ``n`` blocks.

    >>> chosen_indices("all", 4), chosen_indices(2, 4), chosen_indices([3, 1], 4), chosen_indices(0, 4)
    ([0, 1, 2, 3], [0, 1], [1, 3], [])
    """
    v = parse_checkpoint_layers(None if choice == "all" else choice)
    if v is None:
        return list(range(n))
    if isinstance(v, int):
        if v > n:
            raise SpecError(f"{flag} {v} is more than the {n} blocks of {label}", hint=f"use at most {n} (or all)")
        return list(range(v))
    bad = [i for i in v if i >= n]
    if bad:
        raise SpecError(f"block index {bad[0]} is out of range: {label} has {n} blocks (0 to {n - 1})",
                        hint=f"give indices from 0 to {n - 1}")
    return list(v)


# ---------------------------------------------------------------- the selective policy (one place)
# aten ops whose outputs selective checkpointing keeps: matmuls, attention kernels, convolutions (the costly ops to
# recompute); every other op (norms, activations, dropout, elementwise) is recomputed in backward
SELECTIVE_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_flash_attention_for_cpu", "convolution")
_SAVE_PACKETS: set = set()


_kernel = threading.local()     # .depth: inside kernel_outputs() on this thread (fits run simulations in threads)


@contextlib.contextmanager
def kernel_outputs():
    """While the simulation allocates the outputs of a fused kernel it stands in for (the CUDA attention kernel's
    output, softmax statistics and RNG state, memlens.estimator.cuda_rules.FusedAttention): on the GPU those are the
    outputs of one aten attention op, which the selective policy keeps, so its stand-in's allocations are kept too."""
    _kernel.depth = getattr(_kernel, "depth", 0) + 1
    try:
        yield
    finally:
        _kernel.depth -= 1


@contextlib.contextmanager
def opaque_kernels():
    """Inside: the kernel stand-ins' outputs are not kept by selective checkpointing. For a composite that stands for
    one aten op (context parallel's ring attention runs the fused kernel once per ring step inside the aten attention
    op torch dispatches to it): selective checkpointing keeps that op's merged outputs, marked by the caller with
    :func:`kernel_outputs`, not each step's."""
    saved = getattr(_kernel, "depth", 0)
    _kernel.depth = -(1 << 30)
    try:
        yield
    finally:
        _kernel.depth = saved


_SAC_MODES = {"_CachingTorchDispatchMode": "forward", "_CachedTorchDispatchMode": "recompute"}


def selective_checkpoint_phase() -> str | None:
    """"forward" while a selective checkpoint's forward caches, "recompute" while its recomputation replays the cache,
    None outside selective checkpointing (torch.utils.checkpoint's two dispatch modes, the innermost user mode)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode  # heavy: torch, loaded on first use

    return _SAC_MODES.get(type(_get_current_dispatch_mode()).__name__)


@contextlib.contextmanager
def outside_selective_checkpoint():
    """Run ops that selective checkpointing must not see (neither cache nor replay): its innermost dispatch mode popped
    for the while, the other modes (fake tensors, the storage tracker) kept."""
    from torch.utils._python_dispatch import _pop_mode_temporarily  # heavy: torch, loaded on first use

    if selective_checkpoint_phase() is None:
        yield
        return
    with _pop_mode_temporarily():
        yield


def selective_policy(ctx, func, *args, **kwargs):
    """The selective checkpoint policy: MUST_SAVE for :data:`SELECTIVE_SAVE_OPS` (and a simulated kernel's outputs,
    :data:`kernel_outputs`), PREFER_RECOMPUTE otherwise."""
    import torch  # heavy (see find_blocks)
    from torch.utils.checkpoint import CheckpointPolicy  # heavy: torch, loaded on first use

    if not _SAVE_PACKETS:
        _SAVE_PACKETS.update(getattr(torch.ops.aten, n) for n in SELECTIVE_SAVE_OPS if hasattr(torch.ops.aten, n))
    if getattr(_kernel, "depth", 0) > 0 or getattr(func, "_overloadpacket", None) in _SAVE_PACKETS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """``context_fn`` of torch's checkpoint for selective checkpointing (a fresh pair of modes per call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts  # heavy: torch, loaded on first use

    return create_selective_checkpoint_contexts(selective_policy)


# torchtitan's _save_list (Dec 2024), by aten name; "reduce_scatter_tensor" is the _c10d_functional op
TORCHTITAN_SAVE_OPS = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "abs", "max")


def torchtitan_policy():
    """torchtitan's selective op AC policy with a fresh mm count (one per block call, its ``meta`` defaultdict): the
    odd matmuls and the listed ops kept. The fused attention's stand-in (:func:`kernel_outputs`) is kept as the flash
    kernel torchtitan's runs used (torch picked flash on H100 then; cuDNN attention, which its list lacks, is opt-in
    since torch 2.5.1: pytorch#138522)."""
    import torch  # heavy (see find_blocks)
    from torch.utils.checkpoint import CheckpointPolicy  # heavy: torch, loaded on first use

    save = {getattr(torch.ops.aten, n).default for n in TORCHTITAN_SAVE_OPS if hasattr(torch.ops.aten, n)}
    save.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    mm = torch.ops.aten.mm.default
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            count[mode] += 1
        if getattr(_kernel, "depth", 0) > 0 or (func in save and not (func == mm and count[mode] % 2 == 0)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def torchtitan_context():
    """``context_fn`` of torchtitan's selective op AC (:func:`torchtitan_policy`)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts  # heavy: torch, loaded on first use

    return create_selective_checkpoint_contexts(torchtitan_policy())


def checkpoint_kwargs(policy: str = "full") -> dict:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` for a policy (also what
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` takes)."""
    if policy not in ("full", "selective", "torchtitan-op"):
        raise SpecError(f"checkpoint policy {policy!r} is not full, selective or torchtitan-op", hint="use 'full' or 'selective'")
    context = {"selective": selective_context, "torchtitan-op": torchtitan_context}.get(policy)
    return {"use_reentrant": False, **({"context_fn": context} if context else {})}


def checkpoint_function(policy: str = "full"):
    from torch.utils.checkpoint import checkpoint  # heavy: torch, loaded on first use

    return partial(checkpoint, **checkpoint_kwargs(policy))


def offload_context():
    """What an offloaded block's forward runs under: save_on_cpu, pinned where CUDA is available."""
    import torch  # heavy (see find_blocks)

    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


# ---------------------------------------------------------------- wrapping blocks
def _set_forward(block, *, checkpoint: bool, offload: bool) -> None:
    """Give ``block`` (on the instance) a forward that checkpoints it (``_gradient_checkpointing_func``) or runs it
    under ``_memlens_offload()`` in training with gradients on; neither: its own forward back."""
    import torch  # heavy (see find_blocks)

    if getattr(block, "_memlens_base_forward", None) is not None:
        del block.forward
    block._memlens_base_forward = block._memlens_forward = block._memlens_offload = None
    if not (checkpoint or offload):
        return
    forward = block.forward
    block._memlens_base_forward = forward
    if checkpoint:
        block._memlens_forward = forward
    else:
        block._memlens_offload = offload_context

    def wrapped(*args, **kwargs):
        if not (block.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if block._memlens_offload is not None:
            with block._memlens_offload():
                return forward(*args, **kwargs)
        return block._gradient_checkpointing_func(forward, *args, **kwargs)

    block.forward = wrapped


def _checkpointed(block) -> bool:
    return bool(getattr(block, "gradient_checkpointing", False)) if _is_hf_layer(block) else \
        getattr(block, "_memlens_forward", None) is not None


def _offloaded(block) -> bool:
    return getattr(block, "_memlens_offload", None) is not None


def _names(label: str, idx) -> list[str]:
    return [f"{label}.{i}" if label else str(i) for i in sorted(idx)]


def checkpoint_blocks(model, choice: Any, policy: str = "full") -> list[str]:
    """Checkpoint the blocks ``choice`` names ("all", the first N, or indices) with ``policy`` and no others; the
    names of the blocks checkpointed."""
    label, blocks = find_blocks(model)
    keep = set(chosen_indices(choice, len(blocks), label or type(model).__name__))
    _check_apart(keep, {i for i, b in enumerate(blocks) if _offloaded(b)}, label)
    func = checkpoint_function(policy)
    if parse_checkpoint_layers(choice) is not None:     # a subset of this stack: transformers layers of other stacks off
        inside = {id(b) for b in blocks}
        for m in model.modules():
            if _is_hf_layer(m) and id(m) not in inside:
                m.gradient_checkpointing = False
    for i, block in enumerate(blocks):
        if _is_hf_layer(block):
            block.gradient_checkpointing = i in keep
            if i in keep and (getattr(block, "_gradient_checkpointing_func", None) is None or policy != "full"):
                block._gradient_checkpointing_func = func
        else:
            if i in keep:
                block._gradient_checkpointing_func = func
            if i in keep or getattr(block, "_memlens_forward", None) is not None:
                _set_forward(block, checkpoint=i in keep, offload=False)
    return _names(label, keep)


def offload_blocks(model, choice: Any) -> list[str]:
    """Run the blocks ``choice`` names ("all", the first N, or indices; None: none) under save_on_cpu, and no others;
    the names of the blocks offloaded. Refused in one line for a block that is checkpointed."""
    label, blocks = find_blocks(model)
    keep = set() if choice is None else set(chosen_indices(choice, len(blocks), label or type(model).__name__, flag="offload-activations"))
    _check_apart({i for i, b in enumerate(blocks) if _checkpointed(b)}, keep, label)
    for i, block in enumerate(blocks):
        if i in keep or _offloaded(block):
            _set_forward(block, checkpoint=False, offload=i in keep)
    return _names(label, keep)


def _check_apart(checkpointed: set, offloaded: set, label: str) -> None:
    both = sorted(checkpointed & offloaded)
    if both:
        raise SpecError(f"block {_names(label, both[:1])[0]} would be both checkpointed and offloaded: checkpoint saves its "
                        "tensors through its own hooks, in place of save_on_cpu's, so nothing would be offloaded",
                        hint="offload blocks that are not checkpointed")


PLAN_KEYS = ("checkpoint_layers", "checkpoint_policy", "offload_layers")


class Applied(list):
    """What :func:`apply` did: the list of the blocks checkpointed (as before offload and policies), plus
    ``policy`` ("full" / "selective", None: checkpointing untouched) and ``offloaded`` (the blocks under save_on_cpu)."""

    def __init__(self, checkpointed, policy: str | None = None, offloaded=()):
        super().__init__(checkpointed)
        self.policy = policy
        self.offloaded = list(offloaded)

    def to_dict(self) -> dict:
        return {"checkpointed": list(self), "checkpoint_policy": self.policy, "offloaded": self.offloaded}


def block_plan_flag(spec) -> str | None:
    """The flag of the block plan ``spec`` asks for beyond plain checkpointing (selective checkpointing or offloaded
    activations; None: none). A step kind that cannot take one refuses it naming this flag (memlens.step.kinds)."""
    if spec.checkpoint_policy == "full" and spec.offload_layers is None:
        return None
    return "--checkpoint-policy selective" if spec.checkpoint_policy != "full" else "--offload-activations"


def plan_of(plan: dict | Any) -> dict:
    """The plan mapping of ``plan``: a mapping of PLAN_KEYS, a ``memlens fit --least-recompute`` Result, its JSON
    dict, or the path of its result.json; refused in one line otherwise (before any model changes)."""
    if isinstance(plan, (str, os.PathLike)):
        try:
            plan = json.loads(Path(plan).read_text())
        except (OSError, ValueError) as e:
            raise MemlensError(f"cannot read a plan from {plan}: {e}",
                               hint="give the result.json of `memlens fit --least-recompute --out DIR`, or a dict") from None
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
    return plan


def apply(model, plan: dict | Any) -> Applied:
    """Apply a plan to a Hugging Face or plain PyTorch model, without editing its code; what it did (an
    :class:`Applied`: the list of the blocks checkpointed, ``[]`` none, with ``.policy`` and ``.offloaded``).

    ``plan``: ``{"checkpoint_layers": N}`` (the first N blocks, as ``memlens fit --least-recompute`` prints it),
    a list of block indices, or "all", with ``"checkpoint_policy": "selective"`` (keep matmul/attention/conv
    outputs, recompute the rest) and ``"offload_layers"`` (blocks whose saved tensors go to host memory,
    parsed alike); or a Result of ``memlens fit --least-recompute`` (its plan). A key left out leaves that
    part of the model as it is. A transformers model is switched on as
    ``gradient_checkpointing_enable(use_reentrant=False)`` does, then the layers not chosen are switched off
    (so the chosen layers run exactly as under whole checkpointing, the others as without it); any other
    model's chosen blocks get their forward wrapped in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
    Everything is checked before the model changes.

    >>> import memlens                                               # doctest: +SKIP
    >>> memlens.apply(model, {"checkpoint_layers": 12})              # doctest: +SKIP
    ['model.layers.0', ..., 'model.layers.11']
    >>> memlens.apply(model, {"checkpoint_layers": [0, 1], "checkpoint_policy": "selective", "offload_layers": [2, 3]}).offloaded  # doctest: +SKIP
    ['model.layers.2', 'model.layers.3']
    """
    plan = plan_of(plan)
    if not plan:
        return Applied([])
    label, blocks = find_blocks(model)
    where = label or type(model).__name__
    policy = plan.get("checkpoint_policy", "full")
    checkpoint_kwargs(policy)                                           # refused before anything changes
    if "checkpoint_layers" in plan:
        keep = chosen_indices(plan["checkpoint_layers"], len(blocks), where)
    else:
        keep = [i for i, b in enumerate(blocks) if _checkpointed(b)]
        if "checkpoint_policy" in plan and policy != "full" and not keep:
            raise SpecError(f"checkpoint_policy {policy!r} without checkpointed blocks: it says how they recompute",
                            hint="add 'checkpoint_layers' to the plan")
    if "offload_layers" in plan:
        off_choice = parse_offload_layers(plan["offload_layers"])
        off = [] if off_choice is None else chosen_indices(off_choice, len(blocks), where, flag="offload-activations")
    else:
        off = [i for i, b in enumerate(blocks) if _offloaded(b)]
    _check_apart(set(keep), set(off), label)
    for i, b in enumerate(blocks):          # offload off first where it goes, so a block can change from one to the other
        if _offloaded(b) and i not in off:
            _set_forward(b, checkpoint=False, offload=False)
    done = None
    if "checkpoint_layers" in plan or "checkpoint_policy" in plan:
        if keep and _is_hf_layer(blocks[0]) and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy))
        done = checkpoint_blocks(model, keep, policy)
    offloaded = offload_blocks(model, off) if "offload_layers" in plan else _names(label, off)
    return Applied(done if done is not None else _names(label, keep), policy if done is not None else None, offloaded)
