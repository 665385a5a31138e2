"""QOperator nodes (``QLinearConv``, ``QLinearMatMul``, com.microsoft ``QGemm`` ...) as QDQ.

onnxruntime's quantizer writes its QOperator form with one integer kernel
per layer: int8 inputs, weights and outputs, each with a scale and a zero
point. :func:`qoperators_as_pairs` writes each as what it computes in
float: ``DequantizeLinear`` of each operand, the float op, ``QuantizeLinear``
of the result (under the node's own output name, so the nodes reading it
are unchanged). A bias (int32, scale ``input_scale * weight_scale``, zero
point 0) gets a ``DequantizeLinear`` with that scale as an initializer of its
own. Ops the file runs on the integers themselves (a ``MaxPool``, a
``Reshape``, a ``Split``, a ``Resize``, a constant ``Pad`` of the zero
point) read the float values between a pair with the same scale; a
weight whose gradient another such op stops is named in a warning
(:mod:`.._normalize`).
Then :mod:`._lift` trains the weights as it trains a QDQ file's, and a saved
file keeps the QOperator nodes (only their integers change).

The integer kernels round once, at the output; the float form rounds the
same sum of products, accumulated in float32: an output at a rounding
boundary may come out one quantization step away.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .._lookup import _all_names, _unique
from .._onnx_utils import attr

_MS = "com.microsoft"
_STANDARD = ("", "ai.onnx")

#: op type -> (domain, float op, [(data, scale, zero point) positions of the
#: operands], (scale, zero point) positions of the output, or None: float output).
_SIMPLE = {
    "QLinearMatMul": (_STANDARD, "MatMul", [(0, 1, 2), (3, 4, 5)], (6, 7)),
    "QLinearAdd": ((_MS,), "Add", [(0, 1, 2), (3, 4, 5)], (6, 7)),
    "QLinearMul": ((_MS,), "Mul", [(0, 1, 2), (3, 4, 5)], (6, 7)),
    "QLinearSigmoid": ((_MS,), "Sigmoid", [(0, 1, 2)], (3, 4)),
    "QLinearLeakyRelu": ((_MS,), "LeakyRelu", [(0, 1, 2)], (3, 4)),
    "QLinearAveragePool": ((_MS,), "AveragePool", [(0, 1, 2)], (3, 4)),
    "QLinearGlobalAveragePool": ((_MS,), "GlobalAveragePool", [(0, 1, 2)], (3, 4)),
    "QLinearSoftmax": ((_MS,), "Softmax", [(0, 1, 2)], (3, 4)),
}
#: Attributes of the QOperator node the float op does not take.
_NOT_FLOAT = {"channels_last", "opset"}


def has_qoperators(model: onnx.ModelProto) -> bool:
    return any(_kind(node) is not None for node in model.graph.node)


def _kind(node: onnx.NodeProto) -> str | None:
    if node.op_type in _SIMPLE and node.domain in _SIMPLE[node.op_type][0]:
        return "simple"
    if node.op_type == "QLinearConv" and node.domain in _STANDARD:
        return "conv"
    if node.op_type == "QGemm" and node.domain == _MS:
        return "gemm"
    if node.op_type == "QLinearConcat" and node.domain == _MS:
        return "concat"
    return None


def qoperators_as_pairs(model: onnx.ModelProto) -> None:
    """Each QOperator node of the main graph as its float op between pairs, in place.

    A node this cannot write exactly (attributes the float op lacks, a
    bias whose scales are not initializers, channels-last layouts) stays.
    """
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    taken = _all_names(graph)
    nodes = []
    for node in graph.node:
        kind = _kind(node)
        new = None
        if kind is not None:
            writer = _Writer(node, inits, taken, graph)
            new = getattr(writer, kind)()
        nodes.extend([node] if new is None else new)
    del graph.node[:]
    graph.node.extend(nodes)
    _integer_views_as_float(graph, taken)


#: Ops that move or select a quantized tensor's values (or take a maximum):
#: in the integers or in their dequantized floats alike. (A nearest
#: ``Resize`` moves values. A linear one blends them: onnxruntime's integer
#: kernel rounds the blend otherwise than the float op and QuantizeLinear,
#: about 40% of its outputs one step away on a bilinear upsampling
#: (onnxruntime 1.31, measured), and the module's outputs move with them:
#: read anyway, a step off, rather than freezing every weight before it.)
_COMMUTING = frozenset(
    {
        "MaxPool", "GlobalMaxPool", "Reshape", "Transpose", "Flatten", "Squeeze",
        "Unsqueeze", "Slice", "Gather", "Identity", "DepthToSpace", "SpaceToDepth",
        "Resize", "Split", "Pad",
    }
)  # fmt: skip


def _integer_views_as_float(graph: onnx.GraphProto, taken) -> None:
    """Such an op reading a ``QuantizeLinear``'s integers reads their
    ``DequantizeLinear`` instead, and its result is quantized again with the
    same scale and zero point (the values do not change): the gradient then
    passes through it as through the float op."""
    producer = {out: node for node in graph.node for out in node.output}
    inits = {i.name: i for i in graph.initializer}
    nodes = []
    for node in graph.node:
        source = producer.get(node.input[0]) if node.input else None
        if (
            node.op_type not in _COMMUTING
            or node.domain not in _STANDARD
            or source is None
            or source.op_type != "QuantizeLinear"
            or not all(node.output)
            or (len(node.output) != 1 and node.op_type != "Split")
        ):
            nodes.append(node)
            continue
        padding = None
        if node.op_type == "Pad" and attr(node, "mode", "constant") == "constant":
            constant = _float_padding(node, source, inits, taken)
            if constant is None:
                nodes.append(node)
                continue
            nodes.append(constant)
            padding = constant.output[0]
        settings = list(source.input[1:])
        attrs = {a.name: a for a in source.attribute if a.name == "axis"}
        base = node.name or node.output[0]
        dq = _unique(f"{base}/dequantized", taken)
        outs = [_unique(f"{base}/float{i}", taken) for i in range(len(node.output))]
        nodes.append(helper.make_node("DequantizeLinear", [node.input[0], *settings], [dq], dq))
        nodes[-1].attribute.extend(attrs.values())
        float_node = onnx.NodeProto()
        float_node.CopyFrom(node)
        float_node.input[0] = dq
        if padding is not None:  # the padding value on the float side of the pair
            del float_node.input[2:]
            float_node.input.extend([padding, *node.input[3:]])
        del float_node.output[:]
        float_node.output.extend(outs)
        nodes.append(float_node)
        for out, target in zip(outs, node.output):  # each part on the same grid
            name = _unique(f"{base}/q", taken)
            nodes.append(helper.make_node("QuantizeLinear", [out, *settings], [target], name))
            nodes[-1].attribute.extend(attrs.values())
            producer[target] = nodes[-1]
    del graph.node[:]
    graph.node.extend(nodes)


def _float_padding(node, source, inits, taken) -> onnx.NodeProto | None:
    """A ``Constant`` of what a constant ``Pad`` of integers pads with,
    dequantized (0 where it pads with the zero point, as onnxruntime's
    quantizer writes it; a constant, never a weight); None where the pair's
    settings are not one scale and zero point given as initializers."""
    scale = inits.get(source.input[1])
    zero = inits.get(source.input[2]) if len(source.input) > 2 and source.input[2] else None
    if scale is None or (len(source.input) > 2 and source.input[2] and zero is None):
        return None
    scale = numpy_helper.to_array(scale)
    zero_value = numpy_helper.to_array(zero).astype(np.int64) if zero is not None else np.zeros(())
    given = node.input[2] if len(node.input) > 2 else ""
    if scale.size != 1 or zero_value.size != 1 or (given and given not in inits):
        return None
    value = numpy_helper.to_array(inits[given]).astype(np.int64) if given else np.zeros(())
    padded = ((value - zero_value).astype(np.float32) * scale).astype(scale.dtype).reshape(())
    name = _unique(f"{node.name or node.output[0]}/padding", taken)
    return helper.make_node("Constant", [], [name], name, value=numpy_helper.from_array(padded))


def dequantize_linear(data: str, scale: str, zero: str, name: str, inits, axis: int = 1):
    """``DequantizeLinear`` of ``data`` into ``name``, along ``axis`` where the
    scale is an initializer of more than one value (per channel or column)."""
    init = inits.get(scale)
    per_axis = init is not None and len(init.dims) == 1 and init.dims[0] > 1
    inputs = [data, scale] + ([zero] if zero else [])
    return helper.make_node(
        "DequantizeLinear", inputs, [name], name, **({"axis": axis} if per_axis else {})
    )


class _Writer:
    def __init__(self, node, inits, taken, graph):
        self.node, self.inits, self.taken, self.graph = node, inits, taken, graph
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.out = []

    def _fresh(self, stem: str) -> str:
        return _unique(f"{self.node.name or self.node.output[0]}/{stem}", self.taken)

    def dequantized(self, data: str, scale: str, zero: str, axis: int = 1) -> str:
        name = self._fresh(f"{data}/dequantized")
        self.out.append(dequantize_linear(data, scale, zero, name, self.inits, axis))
        return name

    def quantized(self, value: str, scale: str, zero: str, target: str) -> None:
        inputs = [value, scale] + ([zero] if zero else [])
        self.out.append(helper.make_node("QuantizeLinear", inputs, [target], self._fresh("q")))

    def _input(self, pos: int) -> str:
        return self.node.input[pos] if len(self.node.input) > pos else ""

    def _float_op(self, op: str, inputs: list[str], output: str | None = None) -> str:
        """``op`` with the node's attributes (those the float op takes)."""
        name = self._fresh(op.lower())
        kept = {k: v for k, v in self.attrs.items() if k not in _NOT_FLOAT}
        self.out.append(helper.make_node(op, inputs, [output or name], name, **kept))
        return output or name

    def _with_bias(self, inputs: list[str], bias: int) -> list[str] | None:
        """``inputs`` and the dequantized int32 bias at position ``bias`` (if
        any; None: its scales are not initializers)."""
        if not self._input(bias):
            return inputs
        dequantized = self._bias(self._input(bias), self._input(1), self._input(4))
        return None if dequantized is None else [*inputs, dequantized]

    def _bias(self, bias: str, scale_a: str, scale_b: str) -> str | None:
        if bias not in self.inits or scale_a not in self.inits or scale_b not in self.inits:
            return None
        a = numpy_helper.to_array(self.inits[scale_a])
        b = numpy_helper.to_array(self.inits[scale_b])
        scale = self._fresh(f"{bias}/scale")
        value = (a.reshape(-1) * b.reshape(-1)).astype(b.dtype)
        self.graph.initializer.append(numpy_helper.from_array(value, scale))
        self.inits[scale] = self.graph.initializer[-1]
        return self.dequantized(bias, scale, "", axis=0)

    def simple(self):
        _, op, operands, output = _SIMPLE[self.node.op_type]
        if self.attrs.get("channels_last", 0):
            return None
        if op == "Softmax" and self.attrs.get("axis", -1) != -1:
            # Its ``opset`` attribute says whether it flattens from the axis
            # (before 13) or normalises along it; over the last axis both agree.
            return None
        inputs = [self.dequantized(*(self._input(p) for p in ops)) for ops in operands]
        y = self._float_op(op, inputs)
        self.quantized(y, self._input(output[0]), self._input(output[1]), self.node.output[0])
        return self.out

    def conv(self):
        x = self.dequantized(*(self._input(p) for p in (0, 1, 2)))
        w = self.dequantized(*(self._input(p) for p in (3, 4, 5)), axis=0)
        inputs = self._with_bias([x, w], 8)
        if inputs is None:
            return None
        y = self._float_op("Conv", inputs)
        self.quantized(y, self._input(6), self._input(7), self.node.output[0])
        return self.out

    def gemm(self):
        if self.attrs.get("alpha", 1.0) != 1.0:
            return None  # the bias's scale then includes alpha
        a = self.dequantized(*(self._input(p) for p in (0, 1, 2)))
        b_axis = 0 if self.attrs.get("transB", 0) else 1
        b = self.dequantized(*(self._input(p) for p in (3, 4, 5)), axis=b_axis)
        inputs = self._with_bias([a, b], 6)
        if inputs is None:
            return None
        if not self._input(7):  # a float output
            self._float_op("Gemm", inputs, self.node.output[0])
            return self.out
        y = self._float_op("Gemm", inputs)
        self.quantized(y, self._input(7), self._input(8), self.node.output[0])
        return self.out

    def concat(self):
        ins = list(self.node.input)
        parts = [self.dequantized(*ins[i : i + 3]) for i in range(2, len(ins), 3)]
        y = self._float_op("Concat", parts)
        self.quantized(y, ins[0], ins[1], self.node.output[0])
        return self.out
