"""Graphs showing a defect of the training build's gradient builder, beside ONNX's node cases.

Each entry of :data:`ortbridge._engines.training_agent._limits.LIMITS` names its
probe: a case of ONNX's node suite, or a function here building one as a
:class:`~ortbridge._coverage.NodeCase` (float inputs are what the gradient
is taken of; weights are inputs too, as :mod:`ortbridge._coverage` wants).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from ortbridge import _coverage
from ortbridge._coverage._reference import _reference_session


def _case(name, op_type, nodes, inputs, values, outputs, opset=18, initializers=(), shapes=None):
    shapes = shapes or [None] * len(outputs)
    graph = h.make_graph(
        nodes,
        name,
        [h.make_tensor_value_info(n, T.FLOAT, list(v.shape)) for n, v in zip(inputs, values)],
        [h.make_tensor_value_info(o, T.FLOAT, s) for o, s in zip(outputs, shapes)],
        list(initializers),
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 9
    model = onnx.shape_inference.infer_shapes(model)
    reference = _reference_session(model).run(None, dict(zip(inputs, values)))
    return _coverage.NodeCase(name, op_type, "", False, model, list(values), list(reference))


def _typed(value: np.ndarray, name: str):
    """An initializer holding ``value`` in its typed field (as onnxruntime's quantizer writes)."""
    return h.make_tensor(name, h.np_dtype_to_tensor_dtype(value.dtype), value.shape, value.ravel())


def _random(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def loop_of_weight():
    """A Loop summing rows of a weight (as nn.EmbeddingBag's export does)."""
    body = h.make_graph(
        [
            h.make_node("Gather", ["w", "i"], ["row"], axis=0),
            h.make_node("Add", ["acc_in", "row"], ["acc_out"]),
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            h.make_tensor_value_info("i", T.INT64, []),
            h.make_tensor_value_info("cond_in", T.BOOL, []),
            h.make_tensor_value_info("acc_in", T.FLOAT, [3]),
        ],
        [
            h.make_tensor_value_info("cond_out", T.BOOL, []),
            h.make_tensor_value_info("acc_out", T.FLOAT, [3]),
        ],
    )
    init = [
        nh.from_array(np.array(4, np.int64), "trips"),
        nh.from_array(np.array(True), "cond"),
    ]
    nodes = [
        h.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body),
    ]
    return _case(
        "loop_of_weight", "Loop", nodes, ["x", "w"], [_random(3), _random(4, 3)], ["y"],
        initializers=init, shapes=[[3]],
    )  # fmt: skip


def bidirectional_lstm():
    x, w, r = _random(3, 2, 4), _random(2, 20, 4) * 0.3, _random(2, 20, 5) * 0.3
    node = h.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=5, direction="bidirectional")
    return _case("bidirectional_lstm", "LSTM", [node], ["x", "w", "r"], [x, w, r], ["y"])


def split_to_sequence_of_weight():
    """A weight split into a sequence read at a computed position (the rewrite needs constants)."""
    nodes = [
        h.make_node("SplitToSequence", ["w"], ["s"], axis=0),
        h.make_node("Size", ["x"], ["n"]),
        h.make_node("Sub", ["n", "five"], ["one"]),
        h.make_node("SequenceAt", ["s", "one"], ["row"]),
        h.make_node("Mul", ["x", "row"], ["y"]),
    ]
    init = [nh.from_array(np.array(5, np.int64), "five")]
    return _case(
        "split_to_sequence_of_weight", "SplitToSequence", nodes, ["x", "w"],
        [_random(2, 3), _random(2, 3)], ["y"], initializers=init,
    )  # fmt: skip


def split_with_unread_output():
    """A weight split in two, only the second part read."""
    nodes = [
        h.make_node("Split", ["w", "sizes"], ["first", "second"], axis=0),
        h.make_node("Mul", ["x", "second"], ["y"]),
    ]
    init = [nh.from_array(np.array([1, 1], np.int64), "sizes")]
    return _case(
        "split_with_unread_output", "Split", nodes, ["x", "w"], [_random(2, 3), _random(2, 3)],
        ["y"], initializers=init,
    )  # fmt: skip


def reduce_l2_opset17():
    nodes = [
        h.make_node("Mul", ["x", "w"], ["t"]),
        h.make_node("ReduceL2", ["t"], ["y"], axes=[1], keepdims=0),
    ]
    return _case(
        "reduce_l2_opset17", "ReduceL2", nodes, ["x", "w"], [_random(2, 3), _random(2, 3)],
        ["y"], opset=17,
    )  # fmt: skip


def scatter_elements_reduction_add():
    nodes = [
        h.make_node("ScatterElements", ["x", "idx", "u"], ["y"], axis=1, reduction="add"),
    ]
    init = [nh.from_array(np.array([[0, 0, 2], [1, 1, 1]], np.int64), "idx")]
    return _case(
        "scatter_elements_reduction_add", "ScatterElements", nodes, ["x", "u"],
        [_random(2, 4), _random(2, 3)], ["y"], initializers=init,
    )  # fmt: skip


def average_pool_excluding_pads_of_a_dynamic_size():
    """torch's avg_pool2d(padding=1, count_include_pad=False) over a dynamic size."""
    node = h.make_node(
        "AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
        count_include_pad=0,
    )  # fmt: skip
    graph = h.make_graph(
        [node],
        "average_pool_excluding_pads_of_a_dynamic_size",
        [h.make_tensor_value_info("x", T.FLOAT, ["N", 2, "H", "W"])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 9
    values = [_random(2, 2, 5, 5)]
    reference = _reference_session(model).run(None, {"x": values[0]})
    return _coverage.NodeCase(graph.name, "AveragePool", "", False, model, values, reference)


def probe(name: str, suite=None) -> _coverage.NodeCase:
    """The probe ``name``: a function here, else a node case (``suite``: cases collected)."""
    if name in globals() and callable(globals()[name]):
        return globals()[name]()
    cases = suite if suite is not None else _coverage.node_cases()
    found = [c for c in cases if c.name == name]
    assert found, f"no node test case named {name!r} in this onnx"
    return found[0]


def per_axis_fake_quantization():
    """A weight under per-channel fake quantization (int8, one scale per row)."""
    nodes = [
        h.make_node("QuantizeLinear", ["w", "scale", "zero"], ["q"], axis=0),
        h.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"], axis=0),
        h.make_node("MatMul", ["x", "dq"], ["y"]),
    ]
    init = [
        nh.from_array(np.array([0.02, 0.05, 0.1], np.float32), "scale"),
        _typed(np.zeros(3, np.int8), "zero"),
    ]
    return _case(
        "per_axis_fake_quantization", "QuantizeLinear", nodes, ["x", "w"],
        [_random(2, 3), _random(3, 4)], ["y"], initializers=init,
    )  # fmt: skip


def raw_zero_point_fake_quantization():
    """An activation under fake quantization, its zero point held as raw bytes
    (``numpy_helper``'s form; onnxruntime's quantizer writes the typed field)."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"]),
        h.make_node("QuantizeLinear", ["a", "scale", "zero"], ["q"]),
        h.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
    ]
    init = [
        nh.from_array(np.array(0.05, np.float32), "scale"),
        nh.from_array(np.array(128, np.uint8), "zero"),
    ]
    return _case(
        "raw_zero_point_fake_quantization", "QuantizeLinear", nodes, ["x", "w"],
        [_random(2, 3), _random(3, 4)], ["y"], initializers=init,
    )  # fmt: skip


def float16_max_pool():
    """A float16 MaxPool after a Conv (onnxconverter-common's float16 CNN; the
    case's inputs and output float32, cast around it)."""
    nodes = [
        h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16),
        h.make_node("Cast", ["w"], ["w16"], to=T.FLOAT16),
        h.make_node("Conv", ["x16", "w16"], ["c"], kernel_shape=[3, 3]),
        h.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("Cast", ["p"], ["y"], to=T.FLOAT),
    ]
    return _case(
        "float16_max_pool", "MaxPool", nodes, ["x", "w"],
        [_random(2, 3, 6, 6), _random(4, 3, 3, 3)], ["y"],
    )  # fmt: skip


def trainable_scale_fake_quantization():
    """A weight under fake quantization whose scale trains too (LSQ): the scale
    a graph input asked for a gradient as the weight is (the builder's
    FakeQuant gives it none)."""
    nodes = [
        h.make_node("QuantizeLinear", ["w", "scale", "zero"], ["q"]),
        h.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"]),
        h.make_node("MatMul", ["x", "dq"], ["y"]),
    ]
    init = [_typed(np.array(0, np.int8), "zero")]
    return _case(
        "trainable_scale_fake_quantization", "QuantizeLinear", nodes, ["x", "w", "scale"],
        [_random(2, 3), _random(3, 4), np.array(0.05, np.float32)], ["y"], initializers=init,
    )  # fmt: skip


def shared_zero_point_fake_quantization():
    """Two activations under fake quantization with one scale and zero point
    (onnxruntime's quantizer writes a MaxPool's input and output so)."""
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"]),
        h.make_node("QuantizeLinear", ["a", "scale", "zero"], ["qa"]),
        h.make_node("DequantizeLinear", ["qa", "scale", "zero"], ["da"]),
        h.make_node("Relu", ["da"], ["r"]),
        h.make_node("QuantizeLinear", ["r", "scale", "zero"], ["qr"]),
        h.make_node("DequantizeLinear", ["qr", "scale", "zero"], ["y"]),
    ]
    init = [
        nh.from_array(np.array(0.05, np.float32), "scale"),
        _typed(np.array(128, np.uint8), "zero"),
    ]
    return _case(
        "shared_zero_point_fake_quantization", "QuantizeLinear", nodes, ["x", "w"],
        [_random(2, 3), _random(3, 4)], ["y"], initializers=init,
    )  # fmt: skip


def quantize_into_integer_product():
    """A weight under fake quantization read by an integer product, as
    ortbridge's lift writes a dynamically quantized file (the activation by
    DynamicQuantizeLinear, the product by MatMulInteger, the scales after)."""
    nodes = [
        h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        h.make_node("QuantizeLinear", ["w", "scale", "zero"], ["wq"]),
        h.make_node("MatMulInteger", ["xq", "wq", "xz", "zero"], ["acc"]),
        h.make_node("Cast", ["acc"], ["accf"], to=T.FLOAT),
        h.make_node("Mul", ["xs", "scale"], ["s"]),
        h.make_node("Mul", ["accf", "s"], ["y"]),
    ]
    init = [
        nh.from_array(np.array(0.05, np.float32), "scale"),
        _typed(np.array(0, np.int8), "zero"),
    ]
    return _case(
        "quantize_into_integer_product", "QuantizeLinear", nodes, ["x", "w"],
        [_random(2, 3), _random(3, 4)], ["y"], initializers=init,
    )  # fmt: skip


def reshape_allowzero_beside_a_weight():
    """An empty tensor reshaped with allowzero=1, summed into an output a weight reaches."""
    nodes = [
        h.make_node("Reshape", ["x", "shape"], ["r"], allowzero=1),
        h.make_node("ReduceSum", ["r"], ["s"], keepdims=0),
        h.make_node("Mul", ["w", "w"], ["ww"]),
        h.make_node("Add", ["ww", "s"], ["y"]),
    ]
    init = [nh.from_array(np.array([3, 4, 0], np.int64), "shape")]
    return _case(
        "reshape_allowzero_beside_a_weight", "Reshape", nodes, ["x", "w"],
        [_random(0, 3, 4), _random(2)], ["y"], initializers=init,
    )  # fmt: skip


def _if_reading(name, source):
    """An If on a shape test (x has 3 elements) whose branches read ``source`` from outside."""
    then = h.make_graph(
        [h.make_node("Neg", [source], ["a"])],
        "then",
        [],
        [h.make_tensor_value_info("a", T.FLOAT, None)],
    )
    other = h.make_graph(
        [h.make_node("Abs", [source], ["b"])],
        "else",
        [],
        [h.make_tensor_value_info("b", T.FLOAT, None)],
    )
    nodes = [
        h.make_node("Relu", ["x"], ["r"]),
        h.make_node("Size", ["x"], ["n"]),
        h.make_node("Equal", ["n", "three"], ["c"]),
        h.make_node("If", ["c"], ["i"], then_branch=then, else_branch=other),
        h.make_node("Add", ["i", "r"], ["y"]),
    ]
    init = [nh.from_array(np.array(3, np.int64), "three")]
    return _case(name, "If", nodes, ["x"], [_random(3)], ["y"], initializers=init, shapes=[[3]])


def if_reading_an_input():
    """An If whose branches read a graph input (a weight, once weights are inputs)."""
    return _if_reading("if_reading_an_input", "x")


def if_reading_a_computed_tensor():
    """An If whose branches read a tensor computed before it (Silero VAD's decoder)."""
    return _if_reading("if_reading_a_computed_tensor", "r")
