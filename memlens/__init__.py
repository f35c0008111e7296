"""memlens: predict, measure and explain the GPU memory of PyTorch training.

>>> from memlens import TrainingSpec, estimate
>>> spec = TrainingSpec(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16")
>>> estimate(spec).peak_allocated_bytes  # doctest: +SKIP
34470950912

Importing memlens does not import torch; the functions do when called.
"""
from .core.version import __version__
from .doctor import diagnose_oom, doctor_log, doctor_snapshot, doctor_stats, parse_oom
from .core.errors import MemlensError
from .estimator import estimate
from .integrations.trainer_estimate import estimate_trainer
from .explore.compare import compare
from .explore.fit import fit, fit_batch_size
from .explore.sweep import sweep
from .measure.adaptive import adaptive_batch
from .measure.guard import guard
from .measure.monitor import Monitor
from .measure.profiler import Profiler, profile
from .measure.runner import profile_spec
from .report.result import Result
from .core.spec import TrainingSpec

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
    "adaptive_batch",
    "diagnose_oom",
    "parse_oom",
    "doctor_log",
    "doctor_snapshot",
    "doctor_stats",
]
