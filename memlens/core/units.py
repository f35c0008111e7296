"""Byte sizes: parse '16GiB' / '1.5 GB' / '512MiB' and format bytes for people.

Binary units (KiB, MiB, GiB) are what PyTorch's allocator reports; decimal units (KB, MB, GB)
are what nvidia-smi and marketing use. Both are accepted; output is always binary.
"""
from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation

from .errors import MemlensError

_BINARY = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4,
}
_DECIMAL = {"kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_DECIMAL_AS_BINARY = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "tb": 1024**4}
_SPLIT = re.compile(r"^\s*(\d*\.?\d+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def unit_factor(unit: str, binary_decimal: bool = False) -> int | None:
    """Bytes in one ``unit`` (case-insensitive), or None if it is not a size unit. Decimal units
    (KB, MB, GB) are powers of 1000 (as nvidia-smi) unless ``binary_decimal`` (writers such as
    PyTorch's MPS allocator print "GB" for 2**30 bytes).

    >>> unit_factor("MiB"), unit_factor("mb"), unit_factor("MB", binary_decimal=True), unit_factor("parsecs")
    (1048576, 1000000, 1048576, None)
    """
    u = unit.strip().lower()
    if u in _BINARY:
        return _BINARY[u]
    if u in _DECIMAL:
        return _DECIMAL_AS_BINARY[u] if binary_decimal else _DECIMAL[u]
    return None


def size_to_bytes(number: str | float, unit: str, binary_decimal: bool = False) -> int:
    """``number`` ``unit`` in bytes, exact decimal arithmetic rounded to the nearest byte (so that
    "23.69 GiB" is always 25436943811 bytes). Raises ValueError on a bad unit or number.

    >>> size_to_bytes("23.69", "GiB"), size_to_bytes("18.9", "GB"), size_to_bytes("1.80", "GB", binary_decimal=True)
    (25436943811, 18900000000, 1932735283)
    """
    factor = unit_factor(unit, binary_decimal)
    if factor is None:
        raise ValueError(f"not a size unit: {unit!r}")
    try:
        exact = Decimal(str(number))
    except InvalidOperation:
        raise ValueError(f"not a number: {number!r}") from None
    if not exact.is_finite() or exact < 0 or exact.adjusted() > 30:
        raise ValueError(f"not a size: {number!r}")
    value = Context(prec=exact.adjusted() + 40).multiply(exact, factor)  # enough digits to stay exact
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


def parse_size(text: str, binary_decimal: bool = False) -> int:
    """Parse "23.69 GiB" / "18.9GB" / "512 bytes" into bytes. Raises ValueError if it is not one.

    >>> parse_size("1.50 KiB")
    1536
    """
    m = _SPLIT.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return size_to_bytes(m.group(1), m.group(2), binary_decimal)


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """Parse a size a user typed into bytes (one clear error if it is not one). A number of bytes
    is an int; a string needs its unit (``"80"`` is refused: 80 bytes is never what was meant),
    except 0.

    >>> parse_bytes("16GiB")
    17179869184
    >>> parse_bytes("1.5 GB")
    1500000000
    >>> parse_bytes(2048), parse_bytes("0"), parse_bytes("512B")
    (2048, 0, 512)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not text >= 0 or text == float("inf"):
            raise MemlensError(f"{what} {text} is {'negative' if text < 0 else 'not a size'}", hint="give a size such as 16GiB")
        return int(text)
    t = str(text).strip()
    if t.startswith("-"):
        raise MemlensError(f"{what} {t} is negative", hint="give a size such as 16GiB")
    if not t:
        raise MemlensError(f"{what} is empty", hint="write it like 16GiB, 24GB or 512MiB")
    m = _SPLIT.match(t)
    if m and not m.group(2):
        try:
            zero = Decimal(m.group(1)) == 0
        except InvalidOperation:
            zero = False
        if not zero:
            raise MemlensError(f"{what} {t} has no unit", hint=f"did you mean {t}GiB? (sizes take a unit: GiB, MiB, GB, ...; "
                               f"bytes: {t}B)")
    try:
        return parse_size(t)
    except ValueError:
        raise MemlensError(f"cannot read size {t!r}" + (f" ({what})" if what != "size" else ""),
                           hint="write it like 16GiB, 24GB or 512MiB") from None


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


_BYTE_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def bytes_unit(largest: float) -> tuple[float, str]:
    """(divisor, unit) that shows ``largest`` bytes as a number between 1 and 1024 (B/KiB/MiB/GiB),
    for an axis or a table of sizes read in one unit.

    >>> bytes_unit(3 * 1024**3), bytes_unit(256 * 1024), bytes_unit(512), bytes_unit(0)
    ((1073741824, 'GiB'), (1024, 'KiB'), (1, 'B'), (1, 'B'))
    """
    for unit, div in _BYTE_UNITS:
        if abs(largest) >= div:
            return div, unit
    return 1, "B"
