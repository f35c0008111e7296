"""HSDP (``--sharding hsdp --shard-size S``) for one rank: FSDP2 on a 2D DeviceMesh.

``init_device_mesh(device, (world // S, S), mesh_dim_names=("replicate", "shard"))`` and ``fully_shard(module,
mesh=mesh2d)`` on every block, then the root, as torchtitan's ``dp_replicate x dp_shard`` does: each parameter
is a DTensor with placements ``(Replicate(), Shard(0))``, so a rank holds ceil(dim0 / S) rows of it - S ways,
not world ways - and its gradients and optimizer states alike. What the rank allocates is FSDP2's own code,
run as is on fake tensors under the fake process group (torch/distributed/fsdp/_fully_shard/, torch 2.x):

- the all-gathers run over the shard group (S ranks): the same copy-in and output buffers as FSDP2 over S GPUs;
- ``foreach_reduce`` (_fsdp_collectives.py): the reduce-scatter input (every unsharded gradient, padded) and its
  output (1/S of it, on the reduce-scatter stream) over the shard group, then ``dist.all_reduce`` of that
  output **in place** over the replicate group, on the all-reduce stream; the sharded ``.grad`` are views of it,
  and ``FSDPParamGroup._all_reduce_state`` holds it until the next group's reduce (no extra buffer when the
  reduce dtype is the parameters' dtype; a cast otherwise);
- the replicate group costs no parameter memory: the ranks of one replica hold what FSDP2 over S GPUs holds.

Rank r sits at ``(r // S, r % S)``; ranks with the same shard index hold the same rows, so only shard index 0
(the largest shards) and S - 1 (the smallest) can differ, as under FSDP2 over S GPUs.
"""
from __future__ import annotations

from .fsdp import FSDPWrapper


class HSDPWrapper(FSDPWrapper):
    """FSDP2 ``fully_shard`` per block + root on a (replicate, shard) mesh (see the module docstring)."""

    name = "hsdp"

    def __init__(self, spec, **kw):
        super().__init__(spec, **kw)
        self.shard_size = spec.shard_size
        self.replicas = self.world_size // spec.shard_size
        self.applied[-1] = (f"FSDP2 fully_shard on a {self.replicas} x {self.shard_size} DeviceMesh (replicate x shard) per block "
                            f"+ root: each parameter sharded over {self.shard_size} GPUs, replicated {self.replicas} times {self.settings}")

    def make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh  # heavy: torch, loaded on first use

        mesh = init_device_mesh(device_type, (self.replicas, self.shard_size), mesh_dim_names=("replicate", "shard"))
        self.facts.update(mesh={"replicate": self.replicas, "shard": self.shard_size})
        return mesh

    def shard_index(self, rank: int) -> int:
        return rank % self.shard_size


__all__ = ["HSDPWrapper"]
