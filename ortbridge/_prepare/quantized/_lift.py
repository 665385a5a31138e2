"""Quantized weights as float weights under fake quantization, and back.

A file onnxruntime's quantizer wrote in QDQ form holds each weight as an
integer initializer read by a ``DequantizeLinear`` (int8 or uint8, a scale
and a zero point per tensor or per output channel) and each bias as int32
with the scale ``input_scale * weight_scale``; activations pass through
``QuantizeLinear``/``DequantizeLinear`` pairs. Nothing there is a float
weight: a gradient reaches no initializer.

:func:`lift_quantized_weights` (in :func:`._normalize.normalize`) makes each
such weight a float initializer of the same name holding its dequantized
value, read by a ``QuantizeLinear`` then the file's ``DequantizeLinear``:
torch's fake quantization (``torch.fake_quantize_per_channel_affine``), whose
values at the start equal the file's exactly (a dequantized value divided by
its scale rounds back to the integer it came from). A bias becomes its float
value, read directly (no quantization of int32 exists to fake; its step,
``input_scale * weight_scale``, is far below the weights'). The gradient goes
straight through each pair inside the clipping range and is zero outside it
(the engines' rules; scales and zero points stay fixed).

:func:`requantized` gives the integer values a float weight is saved as, for
:func:`.._variants.with_weights`: the file comes back in its own form, the
same nodes, scales and zero points, new integers. QOperator nodes
(``QLinearConv`` ...) are read as the pairs they compute (:mod:`._qoperators`),
weight-only files' ``Mul(Cast(q), scale)`` as a ``DequantizeLinear``
(:mod:`._weight_only`), dynamically quantized ``MatMulInteger`` and
``ConvInteger`` as float ops between pairs (:mod:`._dynamic`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._lookup import _all_names, _unique
from .._onnx_utils import FLOAT_TYPES
from ._dynamic import dynamic_as_pairs, fused_as_pairs, has_dynamic, integer_products
from ._qoperators import has_qoperators, qoperators_as_pairs
from ._weight_only import has_weight_only, weight_only_as_dequantize

_STANDARD = ("", "ai.onnx")
#: Where ``QuantizeLinear``/``DequantizeLinear`` come from: ONNX, or onnxruntime's
#: contrib versions (its quantizer writes them for int4 and int16 before opset 21).
QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
#: Integer types a ``QuantizeLinear`` writes, by the lowest ai.onnx opset that
#: has it (com.microsoft's take every one of them).
_QUANTIZABLE = {
    TensorProto.INT8: 10,
    TensorProto.UINT8: 10,
    TensorProto.INT16: 21,
    TensorProto.UINT16: 21,
    TensorProto.INT4: 21,
    TensorProto.UINT4: 21,
}


def integer_limits(elem_type: int) -> tuple[int, int]:
    """The smallest and largest value of an integer tensor type (4-bit ones included)."""
    bits = {TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}
    if elem_type in bits:
        return bits[elem_type]
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(elem_type))
    return int(info.min), int(info.max)


#: Types whose weights train as float without a quantization pair (biases).
_UNPAIRED = frozenset({TensorProto.INT32})


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """How an integer initializer of the file is dequantized."""

    name: str
    elem_type: int
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    #: Whether the float weight trains under fake quantization (else plain float).
    paired: bool
    #: The scale's initializer (a trained scale replaces the file's on saving).
    scale_name: str = ""

    @property
    def limits(self) -> tuple[int, int]:
        return integer_limits(self.elem_type)

    def _broadcast(self, value: np.ndarray, rank: int) -> np.ndarray:
        if value.ndim == 0 or rank == 0:
            return value
        if value.ndim == 2:  # an LSTM's (directions, 4 * hidden) on (directions, in, 4 * hidden)
            return value.reshape(value.shape[0], 1, value.shape[1])
        shape = [1] * rank
        shape[self.axis % rank] = -1
        return value.reshape(shape)

    def dequantized(self, q: np.ndarray) -> np.ndarray:
        """What the file's ``DequantizeLinear`` computes from ``q`` (float32 arithmetic)."""
        scale = self._broadcast(self.scale, q.ndim)
        zero = self._broadcast(self.zero_point.astype(np.int64), q.ndim)
        return ((q.astype(np.int64) - zero).astype(np.float32) * scale).astype(self.scale.dtype)

    def quantized(self, value: np.ndarray) -> np.ndarray:
        """``value`` rounded to the file's integers (half to even, saturated), as
        ``QuantizeLinear`` rounds; a bias's int32 likewise."""
        value = np.asarray(value, np.float32)
        scale = self._broadcast(self.scale.astype(np.float32), value.ndim)
        zero = self._broadcast(self.zero_point.astype(np.float64), value.ndim)
        q = np.rint(value / scale).astype(np.float64) + zero
        low, high = self.limits
        return np.clip(q, low, high).astype(helper.tensor_dtype_to_np_dtype(self.elem_type))


def quantized_weights(model: onnx.ModelProto) -> dict[str, QuantizedWeight]:
    """The integer initializers of the main graph that train as float weights.

    One qualifies where every node reading it is a ``DequantizeLinear``
    (ONNX's, or onnxruntime's contrib one) reading it as its data, with one
    scale and zero point given as initializers (per tensor or per axis, no
    blocks): int8, uint8 (int16, uint16, int4, uint4 from opset 21, or in
    contrib pairs) under fake quantization, int32 unpaired.
    """
    if has_qoperators(model) or has_weight_only(model) or has_dynamic(model):  # as QDQ
        model = _copy(model)
        _as_qdq(model)
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in _STANDARD), 1)
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    outputs = {o.name for o in graph.output}
    found = {}
    for name, init in inits.items():
        kind = init.data_type
        uses = readers.get(name, [])
        if name in outputs or not uses or not all(_reader(node, slot) for node, slot in uses):
            continue
        contrib = {node.domain for node, _ in uses} == {"com.microsoft"}
        if not (
            kind in _UNPAIRED or kind in _QUANTIZABLE and (contrib or opset >= _QUANTIZABLE[kind])
        ):
            continue
        params = {_params(node, slot, inits) for node, slot in uses}
        if len(params) != 1 or None in params:
            continue
        scale_name, zero_name, axis = params.pop()
        scale = numpy_helper.to_array(inits[scale_name])
        if zero_name:
            zero = numpy_helper.to_array(inits[zero_name])
        else:
            zero = np.zeros(scale.shape, helper.tensor_dtype_to_np_dtype(kind))
        if zero.size != scale.size or not np.all(scale > 0):
            continue
        if scale.ndim > 1:  # an LSTM's (directions, 4 * hidden): a direction's gate channels
            if scale.ndim != 2:
                continue
            if scale.shape[0] == 1:
                scale = scale.reshape(-1)
        zero = zero.reshape(scale.shape)
        found[name] = QuantizedWeight(
            name, kind, scale, zero, axis, kind not in _UNPAIRED, scale_name
        )
    return found


#: com.microsoft ``DynamicQuantizeLSTM``'s int8 weights (input, recurrence):
#: slot -> the slots of their scale and zero point. The weights are
#: ``(directions, in, 4 * hidden)``, scaled per direction (axis 0) or per
#: direction and gate channel (a ``(directions, 4 * hidden)`` scale, axis 2).
LSTM_WEIGHT_SLOTS = {1: (8, 9), 2: (10, 11)}


def recurrent_weights(model: onnx.ModelProto) -> set[str]:
    """The tensors ``DynamicQuantizeLSTM`` nodes read as their int8 weights."""
    return {
        node.input[slot]
        for node in model.graph.node
        if is_dynamic_lstm(node)
        for slot in LSTM_WEIGHT_SLOTS
        if len(node.input) > slot
    }


def as_float_lstm(node, weights, taken, name: str) -> list[onnx.NodeProto]:
    """ONNX's ``LSTM`` computing ``DynamicQuantizeLSTM`` ``node`` with the float
    ``weights`` (input, recurrence; ``(directions, in, 4 * hidden)``, each
    transposed to LSTM's ``(directions, 4 * hidden, in)``), its attributes and
    other inputs; the float model's and the engine's gradient graph's."""
    out = []
    for weight in weights:
        flipped = _unique(f"{weight}_gates_first", taken)
        out.append(helper.make_node("Transpose", [weight], [flipped], perm=[0, 2, 1]))
    inputs = [node.input[0], *(t.output[0] for t in out), *node.input[3:8]]
    while not inputs[-1]:
        inputs.pop()
    lstm = helper.make_node("LSTM", inputs, list(node.output), name)
    lstm.attribute.extend(node.attribute)
    return [*out, lstm]


def lifted_lstm_weight(node, slot: int, producer) -> tuple[str, list[onnx.NodeProto]] | None:
    """The float weight a lifted ``DynamicQuantizeLSTM`` reads at ``slot`` and
    the ``QuantizeLinear`` nodes giving its integers (one, or one a direction
    that a ``Concat`` on axis 0 joins); None where the weight was not lifted."""
    if len(node.input) <= slot:
        return None
    source = producer.get(node.input[slot])
    joined = source is not None and source.op_type == "Concat"
    quantizers = [producer.get(x) for x in source.input] if joined else [source]
    if not all(q is not None and q.op_type == "QuantizeLinear" for q in quantizers):
        return None
    if not joined:
        return quantizers[0].input[0], quantizers
    gathers = [producer.get(q.input[0]) for q in quantizers]
    if not all(g is not None and g.op_type == "Gather" for g in gathers):
        return None
    return gathers[0].input[0], quantizers


def _reader(node: onnx.NodeProto, slot: int) -> bool:
    """Whether ``node`` reads an integer weight at ``slot`` as a quantized one."""
    if node.op_type == "DequantizeLinear":
        return node.domain in QDQ_DOMAINS and slot == 0
    return is_dynamic_lstm(node) and slot in LSTM_WEIGHT_SLOTS


def is_dynamic_lstm(node: onnx.NodeProto) -> bool:
    return node.op_type == "DynamicQuantizeLSTM" and node.domain == "com.microsoft"


def _params(node: onnx.NodeProto, slot: int, inits) -> tuple[str, str, int] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0):
        return None
    if is_dynamic_lstm(node):
        scale, zero = (node.input[i] for i in LSTM_WEIGHT_SLOTS[slot])
        if scale not in inits or zero not in inits:
            return None
        axis = 2 if len(inits[scale].dims) == 2 else 0
        return scale, zero, axis
    scale = node.input[1]
    zero = node.input[2] if len(node.input) > 2 else ""
    if scale not in inits or (zero and zero not in inits):
        return None
    return scale, zero, int(attrs.get("axis", 1))


def lift_quantized_weights(model: onnx.ModelProto) -> list[str]:
    """Make the integer weights of :func:`quantized_weights` float initializers, in place.

    Each keeps its name and holds its dequantized value. Its readers (the
    file's ``DequantizeLinear`` nodes) read a ``QuantizeLinear`` of it with
    the same scale, zero point (of the file's integer type) and axis; an
    int32 bias's readers become an ``Identity``. Returns the names lifted.
    """
    # (the integer products stay: their kernels run the module's inference,
    # the engine reads them in float for the gradient)
    weight_only_as_dequantize(model)
    fused_as_pairs(model)
    qoperators_as_pairs(model)
    found = quantized_weights(model)
    if not found:
        return []
    graph = model.graph
    taken = _all_names(graph)
    products = {node.output[0]: (scale, axis) for node, scale, axis in integer_products(model)}
    for init in graph.initializer:
        record = found.get(init.name)
        if record is not None:
            value = record.dequantized(numpy_helper.to_array(init))
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    nodes = []
    dims = {init.name: list(init.dims) for init in graph.initializer}
    for node in graph.node:
        if is_dynamic_lstm(node):
            nodes.extend(_lstm_weights_quantized(node, found, graph, dims, taken))
            continue
        product = products.get(node.output[0]) if node.output else None
        record = found.get(node.input[1]) if product is not None else None
        if record is not None:  # a ConvInteger or MatMulInteger: its QuantizeLinear
            scale, axis = product
            zero = _zero_point(record, node.input[3] if len(node.input) > 3 else "", graph, taken)
            while len(node.input) < 4:
                node.input.append("")
            node.input[3] = zero
            extra = {} if axis is None else {"axis": axis}
            quantize = _quantize(record, node, [scale, zero], taken, **extra)
            node.input[1] = quantize.output[0]
            nodes.extend([quantize, node])
            continue
        record = (
            found.get(node.input[0]) if node.op_type == "DequantizeLinear" and node.input else None
        )
        if record is None:
            nodes.append(node)
            continue
        if not record.paired:
            nodes.append(helper.make_node("Identity", [record.name], [node.output[0]], node.name))
            continue
        zero = _zero_point(record, node.input[2] if len(node.input) > 2 else "", graph, taken)
        del node.input[2:]
        node.input.append(zero)
        quantize = _quantize(
            record, node, [node.input[1], zero], taken,
            domain=node.domain,  # as the file's DequantizeLinear (int4 before opset 21)
            **({"axis": record.axis} if record.scale.ndim else {}),
        )  # fmt: skip
        node.input[0] = quantize.output[0]
        nodes.extend([quantize, node])
    del graph.node[:]
    graph.node.extend(nodes)
    return sorted(found)


def _zero_point(record: QuantizedWeight, given: str, graph, taken) -> str:
    """The zero point a lifted weight's ``QuantizeLinear`` reads: the file's,
    or one of the integer type where the file has none (without one,
    ``QuantizeLinear`` would write uint8)."""
    if given:
        return given
    name = _unique(f"{record.name}_zero_point", taken)
    graph.initializer.append(numpy_helper.from_array(record.zero_point, name))
    return name


def _quantize(record: QuantizedWeight, reader, settings, taken, **attrs) -> onnx.NodeProto:
    """The ``QuantizeLinear`` of a lifted weight, on ``settings`` (its scale and
    zero point), for the node ``reader`` that reads its integers."""
    return helper.make_node(
        "QuantizeLinear",
        [record.name, *settings],
        [_unique(f"{record.name}_fake_quantized", taken)],
        _unique(f"{reader.name or record.name}_quantize", taken),
        **attrs,
    )


#: Where an operator reads a quantized weight's integers (op type -> slots).
_INTEGER_WEIGHT_SLOTS = {
    "DequantizeLinear": (0,), "ConvInteger": (1,), "MatMulInteger": (1,), "QLinearConv": (3,),
    "QLinearMatMul": (3,), "QGemm": (3,), "DynamicQuantizeLSTM": (1, 2),
}  # fmt: skip


def unread_integer_weights(model: onnx.ModelProto, lifted) -> dict[str, onnx.NodeProto]:
    """Integer initializers ``model`` reads as a quantized weight that were not
    ``lifted`` (a form the lift does not read), with a node reading each: they
    stay frozen as the file holds them."""
    integers = {
        i.name for i in model.graph.initializer if i.data_type not in FLOAT_TYPES and i.dims
    }
    out = {}
    for node in model.graph.node:
        for slot in _INTEGER_WEIGHT_SLOTS.get(node.op_type, ()):
            name = node.input[slot] if len(node.input) > slot else ""
            if name in integers and name not in lifted:
                out.setdefault(name, node)
    return out


def _lstm_weights_quantized(node, found, graph, dims, taken) -> list[onnx.NodeProto]:
    """A ``DynamicQuantizeLSTM`` reading its lifted weights' ``QuantizeLinear``
    (its kernel takes the integers; the engine differentiates it as ONNX's LSTM
    of the dequantized weights, :mod:`ortbridge._engines.onnxruntime`). A
    weight scaled per direction and channel is no per-axis quantization: each
    direction gets its own ``QuantizeLinear`` and a ``Concat`` joins them."""

    def quantize(x, values, held, label, axis) -> onnx.NodeProto:
        names = []
        for name, value in zip(settings, values):
            if dims.get(name) != list(value.shape):  # (1, 4H) as (4H,), a direction's row
                name = _unique(f"{name}_per_channel", taken)
                graph.initializer.append(numpy_helper.from_array(value, name))
                dims[name] = list(value.shape)
            names.append(name)
        return helper.make_node(
            "QuantizeLinear", [x, *names], [held], _unique(label, taken), axis=axis
        )

    out = []
    for slot, (scale_slot, zero_slot) in LSTM_WEIGHT_SLOTS.items():
        record = found.get(node.input[slot]) if len(node.input) > slot else None
        if record is None:
            continue
        held = _unique(f"{record.name}_fake_quantized", taken)
        label = f"{node.name or record.name}_quantize_{slot}"
        settings = (node.input[scale_slot], node.input[zero_slot])
        values = (record.scale, record.zero_point)
        if record.scale.ndim < 2:
            out.append(quantize(record.name, values, held, label, record.axis))
            node.input[slot] = held
            continue
        parts = []
        for d in range(record.scale.shape[0]):
            part, index = (_unique(f"{record.name}_direction{d}{x}", taken) for x in ("", "_i"))
            graph.initializer.append(numpy_helper.from_array(np.asarray([d], np.int64), index))
            out.append(helper.make_node("Gather", [record.name, index], [part], axis=0))
            parts.append(_unique(f"{part}_fake_quantized", taken))
            rows = [v[d] for v in values]
            out.append(quantize(part, rows, parts[-1], f"{label}_direction{d}", 2))
        out.append(helper.make_node("Concat", parts, [held], axis=0))
        node.input[slot] = held
    return [*out, node]


def _as_qdq(model: onnx.ModelProto) -> None:
    weight_only_as_dequantize(model)
    dynamic_as_pairs(model)
    qoperators_as_pairs(model)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def requantized(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The integers ``model``'s quantized initializers among ``weights`` are saved as."""
    integers = {i.name for i in model.graph.initializer if i.data_type not in FLOAT_TYPES}
    if not integers.intersection(weights):  # a float file's save reads no more
        return {}
    found = quantized_weights(model)
    out = {}
    for name, value in weights.items():
        record = found.get(name)
        if record is None:
            continue
        if record.scale_name in weights:  # a trained scale (LSQ): the integers on its grid
            scale = np.asarray(weights[record.scale_name], record.scale.dtype)
            record = dataclasses.replace(record, scale=scale.reshape(record.scale.shape))
        out[name] = record.quantized(value)
    return out
