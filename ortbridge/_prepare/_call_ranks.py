"""Ranks that only a call can tell: tensors graph preparation must know the rank of.

A BatchNormalization needs its input's rank (its statistics reduce every axis
but the channels). Exporters such as older paddle2onnx releases build shapes
at run time (``Shape``, ``Concat``, ``Reshape``), where onnx's shape inference
loses track even with the call's input shapes. The call's inputs settle it:
the graph runs once in onnxruntime inference with those tensors as extra
outputs, and their ranks are declared in the graph before it is prepared.
The graph so built is reused for every call whose inputs have the same ranks.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..exceptions import OnnxModelError
from ._lookup import _infer


class CallShapesNeeded(OnnxModelError):
    """The graph can be prepared only with a call's inputs (none were given)."""


def unknown_ranks(model: onnx.ModelProto) -> list[str]:
    """Inputs of BatchNormalization nodes whose rank onnx's shape inference cannot tell."""
    wanted = [
        node.input[0]
        for node in model.graph.node
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
    ]
    if not wanted:  # no shape inference run for graphs without one
        return []
    shapes = _infer(model)[1]
    return list(dict.fromkeys(name for name in wanted if name not in shapes))


def observed_ranks(
    model: onnx.ModelProto, names: list[str], feeds: dict[str, np.ndarray]
) -> dict[str, tuple[int, int]]:
    """Rank and element type of each tensor ``names`` when ``model`` runs on ``feeds``
    (CPU inference)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    # Imported here: making sessions needs torch, which graph preparation does not.
    from .._runtime._sessions import make_session

    try:
        session = make_session(probe)
        values = session.run(names, feeds)
    except Exception as exc:
        raise OnnxModelError(
            f"the rank of {names[:3]} (input(s) of BatchNormalization) is declared nowhere in "
            f"the graph and running it on this call's inputs to learn it failed: {exc}"
        ) from exc
    return {
        name: (np.ndim(value), helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype))
        for name, value in zip(names, values)
    }


def declare_ranks(model: onnx.ModelProto, ranks: dict[str, tuple[int, int]]) -> None:
    """Declare each tensor of ``ranks`` (rank, element type) with that many unknown
    dimensions, in place."""
    declared = {v.name: v for v in model.graph.value_info}
    for name, (rank, elem) in ranks.items():
        value = declared.get(name)
        if value is None:
            value = model.graph.value_info.add()
            value.name = name
        value.type.tensor_type.elem_type = elem
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for _ in range(rank):
            dims.add()
