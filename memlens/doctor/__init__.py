"""doctor: what an OOM message, a training log, a memory snapshot or memory_stats says, and what to do.

>>> from memlens.doctor import diagnose_oom
>>> diagnose_oom("CUDA out of memory. Tried to allocate 2.50 GiB (GPU 0; 23.69 GiB total capacity; "
...              "21.45 GiB already allocated; 1.89 GiB free; 21.50 GiB reserved in total by PyTorch)").data.diagnosis
'capacity'
"""
from .account import Account, account
from .log import analyze_memory, doctor_log, read_memory_log
from .oom import diagnose, diagnose_oom, parse_oom, what_fits
from .snapshot import diff_snapshots, doctor_snapshot, load_snapshot, summarize_snapshot
from .stats import analyze_memory_stats, doctor_stats

__all__ = [
    "Account", "account", "analyze_memory", "analyze_memory_stats", "diagnose", "diagnose_oom", "diff_snapshots", "doctor_log",
    "doctor_snapshot", "doctor_stats", "load_snapshot", "parse_oom", "read_memory_log", "summarize_snapshot", "what_fits",
]
