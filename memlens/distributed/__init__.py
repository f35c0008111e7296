"""Several GPUs: per-rank memory of DDP, ZeRO and FSDP2 jobs, estimated on this CPU and profiled
under torchrun.

- :mod:`.strategies`: what each ``--sharding`` is in PyTorch settings, the refusals, and the
  pluggable wrapping step :func:`memlens.step.prepare` applies for one rank;
- :mod:`.ddp`, :mod:`.fsdp`: the wrappers (DistributedDataParallel and ZeRO-1 with a model of the
  C++ Reducer for fake tensors; FSDP2 ``fully_shard`` run as is on fake tensors);
- :mod:`.fakepg`: one rank of an N-GPU job in this process (PyTorch's fake process group);
- :mod:`.estimate`: the per-rank estimate (:func:`estimate_ranks`);
- :mod:`.launch`, :mod:`.worker`, :mod:`.gather`: ``memlens profile --world-size N`` under torchrun,
  and per-rank profiles gathered on rank 0 (also inside a user's own torchrun script);
- :mod:`.nccl`: NCCL's own buffers, which only nvidia-smi sees.

Importing this package imports neither torch nor torch.distributed.
"""
from __future__ import annotations

__all__ = ["estimate_ranks", "simulate_rank", "wrapper_for", "register_wrapper", "check", "gather_profiles"]


def __getattr__(name: str):
    if name in ("estimate_ranks", "simulate_rank"):
        from . import estimate

        return getattr(estimate, name)
    if name in ("wrapper_for", "register_wrapper", "check"):
        from . import strategies

        return getattr(strategies, name)
    if name == "gather_profiles":
        from . import gather

        return gather.gather_profiles
    raise AttributeError(name)
