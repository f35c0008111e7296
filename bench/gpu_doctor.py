"""Capture the real-GPU fixtures of `memlens doctor` and `memlens watch` (run once on a CUDA machine).

    python bench/gpu_doctor.py OUT_DIR        # about a minute; then copy the fixture files of OUT_DIR to tests/fixtures/doctor/
                                              # (not logs/ nor gpu_doctor_parts.jsonl, the runner's record of the parts)

Writes, each part in its own process so that one failing leaves the others (see bench_summary.json):
  gpu_oom_plain.txt / .json           OOM of a job bigger than the GPU           (diagnosis: capacity)
  gpu_oom_fraction.txt / .json        OOM under set_per_process_memory_fraction  (memory_fraction_limit)
  gpu_oom_other_process.txt / .json   OOM while another process holds memory     (other_processes)
  gpu_oom_fragmentation.txt / .json   OOM with enough free cached memory in pieces (fragmentation)
  gpu_memory_stats.json               torch.cuda.memory_stats() after that fragmentation OOM
  gpu_snapshot_step5.pickle, gpu_snapshot_step15.pickle, gpu_snapshot_truth.json
                                      memory history of a tiny training loop that leaks a tensor per step
  gpu_watch_once.json, gpu_watch_truth.json, gpu_watch_log.csv
                                      `memlens watch --once --json` (and 3 readings --log) while a child
                                      process holds GPU memory
Each .json beside a message is the truth at the moment of the OOM (requested size, memory_stats,
cudaMemGetInfo, other processes) that the tests check the parsed numbers against.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 1024**2
GIB = 1024**3
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gpu_runner import last_records, list_or_run, read_jsonl, runner_args  # noqa: E402


def _truth(out: Path, name: str, msg: str, requested: int, **extra) -> None:
    import torch

    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    (out / f"gpu_oom_{name}.txt").write_text(msg + "\n")
    (out / f"gpu_oom_{name}.json").write_text(json.dumps({
        "requested_bytes": requested,
        "allocated_bytes": stats["allocated_bytes.all.current"],
        "reserved_bytes": stats["reserved_bytes.all.current"],
        "free_bytes_after": free,
        "total_bytes": total,
        "pid": os.getpid(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        **extra,
    }, indent=2) + "\n")


def _oom(nbytes: int) -> str:
    """Ask for ``nbytes`` (a multiple of 2 MiB, so the message prints it unrounded) and return the OOM text."""
    import torch

    try:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        return str(e)
    raise RuntimeError(f"allocating {nbytes} bytes did not fail")


def _mib(x: float) -> int:
    return int(x) // (2 * MIB) * (2 * MIB)


def part_plain(out: Path) -> None:
    import torch

    total = torch.cuda.mem_get_info()[1]
    held = torch.empty(_mib(0.6 * total), dtype=torch.uint8, device="cuda")  # noqa: F841 - kept alive
    req = _mib(0.6 * total)
    _truth(out, "plain", _oom(req), req, expected_diagnosis="capacity")


def part_fraction(out: Path) -> None:
    import torch

    torch.cuda.set_per_process_memory_fraction(0.5)
    total = torch.cuda.mem_get_info()[1]
    held = torch.empty(_mib(0.3 * total), dtype=torch.uint8, device="cuda")  # noqa: F841
    req = _mib(0.3 * total)
    _truth(out, "fraction", _oom(req), req, fraction=0.5, expected_diagnosis="memory_fraction_limit")


def _spawn_holder(gib: float, ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE), "--part", "hold", str(gib), str(ready)])
    for _ in range(600):
        if ready.exists():
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"the holder process exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the holder process did not get its memory within 60 s")


def part_hold(gib: str, ready: str) -> None:
    import torch

    x = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")  # noqa: F841
    torch.cuda.synchronize()
    Path(ready).write_text(str(os.getpid()))
    time.sleep(120)


def part_other_process(out: Path) -> None:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # create this process' context first
    ready = out / ".holder_ready"
    ready.unlink(missing_ok=True)
    holder = _spawn_holder(20, ready)
    try:
        free = torch.cuda.mem_get_info()[0]
        req = _mib(free + 10 * GIB)  # more than is free, less than free + the holder's 20 GiB
        _truth(out, "other_process", _oom(req), req, other_pid=holder.pid, other_gib=20,
               expected_diagnosis="other_processes")
    finally:
        holder.kill()
        holder.wait()
        ready.unlink(missing_ok=True)


def part_fragmentation(out: Path) -> None:
    """Fill the GPU with 1 GiB segments each split into 16 x 64 MiB tensors, free every other
    tensor (half the memory is cached but in 64 MiB holes), then ask for 128 MiB."""
    import torch

    piece, seg = 64 * MIB, 1 * GIB
    kept, whole = [], []
    while True:
        try:
            torch.empty(seg, dtype=torch.uint8, device="cuda")  # a 1 GiB segment, freed into the cache
            kept.append([torch.empty(piece, dtype=torch.uint8, device="cuda") for _ in range(seg // piece)])
        except torch.OutOfMemoryError:
            break
    torch.cuda.empty_cache()  # hand back what did not split
    while True:  # fill the rest of the device so no new segment can be made
        try:
            whole.append(torch.empty(2 * MIB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
    for group in kept:
        for i in range(0, len(group), 2):
            group[i] = None
    req = 2 * piece
    _truth(out, "fragmentation", _oom(req), req, expected_diagnosis="fragmentation")
    (out / "gpu_memory_stats.json").write_text(json.dumps(torch.cuda.memory_stats(), indent=1) + "\n")


def plant_leak(kept: list, step: int) -> None:
    """The planted leak: one 256 KiB tensor kept per step."""
    import torch

    kept.append(torch.full((64 * 1024,), float(step), device="cuda"))


def part_snapshot(out: Path) -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept: list = []
    for step in range(1, 16):
        x = torch.randn(32, 256, device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        plant_leak(kept, step)
        if step in (5, 15):
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(str(out / f"gpu_snapshot_step{step}.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    (out / "gpu_snapshot_truth.json").write_text(json.dumps({
        "leak_bytes_per_step": 64 * 1024 * 4, "leak_function": "plant_leak", "steps_between": 10,
        "torch": torch.__version__,
    }, indent=2) + "\n")


def part_watch(out: Path) -> None:
    ready = out / ".holder_ready"
    ready.unlink(missing_ok=True)
    holder = _spawn_holder(2, ready)
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-m", "memlens.cli.main", "watch", "--once", "--json"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        (out / "gpu_watch_once.json").write_text(r.stdout)
        (out / "gpu_watch_truth.json").write_text(json.dumps({
            "holder_pid": holder.pid, "holder_bytes": 2 * GIB, "returncode": r.returncode, "stderr": r.stderr[-2000:],
        }, indent=2) + "\n")
        if r.returncode:
            raise RuntimeError(f"memlens watch exited {r.returncode}: {r.stderr.strip()[-300:]}")
        log = out / "gpu_watch_log.csv"
        log.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "memlens.cli.main", "watch", "--count", "3", "--interval", "0.5",
                        "--log", str(log)], capture_output=True, timeout=60, env=env, cwd=REPO, check=True)
    finally:
        holder.kill()
        holder.wait()
        ready.unlink(missing_ok=True)


PARTS = {
    "plain": part_plain, "fraction": part_fraction, "other_process": part_other_process,
    "fragmentation": part_fragmentation, "snapshot": part_snapshot, "watch": part_watch,
}


def run_part(name: str, out: str, dry: bool) -> dict:
    """One part in its own subprocess (bench/gpu_runner.py): the fixture files it wrote."""
    if dry:
        return {"dry_run": "GPU only"}
    before = {p.name: p.stat().st_mtime for p in Path(out).iterdir() if p.is_file()}
    PARTS[name](Path(out))
    return {"files": sorted(p.name for p in Path(out).iterdir() if p.is_file() and before.get(p.name) != p.stat().st_mtime)}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--part":
        if argv[1] == "hold":
            part_hold(argv[2], argv[3])
            return 0
        PARTS[argv[1]](Path(argv[2]))
        return 0
    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=90).parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    list_or_run(a, [(name, str(out)) for name in PARTS], fn=run_part, jsonl="gpu_doctor_parts.jsonl", env_file=False,
                columns=[("files", lambda r: ", ".join(r.get("files", [])))])
    if a.dry_run or a.list:
        return 0
    summary = {r["name"]: {"ok": "error" not in r, "seconds": r.get("seconds"), "error": r.get("error", "")}
               for r in last_records(read_jsonl(out / "gpu_doctor_parts.jsonl")).values()}
    (out / "bench_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"{len(files)} files in {out} ({time.time() - t0:.0f}s): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
