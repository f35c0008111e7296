"""report/ is the one rendering layer: it imports only from the layers below it (core ... doctor), and the
packages that compute results (core, models, step, estimator, doctor, explore) never import it; only the entry
points that write files for a user do (cli, the Trainer and Lightning callbacks, the OOM guard, Monitor.plot)."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "memlens"
BELOW_REPORT = {"core", "models", "step", "estimator", "doctor", "report"}
MAY_RENDER = {"cli", "integrations", "__init__.py", "measure/guard.py", "measure/monitor.py"}


@cache
def _imports(path: Path) -> frozenset[str]:
    """The memlens subpackages a module imports (relative imports resolved against its own package)."""
    here = path.relative_to(PKG.parent).with_suffix("").parts[:-1]     # ("memlens", "report") for report/x.py
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(here[:len(here) - node.level + 1]) if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("memlens.")}
    return frozenset(out)


def _owner(path: Path) -> str:
    """A file named in MAY_RENDER, else its top package under memlens/ ("explore", "measure" ...)."""
    rel = path.relative_to(PKG).as_posix()
    return rel if rel in MAY_RENDER else rel.split("/")[0]


def test_report_imports_only_the_layers_below_it():
    wrong = {p.name: _imports(p) - BELOW_REPORT for p in (PKG / "report").glob("*.py") if _imports(p) - BELOW_REPORT}
    assert wrong == {}


def test_only_entry_points_import_report():
    importers = {_owner(p) for p in PKG.rglob("*.py") if p.parent != PKG / "report" and "report" in _imports(p)}
    assert importers <= MAY_RENDER, sorted(importers - MAY_RENDER)
    assert {"cli", "integrations", "__init__.py"} <= importers       # the test reads the imports it means to


def test_imports_are_read_relative_to_the_module():
    assert _imports(PKG / "cli" / "estimate.py") >= {"report", "estimator", "core"}
    assert _imports(PKG / "report" / "notebook.py") == {"core"}
