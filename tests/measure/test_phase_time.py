"""memlens.measure.phase_time on the CPU (wall-clock marks): what a step's seconds are made of."""
import time

import pytest

from memlens.measure.phase_time import PhaseTimer


def test_the_time_before_the_first_phase_is_data_not_step(monkeypatch):
    # marks at 0 (start), 3 (forward: a loader drew the batch for 3 s), 5 (backward), 9 (optimizer), 10 (end)
    clock = iter([0.0, 3.0, 5.0, 9.0, 10.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    t = PhaseTimer(None)
    t.start()
    for name in ("forward", "backward", "optimizer", "end"):
        t.on_phase(name)
    assert t.finish() == pytest.approx({"data": 3.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "step": 7.0})


def test_micro_batches_sum_per_part_and_clip_is_the_optimizers():
    # two micro-batches and a DP clip: forward and backward summed over both, clip counted as the optimizer's part
    clock = iter([0.0, 0.0, 1.0, 3.0, 4.0, 6.0, 6.5, 7.0, 7.25])
    t = PhaseTimer(None)
    t.marks = []
    for name in ("start", "forward", "backward", "forward", "backward", "clip", "optimizer", "end"):
        t.marks.append((name, next(clock)))
    out = t.finish()
    assert out == pytest.approx({"data": 0.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "step": 7.0})
