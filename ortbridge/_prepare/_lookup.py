"""What a graph already holds: the names taken, and the types and shapes onnx infers.

Shared by every pass that adds nodes to a graph: :func:`_unique` gives a
fresh name, :func:`_infer` the element types and shapes of the named tensors.

A reverse graph has tens of thousands of nodes, and a pass often derives many
names from one base (onnx-ad leaves its nodes unnamed): :class:`Names`
remembers the last suffix given per base, so a fresh name costs a few set
probes however many names share its base (a plain scan from ``_1`` on is
quadratic: 40 s on one published model).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto


class Names(set):
    """The names taken in a graph, with the last suffix :func:`_unique` gave per base.

    Names are only ever added: every ``base_k`` below the remembered suffix
    is taken, so the search resumes there and gives what a scan from ``_1``
    would. ``|=`` keeps the class (and the suffixes); ``|`` gives a plain set.
    """

    def __init__(self, names=()):
        super().__init__(names)
        self.suffixes: dict[str, int] = {}


def _unique(base: str, taken: set[str]) -> str:
    """``base``, or ``base_k`` with the smallest k not in ``taken``; added to it."""
    if base not in taken:
        taken.add(base)
        return base
    suffixes = getattr(taken, "suffixes", None)
    k = suffixes.get(base, 0) if suffixes is not None else 0
    while True:
        k += 1
        name = f"{base}_{k}"
        if name not in taken:
            break
    if suffixes is not None:
        suffixes[base] = k
    taken.add(name)
    return name


def _all_names(graph: onnx.GraphProto) -> Names:
    names = Names(i.name for i in graph.input)
    names |= {i.name for i in graph.initializer}
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
