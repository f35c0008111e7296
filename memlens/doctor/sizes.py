"""Sizes as they appear in messages and logs ("23.69 GiB", "512 bytes", "18.9GB") turned into bytes.

Exact decimal arithmetic, rounded to the nearest byte, so that "23.69 GiB" is always
25436943811 bytes (a float product would land on either side of .5 by accident).
Binary units (KiB, MiB, GiB) are what PyTorch prints; decimal ones (KB, MB, GB) follow
``memlens.core.units`` (powers of 1000, as nvidia-smi) unless ``binary_decimal=True``, for
writers such as PyTorch's MPS allocator that print "GB" for 2**30 bytes.

>>> size_to_bytes("23.69", "GiB")
25436943811
>>> size_to_bytes("18.9", "GB")
18900000000
>>> size_to_bytes("1.80", "GB", binary_decimal=True)
1932735283
>>> size_to_bytes("512", "bytes")
512
"""
from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation

_BINARY = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4,
}
_DECIMAL = {"kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_DECIMAL_AS_BINARY = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "tb": 1024**4}

#: A number followed by a unit, as PyTorch's format_size writes it ("0 bytes", "1.50 KiB", "23.69 GiB").
SIZE = r"\d+(?:\.\d+)?\s?(?:bytes|byte|[KMGT]iB|[KMGT]B|B)\b"
_SPLIT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def unit_factor(unit: str, binary_decimal: bool = False) -> int | None:
    """Bytes in one ``unit`` (case-insensitive), or None if it is not a size unit.

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
    """``number`` ``unit`` in bytes, rounded to the nearest byte. Raises ValueError on a bad unit or number."""
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
    m = _SPLIT.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return size_to_bytes(m.group(1), m.group(2), binary_decimal)
