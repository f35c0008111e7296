import doctest

import pytest

import memlens.core.ledger
import memlens.report.result
import memlens.core.spec
import memlens.core.units


@pytest.mark.parametrize("mod", [memlens.core.ledger, memlens.core.spec, memlens.core.units, memlens.report.result])
def test_docstring_examples(mod):
    assert doctest.testmod(mod).failed == 0
