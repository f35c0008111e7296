"""Suite-wide settings: repeatable property tests, GPU tests skipped without CUDA, and the order and grouping of
tests under pytest-xdist (`make test` runs `-n auto`)."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

try:   # property tests: the same examples on every run, so a suite that passed once passes again;
    # MEMLENS_HYPOTHESIS_EXPLORE=1 explores new random examples (what found the non-finite stats bug)
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile("explore" if os.environ.get("MEMLENS_HYPOTHESIS_EXPLORE") else "repeatable")
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass


HERE = Path(__file__).resolve().parent

# Simulations in this process (and in the subprocesses tests start, which inherit it) unless a test asks for worker
# processes (ScalingEstimator(workers=2), est.scaler.workers = 2, MEMLENS_WORKERS=2 in a child's env: the tests of the
# workers themselves). Under xdist every core already runs a test: a fit or sweep that forks min(cores, 4) workers of
# its own only adds forks, each warming its own imports (tests/cli/test_fuzz_cli.py::test_fit: 33 CPU-s with the
# default, 12 with one).
os.environ.setdefault("MEMLENS_WORKERS", "1")

# The collector's thresholds in the test processes: a worker holds ~385,000 objects once torch and transformers are
# imported, so each full collection walks them all (0.3-0.5 s) and the default thresholds (700, 10, 10) run one every
# few seconds of simulation. With 20,000 allocations a young collection, over three simulation-heavy files (113 tests,
# one process; alternating runs, 2026-11-27): 1-5 full collections where there were 20-23, the collector's CPU 6.9-9.7 ->
# 1.9-2.1 s, the process 75.6-93.6 -> 68.8-72.7 CPU-s, the same peak memory (~670 MB). The library keeps Python's defaults.
gc.set_threshold(20_000, 20, 10)


def _whole_modules(root: Path) -> set[str]:
    """Test modules that run whole on one pytest-xdist worker, in order: those with module-scoped fixtures (a model or
    a whole estimate built once for the module's tests: split over workers, each run of the module's tests a worker
    got would build it again) and those marked xdist_group (tests that read what earlier ones of the module left)."""
    out = set()
    for f in HERE.rglob("test_*.py"):
        text = f.read_text(encoding="utf-8")
        if 'scope="module"' in text or "xdist_group" in text:
            out.add(f.relative_to(root).as_posix())
    return out


@pytest.hookimpl(optionalhook=True)     # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    """`make test` (-n auto): xdist's load scheduling, but a module of _whole_modules is one unit of work (xdist's own
    xdist_group does not group on pytest 9.2, whose node ids it cannot rename). The units go to whichever worker is
    free: the whole modules first, the largest first, then the other tests in collection order, slow ones first."""
    from xdist.scheduler import LoadScopeScheduling

    whole = _whole_modules(config.rootpath)

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in whole else nodeid

    return Scheduling(config, log)


def _freeze() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, peft, opacus, lightning, every test module: ~530,000 objects in
    a worker) and what the tests import later (torch._dynamo, sympy, transformers' model modules, the Trainer, ...:
    up to 1.2 million) lives until the process ends, and a full collection walks it all: 0.3-0.9 s each, about 45 in a
    run of the suite, most of them the library's own after each OOM it catches. gc.freeze() moves what is alive out
    of the collector's sight: after collection, then after each test module, once its module-scoped fixtures are
    finalized (its garbage collected first, which walks only what the module made). Cost: a cycle that is alive at a
    freeze and dies later is never collected. The library keeps Python's defaults."""
    _freeze()


@pytest.hookimpl(trylast=True)     # after pytest's own teardown (the module's fixtures finalized before the freeze)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or nextitem.path != item.path:
        _freeze()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):      # slow first (stable: else as collected), so that no worker is
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)    # left with a long test at the end
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
