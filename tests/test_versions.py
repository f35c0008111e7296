"""The tested version ranges: one table (memlens/core/version.py TESTED) that pyproject and the Makefile follow,
and the one warning line the estimator gives outside it."""
import logging
import re
import tomllib
from pathlib import Path

import pytest

from memlens.core import version as v

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [d for d in deps if re.match(rf"{name}\b", d)]
    return req


@pytest.mark.parametrize("name", ["torch", "transformers"])
def test_pyproject_lower_bound_is_the_lowest_tested(name):
    lo, hi = v.TESTED[name]
    req = _requirement(name)
    assert re.search(rf">={re.escape(lo)}(,|$)", req), (req, lo)
    # the cap is the next major of the newest tested
    assert f"<{int(hi.split('.')[0]) + 1}" in req, req


def test_makefile_lowest_venv_pins_the_lowest_tested():
    mk = (ROOT / "Makefile").read_text()
    pins = re.search(r"^LOWEST_PINS \?= (.*)$", mk, re.M).group(1).split()
    assert f"transformers=={v.TESTED['transformers'][0]}" in pins
    peft_lo = re.search(r"peft>=([\d.]+)", _requirement("peft")).group(1)
    assert f"peft=={peft_lo}" in pins


def test_untested_versions():
    assert v.untested("torch", "2.11.0+cu130") is None
    assert v.untested("torch", "2.13.9") is None
    assert v.untested("torch", "2.10.1") == "torch 2.10.1 is older than the lowest tested (2.11)"
    assert v.untested("torch", "2.14.0.dev20260101") == "torch 2.14.0.dev20260101 is newer than the newest tested (2.13)"
    assert v.untested("transformers", "5.23.4") is None
    assert v.untested("transformers", "5.14.0") == "transformers 5.14.0 is older than the lowest tested (5.15.0)"
    assert v.untested("transformers", "5.15.0rc1") is None       # the release numbers decide
    assert v.untested("transformers", "6.0.0") == "transformers 6.0.0 is newer than the newest tested (5.23)"


def test_one_warning_line_once_per_process(monkeypatch, caplog):
    import importlib.metadata

    fake = {"torch": "2.9.1", "transformers": "5.20.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake[name])
    monkeypatch.setattr(v, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="memlens"):
        assert v.check_tested_versions() == ["torch 2.9.1 is older than the lowest tested (2.11)"]
        assert v.check_tested_versions() == ["torch 2.9.1 is older than the lowest tested (2.11)"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("WARNING: torch 2.9.1 is older than the lowest tested (2.11); memlens relies on their internals")


def test_installed_versions_are_not_below_the_lowest():
    """The venv this suite runs in (CI's newest, .venv-lowest's lowest) is not below the table (a newer release
    than the newest tested only warns)."""
    import importlib.metadata

    for name in v.TESTED:
        assert "older" not in (v.untested(name, importlib.metadata.version(name)) or "")
