"""Trivial case functions for tests/bench/test_gpu_runner.py (the runner imports them in a fresh interpreter by path)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _ran(name: str, payload) -> None:
    with open(Path(payload["out"]) / "ran.txt", "a") as f:
        f.write(name + "\n")


def square(name: str, payload, dry: bool) -> dict:
    _ran(name, payload)
    return {"max_allocated": payload["n"] ** 2, "estimated_peak_allocated": payload["n"] ** 2 + 1, "dry": dry}


def boom(name: str, payload, dry: bool) -> dict:
    _ran(name, payload)
    raise RuntimeError(f"CUDA out of memory. Tried to allocate {payload['n']} GiB")


def killed(name: str, payload, dry: bool) -> dict:
    _ran(name, payload)
    print("about to be killed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hangs(name: str, payload, dry: bool) -> dict:
    (Path(payload["out"]) / "pid").write_text(str(os.getpid()))
    with open(Path(payload["out"]) / "pids", "a") as f:     # every rank's, under a launcher
        f.write(f"{os.getpid()}\n")
    _ran(name, payload)
    time.sleep(60)
    return {}


def by_name(name: str, payload, dry: bool) -> dict:
    return {"boom": boom, "killed": killed, "hangs": hangs}.get(name.split("-")[0], square)(name, payload, dry)


def rank_record(name: str, payload, dry: bool) -> dict:
    """A launcher job's rank: the runner sets nothing; the job's own RANK tells which record this is."""
    return {"world": int(os.environ.get("WORLD_SIZE", "1")), "n": payload["n"]}


def span(name: str, payload, dry: bool) -> dict:
    """Sleeps a little and returns when it ran (cases at once overlap)."""
    t0 = time.time()
    time.sleep(payload["sleep"])
    return {"start": t0, "end": time.time()}
