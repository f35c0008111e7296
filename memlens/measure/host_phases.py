"""The host's seconds in one training step's forward and backward, and the ops each dispatched: what ``memlens
calibrate`` measures the eager host's per-op cost with (calibrate.py) and FSDP2's hook cost against (calibrate_fsdp.py)."""
from __future__ import annotations

import time


def host_per_phase(torch, model, ids) -> tuple[float, float, dict, dict]:
    """(forward s, backward s) of ``model``'s step (median of 10 after 3 warm-ups) and the ops of each, counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..estimator.timing.ops import ALLOC, META, VIEW, kind_of

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"view": 0, "kernel": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = kind_of(func)
            if kind != META:      # a metadata query: not dispatched in eager mode (memlens.estimator.timing.ops_kinds)
                self.n["view" if kind in (VIEW, ALLOC) else "kernel"] += 1
            return func(*args, **(kwargs or {}))

    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)   # a CPU model: tests

    def phases(count: bool) -> tuple:
        fwd, bwd = (Count(), Count()) if count else (None, None)
        sync()
        t = time.perf_counter()
        if fwd:
            with fwd:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        if bwd:
            with bwd:
                loss.backward()
        else:
            loss.backward()
        sync()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t, t2 - t1, fwd.n if fwd else {}, bwd.n if bwd else {}

    _, _, nf, nb = phases(True)
    for _ in range(3):
        phases(False)
    runs = [phases(False) for _ in range(10)]
    return sorted(r[0] for r in runs)[5], sorted(r[1] for r in runs)[5], nf, nb
