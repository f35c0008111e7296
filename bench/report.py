"""Writing a bench script's results: bench/results/NAME.json and NAME.md (a heading, a paragraph,
one table), the pair most scripts here commit."""
from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(name: str, data: dict, title: str, intro: str, header: list[str], rows: list[list]) -> None:
    """``data`` as results/NAME.json; ``title``, ``intro`` and the table of ``rows`` as results/NAME.md."""
    out = os.path.join(RESULTS, name)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"# {title}\n\n{intro}\n\n" + table(header, rows))
