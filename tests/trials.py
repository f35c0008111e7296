"""Measured trials in the test's own process: what ``memlens.measure.trial.run_trial``'s child does (the spec read back
from JSON, ``measure``, a record that is JSON) without starting a fresh interpreter (about 5 CPU-s each: torch,
transformers, peft, opacus imported again). For tests whose subject is what a trial measures and how a verb uses it;
the trial's own process (its crash, timeout and OOM records, a kill -9 midway) is tested with real subprocesses in
tests/explore/test_sweep.py and tests/explore/test_compare.py."""
from __future__ import annotations

import json
import time

from memlens.core.spec import TrainingSpec
from memlens.measure import trial


def in_process(spec: TrainingSpec, *, device: str = "cuda", steps: int = 3, timeout: float = 600,
               memory_fraction: float | None = None, seed: int = 0, detailed: bool = False, gpus=None) -> dict:
    """run_trial's signature and record; an exception in the trial fails the test instead of a "crash" record."""
    assert gpus is None and memory_fraction is None, "a trial on GPUs runs in its own process"
    t = time.perf_counter()
    rec = trial.measure(TrainingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))), device=device, steps=steps,
                        seed=seed, detailed=detailed)
    rec = json.loads(json.dumps(rec))          # what the child prints and the parent reads
    return {"spec": spec.to_dict(), "device": device, **rec, "wall_seconds": time.perf_counter() - t}
