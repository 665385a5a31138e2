"""Small helpers shared by every module that builds ONNX graphs.

onnxruntime-training 1.19.2 loads IR version <= 10 and ai.onnx opset <= 21,
while recent onnx releases write newer IR versions by default: every graph
ortbridge builds goes through :func:`make_model` to pin both.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

#: Highest IR version onnxruntime 1.19.2 loads.
IR_VERSION = 10
#: ai.onnx opset of the graphs ortbridge builds itself.
OPSET = 18

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


def make_model(graph: onnx.GraphProto, opset: int = OPSET, extra_opsets=None) -> onnx.ModelProto:
    """Wrap ``graph`` in a model whose IR version and opsets onnxruntime 1.19.2 accepts."""
    opsets = [helper.make_opsetid("", opset)]
    for domain, version in (extra_opsets or {}).items():
        opsets.append(helper.make_opsetid(domain, version))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="ortbridge")
    model.ir_version = IR_VERSION
    return model


def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def elem_type(dtype) -> int:
    """ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
