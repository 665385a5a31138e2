"""The gradient sources of ``ortbridge.training``: which one runs, that they agree, the graphs."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import torch
from conftest import requires_training_build
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge._runtime._limits import fit_to_runtime, limits
from ortbridge._runtime._sessions import quiet_session_options, training_session
from ortbridge.examples import linear_model
from ortbridge.exceptions import (
    MissingDependencyError,
    NotDifferentiableError,
    NotFittedError,
    OnnxInputError,
    OnnxModelError,
)
from ortbridge.training import OnnxSGDRegressor, OrtFullGraphTrainer, OrtSGD
from ortbridge.training._graphs import _reverse_gradient as reverse_module
from ortbridge.training._graphs import _sgd_rule
from ortbridge.training._graphs._gradient import gradient_model

WEIGHTS = ["w1", "b1", "w2", "b2"]


def mlp(dtype=np.float32, n_in=5, hidden=7, seed=0, dropout=0.0):
    """x -> Tanh(x W1 + b1) [-> Dropout] -> W2 + b2, one output column."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [
        numpy_helper.from_array((rng.standard_normal((n_in, hidden)) / 2).astype(dtype), "w1"),
        numpy_helper.from_array((rng.standard_normal(hidden) / 10).astype(dtype), "b1"),
        numpy_helper.from_array((rng.standard_normal((hidden, 1)) / 2).astype(dtype), "w2"),
        numpy_helper.from_array(np.zeros(1, dtype), "b2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h"]),
    ]
    if dropout:
        inits += [
            numpy_helper.from_array(np.array(dropout, dtype), "ratio"),
            numpy_helper.from_array(np.array(True), "training"),
        ]
        nodes.append(helper.make_node("Dropout", ["h", "ratio", "training"], ["hd"]))
    nodes += [
        helper.make_node("MatMul", ["hd" if dropout else "h", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, ["n", n_in])],
        [helper.make_tensor_value_info("y", elem, ["n", 1])],
        inits,
    )
    return make_model(graph)


def torch_sgd(model, X, y, lr, epochs, batch):
    """:func:`mlp`'s network trained in torch: ``MSELoss`` and ``torch.optim.SGD``,
    batches in order; the weights by initializer name."""
    params = {
        i.name: torch.tensor(numpy_helper.to_array(i), requires_grad=True)
        for i in model.graph.initializer
    }
    optimizer = torch.optim.SGD(params.values(), lr=lr)
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            xb, yb = X[start : start + batch], y[start : start + batch]
            h = torch.tanh(xb @ params["w1"] + params["b1"])
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(h @ params["w2"] + params["b2"], yb).backward()
            optimizer.step()
    return {name: p.detach().numpy() for name, p in params.items()}


def assert_weights(trainer, expected, tol):
    got = trainer.get_weights()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=tol, atol=tol, err_msg=name)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((48, 5))
    y = np.sin(X[:, :1]) - X[:, 1:2]
    return X, y


# -- which source runs ----------------------------------------------------------


def test_auto_sources_per_entry_point(data):
    """Measured (benchmarks/README.rst): the full graph's step is faster on onnx-ad's
    graph, the estimators' fit on the builder's where the training build is installed."""
    X, y = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    trainer = OrtFullGraphTrainer(mlp(), optimizer="sgd", max_iter=1, batch_size=16).fit(X, y)
    assert trainer._active.training.source == "onnxruntime"
    reg = OnnxSGDRegressor(mlp(), max_iter=1, batch_size=16).fit(X, y.ravel())
    builder = "training-agent" if _ort.has_training() else "onnxruntime"
    assert {g.source for g in reg._epoch_graphs.values()} == {builder}


@requires_training_build
def test_auto_falls_back_to_the_builder_where_onnx_ad_refuses(data, monkeypatch):
    X, y = data

    def refuse(*args):
        raise NotDifferentiableError("the onnxruntime engine cannot differentiate node 'n'")

    monkeypatch.setattr(reverse_module, "reverse_gradient", refuse)
    trainer = OrtFullGraphTrainer(mlp(), optimizer="sgd", max_iter=1, batch_size=16).fit(X, y)
    assert trainer._active.training.source == "training-agent"
    assert "the onnxruntime source refused the model" in trainer._active.training.reason
    with pytest.raises(NotDifferentiableError, match="cannot differentiate node 'n'"):
        OrtFullGraphTrainer(mlp(), backend="onnxruntime").fit(X, y)


def test_auto_leaves_the_builder_what_it_gets_wrong(data):
    """A Resize (no CPU kernel for its gradient in the training build) goes to onnx-ad."""
    X, y = data
    graph = mlp().graph
    graph.node[0].input[0] = "x2"
    graph.initializer.append(numpy_helper.from_array(np.array([1.0, 1.0], np.float32), "scales"))
    graph.node.insert(0, helper.make_node("Resize", ["x", "", "scales"], ["x2"], mode="nearest"))
    model = make_model(graph)
    X, y = X.astype(np.float32), y.astype(np.float32)
    options = dict(optimizer="sgd", learning_rate=0.1, max_iter=20, batch_size=16, shuffle=False)
    trainer = OrtFullGraphTrainer(model, trainable=WEIGHTS, **options).fit(X, y)
    assert trainer._active.training.source == "onnxruntime"
    # The Resize (scales 1) changes nothing: torch's training of the MLP.
    assert_weights(trainer, torch_sgd(mlp(), X, y, 0.1, 20, 16), 1e-5)


@pytest.mark.skipif(_ort.has_training(), reason="the training build is installed")
def test_the_builder_asked_for_without_the_training_build(data):
    X, y = data
    trainer = OrtFullGraphTrainer(mlp(), backend="training-agent")
    with pytest.raises(MissingDependencyError, match="install onnxruntime-training 1.19.2"):
        trainer.fit(X, y)
    with pytest.raises(NotFittedError, match="not fitted"):
        trainer.predict(X)  # nothing was kept of the failed fit
    reg = OnnxSGDRegressor(mlp(), backend="training-agent")
    with pytest.raises(MissingDependencyError, match="install onnxruntime-training 1.19.2"):
        reg.fit(X, y.ravel())


def test_unknown_backend_is_refused_before_anything_runs(data):
    X, y = data
    trainer = OrtFullGraphTrainer(mlp(), backend="tensorflow")
    message = r"backend must be one of \['auto', 'training-agent', 'onnxruntime'\], got 'tens"
    with pytest.raises(OnnxInputError, match=message):
        trainer.fit(X, y)
    with pytest.raises(NotFittedError, match="not fitted"):
        trainer.get_weights()


# -- the sources agree ---------------------------------------------------------------


def _loss_model(dtype):
    model = mlp(dtype)
    graph = model.graph
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph.node.append(helper.make_node("Sub", ["y", "target"], ["r"]))
    graph.node.append(helper.make_node("Mul", ["r", "r"], ["r2"]))
    graph.node.append(helper.make_node("ReduceSum", ["r2"], ["loss"], keepdims=0))
    graph.input.append(helper.make_tensor_value_info("target", elem, ["n", 1]))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", elem, []))
    return model


def _run_gradient(gradient, feeds, weights):
    # (onnxruntime 1.19 runs float64 reverse graphs at its basic optimisation level)
    reverse = gradient.source == "onnxruntime"
    session = training_session(gradient.model, quiet_session_options(), "a graph", reverse=reverse)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {**feeds, **weights})))


@requires_training_build
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_builder_and_onnx_ad_compute_the_same_gradients(dtype):
    model = _loss_model(dtype)
    trainable = ["w1", "b1", "w2", "b2"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((6, 5)).astype(dtype),
        "target": rng.standard_normal((6, 1)).astype(dtype),
    }
    options = onnxruntime.SessionOptions()
    built = {
        source: gradient_model(model, "loss", trainable, options, source)
        for source in ("training-agent", "onnxruntime")
    }
    # The static-shape graph of onnx-ad, built for the batch's shapes, agrees too.
    static = {name: value.shape for name, value in feeds.items()}
    built["static"] = gradient_model(model, "loss", trainable, options, "onnxruntime", static)
    assert built["static"].static and not built["onnxruntime"].static
    results = {k: _run_gradient(g, feeds, weights) for k, g in built.items()}
    tol = 1e-5 if dtype == np.float32 else 1e-12
    reference = results.pop("training-agent")
    for source, result in results.items():
        for name in trainable:
            np.testing.assert_allclose(
                result[f"{name}_grad"], reference[f"{name}_grad"], rtol=tol, atol=tol, err_msg=name
            )
        loss = built[source].loss
        np.testing.assert_allclose(result[loss], reference[built["training-agent"].loss], rtol=1e-6)


def test_simplified_reverse_graph_computes_the_same(monkeypatch):
    """The view rewrites (``passes/_simplify.py``) change shapes, never a value."""
    model = _loss_model(np.float64)
    trainable = ["w1", "b1", "w2", "b2"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((6, 5)), "target": rng.standard_normal((6, 1))}
    static = {name: value.shape for name, value in feeds.items()}
    options = onnxruntime.SessionOptions()
    simplified = gradient_model(model, "loss", trainable, options, "onnxruntime", static)
    monkeypatch.setattr(reverse_module, "simplify", lambda model: None)
    plain = gradient_model(model, "loss", trainable, options, "onnxruntime", static)
    assert len(simplified.model.graph.node) < len(plain.model.graph.node)
    ours, theirs = _run_gradient(simplified, feeds, weights), _run_gradient(plain, feeds, weights)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-13, atol=1e-14, err_msg=name)


def test_onnx_ad_dropout_masks_follow_torch_seed(data):
    """Masks are drawn in the graph, seeded from torch's generator when it is built."""
    X, y = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    options = dict(optimizer="sgd", learning_rate=0.1, max_iter=2, batch_size=16, shuffle=False)

    def fit(seed):
        torch.manual_seed(seed)
        model = mlp(dropout=0.5)
        trainer = OrtFullGraphTrainer(model, backend="onnxruntime", trainable=WEIGHTS, **options)
        return trainer.fit(X, y).get_weights()

    first, again, other = fit(0), fit(0), fit(1)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert any(not np.array_equal(first[n], other[n]) for n in first)
    # Dropout is active while training: without it the weights differ.
    trainer = OrtFullGraphTrainer(mlp(), backend="onnxruntime", **options).fit(X, y)
    assert any(not np.allclose(first[n], trainer.get_weights()[n]) for n in first)


# -- graphs load in the installed runtime ------------------------------------------------


def test_graphs_get_the_installed_runtimes_ir_version_and_opsets(data):
    X, y = data
    max_ir, max_opset = limits()
    reg = OnnxSGDRegressor(mlp(), max_iter=1, batch_size=16).fit(X, y.ravel())
    trainer = OrtFullGraphTrainer(mlp(), max_iter=1, batch_size=20).fit(X, y)
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = OrtSGD([w], lr=0.1)
    (w * w).sum().backward()
    optimizer.step()
    graphs = [g.model for g in reg._epoch_graphs.values()]
    graphs += [trainer._active.training.model, trainer.to_onnx(), reg.to_onnx()]
    graphs += [_sgd_rule.build_update_graph(layout) for layout in optimizer._updates]
    for graph in graphs:
        opsets = {o.domain or "ai.onnx": o.version for o in graph.opset_import}
        assert graph.ir_version <= max_ir and opsets["ai.onnx"] <= max_opset


def test_opset_newer_than_the_runtime_is_refused_by_name():
    max_ir, max_opset = limits()
    model = linear_model(3, 1)
    model.ir_version = max_ir + 2
    assert fit_to_runtime(model).ir_version == max_ir
    model.opset_import[0].version = max_opset + 1
    with pytest.raises(OnnxModelError, match=f"opset {max_opset + 1}.*runs opsets up to"):
        fit_to_runtime(model)


def test_loss_of_another_type_than_float32_keeps_its_type_with_onnx_ad():
    """onnx-ad's graph keeps a float64 loss (the builder's casts it to float32)."""
    model = _loss_model(np.float64)
    options = onnxruntime.SessionOptions()
    gradient = gradient_model(model, "loss", ["w1"], options, "onnxruntime")
    assert gradient.loss_elem == gradient.seed_elem == TensorProto.DOUBLE


def test_float64_onnx_ad_graphs_load_with_a_users_session_options(data):
    """onnxruntime 1.19 has no float64 FusedMatMul: its fusions stay off, the options as given."""
    X, y = data
    options = onnxruntime.SessionOptions()
    level = options.graph_optimization_level
    trainer = OrtFullGraphTrainer(
        mlp(np.float64),
        optimizer="sgd",
        learning_rate=0.1,
        max_iter=3,
        batch_size=16,
        shuffle=False,
        session_options=options,
    )
    trainer.fit(X, y)
    assert trainer._active.training.source == "onnxruntime"
    assert_weights(trainer, torch_sgd(mlp(np.float64), X, y, 0.1, 3, 16), 1e-12)
    assert options.graph_optimization_level == level
