"""A job over several machines: how many nodes, how many ranks on each, where they meet, which node this is.

``memlens profile --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT`` runs on every node, as torchrun does:
each node's memlens launches torchrun for its own ranks, all of them meet at the rendezvous endpoint, every rank
profiles its own step, and global rank 0 gathers every rank's profile into one Result (written where rank 0 runs).

Two rendezvous, as torchrun has them (torch/distributed/run.py):

- without ``--node-rank``: c10d (``--rdzv-backend c10d``), the nodes take their order as they join; the first node to
  reach the endpoint's machine hosts the store (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py);
- with ``--node-rank K``: static (``--rdzv-backend static``), node 0 hosts the store on HOST:PORT and node K's ranks
  are K*P .. K*P+P-1 (the classic ``--nnodes N --node-rank K --master-addr`` launch).

Inside ``srun`` over several nodes (one memlens task per node), the job is one of several nodes without a flag, and
what the flags leave out comes from Slurm's environment: the number of
nodes from SLURM_NNODES, this node from SLURM_NODEID, the endpoint from MASTER_ADDR / MASTER_PORT (the convention of
Slurm launch scripts: ``export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)``), the
rendezvous id from SLURM_JOB_ID, the ranks per node from SLURM_GPUS_ON_NODE.

>>> n = nodes_from(nnodes=2, nproc_per_node=4, rdzv_endpoint="10.0.0.1:29400", env={})
>>> n.world_size, n.rendezvous, torchrun_flags(n)[:4]
(8, 'c10d', ['--nnodes=2', '--nproc-per-node=4', '--rdzv-backend=c10d', '--rdzv-endpoint=10.0.0.1:29400'])
>>> slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
...          "SLURM_GPUS_ON_NODE": "8", "MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29600"}
>>> n = nodes_from(nproc_per_node=None, nnodes=None, env=slurm, asked=True)
>>> (n.nnodes, n.nproc_per_node, n.node_rank, n.rdzv_endpoint, n.rdzv_id, n.source)
(2, 8, 1, 'gpu-a01:29600', '77', 'slurm')
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..core.errors import SpecError

DEFAULT_PORT = 29500          # torchrun's --master-port default
SLURM_HINT = ("in an sbatch script: export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1); "
              "srun --ntasks-per-node=1 memlens profile ... --nproc-per-node GPUS")


@dataclass(frozen=True)
class Nodes:
    """Where a job of several machines runs (one memlens, one torchrun agent, per node)."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    node_rank: int | None = None      # None: c10d assigns the order; K: static rendezvous, this is node K
    rdzv_id: str = "memlens-profile"
    source: str = "flags"             # flags | slurm (some values read from Slurm's environment)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def rendezvous(self) -> str:
        return "c10d" if self.node_rank is None else "static"


def _int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key)
    try:
        return int(str(v).split("(")[0]) if v not in (None, "") else None
    except ValueError:
        return None


def _endpoint(env: Mapping[str, str]) -> str | None:
    addr = env.get("MASTER_ADDR")
    return f"{addr}:{env.get('MASTER_PORT') or DEFAULT_PORT}" if addr else None


def nodes_from(*, nnodes: int | None, nproc_per_node: int | None, rdzv_endpoint: str | None = None,
               node_rank: int | None = None, world_size: int | None = None, env: Mapping[str, str] | None = None,
               asked: bool | None = None) -> Nodes | None:
    """The job's nodes from the flags, Slurm's environment filling what they leave out; None for a one-node job.
    ``asked``: a multi-node flag was given, or this is a step of ``srun`` over several nodes (SLURM_STEP_ID with
    SLURM_NNODES > 1; an sbatch script's own shell is no step, and stays one node)."""
    env = os.environ if env is None else env
    if asked is None:
        flags = any(v is not None for v in (nnodes, nproc_per_node, rdzv_endpoint, node_rank))
        asked = flags or ("SLURM_STEP_ID" in env and (_int(env, "SLURM_NNODES") or 1) > 1)
    if not asked:
        return None
    in_slurm = "SLURM_JOB_ID" in env and _int(env, "SLURM_NNODES") is not None
    source = "flags"
    if in_slurm:
        given = (nnodes, node_rank, rdzv_endpoint, nproc_per_node)
        slurm_nodes = _int(env, "SLURM_NNODES")
        if nnodes is not None and nnodes != slurm_nodes:
            raise SpecError(f"--nnodes {nnodes} but this Slurm job has {slurm_nodes} nodes (SLURM_NNODES)",
                            hint="drop --nnodes inside srun, or allocate that many nodes")
        nnodes = slurm_nodes
        tasks = _int(env, "SLURM_NTASKS")
        if tasks is not None and tasks != nnodes:
            raise SpecError(f"Slurm runs {tasks} memlens tasks on {nnodes} nodes; memlens launches the ranks of its node itself",
                            hint="srun --ntasks-per-node=1 memlens profile ... --nproc-per-node GPUS")
        node_rank = node_rank if node_rank is not None else _int(env, "SLURM_NODEID")
        rdzv_endpoint = rdzv_endpoint or _endpoint(env)
        nproc_per_node = nproc_per_node or (None if world_size else _int(env, "SLURM_GPUS_ON_NODE"))
        source = "flags" if given == (nnodes, node_rank, rdzv_endpoint, nproc_per_node) else "slurm"
    return _check(nnodes, nproc_per_node, rdzv_endpoint, node_rank, world_size, env.get("SLURM_JOB_ID") or "memlens-profile",
                  source)


def _check(nnodes, nproc_per_node, rdzv_endpoint, node_rank, world_size, rdzv_id, source) -> Nodes:
    if nnodes is None or nnodes < 1:
        raise SpecError("--nproc-per-node / --rdzv-endpoint / --node-rank describe a job of several nodes: --nnodes is missing",
                        hint="e.g. --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 on every node")
    if nproc_per_node is None and world_size:
        if world_size % nnodes:
            raise SpecError(f"--world-size {world_size} does not split over --nnodes {nnodes}",
                            hint="give --nproc-per-node (world size = nodes x processes per node)")
        nproc_per_node = world_size // nnodes
    if not nproc_per_node or nproc_per_node < 1:
        raise SpecError("--nnodes needs --nproc-per-node (the ranks, one a GPU, on each node)",
                        hint="e.g. --nnodes 2 --nproc-per-node 8")
    if world_size and world_size != nnodes * nproc_per_node:
        raise SpecError(f"--world-size {world_size} is not --nnodes {nnodes} x --nproc-per-node {nproc_per_node} "
                        f"= {nnodes * nproc_per_node}", hint="drop --world-size: it is nodes x processes per node")
    if nnodes > 1 and not rdzv_endpoint:
        raise SpecError(f"--nnodes {nnodes}: the nodes meet at a rendezvous endpoint, and none was given",
                        hint="--rdzv-endpoint HOST:PORT (a machine of the job, the same on every node); " + SLURM_HINT)
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise SpecError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes} (0 .. {nnodes - 1})",
                        hint="number the nodes 0 .. N-1, node 0 on the endpoint's machine")
    return Nodes(nnodes=nnodes, nproc_per_node=nproc_per_node, rdzv_endpoint=rdzv_endpoint or f"localhost:{DEFAULT_PORT}",
                 node_rank=node_rank, rdzv_id=rdzv_id, source=source)


def torchrun_flags(n: Nodes) -> list[str]:
    """torchrun's flags for this node (torch/distributed/run.py): c10d, or static with this node's rank."""
    flags = [f"--nnodes={n.nnodes}", f"--nproc-per-node={n.nproc_per_node}", f"--rdzv-backend={n.rendezvous}",
             f"--rdzv-endpoint={n.rdzv_endpoint}", f"--rdzv-id={n.rdzv_id}"]
    if n.node_rank is not None:
        flags.append(f"--node-rank={n.node_rank}")
    return flags


def this_node() -> dict:
    """Which node this rank runs on: torchrun's GROUP_RANK (the node's place in the job), the hostname, LOCAL_RANK."""
    import socket

    env = os.environ
    return {"node": _int(env, "GROUP_RANK") or 0, "hostname": socket.gethostname(), "local_rank": _int(env, "LOCAL_RANK") or 0}
