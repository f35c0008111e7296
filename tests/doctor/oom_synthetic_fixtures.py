"""OOM messages of issue 14's situations as PyTorch >= 2.1 prints them, built from true byte counts
(c10/cuda/CUDACachingAllocator.cpp's format string and format_size), in the file layout
bench/gpu_oom.py writes for its GPU captures (tests/fixtures/doctor/synthetic_oom_<case>.txt/.json).

`python tests/doctor/oom_synthetic_fixtures.py` rewrites them; test_doctor_gpu_fixtures checks the
committed files equal what this builds, and runs the same checks on them as on the GPU captures.

The worlds are an H100 (85017493504 bytes) with the CUDA context this project measured there before
cuBLAS loads (518 MiB, tests/fixtures/doctor/gpu_oom_other_process.txt). "Hidden" cases print the
process as PyTorch does when getpid() matches no NVML PID (a PID namespace): "Process 731 has ...".
"""
from __future__ import annotations

import json
from pathlib import Path

from doctor_support import format_size as fs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"
MIB, GIB = 2**20, 2**30
TOTAL = 85017493504
CTX = 518 * MIB
SELF_PID, HOLDER_PID = 731, 537
TAIL = ("If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.  See documentation for Memory Management  "
        "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def message(req, free, procs, allocated, reserved, allowed=None, this=None) -> str:
    """procs: [(pid, used)] printed as "Process pid has ..."; this: the "this process" line's bytes."""
    s = f"CUDA out of memory. Tried to allocate {fs(req)}. GPU 0 has a total capacity of {fs(TOTAL)} of which {fs(free)} is free. "
    s += "".join(f"Process {pid} has {fs(u)} memory in use. " for pid, u in procs)
    if this is not None:
        s += f"Including non-PyTorch memory, this process has {fs(this)} memory in use. "
    if allowed is not None:
        s += f"{fs(allowed)} allowed; "
    return s + f"Of the allocated memory {fs(allocated)} is allocated by PyTorch, and {fs(reserved - allocated)} is " \
               f"reserved by PyTorch but unallocated. " + TAIL


def _two_mib(x: int) -> int:
    return x // (2 * MIB) * (2 * MIB)


def cases() -> dict[str, tuple[str, dict]]:
    out = {}

    def add(name, req, free, procs, allocated, reserved, expected, allowed=None, this=None, **extra):
        text = message(req, free, procs, allocated, reserved, allowed, this)
        out[name] = (text, {"requested_bytes": req, "allocated_bytes": allocated, "reserved_bytes": reserved,
                            "free_bytes_after": free, "total_bytes": TOTAL, "pid": 1, "torch": "synthetic",
                            "device": "NVIDIA H100 80GB HBM3", "this_process_line": this is not None,
                            "process_lines": text.count("Process "), "expected_diagnosis": expected,
                            "hidden_method": "synthetic (PyTorch's format, no PID matches)", **extra})

    # 1 GiB segments half freed in 64 MiB holes: 39 GiB cached in pieces, 20 MiB free, 128 MiB asked
    a, r = 42567991296, 84443922432
    add("hidden_fragmentation", 128 * MIB, TOTAL - r - CTX - 9 * MIB, [(SELF_PID, r + CTX)], a, r, "fragmentation")
    # another process holds 20 GiB (+ its context); this one holds nothing yet but its context
    holder = 20 * GIB + CTX
    free = TOTAL - CTX - holder
    add("hidden_other_process", _two_mib(free + 10 * GIB), free, [(HOLDER_PID, holder), (SELF_PID, CTX)], 0, 0,
        "other_processes", other_pid=HOLDER_PID, other_gib=20)
    # set_per_process_memory_fraction(0.5): 23.75 GiB held, 23.75 GiB more asked
    held = _two_mib(0.3 * TOTAL)
    add("hidden_fraction", held, TOTAL - held - CTX, [(SELF_PID, held + CTX)], held, held, "memory_fraction_limit",
        allowed=int(0.5 * TOTAL), fraction=0.5)
    # a job bigger than the GPU
    held = _two_mib(0.6 * TOTAL)
    add("hidden_capacity", held, TOTAL - held - CTX, [(SELF_PID, held + CTX)], held, held, "capacity")
    # 30 GiB taken outside PyTorch in this process (cuMemAlloc), 20 GiB by PyTorch
    used = 20 * GIB + 30 * GIB + CTX
    free = TOTAL - used
    add("non_pytorch", _two_mib(free + 6 * GIB), free, [], 20 * GIB, 20 * GIB, "non_pytorch_memory", this=used,
        outside_pytorch_bytes=30 * GIB)
    return out


def write() -> None:
    for name, (text, truth) in cases().items():
        (FIXTURES / f"synthetic_oom_{name}.txt").write_text(text + "\n")
        (FIXTURES / f"synthetic_oom_{name}.json").write_text(json.dumps(truth, indent=2) + "\n")


if __name__ == "__main__":
    write()
