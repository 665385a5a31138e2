"""Sessions of the graphs training writes, with whichever onnxruntime is installed."""

from __future__ import annotations

import onnx

from .. import _ort
from .._ort_errors import load_error
from .._runtime import _needs_basic_level

#: onnxruntime's optimisers that write ``com.microsoft.FusedMatMul`` (Transpose +
#: MatMul, Mul + MatMul), which has no float64 kernel before onnxruntime 1.30.
_FUSED_MATMUL = ["MatmulTransposeFusion", "MatMulScaleFusion"]


def session_options():
    """Quiet sessions whose idle threads do not spin (the machine may be shared)."""
    so = _ort.runtime().SessionOptions()
    so.log_severity_level = 4  # failures are raised in plain words, not logged
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def training_session(model: onnx.ModelProto, options, what: str, reverse: bool = False):
    """An ``InferenceSession`` of ``model`` on the CPU; ``what`` names it in errors.

    ``reverse``: the graph holds onnx-ad's reverse graph, whose Transpose +
    MatMul pairs onnxruntime before 1.30 fuses into a kernel it lacks in
    float64: those fusions stay off there (the options, maybe a user's, are
    not changed).
    """
    disabled = _FUSED_MATMUL if reverse and _needs_basic_level(model) else None
    try:
        return _ort.runtime().InferenceSession(
            model.SerializeToString(),
            options,
            providers=["CPUExecutionProvider"],
            disabled_optimizers=disabled,
        )
    except Exception as exc:
        raise load_error(exc, model, what) from exc
