"""What the default trains: weights by their role, wherever the file holds them.

Weights in ``Constant`` nodes (paddle2onnx, older torch exports,
constant-folded graphs) become parameters as initializers do, and go back
into their nodes with ``to_onnx()``; constants of the function (epsilons,
exponents, GELU's and attention's factors) stay frozen, initializers or not.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import ortbridge
from ortbridge import _prepare
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._prepare._weights import CONSTANT, STATISTIC, WEIGHT, roles

pytestmark = pytest.mark.usefixtures("backend")

F = TensorProto.FLOAT


def _const(name, array):
    array = np.asarray(array, np.float32)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _run(model, **feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _layer_norm_gelu_mlp(as_constants: bool):
    """x @ W + b, a LayerNorm spelled out (Pow 2, epsilon), GELU by Erf, then a 1-output head.

    The forms PP-OCR's recogniser and skl2onnx's regressors write.
    """
    rng = np.random.default_rng(0)
    tensors = {
        "W": rng.standard_normal((4, 6)),
        "b": rng.standard_normal(6),
        "two": 2.0,
        "eps": 1e-5,
        "gamma": rng.standard_normal(6),
        "beta": rng.standard_normal(6),
        "half": 0.5,
        "sqrt2": np.sqrt(2.0),
        "one": 1.0,
        "head": rng.standard_normal((6, 1)),
        "head_bias": rng.standard_normal(1),  # one element: still a weight (a bias)
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["h", "mean"], ["centred"]),
        helper.make_node("Pow", ["centred", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["normed"]),
        helper.make_node("Mul", ["normed", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["ln"]),
        helper.make_node("Div", ["ln", "sqrt2"], ["u"]),
        helper.make_node("Erf", ["u"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["erf1"]),
        helper.make_node("Mul", ["ln", "erf1"], ["g2"]),
        helper.make_node("Mul", ["g2", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "head"], ["p"]),
        helper.make_node("Add", ["p", "head_bias"], ["y"]),
    ]
    arrays = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    if as_constants:
        nodes = [_const(k, v) for k, v in arrays.items()] + nodes
        inits = []
    else:
        inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", F, ["n", 4])],
        [helper.make_tensor_value_info("y", F, ["n", 1])],
        inits,
    )
    return make_model(graph, opset=13)


WEIGHTS = {"W", "b", "gamma", "beta", "head", "head_bias"}
FUNCTION_CONSTANTS = {"two", "eps", "half", "sqrt2", "one"}
# In Constant nodes, a weight is what a layer reads as one (or a bias added to
# a product); an elementwise affine may be a mask or a window, and stays.
LAYER_WEIGHTS = {"W", "b", "head", "head_bias"}


@pytest.mark.parametrize("as_constants", [False, True], ids=["initializers", "constants"])
def test_default_trains_weights_not_the_constants_of_the_function(as_constants):
    model = _layer_norm_gelu_mlp(as_constants)
    weights = LAYER_WEIGHTS if as_constants else WEIGHTS
    kinds = roles(model)
    assert {n for n, r in kinds.items() if r == WEIGHT} == weights
    constants = {n for n, r in kinds.items() if r == CONSTANT}
    assert constants == set(kinds) - weights and FUNCTION_CONSTANTS <= constants
    layer = ortbridge.OnnxModule(model)
    assert {n for n, _ in layer.named_onnx_parameters()} == weights
    # Weights from Constant nodes are said to be so; the constants stay nodes.
    assert ("held in Constant nodes" in repr(layer)) == as_constants
    if as_constants:
        assert set(layer._summary.float_initializers) == weights
    x = torch.randn(5, 4)
    report = ortbridge.gradcheck(layer, x)
    assert report, str(report)
    # The exponent 2.0 of a negative base would get a NaN gradient and an
    # epsilon could be driven negative: frozen, one SGD step keeps outputs finite.
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = layer(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_trainable_still_selects_constants_of_the_function():
    model = _layer_norm_gelu_mlp(as_constants=False)
    layer = ortbridge.OnnxModule(model, trainable=lambda name, a: name in ("W", "half"))
    assert {n for n, _ in layer.named_onnx_parameters()} == {"W", "half"}


def test_constant_weights_go_back_into_their_nodes():
    model = _layer_norm_gelu_mlp(as_constants=True)
    layer = ortbridge.OnnxModule(model)
    x = torch.randn(3, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(x).sum().backward()
    optimizer.step()
    written = layer.to_onnx()
    # Same nodes, no initializer added: the new values sit in the Constant nodes.
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in model.graph.node]
    assert not written.graph.initializer
    values = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in written.graph.node
        if n.op_type == "Constant"
    }
    np.testing.assert_array_equal(values["W"], layer.onnx_weight("W").detach().numpy())
    assert not np.array_equal(
        values["W"], numpy_helper.to_array(model.graph.node[0].attribute[0].t)
    )
    with torch.no_grad():
        expected = layer.eval()(x).numpy()
    np.testing.assert_allclose(_run(written, x=x.numpy())[0], expected, rtol=1e-5, atol=1e-6)


def _conv_bn_constants():
    """Conv and BatchNormalization whose weights and statistics are Constant nodes (paddle2onnx)."""
    rng = np.random.default_rng(1)
    arrays = {
        "conv_w": rng.standard_normal((3, 2, 3, 3)),
        "conv_b": rng.standard_normal(3),
        "bn_scale": rng.uniform(0.5, 1.5, 3),
        "bn_bias": rng.standard_normal(3),
        "bn_mean": rng.standard_normal(3),
        "bn_var": rng.uniform(0.5, 1.5, 3),
    }
    nodes = [_const(k, v) for k, v in arrays.items()]
    nodes += [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["y"]
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", F, ["n", 2, 5, 5])],
        [helper.make_tensor_value_info("y", F, ["n", 3, 5, 5])],
    )
    return make_model(graph, opset=13), arrays


def test_constant_statistics_become_buffers_and_track():
    model, arrays = _conv_bn_constants()
    kinds = roles(model)
    assert kinds["bn_mean"] == kinds["bn_var"] == STATISTIC
    layer = ortbridge.OnnxModule(model)
    params = {n for n, _ in layer.named_onnx_parameters()}
    assert params == {"conv_w", "conv_b", "bn_scale", "bn_bias"}
    assert not isinstance(layer.onnx_weight("bn_mean"), torch.nn.Parameter)
    x = torch.randn(4, 2, 5, 5)
    layer.train()(x).sum().backward()
    # Train mode updated the running statistics held by the Constant nodes ...
    assert not np.allclose(layer.onnx_weight("bn_mean").numpy(), arrays["bn_mean"])
    # ... and to_onnx() writes them back there: eval output equals plain onnxruntime.
    with torch.no_grad():
        expected = layer.eval()(x).numpy()
    np.testing.assert_allclose(
        _run(layer.to_onnx(), x=x.numpy())[0], expected, rtol=1e-4, atol=1e-5
    )
    layer.eval()
    assert ortbridge.gradcheck(layer, x)


def test_constant_weights_inside_a_subgraph_are_lifted_and_written_back():
    """A Loop body's Constant weight is read from the outer scope once lifted."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 10
    body = helper.make_graph(
        [
            _const("body_w", w),
            helper.make_node("MatMul", ["x", "body_w"], ["xw"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("xw", F, None),
        ],
    )
    trips = numpy_helper.from_array(np.array(2, np.int64), "trips")
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", ""], ["stacked"], body=body)],
        "loop",
        [helper.make_tensor_value_info("x", F, [4, 2])],
        [helper.make_tensor_value_info("stacked", F, [2, 4, 3])],
        [trips],
    )
    model = make_model(graph, opset=13)
    prepared = _prepare.normalize(_prepare.load_model(model))
    assert "body_w" in {i.name for i in prepared.graph.initializer}
    assert not any(n.op_type == "Constant" for n in prepared.graph.node[0].attribute[0].g.node)
    summary = _prepare.summarize(prepared, model)
    assert summary.from_constants == {"body_w"} and summary.default_trainable == {"body_w"}
    new = w + 1
    written = _prepare.with_weights(model, {"body_w": new})
    x = np.ones((4, 2), np.float32)
    np.testing.assert_allclose(_run(written, x=x)[0], np.stack([x @ new] * 2), rtol=1e-6)


def test_torchscript_group_norm_trains_its_affine_weights_only():
    """TorchScript writes GroupNorm as an InstanceNormalization over the groups
    with Constant ones and zeros, then the layer's weight and bias: those two
    train, the exporter's ones and zeros stay constants."""
    import io
    import warnings

    torch.manual_seed(0)
    model = torch.nn.GroupNorm(2, 4).eval()
    with torch.no_grad():
        model.weight.add_(torch.rand(4))
        model.bias.add_(torch.rand(4))
    x = torch.randn(3, 4, 5)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buffer, dynamo=False, do_constant_folding=False)
    proto = onnx.load_from_string(buffer.getvalue())
    norms = [n for n in proto.graph.node if n.op_type == "InstanceNormalization"]
    assert norms and all(
        any(c.op_type == "Constant" and c.output[0] == name for c in proto.graph.node)
        for name in norms[0].input[1:]
    ), "the export no longer writes GroupNorm as this test expects"
    layer = ortbridge.OnnxModule(proto)
    assert {n for n, _ in layer.named_onnx_parameters()} == {"weight", "bias"}
    layer(x).square().sum().backward()
    model(x).square().sum().backward()
    for name, param in layer.named_onnx_parameters():
        torch.testing.assert_close(param.grad, getattr(model, name).grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions", ["counted", "given"])
def test_a_factor_of_positions_counted_out_is_no_weight(positions):
    """Rotary embeddings: inverse frequencies times the positions a Range counts
    out (a buffer in torch) stay constants; times positions the caller gives,
    or times a constant, they are weights as any other factor."""
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
        helper.make_node("Squeeze", ["shape"], ["length"]),
        helper.make_node("Range", ["zero", "length", "one"], ["count"]),
        helper.make_node("Cast", ["count" if positions == "counted" else "pos"], ["p"], to=F),
        helper.make_node("Unsqueeze", ["p", "axis"], ["column"]),
        helper.make_node("Mul", ["column", "inv_freq"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["cos"]),
        helper.make_node("Mul", ["scale", "half"], ["scaled"]),
        helper.make_node("Mul", ["x", "cos"], ["rotated"]),
        helper.make_node("Mul", ["rotated", "scaled"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
        numpy_helper.from_array(np.array([1.0, 0.1, 0.01], np.float32), "inv_freq"),
        numpy_helper.from_array(np.array([2.0, 3.0, 4.0], np.float32), "scale"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [2, "n", 3])]
    if positions == "given":
        inputs.append(helper.make_tensor_value_info("pos", i64, ["n"]))
    graph = helper.make_graph(
        [_const("half", 0.5), *nodes],
        "rotary",
        inputs,
        [helper.make_tensor_value_info("y", F, None)],
        inits,
    )
    kinds = roles(make_model(graph, opset=17))
    assert kinds["scale"] == WEIGHT  # times a constant: a weight still
    assert kinds["inv_freq"] == (CONSTANT if positions == "counted" else WEIGHT)


def test_inspect_marks_weights_from_constant_nodes(tmp_path):
    from ortbridge._cli._inspect import describe_model

    path = tmp_path / "m.onnx"
    onnx.save(_layer_norm_gelu_mlp(as_constants=True), path)
    info = describe_model(str(path))
    by_name = {i["name"]: i for i in info["initializers"]}
    assert set(by_name) == LAYER_WEIGHTS
    assert all(i["from_constant"] and i["trainable"] for i in by_name.values())
