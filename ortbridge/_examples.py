"""Tiny ONNX models for docstring examples and quick checks."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ._onnx_utils import make_model


def linear_model(n_in: int, n_out: int, seed: int = 0):
    """``y = x @ weight.T + bias`` as an ONNX model (input ``x``, output ``y``)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    bias = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "weight", "bias"], ["y"], transB=1)],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")],
    )
    return make_model(graph)
