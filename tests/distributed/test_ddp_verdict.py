"""The fit rule judges DDP on its worst case (the stale buckets held) in estimate, compare and fit (issue 37):
the searches reduce a Result to a Point, which must keep the worst case for need_bytes."""
from __future__ import annotations

import pytest

from memlens.core.fits import need_bytes
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.explore.core import CachedEstimator, Point

# tiny Llama, 2 ranks: the stale buckets lift the reserved peak from 68 MiB (expected) to 70 MiB (worst case)
SPEC = TrainingSpec(model="tests/fixtures/tiny-llama", world_size=2, sharding="ddp", batch_size=2, seq_len=64)


@pytest.fixture(scope="module")
def result():
    return estimate(SPEC)


def test_estimate_judges_the_worst_case(result):
    wc = result.data.worst_case
    assert wc["peak_reserved_bytes"] > result.peak_reserved_bytes          # the worst case needs more than the headline
    assert result.data.fit["need_bytes"] == wc["peak_reserved_bytes"] == need_bytes(result)


def test_a_point_keeps_the_worst_case_for_fit_and_the_planners(result):
    p = Point.from_result(result)
    assert need_bytes(p) == result.data.worst_case["peak_reserved_bytes"] > p.peak_reserved_bytes
    # fit and the planners estimate through CachedEstimator, which hands them Points
    assert need_bytes(CachedEstimator()(SPEC)) == result.data.worst_case["peak_reserved_bytes"]


def test_compare_rows_need_the_worst_case(result):
    from memlens.explore.compare import compare

    c = compare(SPEC, ["fp32"], budget="80GiB")
    (row,) = c.data["rows"]
    assert row["estimated_peak_reserved_bytes"] == result.peak_reserved_bytes
    assert row["need_bytes"] == result.data.worst_case["peak_reserved_bytes"]
