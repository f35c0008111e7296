"""Re-estimate every case of bench/results/liger_accuracy.jsonl on this CPU against the measured peak there.

    PYTHONPATH=$PWD python bench/liger_reestimate.py [records.jsonl]

Prints one markdown row per case: the measured peak allocated of steps 2-3 (max_allocated_after_warmup) and
reserved, the estimate recorded then, today's estimate and its error. No GPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RECORDS = Path(__file__).parent / "results" / "liger_accuracy.jsonl"
GIB = 2 ** 30


def _pct(est: int, real: int) -> str:
    return f"{(est - real) / real * 100:+.2f}%"


def main(path: Path = RECORDS) -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    print("| case | measured alloc GiB | estimate then | estimate now | error now | measured reserved GiB | "
          "estimate now | error now |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        r = estimate(TrainingSpec(**rec["spec"]))
        real, res = rec["max_allocated_after_warmup"], rec["max_reserved"]
        print(f"| {rec['name']} | {real / GIB:.3f} | {rec['estimated_peak_allocated'] / GIB:.3f} | "
              f"{r.peak_allocated_bytes / GIB:.3f} | {_pct(r.peak_allocated_bytes, real)} | {res / GIB:.3f} | "
              f"{r.peak_reserved_bytes / GIB:.3f} | {_pct(r.peak_reserved_bytes, res)} |", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDS)
