"""Rewrites of the nodes :data:`._limits.LIMITS` marks ``rewritten``.

Each turns a configuration onnxruntime-training 1.19.2's gradient builder
gets wrong or fails on into one it differentiates correctly, keeping the
forward values:

- ``auto_pad=SAME_*`` (Conv, pools): explicit pads, or an explicit ``Pad``
  and symmetric pads where the padding is uneven (needs static spatial
  sizes; the batch may be dynamic);
- Dropout in inference mode with a mask output: ``Identity`` and a mask of
  ones (the builder scales the gradient by ``1 / (1 - ratio)`` there);
- ReduceL2 below opset 18: the square root of a ``ReduceSum`` of squares
  (the builder writes an ``Unsqueeze`` without axes for it);
- a fake quantization's zero point held as raw bytes (what ``numpy_helper``
  writes): the same values in the typed field (the builder's QDQ fusion
  reads only that one, and fails reading raw bytes).

A node whose shapes do not allow the rewrite is left as it is: the table
then routes or refuses it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._onnx_utils import NodeBuilder, attr

from ..onnxruntime import _ad_rewrites_conv as conv
from ._limits import inference_dropout

_WINDOWED = ("Conv", "AveragePool", "MaxPool", "LpPool")


def rewrite(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a rewritten copy when a node needed it."""
    raw = raw_zero_points(model)
    if raw:
        model = _typed(model, raw)
    if not any(_wanted(node) for node in model.graph.node):
        return model
    from ortbridge._prepare._lookup import _all_names, _unique

    from ..onnxruntime._ad_rewrites import _Graph, _reinferred

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = _Graph(copy)
    taken = _all_names(copy.graph)
    nodes, changed = [], set()
    for node in copy.graph.node:
        new = None
        if _wanted(node):
            elem = g.types.get(node.input[0], TensorProto.FLOAT)
            b = NodeBuilder(elem, lambda base: _unique(base, taken), prefix=f"{node.output[0]}_")
            new = _one(node, b, g)
        if new is not None:
            changed.update(node.output)
        nodes.extend([node] if new is None else new)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return _reinferred(copy, changed) if changed else model


def raw_zero_points(model: onnx.ModelProto) -> set[str]:
    """Zero-point initializers of fake quantizations held as raw bytes."""
    raw = {i.name for i in model.graph.initializer if i.HasField("raw_data")}
    return {
        node.input[2]
        for node in model.graph.node
        if node.op_type in ("QuantizeLinear", "DequantizeLinear")
        and len(node.input) > 2
        and node.input[2] in raw
    }


def _typed(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``names`` hold their values in the typed field."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        if init.name in names:
            value = numpy_helper.to_array(init)
            typed = helper.make_tensor(init.name, init.data_type, value.shape, value.ravel())
            init.CopyFrom(typed)
    return copy


def _wanted(node: onnx.NodeProto) -> bool:
    if node.domain not in ("", "ai.onnx") or not node.input:
        return False
    kind = node.op_type
    if kind in _WINDOWED and str(attr(node, "auto_pad", "NOTSET")).startswith("SAME"):
        return True
    if kind == "Dropout":
        return len(node.output) > 1
    return kind == "ReduceL2"


def _one(node, b: NodeBuilder, g):
    kind = node.op_type
    if kind == "Dropout":
        return _identity_dropout(node, b) if inference_dropout(node, g.values) else None
    if kind == "ReduceL2":
        return _reduce_l2(node, b, g)
    if kind == "Conv":
        return conv.conv(node, b, g.shape, g.is_constant)
    return conv.pool(node, b, g.shape, g.types.get(node.input[0], TensorProto.FLOAT))


def _identity_dropout(node, b: NodeBuilder):
    x = node.input[0]
    nan = b.op("IsNaN", x)
    # All true, computed from x: the builder's constant folding would turn a
    # ConstantOfShape into an initializer, and then finds no node writing the mask.
    b.op("Or", nan, b.op("Not", nan), out=node.output[1])
    return [helper.make_node("Identity", [x], node.output[:1], name=node.name), *b.nodes]


def _reduce_l2(node, b: NodeBuilder, g):
    if g.opset >= 18:
        return None
    # ReduceSumSquare has no gradient in the builder: x * x summed.
    x = node.input[0]
    axes = attr(node, "axes")
    square = b.op("Mul", x, x)
    inputs = [square] if axes is None else [square, conv.ints(b, axes)]
    b.op("Sqrt", b.op("ReduceSum", *inputs, keepdims=attr(node, "keepdims", 1)))
    return b.replacing(node)
