"""The Result's JSON Schema, generated from the dataclasses themselves (:class:`.result.Result` and the payloads
of :mod:`.payloads`), so the schema cannot drift from what the verbs write.

Every Result JSON carries ``schema_version``; ``docs/result.schema.json`` is this module's output for that
version, and a test holds the two equal (``python -m memlens.core.schema > docs/result.schema.json`` after a
payload changes; a field removed or retyped also bumps :data:`.result.SCHEMA_VERSION`). A field's description
is its comment in :mod:`.payloads`.

>>> s = result_schema()
>>> s["properties"]["schema_version"], s["properties"]["peak_allocated_bytes"]["type"]
({'const': '1'}, ['integer', 'null'])
>>> fit = next(b["then"] for b in s["allOf"] if b["if"]["properties"]["verb"]["const"] == "fit")
>>> fit["properties"]["max_batch_size"]["type"]
['integer', 'null']
"""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import fields
from typing import Any

from .payloads import PAYLOADS, Payload
from . import result as _result
from .result import _CORE, SCHEMA_VERSION, Result

_SCALARS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "object", "list": "array",
            "Any": None, "None": "null"}
_ITEM = re.compile(r"^(list|dict)\[(.+)\]$")


def json_type(annotation: str) -> dict[str, Any]:
    """The JSON Schema of one field, from its annotation as written (``from __future__ import annotations``).

    >>> json_type("int | None"), json_type("list[dict] | None")
    ({'type': ['integer', 'null']}, {'type': ['array', 'null'], 'items': {'type': 'object'}})
    >>> json_type("dict[str, int] | None")
    {'type': ['object', 'null'], 'additionalProperties': {'type': 'integer'}}
    """
    out: dict[str, Any] = {}
    types: list[str] = []
    for part in (p.strip() for p in annotation.split("|")):
        m = _ITEM.match(part)
        base = m.group(1) if m else part
        if base not in _SCALARS:
            raise ValueError(f"no JSON type for the annotation {annotation!r}")
        if _SCALARS[base] is None:
            return {}
        types.append(_SCALARS[base])
        if m and base == "list":
            out["items"] = json_type(m.group(2))
        elif m and base == "dict":
            out["additionalProperties"] = json_type(m.group(2).split(",", 1)[1])
    return {"type": types if len(types) > 1 else types[0], **out}


def _comments(cls: type) -> dict[str, str]:
    """Each field's trailing comment in the class body (continuation comment lines joined)."""
    out: dict[str, str] = {}
    last = None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=[^#]*#\s*(.*)$", line)
        if m:
            last = m.group(1)
            out[last] = m.group(2).strip()
            continue
        m = re.match(r"\s+#\s*(.*)$", line)
        if m and last is not None and line.index("#") > 20:     # a comment continued under the previous one
            out[last] += " " + m.group(1).strip()
        else:
            last = None
    return out


def payload_schema(cls: type[Payload]) -> dict[str, Any]:
    """The properties one verb adds to the Result (its payload's declared fields, all optional)."""
    notes = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, Payload):
            notes.update(_comments(klass))
    types = {f.name: f.type for f in fields(cls)}
    props = {n: {**json_type(types[n]), **({"description": notes[n]} if n in notes else {})} for n in cls.declared()}
    out: dict[str, Any] = {"properties": props}
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):     # a docstring written, not the dataclass's own
        out["description"] = " ".join(cls.__doc__.split())
    return out


def result_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a Result of this :data:`SCHEMA_VERSION`: the common fields, then each verb's
    payload under ``if verb == ... then``. Fields a verb does not declare are allowed (a newer writer's)."""
    core = {f.name: f for f in fields(Result)}
    props: dict[str, Any] = {
        "schema_version": {"const": SCHEMA_VERSION},
        "memlens_version": {"type": "string"},
        "created_at": {"type": "string", "format": "date-time"},
    }
    for name in _CORE:
        props[name] = json_type(core[name].type)
    required = ["schema_version", "verb"]
    verbs = sorted(PAYLOADS)
    props["verb"] = {"enum": verbs}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"memlens-result-v{SCHEMA_VERSION}",
        "title": "memlens Result",
        "description": " ".join((_result.__doc__ or "").split("\n\n")[0].split()),
        "type": "object",
        "required": required,
        "properties": props,
        "allOf": [{"if": {"properties": {"verb": {"const": v}}}, "then": payload_schema(PAYLOADS[v])} for v in verbs],
    }


if __name__ == "__main__":
    print(json.dumps(result_schema(), indent=1))
