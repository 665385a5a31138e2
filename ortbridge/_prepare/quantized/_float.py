"""A quantized file's float model: what a user quantizes again with their own calibration.

:func:`float_model` reads the file as :mod:`._lift` does (each integer weight
a float initializer of its name, every form as QDQ pairs), then takes the
quantization out: a weight's pair goes (the float weight is read directly),
an activation's pair becomes the ``Clip`` to its range (the quantizer drops
a ReLU whose range the pair's zero point already cuts: the clip keeps that),
a dynamic pair goes (its range is the tensor's own), a ``DynamicQuantizeLSTM``
becomes ONNX's LSTM of its float weights. The graph computes the float
function the file approximates.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._lookup import _all_names, _unique
from .._onnx_utils import node_reads
from ._dynamic import integer_products_as_pairs
from ._lift import (
    LSTM_WEIGHT_SLOTS,
    QDQ_DOMAINS,
    as_float_lstm,
    integer_limits,
    is_dynamic_lstm,
    lift_quantized_weights,
    lifted_lstm_weight,
)


def float_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a quantized file as given) without its quantization; a copy."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = set(lift_quantized_weights(out))
    integer_products_as_pairs(out)  # the integer products kept by the lift, in float
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    taken = _all_names(graph)
    nodes = []
    for node in graph.node:
        if is_dynamic_lstm(node):
            nodes.extend(_float_lstm(node, producer, weights, taken))
            continue
        source = producer.get(node.input[0]) if node.input else None
        if node.op_type != "DequantizeLinear" or node.domain not in QDQ_DOMAINS or source is None:
            nodes.append(node)
            continue
        x = source.input[0]
        if source.op_type == "DynamicQuantizeLinear" or x in weights:
            nodes.append(helper.make_node("Identity", [x], [node.output[0]], node.name))
            continue
        bounds = _range(node, inits)
        if source.op_type != "QuantizeLinear" or bounds is None:
            nodes.append(node)
            continue
        low, high = (_unique(f"{node.output[0]}_{end}", taken) for end in ("low", "high"))
        graph.initializer.extend(
            [numpy_helper.from_array(bounds[0], low), numpy_helper.from_array(bounds[1], high)]
        )
        nodes.append(helper.make_node("Clip", [x, low, high], [node.output[0]], node.name))
    # The pairs' QuantizeLinear nodes, now unread, go with what only they read.
    read = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        if any(o in read for o in node.output) or not node.output:
            kept.append(node)
            read.update(node_reads(node))  # a body's outer reads too
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = read | {i.name for i in graph.input}
    unread = [i for i in graph.initializer if i.name not in used]
    for init in unread:
        graph.initializer.remove(init)
    return out


def _range(node: onnx.NodeProto, inits) -> tuple[np.ndarray, np.ndarray] | None:
    """The float range a per-tensor pair keeps, or None."""
    scale = inits.get(node.input[1])
    zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scale is None or (len(node.input) > 2 and node.input[2] and zero is None):
        return None
    s = numpy_helper.to_array(scale)
    if s.size != 1:
        return None
    z = float(numpy_helper.to_array(zero).reshape(())) if zero is not None else 0.0
    low, high = integer_limits(zero.data_type if zero is not None else TensorProto.UINT8)
    s = s.reshape(())
    return np.asarray((low - z) * s, s.dtype), np.asarray((high - z) * s, s.dtype)


def _float_lstm(node, producer, weights, taken) -> list[onnx.NodeProto]:
    """ONNX's LSTM of a ``DynamicQuantizeLSTM``'s lifted float weights, each
    transposed to LSTM's ``(directions, 4 * hidden, in)``; the node itself
    where a weight was not lifted."""
    floats = []
    for slot in LSTM_WEIGHT_SLOTS:
        found = lifted_lstm_weight(node, slot, producer)
        if found is None or found[0] not in weights:
            return [node]
        floats.append(found[0])
    return as_float_lstm(node, floats, taken, node.name)
