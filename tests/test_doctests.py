"""The examples in the public docstrings run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["ortbridge", "ortbridge.module"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
