"""Forms older exporters write (paddle2onnx, early opsets), made the ones graph preparation reads.

Run by :func:`._normalize.normalize` before anything else looks at the
model (the last, a declared rank, where it infers the model's shapes):

- Unknown dimensions: paddle2onnx names them ``?`` (one name for every
  unknown axis, not one shared size) and writes ``-1`` as a dimension's
  value. Both become plain unknown dimensions, so that neither the call
  checks nor onnx's shape inference (which unifies equal names) ties two
  axes together.
- BatchNormalization with its optional statistics outputs (5 below opset 14,
  3 with ``training_mode``) that nothing reads: the outputs are dropped.
  ortbridge picks batch or running statistics itself from the module's mode
  and adds the outputs it needs; left there, they make a train-mode node of
  7 outputs that onnxruntime refuses.
- Declared output ranks the graph contradicts (:func:`outputs_as_computed`):
  torch 2.11's exporter declares a two-layer bidirectional LSTM's ``h_n``
  (4, 2, 4) as (4, 1, 2, 4). onnxruntime runs such a graph (it warns and
  trusts what it computes), but a gradient graph built on the declared
  shape does not load. Every declaration (sizes, intermediate tensors,
  bodies) is checked first by :mod:`._declared_shapes`; this is what keeps
  the outputs' shapes out of the inference normalisation reads.
- bfloat16 (:func:`bfloat16_as_float32`): onnxruntime's CPU provider has
  no bfloat16 kernel for MatMul, Add or Tanh (1.19 and 1.31), so the graph
  computes in float32: every bfloat16 tensor, initializer, constant and
  cast becomes float32 (each bfloat16 value is a float32 value: the
  weights are the same). Rounding to bfloat16 after each node is not
  reproduced; the module holds the file's bfloat16 weights, takes and
  returns bfloat16 where the file does, and saves bfloat16
  (:func:`bfloat16_names` says where).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..exceptions import NotDifferentiableError
from ._onnx_utils import all_graphs, node_reads

_BF16, _FLOAT = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT

#: dim_params that mean "unknown", not a name shared by the axes that carry it.
UNKNOWN_DIM_NAMES = frozenset({"", "?"})


def older_forms_rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (ortbridge's own copy) with the forms above rewritten in place."""
    _clear_unknown_dims(model.graph)
    _batch_norm_single_output(model.graph)
    return model


def _clear_unknown_dims(graph: onnx.GraphProto) -> None:
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if not value.type.HasField("tensor_type"):
            continue
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        for dim in tensor_type.shape.dim:
            which = dim.WhichOneof("value")
            if (which == "dim_param" and dim.dim_param in UNKNOWN_DIM_NAMES) or (
                which == "dim_value" and dim.dim_value < 0
            ):
                dim.Clear()
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _clear_unknown_dims(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for body in attribute.graphs:
                    _clear_unknown_dims(body)


def _batch_norm_single_output(graph: onnx.GraphProto) -> None:
    read = {o.name for o in graph.output}
    for node in graph.node:
        read.update(node_reads(node))
    for node in graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        extra = [name for name in node.output[1:] if name]
        used = [name for name in extra if name in read]
        if used:
            # Named as normalisation names an unnamed node (it runs later).
            label = node.name or f"{node.op_type}_{node.output[0]}"
            raise NotDifferentiableError(
                f"node {label!r} (BatchNormalization): its statistics output(s) {used} are "
                "read by the graph; ortbridge computes a BatchNormalization's statistics from "
                "the module's mode and can only give its first output to other nodes",
                node=label,
                op_type=node.op_type,
            )
        if len(node.output) > 1:
            del node.output[1:]
            keep = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(keep)


def detach_output_shapes(graph: onnx.GraphProto) -> dict[str, onnx.TensorShapeProto]:
    """The graph outputs' declared shapes, removed so that shape inference
    computes each output's shape from its producer (a declared shape that
    disagrees would otherwise be kept silently); see :func:`outputs_as_computed`."""
    declared = {}
    for value in graph.output:
        tensor_type = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor_type.HasField("shape"):
            declared[value.name] = onnx.TensorShapeProto()
            declared[value.name].CopyFrom(tensor_type.shape)
            tensor_type.ClearField("shape")
    return declared


def outputs_as_computed(graph: onnx.GraphProto, declared: dict, shapes: dict) -> None:
    """Put back the shapes :func:`detach_output_shapes` took, except where the
    graph computes another rank (``shapes``, inferred without them): such an
    output is declared as inferred. ``shapes`` gets the result.

    Only the rank decides here: sizes were settled before, with a run where
    onnx's inference and the declaration disagree
    (:func:`._declared_shapes.declarations_as_computed`; onnx's inference can
    be the one that is wrong). An inferred rank 0 is taken for unknown (onnx's
    inference says it for an STFT it cannot size).
    """
    for value in graph.output:
        if value.name not in declared:
            continue
        shape = declared[value.name]
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in shape.dim)
        computed = shapes.get(value.name)
        if computed and len(computed) != len(dims):
            shape = onnx.TensorShapeProto()
            for size in computed:
                dim = shape.dim.add()
                if size is not None:
                    dim.dim_value = size
        elif computed:
            shapes[value.name] = tuple(d if d is not None else c for c, d in zip(computed, dims))
        else:
            shapes[value.name] = dims
        value.type.tensor_type.shape.CopyFrom(shape)


def bfloat16_names(model: onnx.ModelProto) -> tuple[set[str], set[str], set[str]]:
    """The graph inputs, graph outputs and initializers ``model`` declares bfloat16."""
    graph = model.graph

    def half(values):
        return {v.name for v in values if v.type.tensor_type.elem_type == _BF16}

    weights = {i.name for g in all_graphs(graph) for i in g.initializer if i.data_type == _BF16}
    for g in all_graphs(graph):  # weights the file holds in Constant nodes
        weights.update(
            n.output[0]
            for n in g.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].t.data_type == _BF16
        )
    return half(graph.input), half(graph.output), weights


def bfloat16_as_float32(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s bfloat16 tensors, types and casts as float32, in
    place (see above)."""
    for graph in all_graphs(model.graph):
        for value in [*graph.input, *graph.output, *graph.value_info]:
            if value.type.tensor_type.elem_type == _BF16:
                value.type.tensor_type.elem_type = _FLOAT
        for init in graph.initializer:
            _as_float(init)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _as_float(attr.t)
                elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype"):
                    if attr.i == _BF16:
                        attr.i = _FLOAT


def _as_float(tensor: onnx.TensorProto) -> None:
    if tensor.data_type == _BF16:
        value = numpy_helper.to_array(tensor).astype(np.float32)
        tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
