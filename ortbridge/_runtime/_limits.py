"""What the installed onnxruntime loads: the IR version and opset of the graphs training writes.

onnxruntime-training 1.19.2 loads IR versions up to 10 and ai.onnx opsets up
to 21; maintained onnxruntime 1.31.1 up to 13 and 26 (both checked by
loading a one-node model). A graph built here keeps the model's IR version
unless the runtime that will run it cannot load it: it is not pinned to the
oldest runtime's.
"""

from __future__ import annotations

import onnx

from ..exceptions import OnnxModelError
from . import _ort

#: (onnxruntime version, highest IR version, highest ai.onnx opset), newest first.
#: A version between two rows gets the older row's limits (known to load).
_KNOWN = (((1, 31), 13, 26), ((1, 19), 10, 21))


def limits() -> tuple[int, int]:
    """(highest IR version, highest ai.onnx opset) the installed onnxruntime loads."""
    version = _ort.version()
    for since, ir_version, opset in _KNOWN:
        if version >= since:
            return ir_version, opset
    return _KNOWN[-1][1:]


def fit_to_runtime(model: onnx.ModelProto) -> onnx.ModelProto:
    """Lower ``model.ir_version`` (in place) to what the installed onnxruntime loads.

    Raises ``OnnxModelError`` when its ai.onnx opset is newer than that
    onnxruntime runs: a graph must not fail later, at session creation, with
    onnxruntime's less clear message.
    """
    ir_version, max_opset = limits()
    if model.ir_version > ir_version:
        model.ir_version = ir_version
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > max_opset:
            raise OnnxModelError(
                f"the model uses ai.onnx opset {opset.version}; onnxruntime "
                f"{_ort.runtime().__version__} runs opsets up to {max_opset} (and IR versions "
                f"up to {ir_version}): convert it with "
                f"onnx.version_converter.convert_version(model, {max_opset})"
            )
    return model
