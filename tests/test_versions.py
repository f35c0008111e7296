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


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


@pytest.mark.parametrize("name", ["torch", "transformers"])
def test_pyproject_range_is_the_tested_range(name):
    """The declared range is the tested one: from the lowest tested to below the next minor of the newest, the
    same boundary as `untested` (a newer major.minor warns), so a fresh install never gets a version that warns."""
    lo, hi = v.TESTED[name]
    req = _requirement(name)
    assert re.search(rf">={re.escape(lo)}(,|$)", req), (req, lo)
    cap = _next_minor(hi)
    assert re.search(rf",<{re.escape(cap)}$", req), (req, cap)
    assert v.untested(name, cap + ".0") is not None and v.untested(name, hi + ".9") is None


def test_vision_extra_cannot_pull_an_untested_torch():
    """torchvision 0.N pins torch 2.(N-15) (0.26: torch==2.11.0, 0.28: 2.13.0): [vision]'s range is the torch range."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (tv,) = [d for d in extras["vision"] if d.startswith("torchvision")]
    lo, hi = v.TESTED["torch"]
    lo_minor, hi_minor = int(lo.split(".")[1]), int(hi.split(".")[1])
    assert tv == f"torchvision>=0.{lo_minor + 15},<0.{hi_minor + 16}", tv


def test_license_is_an_spdx_string():
    """A TOML-table license warns on every install (setuptools >= 77 wants the SPDX string, PEP 639)."""
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    (st,) = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.search(r">=(\d+)", st).group(1)) >= 77, st


def test_makefile_lowest_venv_pins_the_lowest_tested():
    mk = (ROOT / "Makefile").read_text()
    pins = re.search(r"^LOWEST_PINS \?= (.*)$", mk, re.M).group(1).split()
    assert f"transformers=={v.TESTED['transformers'][0]}" in pins
    peft_lo = re.search(r"peft>=([\d.]+)", _requirement("peft")).group(1)
    assert f"peft=={peft_lo}" in pins


def test_untested_versions(monkeypatch):
    monkeypatch.setattr(v, "TESTED", {"torch": ("2.11", "2.13"), "transformers": ("5.15.0", "5.24")})
    assert v.untested("torch", "2.11.0+cu130") is None
    assert v.untested("torch", "2.13.9") is None
    assert v.untested("torch", "2.10.1") == "torch 2.10.1 is older than the lowest tested (2.11)"
    assert v.untested("torch", "2.14.0.dev20260101") == "torch 2.14.0.dev20260101 is newer than the newest tested (2.13)"
    assert v.untested("transformers", "5.24.4") is None
    assert v.untested("transformers", "5.14.0") == "transformers 5.14.0 is older than the lowest tested (5.15.0)"
    assert v.untested("transformers", "5.15.0rc1") is None       # the release numbers decide
    assert v.untested("transformers", "5.25.0") == "transformers 5.25.0 is newer than the newest tested (5.24)"
    assert v.untested("transformers", "6.0.0") == "transformers 6.0.0 is newer than the newest tested (5.24)"


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


def test_installed_versions_are_in_the_table():
    """The venv this suite runs in (CI's .venv: what a fresh install gets; .venv-lowest: the lowest pins) is inside
    the table: a release newer than the newest tested fails here (raise TESTED and pyproject's cap once this suite
    passes on it) instead of warning at every user's command."""
    import importlib.metadata

    for name in v.TESTED:
        assert v.untested(name, importlib.metadata.version(name)) is None
