"""Helpers of the doctor tests: fixture paths, PyTorch's own size formatting (imported as a plain module)."""
from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"


def format_size(size: int) -> str:
    """PyTorch's c10 format_size: '<n> bytes' up to 1024, else two decimals of KiB, MiB or GiB."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576:.2f} MiB"
    return f"{size / 1073741824:.2f} GiB"


def gpu_fixture(name: str, script: str = "bench/gpu_doctor.py") -> Path:
    """A fixture captured by ``script`` on a GPU; the test is skipped while it is absent."""
    p = FIXTURES / name
    if not p.exists():
        where = "OUT/fixtures/*" if script.endswith("gpu_oom.py") else "OUT/*"
        pytest.skip(f"{p.relative_to(FIXTURES.parent.parent.parent)} is absent: run `python {script} OUT` "
                    f"on a CUDA machine and copy {where} to tests/fixtures/doctor/")
    return p
