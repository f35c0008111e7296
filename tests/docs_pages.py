"""The documentation the tests read: README.md and every page under docs/ (the README's deep sections live there)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text() -> str:
    """README.md then docs/*.md, joined: each page's code blocks are closed within it, so a block never spans two."""
    return "\n".join(p.read_text() for p in pages())
