"""memlens' version and the environment a Result was made in.

>>> __version__.count(".") >= 2
True
>>> env = environment(); env["memlens"] == __version__ and "python" in env
True
"""
from __future__ import annotations

import platform
import sys
from typing import Any


def _read_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("memlens")
    except Exception:  # noqa: BLE001 - not installed (a checkout on PYTHONPATH): read pyproject.toml
        import re
        from pathlib import Path

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
