import doctest

import pytest

import memlens.ledger
import memlens.report.result
import memlens.spec
import memlens.units


@pytest.mark.parametrize("mod", [memlens.ledger, memlens.spec, memlens.units, memlens.report.result])
def test_docstring_examples(mod):
    assert doctest.testmod(mod).failed == 0
