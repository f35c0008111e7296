"""Every docstring example in the package runs (CI runs this file: `make test`)."""
import doctest
import importlib
import pkgutil

import pytest

import memlens

MODULES = sorted(m.name for m in pkgutil.walk_packages(memlens.__path__, "memlens."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)      # examples that write files write them here
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0, f"{res.failed} of {res.attempted} examples failed in {name}"
