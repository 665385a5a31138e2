"""Declared shapes the graph contradicts: what it computes wins (:mod:`._declared_shapes`).

The files are a small CNN+LSTM exported by torch's TorchScript exporter (IR 6,
opset 11, as older exporters wrote them) whose declarations are then made
wrong in the ways published files have them: a graph output of the wrong
rank (with the intermediate declaration that agrees with it, as the published
CNN+LSTM has), a batch of 1 where the graph computes N, another number of
classes, every ``value_info`` one axis too many or one size off, and a Loop
body declared with the wrong rank. onnxruntime runs every one of them; the
onnxruntime engine's backward refused them (a seed of the declared shape).
The references: torch's autograd on the source model, and onnxruntime
inference of the file.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import compare_with_torch
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule, _prepare
from ortbridge._prepare import _declared_shapes
from ortbridge._prepare._declared_shapes import declarations_as_computed

CLASSES = 5


class _CnnLstm(torch.nn.Module):
    """A text-line recogniser in small: Conv, columns as a sequence, LSTM, Linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.rnn = torch.nn.LSTM(4 * 4, 6, batch_first=True)
        self.fc = torch.nn.Linear(6, CLASSES)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        n, c, h, w = y.shape
        y = y.permute(0, 3, 1, 2).reshape(n, w, c * h)
        y, _ = self.rnn(y)
        return self.fc(y)  # (N, W, CLASSES)


@pytest.fixture(scope="module")
def cnn_lstm():
    torch.manual_seed(0)
    ref = _CnnLstm()
    x = torch.randn(2, 1, 4, 7)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            ref,
            (x,),
            buffer,
            dynamo=False,
            opset_version=11,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "N", 3: "W"}, "y": {0: "N", 1: "W"}},
        )
    proto = onnx.load_from_string(buffer.getvalue())
    proto.ir_version = 6
    return ref, onnx.shape_inference.infer_shapes(proto)  # value_info as exporters write it


def _set_dims(value, dims):
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for size in dims:
        if isinstance(size, int):
            shape.dim.add().dim_value = size
        else:
            shape.dim.add().dim_param = size


def _dims(value):
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _wrong(proto, kind):
    """``proto`` with its declarations made wrong as ``kind`` says."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    output = graph.output[0]
    if kind == "published":
        # The published file: (N, C) declared for (N, T, C), and the tensor the
        # last Add reads declared so too (inference from it agrees with the output).
        _set_dims(output, ["N", CLASSES])
        producer = next(n for n in graph.node if n.output[0] == output.name)
        fed = [v for v in graph.value_info if v.name in producer.input]
        assert fed
        for value in fed:
            _set_dims(value, ["N", CLASSES])
    elif kind == "batch-of-one":
        _set_dims(output, [1, "W", CLASSES])
    elif kind == "classes":
        _set_dims(output, ["N", "W", CLASSES - 1])
    elif kind == "value-info-ranks":
        for value in graph.value_info:
            if len(value.type.tensor_type.shape.dim) >= 2:
                value.type.tensor_type.shape.dim.add().dim_value = 1
    elif kind == "value-info-sizes":
        # The convolution's channels (4) and rows (4) one more, up to the
        # reshape into a sequence (what reads them later would refuse to load).
        for value in graph.value_info:
            if not value.name.startswith(("/conv/", "/Relu", "/Transpose_output")):
                continue
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_value") and dim.dim_value > 1:
                    dim.dim_value += 1
    return model


KINDS = ["published", "batch-of-one", "classes", "value-info-ranks", "value-info-sizes"]


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("kind", KINDS)
def test_wrong_declarations_train_as_torch(cnn_lstm, kind):
    """onnxruntime runs each file; its gradients are torch's, with both engines."""
    ref, proto = cnn_lstm
    model = _wrong(proto, kind)
    x = torch.randn(3, 1, 4, 9)  # not the export's shapes
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the file's wrong declarations make onnxruntime warn
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    expected = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
    assert expected.shape == (3, 9, CLASSES)
    module = OnnxModule(model)
    ref.zero_grad(set_to_none=True)
    out = compare_with_torch(ref, module, [x.requires_grad_()])
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * max(1.0, scale))


def test_the_published_form_is_replaced_as_computed(cnn_lstm):
    """What normalisation replaces in the published form, and with what."""
    _, proto = cnn_lstm
    found = []
    prepared = _prepare.normalize(_wrong(proto, "published"), wrong_shapes=found)
    replaced = {w.name: (w.where, w.declared, w.computed) for w in found}
    assert replaced["y"] == ("graph output", ("N", CLASSES), (None, None, CLASSES))
    assert all(where == "value_info" for where, _, _ in list(replaced.values())[1:])
    assert len(replaced) == 2
    assert _dims(prepared.graph.output[0]) == [0, 0, CLASSES]  # unknown, unknown, 5


def test_a_size_only_a_run_can_tell(cnn_lstm):
    """onnx's inference loses the batch axis behind the LSTM's Shape arithmetic:
    the declared 1 is checked by a run on stand-in inputs, which gives 3."""
    _, proto = cnn_lstm
    model = _wrong(proto, "batch-of-one")
    assert [w.computed for w in declarations_as_computed(model)] == [(None, "W", CLASSES)]


def test_a_correct_file_is_left_as_it_is(cnn_lstm):
    _, proto = cnn_lstm
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    assert declarations_as_computed(model) == []
    assert model.SerializeToString() == proto.SerializeToString()


def test_sizes_and_ranks_on_a_small_graph():
    """A declared name of an axis (``batch``) stays; a size the graph does not
    compute (5 where it computes 2) and a rank it does not compute (2, 1, 3)
    are replaced; a static size where the graph follows an input's named axis
    (1 where it computes ``n``) becomes that name."""
    graph = helper.make_graph(
        [
            *(helper.make_node("Relu", ["x"], [name]) for name in ("a", "b", "c")),
            helper.make_node("Relu", ["z"], ["d"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3]),
        ],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [5, 3]),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 1, 3]),
            helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    found = declarations_as_computed(model)
    assert {w.name: w.computed for w in found} == {"b": (2, 3), "c": (2, 3), "d": ("n", 3)}
    assert {o.name: _dims(o) for o in model.graph.output} == {
        "a": ["batch", 3],
        "b": [2, 3],
        "c": [2, 3],
        "d": ["n", 3],
    }


@pytest.mark.parametrize(
    ("declared", "inferred", "observed", "settled"),
    [
        # onnx's inference can be the one that is wrong (it gave an STFT 16
        # frequency bins where onnxruntime's kernel computes 9): the run says.
        ((1, 9, 2), (1, 16, 2), (1, 9, 2), None),
        ((1, 5), (1, 7), (1, 7), (1, 7)),  # declared 5 where 7 is computed
        ((1, 5), (1, 7), None, (1, None)),  # no run to tell: unknown, as onnxruntime merges
        ((1, 5), (1, None), None, None),  # nothing tells: kept
        ((1, 5), (1, None), (1, 3), (1, None)),  # depends on the stand-in size: unknown
        ((1, 5), None, (1, 5, 2), (None, None, None)),
    ],
)
def test_which_shape_wins(declared, inferred, observed, settled):
    assert _declared_shapes._settled(declared, inferred, observed, set()) == settled


def test_a_run_that_kills_onnxruntime_leaves_the_process_alive():
    """A graph dividing integers by zero kills onnxruntime (SIGFPE) on any
    input: the run is a child's, and the declaration it would check stays."""
    nodes = [
        helper.make_node("Sub", ["k", "k"], ["zero"]),
        helper.make_node("Div", ["k", "zero"], ["q"]),
        helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Reshape", ["x", "s"], ["xr"]),
        helper.make_node("Add", ["xr", "qf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert declarations_as_computed(model) == []
    assert _dims(model.graph.output[0]) == [1, 3]


def _loop_model():
    """``y = tanh(tanh(tanh(x * w) * w) * w)`` as a Loop whose body declares its
    carried value (N, 3) as (N, 3, 1), and an intermediate as (1, 3, 1)."""
    float_info = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Mul", ["v_in", "w"], ["v_mid"]),
            helper.make_node("Tanh", ["v_mid"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            float_info("v_in", ["N", 3, 1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            float_info("v_out", ["N", 3, 1]),
        ],
        value_info=[float_info("v_mid", [1, 3, 1])],
    )
    loop = helper.make_node("Loop", ["n", "c", "x"], ["y"], body=body, name="loop")
    graph = helper.make_graph(
        [loop],
        "g",
        [float_info("x", ["N", 3])],
        [float_info("y", ["N", 3, 1])],
        [
            numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w"),
            numpy_helper.from_array(np.array(3, np.int64), "n"),
            numpy_helper.from_array(np.array(True), "c"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_scan_body_inputs_as_bound():
    """A Scan's state declared (1, 3) for a (3,) state, its slice declared (T, 3)
    for a (3,) row: both declared as the node binds them."""
    body = helper.make_graph(
        [helper.make_node("Add", ["state", "row"], ["state_out"])],
        "body",
        [
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, ["T", 3]),
        ],
        [helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [3])],
    )
    scan = helper.make_node("Scan", ["s0", "x"], ["total"], body=body, num_scan_inputs=1)
    graph = helper.make_graph(
        [scan],
        "g",
        [
            helper.make_tensor_value_info("s0", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 3]),
        ],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    found = {w.name: w.computed for w in declarations_as_computed(model)}
    assert found == {"state": (3,), "row": (3,)}
    body = model.graph.node[0].attribute[0].g
    assert [_dims(v) for v in body.input] == [[3], [3]]


class _Looped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(x * self.w)
        return x


def test_loop_body_declarations_as_computed():
    model = _loop_model()
    found = {w.name: (w.where, w.computed) for w in declarations_as_computed(model)}
    assert found["v_in"] == ("input of Loop 'loop' body", ("N", 3))
    assert found["v_mid"] == ("value_info of Loop 'loop' body", ("N", 3))
    assert found["v_out"] == ("output of Loop 'loop' body", ("N", 3))
    assert found["y"][1] == (None, None)


@pytest.mark.engines("onnxruntime")  # the training build's gradient builder fails on Loops
@pytest.mark.usefixtures("backend")
def test_a_loop_body_declared_wrong_trains_as_torch():
    compare_with_torch(_Looped(), OnnxModule(_loop_model()), [torch.randn(4, 3).requires_grad_()])
