"""The runnable examples in the docstrings stay true."""

from __future__ import annotations

import doctest

import pytest
from plyx.safety import _guard, _normalize, _policy, _redteam, testing


@pytest.mark.parametrize("module", [_normalize, _policy, _guard, _redteam, testing], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
