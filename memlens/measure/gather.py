"""Per-rank profiles of one job gathered into one Result, on rank 0.

``memlens profile --world-size N`` (under torchrun), :class:`memlens.measure.profiler.Profiler`
and the Trainer callbacks inside a user's own torchrun script each profile their own rank; rank 0
collects every rank's Result with ``torch.distributed.gather_object`` and :func:`merge_profiles`
makes one: the top-level peak is the rank that peaks (its categories, phases and modules), and
``ranks`` holds each rank's peaks, phases, categories, NVML figure and timeline, with the
imbalance between ranks. A job over several machines (``--nnodes``) records each rank's node (torchrun's GROUP_RANK)
and hostname: ``ranks[i]["node"]``, ``ranks[i]["hostname"]``, and ``nodes`` groups the ranks by node.

>>> from memlens.core.result import Result
>>> a = Result(verb="profile", peak_allocated_bytes=100, peak_reserved_bytes=200, data={"rank": 0, "peak_phase": "backward"})
>>> b = Result(verb="profile", peak_allocated_bytes=150, peak_reserved_bytes=210, data={"rank": 1, "peak_phase": "optimizer"})
>>> m = merge_profiles([a, b])
>>> m.peak_allocated_bytes, m.data["peak_rank"], m.data["rank_imbalance_bytes"], [r["rank"] for r in m.data["ranks"]]
(150, 1, 50, [0, 1])
"""
from __future__ import annotations

from typing import Any

from ..core.result import Result
from .nodes import this_node

RANK_FIELDS = ("peak_phase", "peak_step", "device", "mode", "steps", "nvml", "max_memory_allocated_bytes",
               "max_memory_reserved_bytes", "allocator", "model_load")


def rank_info() -> tuple[int, int] | None:
    """(rank, world size) when this process is one rank of a job with several, else None."""
    try:
        import torch.distributed as dist  # heavy: torch, loaded on first use
    except ImportError:   # pragma: no cover - torch without distributed
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def rank_summary(r: Result) -> dict[str, Any]:
    """What a merged Result keeps of one rank's profile."""
    d = r.data
    out: dict[str, Any] = {"rank": d.get("rank", 0), "peak_allocated_bytes": r.peak_allocated_bytes,
                           "peak_reserved_bytes": r.peak_reserved_bytes, "by_phase": r.by_phase,
                           "by_category": r.by_category, "timeline": r.timeline,
                           "by_module": r.by_module[:40], "pid": (r.environment or {}).get("pid"),
                           "device_name": (r.environment or {}).get("device_name")}
    for k in RANK_FIELDS:
        if k in d:
            out[k] = d[k]
    if isinstance(d.get("node"), dict):          # where the rank ran (this_node(), recorded by the rank itself)
        out.update({k: d["node"].get(k) for k in ("node", "hostname", "local_rank")})
    return out


def by_node(ranks: list[dict]) -> list[dict]:
    """The ranks grouped by the node they ran on (in node order): each node's ranks, hostname and peaks."""
    groups: dict[Any, list[dict]] = {}
    for r in ranks:
        groups.setdefault(r.get("node"), []).append(r)
    out = []
    for node, rs in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] if kv[0] is not None else 0)):
        top = max(rs, key=lambda r: r.get("peak_allocated_bytes") or 0)
        out.append({"node": node, "hostname": rs[0].get("hostname"), "ranks": [r["rank"] for r in rs],
                    "peak_allocated_bytes": top.get("peak_allocated_bytes"), "peak_rank": top["rank"],
                    "peak_reserved_bytes": max(r.get("peak_reserved_bytes") or 0 for r in rs)})
    return out


def merge_profiles(results: list[Result | dict]) -> Result:
    """One Result for the job: the rank that peaks on top, every rank in ``ranks``."""
    rs = [r if isinstance(r, Result) else Result.from_dict(r) for r in results]
    rs.sort(key=lambda r: r.data.get("rank", 0))
    peak = max(rs, key=lambda r: ((r.peak_allocated_bytes or 0), -r.data.get("rank", 0)))
    lo = min(rs, key=lambda r: r.peak_allocated_bytes or 0)
    ranks = [rank_summary(r) for r in rs]
    data = {k: v for k, v in peak.data.items() if k not in ("rank", "node")}
    data.update(ranks=ranks, peak_rank=peak.data.get("rank", 0), world_size=len(rs),
                rank_imbalance_bytes=(peak.peak_allocated_bytes or 0) - (lo.peak_allocated_bytes or 0))
    if any("node" in r for r in ranks):
        data["nodes"] = by_node(ranks)
    nv = [x.get("nvml", {}).get("process_used_bytes") for x in ranks]
    if all(v is not None for v in nv):
        data["job"] = {"gpus": len(rs), "peak_allocated_bytes_sum": sum(r.peak_allocated_bytes or 0 for r in rs),
                       "peak_reserved_bytes_sum": sum(r.peak_reserved_bytes or 0 for r in rs), "nvml_process_used_bytes_sum": sum(nv)}
    else:
        data["job"] = {"gpus": len(rs), "peak_allocated_bytes_sum": sum(r.peak_allocated_bytes or 0 for r in rs),
                       "peak_reserved_bytes_sum": sum(r.peak_reserved_bytes or 0 for r in rs)}
    if "nodes" in data:
        data["job"]["nodes"] = len(data["nodes"])
    notes = list(peak.notes) + [
        f"{len(rs)} ranks gathered on rank 0; the top-level figures are rank {data['peak_rank']}'s (the rank that peaks); "
        "ranks[] holds every rank's own peaks, phases and categories."]
    return Result(verb="profile", spec=peak.spec, peak_allocated_bytes=peak.peak_allocated_bytes,
                  peak_reserved_bytes=peak.peak_reserved_bytes, by_category=peak.by_category, by_phase=peak.by_phase,
                  by_module=peak.by_module, timeline=peak.timeline, notes=notes, environment=peak.environment, data=data)


def gather_profiles(result: Result, dst: int = 0) -> Result:
    """Inside a job: every rank calls this with its own Result (a collective). Rank ``dst`` gets the
    merged Result; the others get their own back, marked with their rank."""
    info = rank_info()
    if info is None:
        return result
    import torch.distributed as dist  # heavy: torch, loaded on first use

    rank, world = info
    result.data["rank"] = rank
    result.data["world_size"] = world
    result.data["node"] = this_node()
    got: list | None = [None] * world if rank == dst else None
    dist.gather_object(result.to_dict(), got, dst=dst)
    dist.barrier()          # no rank leaves (and tears its process group down) while rank dst still receives
    if rank != dst:
        return result
    return merge_profiles(got)
