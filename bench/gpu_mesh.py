"""HSDP and TP x FSDP2 per rank on 4 GPUs (issue 37): measured peaks vs memlens' per-rank estimate.

Run on a 4-GPU machine from the repo root (4 cases: about 5 minutes on 4 x H100):

    python bench/gpu_mesh.py            # results under $OUT (default ./out): gpu_mesh.jsonl, a table printed last
    python bench/gpu_mesh.py --dry-run  # CPU only: every case's estimate on a tiny Llama (no GPU, no torchrun)
    python bench/gpu_mesh.py hsdp       # only the cases whose name contains "hsdp"
    python bench/gpu_mesh.py profile    # only `memlens profile --world-size 4` of each mesh (about 3 minutes)

Each case runs in its own torchrun job (bench/gpu_distributed.py's rank code: memlens.step.prepare builds the very
wrapper the estimate simulates - FSDP2 fully_shard on a 2 x 2 replicate x shard mesh, or parallelize_module with
torchtitan's Llama TP plan then fully_shard on the data-parallel sub-mesh - resets the peak counters after building
and runs 3 steps), so an OOM or a crash loses one case. Every rank's max_memory_allocated / max_memory_reserved is
compared with memlens' estimate of the same rank (estimate_ranks on fake CPU tensors, in this process after the GPU
runs; the rank group that stands for it). One JSON line per case is appended to $OUT/gpu_mesh.jsonl as it comes,
with each rank's NCCL memory (NVML growth the caching allocator does not explain: several communicators per rank on a
2D mesh). Then `memlens profile --world-size 4 --compare-estimate` runs once per mesh (the CLI's own torchrun launch),
its output kept in $OUT/profile-*.txt.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORLD = 4
LLAMA_1B = dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="amp-bf16")
TINY = dict(model="tests/fixtures/tiny-llama", batch_size=2, seq_len=64, precision="amp-bf16")


def cases(base: dict) -> list[tuple[str, dict]]:
    """4-GPU meshes on a Llama-class model: FSDP2 over 4 (the baseline, measured exact before), HSDP 2 x 2,
    TP 2 x FSDP2 2 (with and without checkpointing)."""
    w = {"world_size": WORLD}
    return [
        ("fsdp4-llama1b-ampbf16-b4-L1024", dict(base, sharding="fsdp", **w)),
        ("hsdp2x2-llama1b-ampbf16-b4-L1024", dict(base, sharding="hsdp", shard_size=2, **w)),
        ("tp2xfsdp2-llama1b-ampbf16-b4-L1024", dict(base, sharding="fsdp", tp=2, **w)),
        ("tp2xfsdp2-llama1b-ampbf16-ckpt-b4-L2048", dict(base, sharding="fsdp", tp=2, grad_checkpointing=True,
                                                         seq_len=2 * base["seq_len"], **w)),
    ]


PROFILES = {   # `memlens profile --world-size 4 ... --compare-estimate`: the CLI path (torchrun launched by memlens itself)
    "profile-hsdp2x2": ["--sharding", "hsdp", "--shard-size", "2"],
    "profile-tp2xfsdp2": ["--sharding", "fsdp", "--tp", "2"],
}


def profile_run(out: Path, name: str) -> str:
    """One `memlens profile` of Llama-3.2-1B amp-bf16 b4 L1024 on the 4 GPUs; its output kept in $OUT/<name>.txt."""
    import subprocess

    cmd = [sys.executable, "-m", "memlens.cli.main", "profile", "--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "1024",
           "--precision", "amp-bf16", "--world-size", str(WORLD), *PROFILES[name], "--steps", "3", "--compare-estimate",
           "--out", str(out / name)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]),
               COLUMNS="160")
    t = time.time()
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired:
        text, rc = "timeout", "timeout"
    (out / f"{name}.txt").write_text(" ".join(cmd[2:]) + "\n" + text)
    return f"{name}: rc={rc} {time.time() - t:.0f}s (output in {out / (name + '.txt')})"


def gpu_name() -> str:
    import torch

    return "h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0) else "h100"


def estimate(fields: dict, gpu: str) -> dict:
    """memlens' per-rank estimate: {rank: (allocated, reserved)} for every rank, from the rank group standing for it."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import estimate_ranks

    t = time.time()
    r = estimate_ranks(TrainingSpec.from_dict(dict(fields, gpu=gpu)))
    per: dict[int, list[int]] = {}
    for e in r.data["ranks"]:
        for k in e["ranks"]:
            if e.get("simulated"):
                per[k] = [e["peak_allocated_bytes"], e["peak_reserved_bytes"]]
            else:      # between two simulated ranks: bounded by them (the higher reported)
                per[k] = [e["peak_allocated_bytes_between"][1], e["peak_reserved_bytes_between"][1]]
    return {"ranks": per, "strategy": r.data["strategy"], "applied": r.data.get("applied"), "seconds": round(time.time() - t, 1)}


def main() -> None:
    args = sys.argv[1:]
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    todo = [(n, f) for n, f in cases(TINY if dry else LLAMA_1B) if not args or any(a in n for a in args)]
    profiles = [n for n in PROFILES if any(a in n for a in args)]      # only when asked: `python bench/gpu_mesh.py profile`
    rows = []
    if dry:
        for name, fields in todo:
            est = estimate(fields, "h100")
            print(f"{name:42s} {est['seconds']:5.1f}s " + " ".join(f"r{k}={v[0] / 2**20:.2f}MiB" for k, v in sorted(est["ranks"].items()))
                  + f"  [{est['strategy']}]", flush=True)
        return
    import torch

    from bench.gpu_distributed import run_case

    if torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
           "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    gpu = gpu_name()
    measured = []
    for name, fields in todo:          # the GPU runs first (each its own torchrun job), then the estimates on the CPU
        (out / "gpu_mesh_runs").mkdir(exist_ok=True)
        rec = run_case(out / "gpu_mesh_runs", name, fields, WORLD)     # its raw record also in gpu_mesh_runs/gpu_distributed.jsonl
        measured.append((name, fields, rec))
        print(f"{name:42s} {rec['wall_s']:5.0f}s " + " ".join(f"r{r['rank']}={r.get('max_allocated', 0) / 2**30:.3f}"
                                                               for r in rec["ranks"]) + f" {rec.get('error', '')}", flush=True)
    lines = [profile_run(out, n) for n in profiles]       # the CLI path, after the per-case runs
    for line in lines:
        print(line, flush=True)
    for name, fields, rec in measured:
        try:
            est = estimate(fields, gpu)
        except Exception as e:  # noqa: BLE001 - one case's estimate failing loses that case only
            est = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ranks": {}}
        row = {"name": name, "spec": fields, "env": env, "gpu": gpu, "estimate": est,
               "measured": [{k: r.get(k) for k in ("rank", "status", "max_allocated", "max_reserved", "error", "applied", "phases",
                                                   "nccl_bytes")} for r in rec["ranks"]], "error": rec.get("error")}
        rows.append(row)
        with open(out / "gpu_mesh.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"\n{env['device']} x {WORLD}, torch {env['torch']}, NCCL {env['nccl']}\n")
    print("| case | rank | measured alloc GiB | estimate GiB | err | measured reserved GiB | estimate GiB | err | NCCL MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for m in row["measured"]:
            e = row["estimate"]["ranks"].get(m["rank"])
            if m.get("status") != "ok" or not e:
                print(f"| {row['name']} | {m['rank']} | {m.get('status')} {m.get('error') or row['estimate'].get('error', '')} |||||||")
                continue
            ea, er = e
            print(f"| {row['name']} | {m['rank']} | {m['max_allocated'] / 2**30:.3f} | {ea / 2**30:.3f} | "
                  f"{100 * (ea - m['max_allocated']) / m['max_allocated']:+.2f}% | {m['max_reserved'] / 2**30:.3f} | {er / 2**30:.3f} | "
                  f"{100 * (er - m['max_reserved']) / m['max_reserved']:+.2f}% | {(m.get('nccl_bytes') or 0) / 2**20:.0f} |")


if __name__ == "__main__":
    main()
