"""Result._repr_html_: what a notebook shows carries the real numbers, tables and the timeline."""
from __future__ import annotations

import pytest

from memlens.core.result import Result
from memlens.core.spec import TrainingSpec
from memlens.core.units import fmt_bytes
from memlens.estimator import estimate


@pytest.fixture(scope="module")
def small() -> Result:
    return estimate(TrainingSpec(model="tests.tiny_models:linear"))


def test_html_has_the_estimates_numbers_and_tables(small):
    h = small._repr_html_()
    assert h.startswith("<div") and "memlens estimate: tests.tiny_models:linear" in h
    assert fmt_bytes(small.peak_allocated_bytes) in h and fmt_bytes(small.peak_reserved_bytes) in h
    for cat, v in small.by_category.items():
        if v:
            assert f">{cat}</td>" in h and fmt_bytes(v) in h
    for ph, v in small.by_phase.items():
        assert f">{ph}</td>" in h and fmt_bytes(v["peak_allocated_bytes"]) in h
    top = max(small.by_module, key=lambda r: r["bytes"])
    assert f">{top['module']}</td>" in h
    assert "<svg" in h


def test_html_draws_an_svg_timeline(small):
    h = small._repr_html_()
    assert "<svg" in h and "<polyline" in h and "base64" not in h
    assert f"y from 0 to {fmt_bytes(max(p['reserved_bytes'] for p in small.timeline))}" in h


def test_html_says_the_fit_verdict():
    r = Result(verb="fit", peak_allocated_bytes=5 * 2**30, data={"max_batch_size": 12, "budget_bytes": 24 * 2**30})
    h = r._repr_html_()
    assert "largest batch that fits: 12" in h and "24.00 GiB" in h and "5.00 GiB" in h
