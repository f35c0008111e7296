"""Measure one spec with real steps, in a fresh subprocess with a timeout.

A fresh process per trial gives each one its own caching allocator, cuBLAS handles and CUDA
context, so one trial's fragmentation or OOM never leaks into the next, and a hang or a crash
(segfault, kill) is contained. The parent gets a dict with ``status``:

- ``ok``: ``peak_allocated_bytes`` (max_memory_allocated over the steps), ``peak_reserved_bytes``,
  ``step_seconds`` (each step, synchronized), ``losses`` (each step's loss), ``timeline``
  (allocated at each phase boundary);
- ``oom``: torch raised OutOfMemoryError (``error`` holds its first line);
- ``timeout``: killed after ``timeout`` seconds;
- ``crash``: the process died or raised something else (``error``: the last line of stderr).

``detailed=True`` (the Opacus profiler's detailed mode) profiles the steps instead (``memlens
profile``'s runner, full mode: the allocator's history on CUDA, the ledger on the CPU) and adds
``detail``: the peak by category (memory type), by phase (operation), by component (attention,
MLP, embedding, norm, LoRA) and the labelled snapshots.

On ``device="cpu"`` the steps run on real CPU tensors under the CPU ledger of ``memlens profile
--device cpu`` (the profiler's StorageTracker: the bytes of every live tensor storage): times,
losses and the peak of the storages are measured (``measured_by`` says so; there is no caching
allocator, so reserved = allocated). That is what CI uses to test the subprocess, timeout and
resume machinery without a GPU.

>>> from memlens.core.spec import TrainingSpec
>>> rec = run_trial(TrainingSpec(model="gpt2", batch_size=1, seq_len=16), device="cpu", steps=1)  # doctest: +SKIP
>>> rec["status"], rec["measured_by"]                                                              # doctest: +SKIP
('ok', 'cpu ledger')
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from ..core.errors import sentences
from ..core.parallel import is_distributed
from ..core.spec import TrainingSpec
from ..step import prepare
from .launch import job_trial

MARK = "MEMLENS_TRIAL "


def measure(spec: TrainingSpec, *, device: str = "cuda", steps: int = 3, memory_fraction: float | None = None,
            seed: int = 0, detailed: bool = False) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of ``spec`` in this process and return what was measured.

    The model is built by memlens' builder with weights from ``torch.manual_seed(seed)`` and trained by
    memlens' prepared step (``memlens.step.prepare``), the code ``estimate`` simulates.
    """
    import torch  # heavy: torch, loaded on first use

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    rec: dict[str, Any] = {"status": "ok", "device": device, "memory_measured": True, "steps": steps,
                           "measured_by": "cuda allocator" if cuda else "cpu ledger"}
    if cuda:
        torch.cuda.init()
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(float(memory_fraction), dev.index)
        rec["device_name"] = torch.cuda.get_device_name(dev)
        rec["total_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    timeline: list[dict[str, Any]] = []
    if detailed:
        return _measure_detailed(spec, dev, steps, rec)
    try:
        step = prepare(spec, device=dev, seed=seed)
        if cuda:  # this process is the trial's own: its peak counter measures the steps only
            torch.cuda.reset_peak_memory_stats(dev)
        ledger = None if cuda else _cpu_ledger(step, spec)
        times, losses = [], []
        t_start = time.perf_counter()
        if ledger is not None:
            ledger.__enter__()
        for n in range(1, steps + 1):
            def on_phase(ph: str, n: int = n) -> None:
                if cuda:
                    timeline.append({"step": n, "phase": ph, "t": round(time.perf_counter() - t_start, 6),
                                     "allocated_bytes": torch.cuda.memory_allocated(dev),
                                     "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev)})

            sync()
            t = time.perf_counter()
            loss = step.run(on_phase)
            sync()
            times.append(time.perf_counter() - t)
            losses.append(float(loss) * spec.grad_accum if loss is not None else None)
        if ledger is not None:
            ledger.__exit__(None, None, None)
        rec["step_seconds"] = times
        rec["seconds"] = _median(times[1:] or times)
        rec["losses"] = losses
        if cuda:
            rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
            rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
            rec["num_alloc_retries"] = torch.cuda.memory_stats(dev).get("num_alloc_retries")
        elif ledger is None:
            rec.update(peak_allocated_bytes=None, peak_reserved_bytes=None, memory_measured=False,
                       measured_by="not measured: Opacus' functorch per-sample gradients cannot run under the CPU ledger")
        else:
            r = ledger.result
            rec["peak_allocated_bytes"] = rec["peak_reserved_bytes"] = r.peak_allocated_bytes
            timeline = [{"step": p["step"], "phase": p["phase"], "t": p["t_s"], "allocated_bytes": p["allocated_bytes"],
                         "peak_allocated_bytes": p["peak_allocated_bytes"]} for p in r.data.get("snapshots", [])]
        rec["timeline"] = timeline
    except torch.OutOfMemoryError as e:
        rec = {**rec, "status": "oom", "error": sentences(e, 300) or "OutOfMemoryError",
               "peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return rec


def _cpu_ledger(step, spec: TrainingSpec):
    """The profiler in its CPU ledger mode over a prepared step (as `memlens profile --device cpu` runs it)."""
    from .profiler import Profiler  # heavy: imports torch

    dp = step.dp
    if dp is not None and dp.functorch_layers:   # functorch cannot run under the ledger's saved-tensor hooks
        return None
    prof = Profiler(step.model, dp.original_optimizer if dp else step.optimizer, device="cpu", mode="phases",
                    spec=spec.to_dict())
    if dp:
        dp.observer = prof
    return prof


def _measure_detailed(spec: TrainingSpec, dev, steps: int, rec: dict[str, Any]) -> dict[str, Any]:
    """The steps under memlens' profiler (full mode): the peak and its breakdown per category, phase and component."""
    import torch  # heavy: torch, loaded on first use

    from .runner import profile_spec  # heavy: imports torch

    cuda = dev.type == "cuda"
    try:
        r, _ = profile_spec(spec, steps=steps, warmup=0, device=dev, mode="full")
    except torch.OutOfMemoryError as e:
        return {**rec, "status": "oom", "error": sentences(e, 300) or "OutOfMemoryError",
                "peak_allocated_bytes": None, "peak_reserved_bytes": None}
    d = r.data
    times = [s["host_seconds"] for s in d.get("steps", [])]
    rec.update(step_seconds=times, seconds=_median(times[1:] or times), losses=None,
               peak_allocated_bytes=r.peak_allocated_bytes if cuda else None,
               peak_reserved_bytes=r.peak_reserved_bytes if cuda else None,
               timeline=[{"step": s["step"], "phase": s["phase"], "label": s["label"], "t": s["t_s"],
                          "allocated_bytes": s["allocated_bytes"], "peak_allocated_bytes": s["peak_allocated_bytes"]}
                         for s in d.get("snapshots", [])],
               detail={"source": d.get("measured_by"), "peak_allocated_bytes": r.peak_allocated_bytes,
                       "by_category": {k: v for k, v in r.by_category.items() if v},
                       "by_phase": {k: v["peak_allocated_bytes"] for k, v in r.by_phase.items()},
                       "by_component": d.get("by_component") or [], "dp": d.get("dp")})
    return rec


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _child_env() -> dict[str, str]:
    """The child imports this same memlens (and factories from the working directory)."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [pkg_root, os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_trial(spec: TrainingSpec, *, device: str = "cuda", steps: int = 3, timeout: float = 600,
              memory_fraction: float | None = None, seed: int = 0, detailed: bool = False,
              gpus: list[int] | None = None) -> dict[str, Any]:
    """``measure`` in a fresh ``python -m memlens.measure.trial`` process; never raises for the trial's fate.
    The child inherits the environment (HF_TOKEN for gated configs: never on its command line).

    ``gpus``: the GPUs the trial may see (CUDA_VISIBLE_DEVICES). A spec for several GPUs runs under
    torchrun, one process per GPU (:func:`memlens.measure.launch.job_trial`; every rank's peaks)."""
    if is_distributed(spec):
        return job_trial(spec, steps=steps, timeout=timeout, memory_fraction=memory_fraction, gpus=gpus)
    req = {"spec": spec.to_dict(), "device": device, "steps": steps, "memory_fraction": memory_fraction, "seed": seed,
           "detailed": detailed}
    t = time.perf_counter()
    base = {"spec": spec.to_dict(), "device": device}
    try:
        env = _child_env()
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        p = subprocess.run([sys.executable, "-m", "memlens.measure.trial"], input=json.dumps(req), capture_output=True,
                           text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "error": f"no result after {timeout:g} s", "wall_seconds": time.perf_counter() - t}
    wall = time.perf_counter() - t
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            rec = json.loads(line[len(MARK):])
            rec["wall_seconds"] = wall
            return {**base, **rec}
    tail = [ln for ln in (p.stderr or "").strip().splitlines() if ln.strip()][-1:] or [f"exit code {p.returncode}"]
    return {**base, "status": "crash", "returncode": p.returncode, "error": tail[0][:300], "wall_seconds": wall}


def _main() -> int:
    req = json.loads(sys.stdin.read())
    spec = TrainingSpec.from_dict(req["spec"])
    try:
        rec = measure(spec, device=req.get("device", "cuda"), steps=int(req.get("steps", 3)),
                      memory_fraction=req.get("memory_fraction"), seed=int(req.get("seed", 0)),
                      detailed=bool(req.get("detailed", False)))
    except Exception as e:  # noqa: BLE001 - reported to the parent as a crash
        rec = {"status": "crash", "error": f"{type(e).__name__}: {sentences(e, 300)}"}
    sys.stdout.write(MARK + json.dumps(rec) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
