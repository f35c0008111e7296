"""Per-rank ground truth for `memlens estimate --world-size N` (DDP, ZeRO-1, FSDP2), on N GPUs.

Run on the GPU machine from the repo root:

    python bench/gpu_distributed.py OUT_DIR --world-size 2 [case-name-substring ...]

Every case (bench/distributed_cases.py) runs in a fresh torchrun job through bench/gpu_runner.py (`python -m
torch.distributed.run --standalone --nproc-per-node N bench/gpu_runner.py --child REQUEST`; cases already in the
JSONL are skipped, --fresh starts over, --dry-run checks every spec on the CPU): each rank builds the step with memlens' own prepared step (memlens.step.prepare: the same wrapper
the estimate simulates: DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2 fully_shard),
resets its peak counters after building, runs 3 optimizer steps, and returns its record; the
runner appends one JSON line per case to OUT_DIR/gpu_distributed.jsonl (nothing lost on a
timeout) with every rank's max_memory_allocated / max_memory_reserved, allocated at every phase
boundary, NVML per-process used memory, and NCCL's own memory (NVML growth that the caching
allocator does not explain, after the CUDA libraries were warmed up before the process group).
Then `memlens profile --world-size N` runs once under torchrun (report.html with a lane per
rank, written to OUT_DIR/profile_fsdp/), and a screenshot is taken with headless Chromium if the
machine has one. A short table is printed at the end. Budget: ~8 minutes on 2 H200s.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import gib, last_records, list_or_run, read_jsonl, runner_args  # noqa: E402

STEPS = int(os.environ.get("MEMLENS_BENCH_STEPS", "3"))    # optimizer steps per case
# MEMLENS_BENCH_SEGMENTS=1: every rank records the caching allocator's segment allocations after step 1 (size, step,
# phase, the Python frames of the allocation that made it): where a rank's reserved grows past the estimate
SEGMENTS = os.environ.get("MEMLENS_BENCH_SEGMENTS") == "1"
SEGMENTS_FROM = int(os.environ.get("MEMLENS_BENCH_SEGMENTS_FROM", "2"))   # the step the recording starts at (0: the build)
CASE_TIMEOUT = 240


def _nvml_used(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        used = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    used = (used or 0) + p.usedGpuMemory
        return used
    except Exception:  # noqa: BLE001
        return None


def rank_case(name: str, fields: dict, dry: bool) -> dict:
    """One rank of one case, run by torchrun through bench/gpu_runner.py (each rank returns its own record; an
    exception, OOM included, becomes the rank's error and the rank leaves at once, so torchrun stops the others).
    --dry-run (no torchrun): the spec is checked on the CPU (model, parallel settings) and nothing runs."""
    if dry:
        from memlens.core.spec import TrainingSpec
        from memlens.models.source import resolve
        from memlens.step.plan import resolve as resolve_step

        spec = TrainingSpec(**fields)
        resolve(spec.model)
        resolve_step(spec, fake=True)   # every refusal, the multi-GPU ones among them
        return {"checked": True, "world_size": spec.world_size, "sharding": spec.sharding}
    import torch
    import torch.distributed as dist

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    rec: dict = {"rank": rank}
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    # warm the CUDA libraries a step uses (cuBLAS, cuDNN attention) so NVML's growth after this is NCCL's
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 128, 64, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    del a, q
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()   # the step allocates its own at its first GEMM (as the estimate does)
    torch.cuda.empty_cache()
    pid = os.getpid()
    rec["nvml_before_process_group"] = _nvml_used(pid)
    rec["reserved_before_process_group"] = torch.cuda.memory_reserved()
    dist.init_process_group("nccl", device_id=dev)
    dist.barrier()
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    del t
    torch.cuda.empty_cache()
    rec["nvml_after_process_group"] = _nvml_used(pid)
    rec["reserved_after_process_group"] = torch.cuda.memory_reserved()
    spec = TrainingSpec.from_dict(fields)
    if SEGMENTS and SEGMENTS_FROM == 0:     # every segment's address, the build's included
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400_000)
    t0 = time.perf_counter()
    step = prepare(spec, device=dev, seed=0)
    torch.cuda.synchronize()
    rec["build_s"] = time.perf_counter() - t0
    rec["after_build_allocated"] = torch.cuda.memory_allocated()
    rec["after_build_reserved"] = torch.cuda.memory_reserved()
    rec["applied"] = step.applied
    rec["tied_embeddings_kept"] = True      # FSDP builds re-tie embeddings (runs before this key measured untied ones)
    torch.cuda.reset_peak_memory_stats()
    rec.update(run_steps(step))
    rec["nvml_after_steps"] = _nvml_used(pid)
    b0, b1, b2 = rec["nvml_before_process_group"], rec["nvml_after_process_group"], rec["nvml_after_steps"]
    if None not in (b0, b1, b2):
        # NVML growth not explained by the caching allocator's reserved memory
        rec["nccl_bytes_after_init"] = b1 - b0 - (rec["reserved_after_process_group"] - rec["reserved_before_process_group"])
        rec["nccl_bytes"] = b2 - b0 - (rec["reserved_now"] - rec["reserved_before_process_group"])
        rec["cuda_context_bytes"] = b0 - rec["reserved_before_process_group"]
    dist.barrier()
    dist.destroy_process_group()
    return rec


def run_steps(step) -> dict:
    """STEPS optimizer steps with the allocated bytes at every phase boundary; the peaks over them."""
    import torch

    steps, phases, marks = [], [], []
    for n in range(1, STEPS + 1):
        if SEGMENTS and n == SEGMENTS_FROM:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400_000)

        def on_phase(ph, n=n):
            torch.cuda.synchronize()
            phases.append({"phase": ph, "step": n, "allocated": torch.cuda.memory_allocated(),
                           "peak_so_far": torch.cuda.max_memory_allocated()})
            if SEGMENTS and n >= SEGMENTS_FROM:    # a marker in the trace: an allocation of a size nothing else makes
                marks.append((n, ph))
                torch.empty(512 * (1000 + len(marks)), dtype=torch.uint8, device="cuda")

        t1 = time.perf_counter()
        loss = step.run(on_phase)
        torch.cuda.synchronize()
        steps.append({"step": n, "seconds": time.perf_counter() - t1, "loss": float(loss) if loss is not None else None,
                      "end_allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()})
    stats = torch.cuda.memory_stats()
    extra = {"segment_allocs": _segment_allocs(torch, marks)} if SEGMENTS else {}   # {"segments": ..., "large_events": ...}
    return dict(status="ok", steps=steps, phases=phases, **extra, max_allocated=torch.cuda.max_memory_allocated(),
                max_reserved=stats["reserved_bytes.all.peak"], reserved_now=torch.cuda.memory_reserved(),
                num_alloc_retries=stats.get("num_alloc_retries"), segments=stats.get("segment.all.current"))


def _segment_allocs(torch, marks: list) -> list:
    """The segments allocated from step 2 on: bytes, the step and phase mark before them, and the frames (memlens,
    torch, transformers) of the allocation that made each."""
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    # every segment held at the end: [address, bytes, pool ("large"/"small"), stream]
    held = sorted([s["address"], s["total_size"], s.get("segment_type"), s.get("stream", 0)] for s in snap["segments"]
                  if s.get("device", torch.cuda.current_device()) == torch.cuda.current_device())
    out, at, big = [], ((SEGMENTS_FROM, "start") if SEGMENTS_FROM else (0, "build")), []
    for i, e in enumerate(trace):
        k = e["size"] // 512 - 1001 if e["action"] == "alloc" and e["size"] % 512 == 0 else -1
        if 0 <= k < len(marks) and e["size"] == 512 * (1001 + k):
            at = marks[k]
        if e["action"] in ("alloc", "free_requested", "free_completed", "segment_free") and e["size"] >= 2**20:
            big.append([at[0], at[1], e["action"], e["size"], e["addr"], e.get("stream", 0)])
        if e["action"] != "segment_alloc":
            continue
        step, phase = at
        big.append([step, phase, "segment_alloc", e["size"], e["addr"], e.get("stream", 0)])
        frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in e.get("frames", [])
                  if "/torch/" in f["filename"] or "memlens" in f["filename"] or "transformers" in f["filename"]][:12]
        out.append({"bytes": e["size"], "step": step, "after_phase": phase, "index": i, "frames": frames})
    # every event of 1 MiB or more from step 2 on: [step, phase, action, bytes, address, stream] (to replay against the estimate)
    return {"segments": out, "large_events": big, "held_segments": held}


PROFILES = {  # name: the profile command's flags (one run each under torchrun; report.html with a lane per rank)
    "profile_fsdp": ["--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "1024", "--precision", "amp-bf16",
                     "--sharding", "fsdp"],
    # issue 27: the source profiler's scenario, Opacus ghost clipping under FSDP2 with BatchMemoryManager
    "profile_dp_ghost_fsdp_8b": ["--model", "llama-3.1-8b", "--dp", "--grad-sample-mode", "ghost", "--batch-size", "4",
                                 "--physical-batch-size", "2", "--seq-len", "512", "--lora-rank", "16", "--precision", "bf16",
                                 "--sharding", "fsdp"],
}


def profile_run(out_dir: Path, world_size: int, name: str) -> None:
    """`memlens profile --world-size N` once, and a screenshot if Chromium is here (else it is taken where the report lands)."""
    d = out_dir / name
    cmd = [sys.executable, "-m", "memlens.cli.main", "profile", *PROFILES[name], "--world-size", str(world_size), "--steps", "2",
           "--out", str(d), "--compare-estimate"]
    t = time.time()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]),
                                COLUMNS="160"))
    (out_dir / f"{name}_cli_output.txt").write_text(" ".join(cmd[2:]) + "\n" + p.stdout + p.stderr)
    print(f"memlens profile {name} --world-size {world_size}: rc={p.returncode} {time.time() - t:.0f}s", flush=True)
    chrome = next((shutil.which(c) for c in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(c)), None)
    if chrome and (d / "report.html").exists():
        subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,2400",
                        f"--screenshot={out_dir / (name + '_report.png')}", f"file://{d / 'report.html'}"],
                       check=False, capture_output=True, timeout=120)


CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
COLUMNS = [("ranks: max allocated GiB", lambda r: " ".join(f"r{x['rank']}={gib(x.get('max_allocated'))}" for x in r.get("ranks", []))
            or "-"),
           ("checked (--dry-run)", lambda r: r.get("checked", "-"))]


def main(argv: list[str] | None = None) -> None:
    ap = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=CASE_TIMEOUT)
    ap.add_argument("--world-size", type=int, default=2, help="GPUs, one rank each (default 2)")
    a = ap.parse_args(argv)
    out, ws = Path(a.out), a.world_size
    from bench.distributed_cases import cases, dp_cases

    profiles = [f for f in a.filters if f in PROFILES]
    a.filters = [f for f in a.filters if f not in PROFILES]
    if a.list:
        list_or_run(a, dp_cases(ws) + cases(ws))
        return
    out.mkdir(parents=True, exist_ok=True)
    if not a.dry_run:
        import torch

        if torch.cuda.device_count() < ws:
            sys.exit(f"needs {ws} GPUs, this machine has {torch.cuda.device_count()}")
    torchrun = None if a.dry_run else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ws}"]
    run = dict(fn=rank_case, jsonl="gpu_distributed.jsonl", launcher=torchrun, env=CHILD_ENV,
               env_file=f"gpu_distributed_env_ws{ws}.json", columns=COLUMNS,
               meta=lambda c: {"spec": c.payload, "world_size": ws})
    list_or_run(a, dp_cases(ws), **run)       # DP-SGD first (issue 27), then its profile, then the other per-rank cases
    if not a.dry_run:
        for name in profiles or ([] if a.filters else list(PROFILES)[::-1]):
            profile_run(out, ws, name)
    list_or_run(a, cases(ws), **run)
    if not a.dry_run:
        print("\ncase | rank | max allocated GiB | max reserved GiB | NVML GiB | NCCL MiB")
        for rec in last_records(read_jsonl(out / "gpu_distributed.jsonl")).values():
            for r in rec.get("ranks", []):
                if r.get("status") == "ok":
                    print(f"{rec['name']} | {r['rank']} | {r['max_allocated'] / 2**30:.3f} | {r['max_reserved'] / 2**30:.3f} | "
                          f"{(r.get('nvml_after_steps') or 0) / 2**30:.2f} | {(r.get('nccl_bytes') or 0) / 2**20:.0f}")


if __name__ == "__main__":
    main()
