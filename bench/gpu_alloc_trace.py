"""The caching allocator's large-pool events of accuracy cases (bench/cases.py), compact, for a replay beside memlens'.

    python bench/gpu_alloc_trace.py OUT_DIR [case-substring ...]   -> OUT_DIR/alloc_trace.jsonl (one line per case)

Each case runs in its own process (bench/gpu_runner.py), built by memlens' own prepared step (as bench/gpu_truth.py
builds it), for STEPS optimizer steps with the allocator's history recorded from before the build. A line holds the case, its spec, the peaks, the reserved
bytes at the end of each step, and every event of more than 1 MiB (the large pool: requests above 1 MiB, which the
small pool never serves) as [step, phase, action, bytes, address, stream], the step and phase taken from markers (an
allocation of a size nothing else makes, at each phase boundary). bench/alloc_trace_diff.py replays a line beside
memlens' simulation of the same spec.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import estimate_spec, list_or_run, runner_args  # noqa: E402

STEPS = int(os.environ.get("MEMLENS_BENCH_STEPS", "3"))


def trace_case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess; --dry-run: the estimate only (CPU)."""
    if dry:
        return estimate_spec(fields)
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000)
    t0 = time.perf_counter()
    step = prepare(TrainingSpec(**fields), device=torch.device("cuda"), seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks, ends = [], []
    for n in range(1, STEPS + 1):
        def on_phase(ph, n=n):
            marks.append((n, ph))
            torch.empty(512 * (1000 + len(marks)), dtype=torch.uint8, device="cuda")
        step.run(on_phase)
        torch.cuda.synchronize()
        ends.append(torch.cuda.memory_reserved())
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events, at = [], (0, "build")
    for e in snap["device_traces"][torch.cuda.current_device()]:
        k = e["size"] // 512 - 1001 if e["action"] == "alloc" and e["size"] % 512 == 0 else -1
        if 0 <= k < len(marks) and e["size"] == 512 * (1001 + k):
            at = marks[k]
            continue
        if e["size"] > 2**20 and e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free"):
            events.append([at[0], at[1], e["action"], e["size"], e["addr"], e.get("stream", 0)])
    stats = torch.cuda.memory_stats()
    return dict(spec=fields, steps=STEPS, seconds=time.perf_counter() - t0,
                max_allocated=torch.cuda.max_memory_allocated(), max_reserved=stats["reserved_bytes.all.peak"],
                end_reserved=ends, device=torch.cuda.get_device_name(), torch=torch.__version__, large_events=events)


def main(argv: list[str] | None = None) -> None:
    from bench.cases import CASES

    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=400).parse_args(argv)
    list_or_run(a, CASES, fn=trace_case, jsonl="alloc_trace.jsonl", env_file="alloc_trace_env.json")


if __name__ == "__main__":
    main()
