"""Ranks that only a call can tell: tensors graph preparation must know the rank of.

A BatchNormalization needs its input's rank (its statistics reduce every axis
but the channels). Exporters such as older paddle2onnx releases build shapes
at run time (``Shape``, ``Concat``, ``Reshape``), where onnx's shape inference
loses track even with the call's input shapes. The call's inputs settle it:
the graph runs once in onnxruntime inference with those tensors as extra
outputs, and their ranks are declared in the graph before it is prepared.
The graph so built is reused for every call whose inputs have the same ranks.

Likewise :func:`outputs_empty` tells, from a call's input shapes alone,
whether every output is empty (a batch of zero rows).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..exceptions import OnnxModelError
from ._lookup import _infer
from ._onnx_utils import set_input_shapes


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


def inferred_outputs(model: onnx.ModelProto, shapes: dict[str, tuple]) -> list:
    """The graph outputs (``ValueInfoProto``) as shape inference sizes them from these
    input shapes alone (sizes, or names of symbolic ones): the file's declared output
    and intermediate shapes are set aside. Raises what onnx's inference raises."""
    sized = onnx.ModelProto()
    sized.CopyFrom(model)
    set_input_shapes(sized, shapes)
    del sized.graph.value_info[:]
    for value in sized.graph.output:
        value.type.tensor_type.ClearField("shape")
    return list(onnx.shape_inference.infer_shapes(sized, data_prop=True).graph.output)


def outputs_empty(model: onnx.ModelProto, shapes: dict[str, tuple]) -> bool:
    """True where shape inference sizes every output of ``model`` with a 0 for these inputs.

    A call with an empty input and only empty outputs asks no engine for a
    gradient graph of zero-size shapes (onnxruntime's shape inference refuses
    some of them): it runs as plain inference. Where inference cannot size
    the outputs, False: the engine's path, which reports what fails.
    """
    try:
        outputs = inferred_outputs(model, shapes)
    except Exception:  # noqa: BLE001 - unknown: the engine's path, which reports what fails
        return False
    return bool(outputs) and all(
        any(d.HasField("dim_value") and d.dim_value == 0 for d in o.type.tensor_type.shape.dim)
        for o in outputs
    )
