"""Several GPUs: what each ``--sharding`` runs for one rank (DDP, ZeRO-1, FSDP2, Opacus' DPDDP), its refusals,
which ranks can differ, and the fake process group under which a rank is simulated on this CPU.

:mod:`.base` holds the wrapper interface and the refusals; :mod:`.ddp`, :mod:`.dpddp`, :mod:`.fsdp` the
wrappers; :mod:`.fakepg` one rank of an N-GPU job in this process. Importing this package imports neither
torch nor torch.distributed.

A parallelism is one :func:`register_wrapper` call: ``applies(plan)`` asks the step's plan
(:class:`memlens.step.plan.StepPlan`: ``plan.sharding``, ``plan.dp``, ``plan.world_size``, ``plan.spec``), and
the first entry that applies wraps the rank. A new ``--sharding`` name is a :class:`memlens.core.parallel.Sharding`
entry (:func:`memlens.core.parallel.register_sharding`) that says what it shards; its wrapper class (a
:class:`.base.Wrapper`) says how a rank is wrapped and which ranks can differ. Nothing else changes: estimate,
compare, sweep and fit ask the plan (tests/step/toy_parallel.py adds a 2-way replica this way).
"""
from __future__ import annotations

from typing import Any, Callable

from ...core.errors import SpecError
from .base import RankGroup, Streams, Wrapper, check
from .ddp import DDPWrapper, Zero1Wrapper
from .cp import CPWrapper
from .dp_fsdp import DPFSDPWrapper
from .dpddp import DPDDPWrapper
from .fsdp import FSDPWrapper
from .hsdp import HSDPWrapper
from .pp import PPWrapper
from .tp import TPWrapper

# (applies(plan), wrapper class), asked in order: the first that applies wraps the rank
_REGISTRY: list[tuple[Callable[[Any], bool], type]] = [
    (lambda p: p.sharding.name == "ddp" and p.dp, DPDDPWrapper),
    (lambda p: p.sharding.family == "fsdp" and p.dp, DPFSDPWrapper),   # Opacus' ghost_fsdp
    (lambda p: p.sharding.name == "ddp", DDPWrapper),
    (lambda p: p.sharding.name == "zero1", Zero1Wrapper),
    (lambda p: p.sharding.family == "fsdp" and p.spec.pp > 1, PPWrapper),   # pipeline stages x FSDP2
    (lambda p: p.sharding.family == "fsdp" and p.spec.cp > 1, CPWrapper),   # ring attention x FSDP2 (x TP)
    (lambda p: p.sharding.family == "fsdp" and p.spec.tp > 1, TPWrapper),   # DTensor TP x FSDP2 (or HSDP)
    (lambda p: p.sharding.name == "hsdp", HSDPWrapper),      # FSDP2 on a replicate x shard mesh
    (lambda p: p.sharding.family == "fsdp", FSDPWrapper),
]


def register_wrapper(applies: Callable[[Any], bool], cls: type, *, first: bool = True) -> None:
    """Add a parallelism: ``cls`` wraps the ranks of the plans ``applies`` accepts (asked before the
    built-in ones when ``first``)."""
    if first:
        _REGISTRY.insert(0, (applies, cls))
    else:
        _REGISTRY.append((applies, cls))


def wrapper_class(plan) -> type | None:
    """The wrapper class of the plan's ranks (None on one GPU)."""
    if not plan.distributed:
        return None
    for applies, cls in _REGISTRY:
        if applies(plan):
            return cls
    raise SpecError(f"--sharding {plan.sharding.name} has no wrapper", hint="use ddp, zero1, zero2, zero3 or fsdp")


def wrapper_for(plan, *, fake: bool) -> Wrapper | None:
    """The wrapper for the plan's step on this rank (None on one GPU). ``plan``: a StepPlan
    (:func:`memlens.step.plan.resolve`). The process group must be up: the fake one of
    :func:`memlens.step.parallel.fakepg.fake_process_group`, or torchrun's."""
    if not plan.distributed:
        return None
    check(plan, fake=fake)
    import torch.distributed as dist  # heavy: torch loaded when a rank is wrapped

    n = plan.world_size
    if not dist.is_available() or not dist.is_initialized():
        how = ("`memlens estimate --world-size N` simulates each rank" if not fake else "run it inside memlens.step.parallel.fakepg.fake_process_group")
        raise SpecError(f"--world-size {n}: this process is not one rank of a {n}-GPU job",
                        hint=f"`memlens profile --world-size {n}` launches torchrun itself; {how}")
    world = dist.get_world_size()
    if world != n:
        raise SpecError(f"--world-size {n} but the process group has {world} ranks",
                        hint=f"launch with torchrun --nproc-per-node {n}, or use --world-size {world}")
    return (plan.wrapper or wrapper_class(plan))(plan.spec, fake=fake, rank=dist.get_rank(), world_size=world)


__all__ = ["RankGroup", "Streams", "Wrapper", "check", "register_wrapper", "wrapper_class", "wrapper_for"]
