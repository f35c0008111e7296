"""Built-in model configs shipped in the package (small JSON facts: no weights, no network)."""
from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def _index() -> dict[str, dict]:
    out = {}
    root = resources.files("memlens.models").joinpath("configs")
    for entry in [*root.iterdir(), *root.joinpath("diffusers").iterdir()]:   # diffusers' models: built by models/diffusion.py
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            out[doc["name"]] = doc
    return out


def names() -> list[str]:
    """Names of the built-in models.

    >>> "gpt2" in names() and "llama-3.1-8b" in names()
    True
    """
    return sorted(_index())


def get(name: str) -> dict | None:
    """The registry entry (name, hf_id, task, config) for a built-in name or its Hugging Face id."""
    idx = _index()
    key = name.lower()
    if key in idx:
        return idx[key]
    for doc in idx.values():
        if doc["hf_id"].lower() == key or doc["hf_id"].split("/")[-1].lower() == key:
            return doc
    return None


def suggest(name: str, n: int = 3) -> list[str]:
    """Close built-in names, for 'did you mean' hints."""
    return difflib.get_close_matches(name.lower(), names(), n=n, cutoff=0.5)
