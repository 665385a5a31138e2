"""What a graph already holds: the names taken, and the types and shapes onnx infers.

Shared by every pass that adds nodes to a graph: :func:`_unique` gives a
fresh name, :func:`_infer` the element types and shapes of the named tensors.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto


def _unique(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    names |= {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.output)
        names.add(node.name)
    return names


def _infer(model: onnx.ModelProto, symbolic: bool = False) -> tuple[dict[str, int], dict]:
    """Element type and shape (ints, None for unknown dimensions) of every named
    tensor that onnx's shape inference can type, in one inference pass.

    ``symbolic``: a symbolic dimension is given by its name, not None.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference cannot handle still runs
        inferred = model
    graph = inferred.graph
    types = {init.name: init.data_type for init in graph.initializer}
    shapes = {}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        tensor_type = vi.type.tensor_type
        if tensor_type.elem_type:
            types[vi.name] = tensor_type.elem_type
        if tensor_type.HasField("shape"):
            shapes[vi.name] = tuple(
                d.dim_value
                if d.HasField("dim_value")
                else ((d.dim_param or None) if symbolic else None)
                for d in tensor_type.shape.dim
            )
    for init in graph.initializer:
        shapes.setdefault(init.name, tuple(init.dims))
    return types, shapes


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    return _infer(model)[0]


def _elem_type_of(graph, name) -> int:
    for init in graph.initializer:
        if init.name == name:
            return init.data_type
    for vi in list(graph.input) + list(graph.value_info):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return TensorProto.FLOAT
