"""One rank of ``memlens profile --world-size N``: run by torchrun, one process per GPU.

    python -m torch.distributed.run --standalone --nproc-per-node N -m memlens.measure.worker REQUEST.json

Each rank joins the process group torchrun describes (NCCL on CUDA, gloo on the CPU), builds its
step with :func:`memlens.step.prepare` on its own device (the spec's wrapper: DDP, ZeRO-1 or FSDP2),
profiles its own steps with :class:`memlens.measure.profiler.Profiler` (via
:func:`memlens.measure.runner.profile_spec`), writes its own record ``rank<R>.json`` (so a rank that
runs out of memory still says so), and rank 0 gathers every rank's Result with
``gather_object`` into one (:func:`memlens.measure.gather.merge_profiles`), ``result.json``.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from pathlib import Path

from ..core.spec import TrainingSpec
from .gather import merge_profiles
from .nodes import this_node
from .nvml import open_backend, process_used_bytes


def _record(out: Path, rank: int, rec: dict) -> None:
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(rec, default=str))
    os.replace(tmp, out / f"rank{rank}.json")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    req = json.loads(Path(argv[0]).read_text())
    out = Path(req["exchange"])
    import torch  # heavy: torch, loaded on first use
    import torch.distributed as dist  # heavy: torch, loaded on first use

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = req.get("device", "cuda") == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        torch.cuda.init()
        if req.get("memory_fraction") is not None:
            torch.cuda.set_per_process_memory_fraction(float(req["memory_fraction"]), local)
        # what this process holds before any collective: the CUDA context (for NCCL's own share)
        req_nvml0 = _nvml_used()
    else:
        req_nvml0 = None
    dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None)
    spec = TrainingSpec.from_dict(req["spec"])
    status = "ok"
    try:
        from .runner import profile_spec  # heavy: imports torch

        dev = f"cuda:{local}" if cuda else "cpu"
        result, artifacts = profile_spec(spec, steps=int(req.get("steps", 3)), warmup=int(req.get("warmup", 1)), device=dev,
                                         mode=req.get("mode", "phases"), torch_profiler=bool(req.get("torch_profiler")),
                                         snapshot=bool(req.get("snapshot")),
                                         trace_path=str(out / f"trace_rank{rank}.json") if req.get("torch_profiler") else None,
                                         own_process=True, gather=False)
        result.data["rank"] = rank
        result.data["world_size"] = dist.get_world_size()
        result.data["node"] = this_node()          # torchrun's GROUP_RANK and this machine's name (several nodes)
        if cuda:
            torch.cuda.synchronize()
            result.data["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result.data["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
            if req_nvml0 is not None:
                result.data.setdefault("nvml", {})["before_process_group_bytes"] = req_nvml0
        snap = artifacts.get("memory_snapshot")
        if snap is not None:

            with open(out / f"memory_snapshot_rank{rank}.pickle", "wb") as f:
                pickle.dump(snap, f)
        _record(out, rank, {"status": "ok", "result": result.to_dict()})
    except torch.OutOfMemoryError as e:
        status = "oom"
        _record(out, rank, {"status": "oom", "error": (str(e).splitlines() or ["CUDA out of memory"])[0][:300]})
    except Exception as e:  # noqa: BLE001 - reported by the launcher as this rank's failure
        status = "crash"
        msg = getattr(e, "message", None) or (str(e).splitlines() or [""])[0]
        _record(out, rank, {"status": "crash", "error": f"{type(e).__name__}: {msg[:300]}",
                            "hint": getattr(e, "hint", None), "traceback": traceback.format_exc()[-3000:]})
    if status != "ok":
        # the other ranks wait in a collective: leave at once so torchrun stops them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)

    mine = json.loads((out / f"rank{rank}.json").read_text())["result"]
    got = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank == 0:
        merged = merge_profiles(got)
        merged.save(out / "result.json")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _nvml_used() -> int | None:
    """NVML used memory of this process (None where the driver does not say)."""
    try:
        be = open_backend()
    except Exception:  # noqa: BLE001 - no NVML: no figure
        return None
    try:
        return process_used_bytes(be, os.getpid())
    except Exception:  # noqa: BLE001
        return None
    finally:
        be.close()


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: the rank's record and rank 0's result are written and the process
    # group is destroyed, but objects still referenced then (a DDP model's reducer holds its process group) are
    # finalized in no set order, and a joinable C++ thread destroyed on the way aborts the rank ("terminate called
    # without an active exception", SIGABRT: a gloo rank, about one job in ten under load on a 2-core CPU) after it
    # finished: torchrun then reports the job failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
