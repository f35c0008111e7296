"""``--config FILE``: a memlens spec YAML, an axolotl YAML or a TRL recipe YAML, told apart by their keys.

- a memlens spec (or a result.json / YAML with a ``spec`` section) names ``model``;
- an axolotl config names ``base_model`` (:mod:`.axolotl`);
- a TRL recipe names ``model_name_or_path`` (:mod:`.trl_recipe`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import SpecError
from ..core.spec import TrainingSpec, load_yaml
from . import axolotl, trl_recipe


def read_config(path: str | Path, trainer: str | None = None) -> tuple[dict[str, Any], list[str], str]:
    """(spec fields, notes, kind) of a --config file; kind is "memlens", "axolotl" or "trl"."""
    data = load_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("spec"), dict):
        data = data["spec"]
    if axolotl.looks_like_axolotl(data):
        fields, notes = axolotl.spec_fields(data)
        return fields, notes, "axolotl"
    if trl_recipe.looks_like_trl_recipe(data):
        fields, notes = trl_recipe.spec_fields(data, trainer=trainer)
        return fields, notes, "trl"
    if isinstance(data, dict) and "model" not in data:
        raise SpecError(f"{path} names no model (memlens spec: model; axolotl: base_model; TRL recipe: model_name_or_path)",
                        hint="add `model: gpt2`, or give an axolotl config or a TRL recipe")
    return TrainingSpec.from_dict(data).to_dict(), [], "memlens"
