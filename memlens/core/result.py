"""The one Result schema every verb writes.

A Result is a flat JSON object with one top-level schema for every verb. Memory verbs fill the
common memory fields; each verb's own fields are its typed payload (:mod:`.payloads`: e.g. ``rows``
for sweep, ``plan`` for fit), flattened beside them. Its JSON Schema is generated from these dataclasses
(:mod:`.schema`). Tables, CSV, PNG and HTML are renderings of it (memlens.report).

>>> r = Result(verb="estimate", peak_allocated_bytes=1024, data={"method": "simulate"})
>>> d = r.to_dict()
>>> d["schema_version"], d["peak_allocated_bytes"], d["method"]
('1', 1024, 'simulate')
>>> Result.from_dict(d).data["method"]
'simulate'
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import MemlensError
from .payloads import Payload, payload_for
from .version import __version__, environment

# the JSON's version (docs/result.schema.json, memlens.core.schema): bumped when a field is removed or retyped
SCHEMA_VERSION = "1"

# the notebook view is a rendering: memlens.report.notebook registers it (import memlens does), core never imports report
_HTML_VIEW: list[Callable[["Result"], str]] = []


def register_html_view(view: Callable[["Result"], str]) -> None:
    """Set the function that renders a Result as HTML for Jupyter (one view: the last registered)."""
    _HTML_VIEW[:] = [view]


_CORE = (
    "verb", "spec", "peak_allocated_bytes", "peak_reserved_bytes", "by_category", "by_phase",
    "by_module", "timeline", "notes", "environment",
)


@dataclass
class Result:
    """Output of any memlens verb; see the module docstring."""

    verb: str
    spec: dict | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    by_category: dict[str, int] = field(default_factory=dict)
    by_phase: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_module: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    data: Payload = None   # type: ignore[assignment] - the verb's own fields: its payload (a dict or None is converted)

    def __post_init__(self) -> None:
        self.data = payload_for(self.verb, self.data)
        # what it was made with (a profile adds its device; a loaded result keeps its own)
        self.environment = {**environment(), **(self.environment or {})}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "memlens_version": __version__,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        for k in _CORE:
            out[k] = getattr(self, k)
        extra = self.data.to_dict()
        clash = set(extra) & set(out)
        if clash:
            raise ValueError(f"Result.data may not redefine core keys: {sorted(clash)}")
        out.update(extra)
        return out

    def _repr_html_(self) -> str | None:
        """What Jupyter shows: the summary, the main tables and the timeline inline (the view that
        :mod:`memlens.report.notebook` registers; without it, None: Jupyter shows the repr)."""
        return _HTML_VIEW[0](self) if _HTML_VIEW else None

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        if not isinstance(d, dict) or "verb" not in d:
            raise MemlensError("not a memlens result (no 'verb' key)", hint="pass a result.json written by memlens --out or --json")
        d = dict(d)
        for k in ("schema_version", "memlens_version", "created_at"):
            d.pop(k, None)
        core = {k: d.pop(k) for k in _CORE if k in d}
        r = cls(**core, data=d)
        r.environment = dict(core.get("environment") or {})   # as it was made, not as it is loaded
        return r

    @classmethod
    def load(cls, path: str | Path) -> "Result":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise MemlensError(f"result file {path} does not exist", hint="check the path") from None
        except json.JSONDecodeError as e:
            raise MemlensError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})", hint="pass a result.json written by memlens") from None


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot serialize {type(o).__name__}")
