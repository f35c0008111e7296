import os

import pytest

try:   # property tests: the same examples on every run, so a suite that passed once passes again;
    # MEMLENS_HYPOTHESIS_EXPLORE=1 explores new random examples (what found the non-finite stats bug)
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile("explore" if os.environ.get("MEMLENS_HYPOTHESIS_EXPLORE") else "repeatable")
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass


def pytest_collection_modifyitems(config, items):
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
