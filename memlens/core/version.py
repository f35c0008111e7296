"""memlens' version and the environment a Result was made in.

>>> __version__.count(".") >= 2
True
>>> env = environment(); env["memlens"] == __version__ and "python" in env
True
"""
from __future__ import annotations

import importlib.metadata
import logging
import platform
import re
import sys
from importlib.metadata import PackageNotFoundError
from pathlib import Path
from typing import Any


def _read_version() -> str:
    try:
        return importlib.metadata.version("memlens")
    except Exception:  # noqa: BLE001 - not installed (a checkout on PYTHONPATH): read pyproject.toml
        p = Path(__file__).resolve().parents[2] / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', p.read_text(), re.M) if p.exists() else None
        return m.group(1) if m else "0+unknown"


__version__ = _read_version()

# libraries whose versions decide memory (reported only when already imported: no import for a version)
_LIBS = ("torch", "transformers", "peft", "accelerate", "opacus", "bitsandbytes", "timm", "torchvision", "lightning")


def environment() -> dict[str, Any]:
    """memlens, Python and the versions of the libraries that were used (those already imported)."""
    env: dict[str, Any] = {"memlens": __version__, "python": platform.python_version(), "platform": platform.platform(terse=True)}
    for name in _LIBS:
        mod = sys.modules.get(name)
        v = getattr(mod, "__version__", None) if mod is not None else None
        if v is not None:
            env[name] = str(v)
    return env


# The versions memlens was tested with (one place: pyproject's ranges and the Makefile's lowest venv follow it;
# tests/test_versions.py checks they agree). memlens runs torch's and transformers' own code on fake tensors and
# relies on their internals (FakeTensorMode, autocast policy, FSDP2, model classes), so a version outside these
# ranges may give a wrong answer without failing: the estimator says so in one line (check_tested_versions).
#   torch 2.11: the GPU machine (bench/results/raw/gpu_env.json; GPU tests and every bench/results accuracy run).
#   torch 2.13 (CPU wheel): CI, `make test`, on both the lowest and the newest transformers below.
#   transformers 5.15.0: the lowest that passes the core suite (`make test` runs it in .venv-lowest). Below it:
#     5.0.0-5.14.0: T5 cannot be built with SDPA, the default --attn (Swin neither on 5.0.0); 5.0.0 also counts GPT-2's
#     tied embeddings twice (163,037,184 parameters instead of 124,439,808: a wrong answer, not an error);
#     4.57.6: T5 and Swin as above; 4.45-4.55: every estimate fails (from_config takes no `dtype` before 4.56).
#   transformers 5.24: the newest tested (CI's .venv, which gets what a fresh install of the pyproject ranges gets:
#     5.24.0; 5.23.0 before it); 5.17 on the GPU machine.
# pyproject caps torch and transformers below the next minor of the newest here, so that the warning can only come
# from a version outside the declared ranges; raise the two together, after `make test` passed on the new release.
TESTED = {
    "torch": ("2.11", "2.13"),
    "transformers": ("5.15.0", "5.24"),
}

_warned: set[str] = set()


def _numbers(v: str) -> tuple[int, ...]:
    """The leading numeric release of a version: '2.13.0+cpu' -> (2, 13, 0); '5.0.0rc1' -> (5, 0, 0)."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def untested(name: str, installed: str) -> str | None:
    """Why ``installed`` of ``name`` is outside TESTED (lower than the lowest, or a newer major.minor than the newest), or None.

    >>> untested("torch", "2.13.0+cpu") is None and untested("transformers", "5.24.1") is None
    True
    >>> untested("transformers", "4.57.6")
    'transformers 4.57.6 is older than the lowest tested (5.15.0)'
    >>> untested("torch", "2.14.0")
    'torch 2.14.0 is newer than the newest tested (2.13)'
    """
    lo, hi = TESTED[name]
    v = _numbers(installed)
    if v < _numbers(lo):
        return f"{name} {installed} is older than the lowest tested ({lo})"
    if v[:2] > _numbers(hi)[:2]:
        return f"{name} {installed} is newer than the newest tested ({hi})"
    return None


def check_tested_versions() -> list[str]:
    """One warning line (logging, once per process) for each of torch / transformers outside TESTED; returns the reasons."""
    reasons = []
    for name in TESTED:
        try:
            why = untested(name, importlib.metadata.version(name))
        except PackageNotFoundError:
            continue
        if why:
            reasons.append(why)
    new = [r for r in reasons if r not in _warned]
    if new:
        _warned.update(new)
        logging.getLogger("memlens").warning(
            "WARNING: %s; memlens relies on their internals and may be wrong here (tested: %s)", "; ".join(new),
            ", ".join(f"{n} {lo} to {hi}" for n, (lo, hi) in TESTED.items()))
    return reasons
