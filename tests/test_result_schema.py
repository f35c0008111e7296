"""The Result's JSON Schema: generated from the dataclasses (memlens.core.schema), equal to the committed
docs/result.schema.json; results written by earlier versions (committed JSON) load through Result.from_dict into
their verb's payload, every field they carry of the type the schema says, and are written back the same; a fresh
estimate writes only declared fields."""
from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from memlens.core.payloads import PAYLOADS, UNSET, Payload
from memlens.core.result import SCHEMA_VERSION, Result
from memlens.core.schema import json_type, result_schema
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "docs" / "result.schema.json"
# results written before the payloads were typed end to end (schema 1): memlens' own fixtures and GPU runs
OLD = sorted((ROOT / "tests" / "fixtures" / "results").glob("*.json")) + [
    ROOT / "tests/fixtures/profile/cpu_tiny_gpt2_profile.json", ROOT / "tests/fixtures/doctor/gpu_watch_once.json",
    ROOT / "bench/results/profile_fsdp_2gpu/result.json", ROOT / "bench/results/dp_2gpu/profile_dpddp_ghost_llama1b.json",
    ROOT / "bench/results/compare_gpt2m_states.json", ROOT / "bench/results/raw/oom_guard_fraction/oom_report.json"]
SCHEMA = result_schema()     # generated once for the module
PY_OF = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list, "null": type(None)}


def test_the_committed_schema_is_the_generated_one():
    assert json.loads(COMMITTED.read_text()) == SCHEMA, (
        "the payloads changed: run `python -m memlens.core.schema > docs/result.schema.json` (and bump "
        "SCHEMA_VERSION in memlens/core/result.py if a field was removed or retyped)")
    assert SCHEMA["properties"]["schema_version"] == {"const": SCHEMA_VERSION}


def test_every_payload_field_is_absent_until_set_and_has_a_json_type():
    for cls in {Payload, *PAYLOADS.values()}:
        for f in fields(cls):
            if f.name != "extra":
                assert f.default is UNSET and f.default_factory is MISSING, f"{cls.__name__}.{f.name}"
                assert json_type(f.type)["type"], f"{cls.__name__}.{f.name}"


def test_json_types_of_annotations():
    assert json_type("bool | None") == {"type": ["boolean", "null"]}
    assert json_type("list[str] | None") == {"type": ["array", "null"], "items": {"type": "string"}}
    with pytest.raises(ValueError, match="no JSON type for the annotation 'Path'"):
        json_type("Path")


def _conforms(value, schema: dict) -> bool:
    types = schema.get("type")
    if types is None:
        return True
    types = [types] if isinstance(types, str) else types
    if isinstance(value, bool):
        return "boolean" in types
    return any(isinstance(value, PY_OF[t]) for t in types)


@pytest.mark.parametrize("path", OLD, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_old_result_loads_into_its_payload_and_writes_back_the_same(path):
    old = json.loads(path.read_text())
    assert old["schema_version"] == SCHEMA_VERSION
    r = Result.from_dict(old)
    assert type(r.data) is PAYLOADS[old["verb"]]
    props = next(b["then"]["properties"] for b in SCHEMA["allOf"] if b["if"]["properties"]["verb"]["const"] == old["verb"])
    for key in r.data:
        if key in props:
            assert _conforms(r.data[key], props[key]), f"{key}: {type(r.data[key]).__name__} is not {props[key]['type']}"
    back = r.to_dict()
    for k in ("created_at", "memlens_version"):
        old.pop(k, None), back.pop(k)
    assert back == old


def test_the_v1_fixtures_hold_only_declared_fields():
    """What memlens itself wrote at schema 1 (tests/fixtures/results) is all typed: nothing falls into ``extra``."""
    fixtures = sorted((ROOT / "tests" / "fixtures" / "results").glob("*.json"))
    assert {json.loads(p.read_text())["verb"] for p in fixtures} >= {"estimate", "fit", "compare", "sweep", "doctor.oom"}
    for p in fixtures:
        assert Result.from_dict(json.loads(p.read_text())).data.extra == {}, p.name


def test_an_estimate_writes_only_declared_fields():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear"))
    assert r.data.extra == {} and r.data.method == "simulate" and r.data.fit["fits"] is True
    assert set(r.to_dict()) - {"schema_version", "memlens_version", "created_at"} <= set(SCHEMA["properties"]) | set(
        PAYLOADS["estimate"].declared())
