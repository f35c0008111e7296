"""Fixtures of the doctor tests (helpers live in doctor_support.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from doctor_support import FIXTURES


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
