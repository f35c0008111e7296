"""memlens: predict, measure and explain the GPU memory of PyTorch training.

>>> from memlens import TrainingSpec, estimate
>>> spec = TrainingSpec(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16")
>>> estimate(spec).peak_allocated_bytes  # doctest: +SKIP
34470950912
>>> estimate(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16").peak_allocated_bytes  # doctest: +SKIP
34470950912

Every verb that takes a TrainingSpec (estimate, compare, sweep, fit, fit_batch_size, profile_spec,
diagnose_oom) takes its fields as keywords too (memlens.core.specargs).

Importing memlens does not import torch; the functions do when called.
"""
import importlib
from typing import TYPE_CHECKING

from .core.version import __version__
from .report import notebook as _notebook  # noqa: F401 - registers a Result's Jupyter view (light: no torch)

# Each name is imported on first use (PEP 562), so `import memlens` imports neither torch nor the
# verbs a program does not call (`memlens doctor` never imports torch; `memlens estimate` no doctor).
_EXPORTS = {
    "TrainingSpec": ".core.spec", "Result": ".core.result", "MemlensError": ".core.errors",
    "estimate": ".estimator", "compare": ".explore.compare", "sweep": ".explore.sweep", "fit": ".explore.fit",
    "fit_batch_size": ".explore.fit", "profile": ".measure.profiler", "Profiler": ".measure.profiler",
    "profile_spec": ".measure.runner", "Monitor": ".measure.monitor", "diagnose_oom": ".doctor",
    "parse_oom": ".doctor", "doctor_log": ".doctor", "doctor_snapshot": ".doctor", "doctor_stats": ".doctor",
    "estimate_trainer": ".integrations.trainer_estimate", "adaptive_batch": ".explore.adaptive", "guard": ".measure.guard",
    "apply": ".models.checkpoint", "lengths_of": ".core.lengths",
}

# the verbs whose TrainingSpec may come as keywords (memlens.core.specargs), and the argument it is
_SPEC_VERBS = {"estimate": "spec", "compare": "spec", "sweep": "spec", "fit": "spec", "fit_batch_size": "spec",
               "profile_spec": "spec", "diagnose_oom": "spec"}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .core.errors import MemlensError
    from .core.result import Result
    from .core.spec import TrainingSpec
    from .doctor import (
        diagnose_oom,
        doctor_log,
        doctor_snapshot,
        doctor_stats,
        parse_oom,
    )
    from .estimator import estimate
    from .explore.adaptive import adaptive_batch
    from .explore.compare import compare
    from .explore.fit import fit, fit_batch_size
    from .explore.sweep import sweep
    from .integrations.trainer_estimate import estimate_trainer
    from .measure.guard import guard
    from .measure.monitor import Monitor
    from .measure.profiler import Profiler, profile
    from .measure.runner import profile_spec
    from .core.lengths import lengths_of
    from .models.checkpoint import apply


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'memlens' has no attribute {name!r}")

    value = getattr(importlib.import_module(mod, __name__), name)
    if name in _SPEC_VERBS:
        from .core.specargs import with_spec_fields   # light: no torch

        value = with_spec_fields(value, _SPEC_VERBS[name])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "__version__",
    "TrainingSpec",
    "Result",
    "MemlensError",
    "estimate",
    "estimate_trainer",
    "compare",
    "sweep",
    "fit",
    "fit_batch_size",
    "profile",
    "Profiler",
    "profile_spec",
    "Monitor",
    "guard",
    "apply",
    "lengths_of",
    "adaptive_batch",
    "diagnose_oom",
    "parse_oom",
    "doctor_log",
    "doctor_snapshot",
    "doctor_stats",
]
