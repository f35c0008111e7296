"""Several GPUs: what each ``--sharding`` runs for one rank (DDP, ZeRO-1, FSDP2, Opacus' DPDDP), its refusals,
which ranks can differ, and the fake process group under which a rank is simulated on this CPU.

:mod:`.base` holds the wrapper interface and the registry :func:`memlens.step.prepare` asks; :mod:`.ddp`,
:mod:`.dpddp`, :mod:`.fsdp` the wrappers; :mod:`.fakepg` one rank of an N-GPU job in this process.
Importing this package imports neither torch nor torch.distributed.
"""
from __future__ import annotations

from typing import Callable

from ...core.errors import SpecError
from ...core.parallel import is_distributed, sharding_of
from ...core.spec import TrainingSpec
from .base import RankGroup, Streams, Wrapper, check
from .ddp import DDPWrapper, Zero1Wrapper
from .dp_fsdp import DPFSDPWrapper
from .dpddp import DPDDPWrapper
from .fsdp import FSDPWrapper
from .hsdp import HSDPWrapper
from .tp import TPWrapper

# (applies, wrapper class), asked in order: the first that applies wraps the rank
_REGISTRY: list[tuple[Callable[[TrainingSpec], bool], type]] = [
    (lambda s: sharding_of(s).name == "ddp" and s.dp, DPDDPWrapper),
    (lambda s: sharding_of(s).family == "fsdp" and s.dp, DPFSDPWrapper),   # Opacus' ghost_fsdp
    (lambda s: sharding_of(s).name == "ddp", DDPWrapper),
    (lambda s: sharding_of(s).name == "zero1", Zero1Wrapper),
    (lambda s: sharding_of(s).family == "fsdp" and s.tp > 1, TPWrapper),   # DTensor TP x FSDP2 (or HSDP)
    (lambda s: sharding_of(s).name == "hsdp", HSDPWrapper),      # FSDP2 on a replicate x shard mesh
    (lambda s: sharding_of(s).family == "fsdp", FSDPWrapper),
]


def register_wrapper(applies: Callable[[TrainingSpec], bool], cls: type, *, first: bool = True) -> None:
    """Add a parallelism: ``cls`` wraps the ranks of the specs ``applies`` accepts (asked before the
    built-in ones when ``first``)."""
    if first:
        _REGISTRY.insert(0, (applies, cls))
    else:
        _REGISTRY.append((applies, cls))


def wrapper_class(spec: TrainingSpec) -> type | None:
    """The wrapper class of ``spec``'s ranks (None on one GPU)."""
    if not is_distributed(spec):
        return None
    for applies, cls in _REGISTRY:
        if applies(spec):
            return cls
    raise SpecError(f"--sharding {spec.sharding} has no wrapper", hint="use ddp, zero1, zero2, zero3 or fsdp")


def wrapper_for(spec: TrainingSpec, *, fake: bool) -> Wrapper | None:
    """The wrapper for ``spec`` on this rank (None on one GPU). The process group must be up: the
    fake one of :func:`memlens.step.parallel.fakepg.fake_process_group`, or torchrun's."""
    if not is_distributed(spec):
        return None
    check(spec, fake=fake)
    import torch.distributed as dist  # heavy: torch loaded when a rank is wrapped

    if not dist.is_available() or not dist.is_initialized():
        how = ("`memlens estimate --world-size N` simulates each rank" if not fake else "run it inside memlens.step.parallel.fakepg.fake_process_group")
        raise SpecError(f"--world-size {spec.world_size}: this process is not one rank of a {spec.world_size}-GPU job",
                        hint=f"`memlens profile --world-size {spec.world_size}` launches torchrun itself; {how}")
    world = dist.get_world_size()
    if world != spec.world_size:
        raise SpecError(f"--world-size {spec.world_size} but the process group has {world} ranks",
                        hint=f"launch with torchrun --nproc-per-node {spec.world_size}, or use --world-size {world}")
    return wrapper_class(spec)(spec, fake=fake, rank=dist.get_rank(), world_size=world)


__all__ = ["RankGroup", "Streams", "Wrapper", "check", "register_wrapper", "wrapper_class", "wrapper_for"]
