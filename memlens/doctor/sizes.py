"""How sizes appear in PyTorch's messages and logs ("23.69 GiB", "512 bytes", "18.9GB"): the
pattern to find them. Parsing is the one size parser of :mod:`memlens.core.units`.

>>> import re
>>> [parse_size(m) for m in re.findall(SIZE, "Tried to allocate 2.00 GiB; 512 bytes free")]
[2147483648, 512]
"""
from __future__ import annotations

from ..core.units import parse_size, size_to_bytes, unit_factor  # noqa: F401 - the one size parser

#: A number followed by a unit, as PyTorch's format_size writes it ("0 bytes", "1.50 KiB", "23.69 GiB").
SIZE = r"\d+(?:\.\d+)?\s?(?:bytes|byte|[KMGT]iB|[KMGT]B|B)\b"
