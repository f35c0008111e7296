"""TorchScript functions in model code, run as the Python they were scripted from.

Some model code scripts small helpers with ``@torch.jit.script`` (DeBERTa-v2/v3's relative-position
buckets and expands in transformers up to 5.23, SEW-D, GPT-BigCode...). The TorchScript interpreter
cannot run fake tensors, so a simulation runs each such function's Python original
(``torch.jit.script`` keeps it on the ScriptFunction as ``_torchdynamo_inline``, for torch.compile).
The two compute the same tensors: on CUDA a scripted helper of a few elementwise ops allocates what
its Python body does (the profiling executor fuses nothing until a function has run twice, and
these are index computations outside autograd), so the memory of the step does not change.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


def _script_functions(module_names) -> list[tuple[dict, str, object]]:
    """(module globals, name, Python original) of every module-level ScriptFunction in those modules."""
    import torch  # heavy: torch, loaded on first use

    found = []
    for mod_name in sorted(module_names):
        mod = sys.modules.get(mod_name)
        for name, value in list(vars(mod).items()) if mod is not None else ():
            original = getattr(value, "_torchdynamo_inline", None)
            if isinstance(value, torch.jit.ScriptFunction) and callable(original):
                found.append((vars(mod), name, original))
    return found


@contextlib.contextmanager
def python_originals(model) -> Iterator[int]:
    """While inside: the ScriptFunctions of the modules that define ``model``'s module classes are their
    Python originals; yields how many were swapped. Restored on exit (a later real run is untouched)."""
    modules = {type(m).__module__ for m in model.modules()} if hasattr(model, "modules") else set()
    swaps = _script_functions(modules)
    saved = [(g, name, g[name]) for g, name, _ in swaps]
    for g, name, original in swaps:
        g[name] = original
    try:
        yield len(swaps)
    finally:
        for g, name, value in saved:
            g[name] = value
