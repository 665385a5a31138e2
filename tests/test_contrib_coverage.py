"""onnxruntime's com.microsoft fused nodes, each checked as ONNX's node cases are.

The cases (:mod:`ortbridge._coverage._contrib`) go through
:func:`ortbridge._coverage.run_case`: outputs against onnxruntime's fused
kernel, gradients against central finite differences of it.
"""

from __future__ import annotations

import pytest

from ortbridge import _coverage
from ortbridge._coverage._contrib import CASES, NEWER
from ortbridge._runtime import _ort


@pytest.mark.parametrize("name", list(CASES))
def test_each_fused_node_is_differentiated_correctly(name):
    result = _coverage.run_case(CASES[name](), backend="onnxruntime")
    if name in NEWER and _ort.version() < (1, 20):
        assert result.status == _coverage.REFUSED, (result.status, result.detail)
        assert "MultiHeadAttention" in result.detail
        return
    assert result.status == _coverage.CORRECT, (result.status, result.detail)
    assert result.checked > 0
