"""One rank of an N-GPU job inside this process: PyTorch's fake process group.

``torch.testing._internal.distributed.fake_pg.FakeStore`` with backend ``"fake"`` gives a process
group whose collectives return at once without moving data (torchtitan's memory estimator and
PyTorch's FSDPMemTracker use it the same way). The real wrapping code (FSDP2's ``fully_shard``,
``ZeroRedundancyOptimizer``) then runs as it would on rank ``rank`` of ``world_size``.

>>> with fake_process_group(1, 4) as (rank, world):
...     import torch.distributed as dist
...     dist.get_rank(), dist.get_world_size(), rank, world
(1, 4, 1, 4)
>>> import torch.distributed as dist; dist.is_initialized()
False
"""
from __future__ import annotations

import contextlib

from ...core.errors import MemlensError


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """Initialize the default process group as rank ``rank`` of ``world_size`` (fake backend), and
    destroy it on exit. Refused when this process already runs a real process group."""
    import torch.distributed as dist  # heavy: torch, loaded on first use

    if not dist.is_available():
        raise MemlensError("this PyTorch build has no torch.distributed", hint="install a PyTorch build with distributed support")
    if dist.is_initialized():
        raise MemlensError("a per-rank estimate runs its own fake process group, and this process already has one",
                           hint="call memlens.estimate before torch.distributed.init_process_group (or in another process)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # heavy: torch, loaded on first use

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield rank, world_size
    finally:
        dist.destroy_process_group()
