"""Byte sizes: parse '16GiB' / '1.5 GB' / '512MiB' and format bytes for people.

Binary units (KiB, MiB, GiB) are what PyTorch's allocator reports; decimal units (KB, MB, GB)
are what nvidia-smi and marketing use. Both are accepted; output is always binary.
"""
from __future__ import annotations

import re

from .errors import MemlensError

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse a size into bytes.

    >>> parse_bytes("16GiB")
    17179869184
    >>> parse_bytes("1.5 GB")
    1500000000
    >>> parse_bytes(2048)
    2048
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise MemlensError(f"size {text} is negative", hint="give a size such as 16GiB")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise MemlensError(f"cannot read size {text!r}", hint="write it like 16GiB, 24GB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float | int | None, digits: int = 2) -> str:
    """Format bytes with binary units.

    >>> fmt_bytes(1536)
    '1.50 KiB'
    >>> fmt_bytes(3 * 1024**3)
    '3.00 GiB'
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gib(n: float | int) -> float:
    """Bytes to GiB as a float."""
    return float(n) / 1024**3
