"""``memlens profile --world-size N``: launch torchrun, one process per GPU, and read back the job.

    python -m torch.distributed.run --standalone --nproc-per-node N -m memlens.measure.worker REQUEST.json

Over several machines (``--nnodes``, :mod:`memlens.measure.nodes`) memlens runs on every node and launches torchrun
for that node's ranks, meeting the other nodes at the rendezvous endpoint:

    python -m torch.distributed.run --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        --rdzv-id=ID -m memlens.measure.worker REQUEST.json

The node that runs global rank 0 gets the whole job's Result; every other node gets its own ranks' Result.

Each rank (:mod:`memlens.measure.worker`) profiles its own step on its own GPU and leaves its
record in an exchange directory; rank 0 gathers the Results into one. A rank that runs out of
memory or fails says so in its record and leaves at once (torchrun then stops the others), so the
launcher can say which rank failed and why in one line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.errors import MemlensError, NoDeviceError
from ..core.parallel import sharding_of
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..estimator import estimate
from ..models.source import resolve
from ..step.plan import resolve as resolve_step
from .gather import merge_profiles
from .nodes import Nodes, torchrun_flags


def check_gpus(world_size: int, device: str = "cuda", gpus: list[int] | None = None) -> None:
    """One line when this machine cannot host ``world_size`` ranks."""
    if device != "cuda":
        return
    try:
        import torch  # heavy: torch, loaded on first use

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        have = 0
    visible = len(gpus) if gpus is not None else have
    if have == 0:
        raise NoDeviceError(f"--world-size {world_size} profiles {world_size} GPUs and this machine has none",
                            hint="use `memlens estimate --world-size N` on a CPU, or --device cpu (gloo, ledger only)")
    if world_size > visible:
        raise NoDeviceError(f"--world-size {world_size} needs {world_size} GPUs and {visible} are available",
                            hint=f"use --world-size {visible} or fewer, or a machine with {world_size} GPUs")


def child_env(gpus: list[int] | None = None) -> dict[str, str]:
    """Environment of the launched processes: this memlens first on the path, the chosen GPUs visible."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [pkg_root, os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def torchrun_command(world_size: int, request_path: str, nodes: Nodes | None = None) -> list[str]:
    """torchrun for one node: --standalone with every rank here, or this node's part of a job of several nodes."""
    where = torchrun_flags(nodes) if nodes is not None else ["--standalone", f"--nproc-per-node={world_size}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "-m", "memlens.measure.worker", request_path]


def run_job(spec: TrainingSpec, *, steps: int = 3, warmup: int = 1, mode: str = "phases", device: str = "cuda",
            torch_profiler: bool = False, snapshot: bool = False, gpus: list[int] | None = None,
            timeout: float = 1800, keep: str | Path | None = None, memory_fraction: float | None = None,
            nodes: Nodes | None = None) -> dict[str, Any]:
    """Run the job under torchrun; returns {"status", "result" (merged Result or None), "ranks" (this node's records),
    "error", "wall_seconds", "exchange", "has_rank_0"}. Never raises for the job's own fate (OOM, crash, timeout).
    With ``nodes``, this node's part: the whole job's Result where rank 0 ran, else this node's ranks merged."""
    exchange = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="memlens-job-"))
    exchange.mkdir(parents=True, exist_ok=True)
    req = {"spec": spec.to_dict(), "steps": steps, "warmup": warmup, "mode": mode, "device": device,
           "torch_profiler": torch_profiler, "snapshot": snapshot, "exchange": str(exchange), "memory_fraction": memory_fraction}
    req_path = exchange / "request.json"
    req_path.write_text(json.dumps(req))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": "ok", "result": None, "ranks": {}, "exchange": str(exchange)}
    try:
        p = subprocess.run(torchrun_command(spec.world_size, str(req_path), nodes), env=child_env(gpus),
                           capture_output=True, text=True, timeout=timeout)
        tail = [why_torchrun_failed(p.stderr or "")]
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"no result after {timeout:g} s"]
        out["status"] = "timeout"
    out["wall_seconds"] = round(time.perf_counter() - t0, 3)
    for f in sorted(exchange.glob("rank*.json")):
        out["ranks"][int(f.stem[4:])] = json.loads(f.read_text())
    merged = exchange / "result.json"
    out["has_rank_0"] = merged.exists()
    if rc == 0 and merged.exists():
        out["result"] = Result.load(merged)
        return out
    mine = [rec.get("result") for rec in out["ranks"].values()]
    if rc == 0 and nodes is not None and mine and all(mine):     # rank 0 ran on another node: this node's ranks
        out["result"] = merge_profiles(mine)
        return out
    failed = {r: rec for r, rec in out["ranks"].items() if rec.get("status") != "ok"}
    if out["status"] != "timeout":
        out["status"] = "oom" if any(rec["status"] == "oom" for rec in failed.values()) else "crash"
    if failed:
        r, rec = next(iter(sorted(failed.items())))
        out["error"] = f"rank {r}: {rec.get('error', '')}"
        out["hint"] = rec.get("hint")
    else:
        out["error"] = (tail[0] if tail and tail[0] else f"torchrun exit code {rc}")[:300]
    return out


_EXCEPTION = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b.*")
_ROOT_CAUSE = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.+)$")


def why_torchrun_failed(stderr: str) -> str:
    r"""The line of a failed torchrun job's stderr that says why, for a one-line error: the last exception a rank
    printed (not torchrun's own ChildFailedError), else the root cause torchrun's summary names (the rank, its exit
    code, the signal), else the last line that is not the summary's ``=====`` rule.

    >>> why_torchrun_failed("Traceback (most recent call last):\n  ...\nRuntimeError: gloo timeout\n====\n[0]:\n")
    'RuntimeError: gloo timeout'
    >>> why_torchrun_failed("Root Cause (first observed failure):\n  rank : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)\n"
    ...                     "  traceback : Signal 9 (SIGKILL) received by PID 7\n=====")
    'rank 1 (local_rank: 1): exitcode -9 (pid: 7); Signal 9 (SIGKILL) received by PID 7'
    """
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.strip() for ln in lines if _EXCEPTION.match(ln.strip()) and "ChildFailedError" not in ln]
    if errors:
        return errors[-1][:300]
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Root Cause")), default=None)
    if start is not None:
        found = dict(m.groups() for m in (_ROOT_CAUSE.match(ln) for ln in lines[start:]) if m)
        parts = [f"exitcode {found['exitcode']}" if "exitcode" in found else "",
                 found.get("traceback", "") if found.get("traceback") != "<N/A>" else ""]
        why = "; ".join(p for p in parts if p)
        if why:
            return (f"rank {found['rank']}: {why}" if "rank" in found else why)[:300]
    rest = [ln for ln in lines if set(ln.strip()) - set("=-")]
    return rest[-1][:300] if rest else ""


def profile_distributed(spec: TrainingSpec, *, steps: int = 3, warmup: int = 1, device: str | None = None,
                        mode: str = "phases", torch_profiler: bool = False, snapshot: bool = False,
                        compare_estimate: bool = False, out_dir: str | Path | None = None,
                        timeout: float = 1800, nodes: Nodes | None = None) -> tuple[Result, dict]:
    """``profile_spec`` for several GPUs: torchrun launched here, every rank profiled, one Result.

    With ``nodes`` (a job over several machines, run on each): this node's ranks launched here; the Result is the whole
    job's on the node of rank 0, this node's ranks' elsewhere (``data["multinode"]`` says which).
    Per-rank artifacts (memory snapshots, Chrome traces) are copied into ``out_dir`` as
    ``memory_snapshot_rank<R>.pickle`` / ``trace_rank<R>.json``.
    """
    if nodes is not None and spec.world_size != nodes.world_size:
        spec = spec.replace(world_size=nodes.world_size)
    dev = _check_job(spec, steps, warmup, device)
    check_gpus(nodes.nproc_per_node if nodes is not None else spec.world_size, dev)
    job = run_job(spec, steps=steps, warmup=warmup, mode=mode, device=dev, torch_profiler=torch_profiler,
                  snapshot=snapshot, timeout=timeout, nodes=nodes)
    try:
        if job["result"] is None:
            what = {"oom": "ran out of memory", "timeout": "timed out"}.get(job["status"], "failed")
            where = f" (node part: {nodes.nproc_per_node} of its ranks here)" if nodes is not None else ""
            raise MemlensError(f"the {spec.world_size}-rank job {what}{where}: {job.get('error')}",
                               hint=job.get("hint") or "rerun one rank's step with `memlens profile` (no --world-size) to see it alone")
        result = job["result"]
        result.data["launcher"] = {"command": " ".join(["python"] + torchrun_command(spec.world_size, "REQUEST", nodes)[1:-1]),
                                   "wall_seconds": job["wall_seconds"]}
        if nodes is not None:
            result.data["multinode"] = _multinode(nodes, job["has_rank_0"], result)
        if out_dir is not None:
            d = Path(out_dir)
            d.mkdir(parents=True, exist_ok=True)
            for f in Path(job["exchange"]).glob("*_rank*.*"):
                shutil.copy(f, d / f.name)
        if compare_estimate:
            result.data["compare_estimate"] = compare_ranks(spec, result)
        return result, {}
    finally:
        shutil.rmtree(job["exchange"], ignore_errors=True)


def _check_job(spec: TrainingSpec, steps: int, warmup: int, device: str | None) -> str:
    """The refusals of a job launched under torchrun, in one line each; the device kind ("cuda" | "cpu")."""
    if steps < 1:
        raise MemlensError(f"--steps must be at least 1, got {steps}", hint="e.g. --steps 3")
    if warmup < 0:
        raise MemlensError(f"--warmup must be 0 or more, got {warmup}", hint="e.g. --warmup 1")
    dev = "cpu" if device == "cpu" else "cuda"
    if device not in (None, "cpu", "cuda"):
        raise MemlensError(f"--device {device} names one GPU; --world-size {spec.world_size} uses the first {spec.world_size}",
                           hint="drop --device (or use CUDA_VISIBLE_DEVICES to choose the GPUs)")
    if dev == "cpu" and sharding_of(spec).family != "ddp":
        raise MemlensError("--device cpu runs gloo, which FSDP2's collectives on CPU tensors are not measured with",
                           hint="use --sharding ddp on the CPU, or a GPU machine")
    resolve(spec.model)            # a bad --model is the first thing to say
    resolve_step(spec, fake=False)   # its refusals, the multi-GPU ones (memlens.step.parallel.check) among them
    return dev


def _multinode(nodes: Nodes, has_rank_0: bool, result: Result) -> dict[str, Any]:
    """What this node's launch was, and whether its Result is the whole job's."""
    return {"nnodes": nodes.nnodes, "nproc_per_node": nodes.nproc_per_node, "rendezvous": nodes.rendezvous,
            "rdzv_endpoint": nodes.rdzv_endpoint, "node_rank": nodes.node_rank, "source": nodes.source,
            "whole_job": has_rank_0, "ranks_here": [r["rank"] for r in result.data.get("ranks", [])],
            "note": ("rank 0 ran on this node: every node's ranks are gathered here" if has_rank_0 else
                     "rank 0 ran on another node, which holds the whole job's report; this Result holds this node's ranks")}


def compare_ranks(spec: TrainingSpec, measured: Result) -> dict[str, Any]:
    """The per-rank estimate beside each measured rank (peak allocated and reserved)."""
    try:
        est = estimate(spec)
    except MemlensError as e:
        return {"available": False, "reason": e.message}
    by_rank: dict[int, dict] = {}
    for e in est.data["ranks"]:
        for r in e["ranks"]:
            by_rank[r] = e
    rows = []
    for m in measured.data["ranks"]:
        e = by_rank.get(m["rank"], {})
        ea, er = e.get("peak_allocated_bytes"), e.get("peak_reserved_bytes")
        ma, mr = m["peak_allocated_bytes"], m["peak_reserved_bytes"]
        rows.append({"name": f"rank {m['rank']} peak allocated", "estimated_bytes": ea, "measured_bytes": ma,
                     "error": round((ea - ma) / ma, 6) if ea and ma else None})
        rows.append({"name": f"rank {m['rank']} peak reserved", "estimated_bytes": er, "measured_bytes": mr,
                     "error": round((er - mr) / mr, 6) if er and mr else None})
    return {"available": True, "rows": rows, "by_phase": [], "by_category": [],
            "note": "estimate: each rank simulated under a fake process group (memlens.step.parallel); ranks between two "
                    "simulated ranks take the simulated rank of their group.", "estimate_peak_rank": est.data.get("peak_rank")}


def job_trial(spec: TrainingSpec, *, steps: int = 3, timeout: float = 600, memory_fraction: float | None = None,
              gpus: list[int] | None = None) -> dict[str, Any]:
    """A measured trial of a multi-GPU spec (sweep, compare): the job under torchrun, as a trial record
    (``status`` ok | oom | timeout | crash; the peaks of the rank that peaks; every rank's peaks)."""
    job = run_job(spec, steps=steps, warmup=1, mode="phases", gpus=gpus, timeout=timeout, memory_fraction=memory_fraction)
    try:
        rec: dict[str, Any] = {"spec": spec.to_dict(), "device": "cuda", "status": job["status"], "memory_measured": True,
                               "wall_seconds": job.get("wall_seconds"), "gpus": gpus}
        r = job["result"]
        if r is None:
            rec.update(error=job.get("error"), peak_allocated_bytes=None, peak_reserved_bytes=None)
            return rec
        rec.update(peak_allocated_bytes=r.peak_allocated_bytes, peak_reserved_bytes=r.peak_reserved_bytes,
                   peak_rank=r.data.get("peak_rank"),
                   ranks=[{"rank": x["rank"], "peak_allocated_bytes": x["peak_allocated_bytes"],
                           "peak_reserved_bytes": x["peak_reserved_bytes"]} for x in r.data.get("ranks", [])],
                   seconds=_median_step_seconds(r), timeline=[])
        return rec
    finally:
        shutil.rmtree(job["exchange"], ignore_errors=True)


def _median_step_seconds(r: Result) -> float | None:
    secs = sorted(s.get("host_seconds") for s in r.data.get("steps") or [] if s.get("host_seconds") is not None)
    return secs[len(secs) // 2] if secs else None
