"""Per-rank ground truth for `memlens estimate --world-size N` (DDP, ZeRO-1, FSDP2), on N GPUs.

Run on the GPU machine from the repo root:

    python bench/gpu_distributed.py OUT_DIR --world-size 2 [case-name-substring ...]

Every case (bench/distributed_cases.py) runs in a fresh torchrun job (`python -m
torch.distributed.run --standalone --nproc-per-node N bench/gpu_distributed.py --rank REQUEST`):
each rank builds the step with memlens' own prepared step (memlens.step.prepare: the same wrapper
the estimate simulates: DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2 fully_shard),
resets its peak counters after building, runs 3 optimizer steps, and writes its record; the
parent appends one JSON line per case to OUT_DIR/gpu_distributed.jsonl (nothing lost on a
timeout) with every rank's max_memory_allocated / max_memory_reserved, allocated at every phase
boundary, NVML per-process used memory, and NCCL's own memory (NVML growth that the caching
allocator does not explain, after the CUDA libraries were warmed up before the process group).
Then `memlens profile --world-size N` runs once under torchrun (report.html with a lane per
rank, written to OUT_DIR/profile_fsdp/), and a screenshot is taken with headless Chromium if the
machine has one. A short table is printed at the end. Budget: ~8 minutes on 2 H200s.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 3
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


def rank_main(req_path: str) -> None:
    """One rank of one case (run by torchrun)."""
    import torch
    import torch.distributed as dist

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    req = json.loads(Path(req_path).read_text())
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    out = Path(req["out"])
    rec: dict = {"rank": rank}
    try:
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
        spec = TrainingSpec.from_dict(req["spec"])
        t0 = time.perf_counter()
        step = prepare(spec, device=dev, seed=0)
        torch.cuda.synchronize()
        rec["build_s"] = time.perf_counter() - t0
        rec["after_build_allocated"] = torch.cuda.memory_allocated()
        rec["after_build_reserved"] = torch.cuda.memory_reserved()
        rec["applied"] = step.applied
        rec["tied_embeddings_kept"] = True      # FSDP builds re-tie embeddings (runs before this key measured untied ones)
        torch.cuda.reset_peak_memory_stats()
        steps, phases = [], []
        for n in range(1, STEPS + 1):
            def on_phase(ph, n=n):
                torch.cuda.synchronize()
                phases.append({"phase": ph, "step": n, "allocated": torch.cuda.memory_allocated(),
                               "peak_so_far": torch.cuda.max_memory_allocated()})

            t1 = time.perf_counter()
            loss = step.run(on_phase)
            torch.cuda.synchronize()
            steps.append({"step": n, "seconds": time.perf_counter() - t1, "loss": float(loss) if loss is not None else None,
                          "end_allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()})
        stats = torch.cuda.memory_stats()
        rec.update(status="ok", steps=steps, phases=phases, max_allocated=torch.cuda.max_memory_allocated(),
                   max_reserved=stats["reserved_bytes.all.peak"], reserved_now=torch.cuda.memory_reserved(),
                   num_alloc_retries=stats.get("num_alloc_retries"), segments=stats.get("segment.all.current"))
        rec["nvml_after_steps"] = _nvml_used(pid)
        b0, b1, b2 = rec["nvml_before_process_group"], rec["nvml_after_process_group"], rec["nvml_after_steps"]
        if None not in (b0, b1, b2):
            # NVML growth not explained by the caching allocator's reserved memory
            rec["nccl_bytes_after_init"] = b1 - b0 - (rec["reserved_after_process_group"] - rec["reserved_before_process_group"])
            rec["nccl_bytes"] = b2 - b0 - (rec["reserved_now"] - rec["reserved_before_process_group"])
            rec["cuda_context_bytes"] = b0 - rec["reserved_before_process_group"]
        dist.barrier()
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", error=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001
        import traceback

        rec.update(status="crash", error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc()[-3000:])
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    if rec.get("status") != "ok":
        os._exit(3)
    dist.destroy_process_group()


def run_case(out_dir: Path, name: str, fields: dict, world_size: int) -> dict:
    ex = Path(tempfile.mkdtemp(prefix="memlens-bench-"))
    req = ex / "request.json"
    req.write_text(json.dumps({"spec": fields, "out": str(ex)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    t = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", __file__, "--rank", str(req)]
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=CASE_TIMEOUT, env=env, cwd=ROOT)
        rc, tail = p.returncode, [ln for ln in p.stderr.splitlines() if ln.strip()][-3:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", []
    ranks = [json.loads(f.read_text()) for f in sorted(ex.glob("rank*.json"), key=lambda f: int(f.stem[4:]))]
    shutil.rmtree(ex, ignore_errors=True)
    rec = {"name": name, "spec": fields, "world_size": world_size, "returncode": rc, "wall_s": round(time.time() - t, 1),
           "ranks": ranks}
    if rc != 0 or len(ranks) != world_size or any(r.get("status") != "ok" for r in ranks):
        rec["error"] = next((f"rank {r['rank']}: {r.get('error')}" for r in ranks if r.get("status") != "ok"), " | ".join(tail) or str(rc))
    with open(out_dir / "gpu_distributed.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


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


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
        return
    args = sys.argv[1:]
    out = Path(args.pop(0))
    world_size = 2
    if "--world-size" in args:
        i = args.index("--world-size")
        world_size = int(args[i + 1])
        del args[i:i + 2]
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    from bench.distributed_cases import cases, dp_cases

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": torch.cuda.get_device_name(0),
           "gpus": torch.cuda.device_count(), "total_memory": torch.cuda.get_device_properties(0).total_memory,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
           "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}, "world_size": world_size}
    (out / f"gpu_distributed_env_ws{world_size}.json").write_text(json.dumps(env, indent=1))
    if torch.cuda.device_count() < world_size:
        sys.exit(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    rows = []
    profiles = [a for a in args if a in PROFILES]
    args = [a for a in args if a not in PROFILES]

    def run(name, fields):
        rec = run_case(out, name, fields, world_size)
        rows.append(rec)
        peaks = " ".join(f"r{r['rank']}={r.get('max_allocated', 0) / 2**30:.3f}" for r in rec["ranks"])
        print(f"{name:40s} {rec['wall_s']:5.0f}s {peaks} {rec.get('error', '')}", flush=True)

    dp = dp_cases(world_size)     # DP-SGD first (issue 27), then its profile, then the other per-rank cases
    for name, fields in dp:
        if not args or any(a in name for a in args):
            run(name, fields)
    for name in profiles or ([] if args else list(PROFILES)[::-1]):
        profile_run(out, world_size, name)
    for name, fields in cases(world_size):
        if not args or any(a in name for a in args):
            run(name, fields)
    print("\ncase | rank | max allocated GiB | max reserved GiB | NVML GiB | NCCL MiB")
    for rec in rows:
        for r in rec["ranks"]:
            if r.get("status") == "ok":
                print(f"{rec['name']} | {r['rank']} | {r['max_allocated'] / 2**30:.3f} | {r['max_reserved'] / 2**30:.3f} | "
                      f"{(r.get('nvml_after_steps') or 0) / 2**30:.2f} | {(r.get('nccl_bytes') or 0) / 2**20:.0f}")


if __name__ == "__main__":
    main()
