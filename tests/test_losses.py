"""add_loss_output and get_train_initializer against numpy on random data."""

from __future__ import annotations

import doctest

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortbridge
import ortbridge.losses
from ortbridge import add_loss_output, get_train_initializer
from ortbridge._runtime._limits import limits
from ortbridge.exceptions import OnnxInputError, OnnxModelError

N_IN, N_HIDDEN = 4, 5


def _mlp(n_out, opset=18, flat=False, seed=0):
    """x -> MatMul/Add/Relu/MatMul/Add -> Reshape, with an int64 shape initializer."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((N_IN, N_HIDDEN)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(N_HIDDEN).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((N_HIDDEN, n_out)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(n_out).astype(np.float32), "b2"),
        numpy_helper.from_array(np.array([-1] if flat else [-1, n_out], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Reshape", ["h4", "shape"], ["y"]),
    ]
    out_shape = ["N"] if flat else ["N", n_out]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", N_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    # onnx.helper's default IR version: newer than onnxruntime 1.19.2 loads
    # with recent onnx releases, which add_loss_output must fix.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _predict(model, x):
    weights = get_train_initializer(model)
    h = np.maximum(x @ weights["w1"] + weights["b1"], 0)
    y = h @ weights["w2"] + weights["b2"]
    rank = len(model.graph.output[0].type.tensor_type.shape.dim)
    return y.reshape(-1) if rank == 1 else y


def _reference(loss, p, y, sample_weight=None, l1_weight=0.5, l2_weight=0.5):
    """Per-row mean of the elementwise loss, weighted, averaged over the batch."""
    r = p - y
    elementwise = {
        "squared_error": r**2,
        "absolute_error": np.abs(r),
        "elastic": l1_weight * np.abs(r) + l2_weight * r**2,
        "log_loss": np.logaddexp(0, p) - y * p,
    }[loss]
    per_row = elementwise.reshape(len(p), -1).mean(axis=1)
    if sample_weight is not None:
        per_row = per_row * sample_weight
    return per_row.mean()


def _run(model, feeds):
    sess = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return sess.run(None, feeds)


@pytest.mark.parametrize("loss", ortbridge.losses.LOSSES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("n_out", [1, 3, "flat"], ids=["N-1", "N-3", "N"])
def test_loss_matches_numpy(loss, weighted, n_out):
    flat = n_out == "flat"
    base = _mlp(1 if flat else n_out, flat=flat)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, N_IN)).astype(np.float32)
    p = _predict(base, x)
    y = rng.standard_normal(p.shape).astype(np.float32)
    if loss == "log_loss":
        y = (y > 0).astype(np.float32)
    sw = rng.uniform(0.1, 2.0, size=7).astype(np.float32) if weighted else None
    model = add_loss_output(
        base, loss, weight_name="sw" if weighted else None, l1_weight=0.3, l2_weight=0.7
    )
    feeds = {"x": x, "label": y}
    if weighted:
        feeds["sw"] = sw
    value, pred = _run(model, feeds)
    expected = _reference(loss, p, y, sw, l1_weight=0.3, l2_weight=0.7)
    assert value.shape == ()
    np.testing.assert_allclose(pred, p, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=f"{loss}: onnx vs numpy")


def test_sample_weight_is_per_row_not_broadcast():
    base = _mlp(1)
    model = add_loss_output(base, "squared_error", weight_name="sw")
    inputs = {i.name: i for i in model.graph.input}
    dims = inputs["sw"].type.tensor_type.shape.dim
    assert len(dims) == 1 and dims[0].dim_param == "N"
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, N_IN)).astype(np.float32)
    y = rng.standard_normal((6, 1)).astype(np.float32)
    sw = np.arange(1, 7, dtype=np.float32)
    value, _ = _run(model, {"x": x, "label": y, "sw": sw})
    r2 = (_predict(base, x) - y) ** 2  # (6, 1)
    np.testing.assert_allclose(value, (r2[:, 0] * sw).mean(), rtol=1e-5)
    broadcast = (r2 * sw).mean()  # the (N, 1) x (N,) -> (N, N) mistake
    assert not np.isclose(value, broadcast, rtol=1e-3)


def test_penalties_per_initializer():
    base = _mlp(2)
    penalty = {"w1": {"l1": 0.1, "l2": 0.2}, "w2": {"l2": 0.05}, "b1": {"l1": 0.3}}
    model = add_loss_output(base, "absolute_error", penalty=penalty)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, N_IN)).astype(np.float32)
    y = rng.standard_normal((5, 2)).astype(np.float32)
    value, _ = _run(model, {"x": x, "label": y})
    weights = get_train_initializer(base)
    expected = _reference("absolute_error", _predict(base, x), y)
    for name, coefs in penalty.items():
        expected += coefs.get("l1", 0) * np.abs(weights[name]).sum()
        expected += coefs.get("l2", 0) * (weights[name] ** 2).sum()
    np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_loss_is_first_output_and_other_outputs_follow():
    model = add_loss_output(_mlp(2), "squared_error", loss_name="training_loss")
    assert [o.name for o in model.graph.output] == ["training_loss", "y"]
    assert [i.name for i in model.graph.input] == ["x", "label"]


@pytest.mark.parametrize("opset", [11, 13, 17, 18, 21])
def test_any_opset_and_ir_version_loads_in_onnxruntime(opset):
    base = _mlp(3, opset=opset)
    model = add_loss_output(base, "elastic", weight_name="sw", penalty={"w2": {"l1": 0.1}})
    assert model.ir_version <= limits()[0]  # what the installed onnxruntime loads
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    onnx.checker.check_model(model)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, N_IN)).astype(np.float32)
    y = rng.standard_normal((3, 3)).astype(np.float32)
    value, _ = _run(model, {"x": x, "label": y, "sw": np.ones(3, np.float32)})
    expected = _reference("elastic", _predict(base, x), y)
    expected += 0.1 * np.abs(get_train_initializer(base)["w2"]).sum()
    np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_accepts_bytes_and_path(tmp_path):
    base = _mlp(1)
    path = tmp_path / "mlp.onnx"
    onnx.save(base, path)
    from_path = add_loss_output(str(path))
    from_bytes = add_loss_output(base.SerializeToString())
    assert from_path.SerializeToString() == from_bytes.SerializeToString()
    assert len(base.graph.output) == 1  # the input model is left untouched


def test_errors_name_what_was_wrong():
    base = _mlp(1)
    with pytest.raises(OnnxInputError, match=r"loss='hinge' is not supported.*squared_error"):
        add_loss_output(base, "hinge")
    with pytest.raises(OnnxInputError, match=r"penalty names 'shape'.*\['w1', 'b1', 'w2', 'b2'\]"):
        add_loss_output(base, penalty={"shape": {"l2": 1.0}})
    with pytest.raises(OnnxInputError, match=r"penalty\['w1'\] must be a dict with keys 'l1'"):
        add_loss_output(base, penalty={"w1": {"l3": 1.0}})
    with pytest.raises(OnnxInputError, match=r"weight_name='x' is already a name"):
        add_loss_output(base, weight_name="x")
    with pytest.raises(OnnxInputError, match=r"output_index=2 is out of range.*\['y'\]"):
        add_loss_output(base, output_index=2)
    max_opset = limits()[1]
    newer = _mlp(1, opset=max_opset + 1)
    with pytest.raises(OnnxModelError, match=f"opset {max_opset + 1}.*up to {max_opset}"):
        add_loss_output(newer)


def test_integer_output_is_refused():
    graph = helper.make_graph(
        [helper.make_node("ArgMax", ["x"], ["y"], axis=1)],
        "argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["N", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(OnnxModelError, match="output 'y' has element type INT64"):
        add_loss_output(model)


def test_get_train_initializer_lists_float_initializers_only():
    base = _mlp(2)
    weights = get_train_initializer(base)
    assert list(weights) == ["w1", "b1", "w2", "b2"]  # the int64 shape is left out
    assert weights["w1"].dtype == np.float32 and weights["w1"].shape == (N_IN, N_HIDDEN)
    np.testing.assert_array_equal(weights["w2"], numpy_helper.to_array(base.graph.initializer[2]))
    weights["w1"][:] = 0  # a copy: the model is untouched
    assert np.abs(get_train_initializer(base)["w1"]).sum() > 0


def test_docstring_examples():
    for module in (ortbridge.losses,):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0


def test_old_model_listing_initializers_as_inputs():
    base = _mlp(1, opset=9)
    base.ir_version = 3
    for init in base.graph.initializer:
        base.graph.input.append(
            helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        )
    model = add_loss_output(base, "squared_error", weight_name="sw")
    names = [i.name for i in model.graph.input]
    assert names == ["x", "label", "sw", "w1", "b1", "w2", "b2", "shape"]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, N_IN)).astype(np.float32)
    y = rng.standard_normal((4, 1)).astype(np.float32)
    value, _ = _run(model, {"x": x, "label": y, "sw": np.ones(4, np.float32)})
    np.testing.assert_allclose(value, _reference("squared_error", _predict(base, x), y), rtol=1e-5)
