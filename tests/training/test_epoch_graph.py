"""The estimators' epoch graph: one onnxruntime call an epoch, the batch-by-batch weights."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import export
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule
from ortbridge._prepare._onnx_utils import make_model
from ortbridge.examples import linear_model
from ortbridge.exceptions import TrainingDivergedError
from ortbridge.training import OnnxSGDClassifier, OnnxSGDRegressor
from ortbridge.training._graphs._epoch import EpochGraph


@pytest.fixture
def make_regressor(backend):
    """``OnnxSGDRegressor`` on the gradient source under test (each one installed)."""
    return functools.partial(OnnxSGDRegressor, backend=backend)


def mlp_model(dtype=np.float32, n_in=5, hidden=7, n_out=1, seed=0):
    """x -> Relu(x @ w1 + b1) @ w2 + b2 in ``dtype`` (no Relu in float64: onnxruntime
    has no float64 ReluGrad kernel)."""
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    inits = {
        "w1": rng.standard_normal((n_in, hidden)) / np.sqrt(n_in),
        "b1": rng.standard_normal(hidden) * 0.1,
        "w2": rng.standard_normal((hidden, n_out)) / np.sqrt(hidden),
        "b2": rng.standard_normal(n_out) * 0.1,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu" if dtype == np.float32 else "Identity", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", elem, ["n", n_in])],
        [helper.make_tensor_value_info("y", elem, ["n", n_out])],
        [numpy_helper.from_array(v.astype(dtype), k) for k, v in inits.items()],
    )
    return make_model(graph)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(120, 5))
    y = X[:, 0] - 2 * X[:, 1] + np.sin(X[:, 2])
    weight = rng.uniform(0.5, 2.0, size=len(X))
    weight[32:48] = 0.0  # the third batch of 16 rows has nothing to learn
    return X, y, weight


def by_batch(estimator):
    """The same estimator forced onto the batch-by-batch path."""
    estimator._epoch_engine = lambda: None
    return estimator


def state_of(est):
    params = dict(est.module_.named_onnx_parameters())
    weights = {n: p.detach().numpy().copy() for n, p in params.items()}
    velocities = {
        n: est.optimizer_.state[p]["velocity"].numpy().copy()
        for n, p in params.items()
        if "velocity" in est.optimizer_.state[p]
    }
    return weights, velocities


CASES = {
    # Every case has sample weights and a last batch of 8 rows; without
    # shuffling the third batch has weight 0. Nesterov, a penalty on w1 and
    # w2 (not the biases), a schedule:
    "nesterov-elastic-penalty": dict(
        alpha=0.05, l1_ratio=0.3, learning_rate="invscaling", learning_rate_init=0.05
    ),
    "momentum-absolute-no-shuffle": dict(
        loss="absolute_error", nesterovs_momentum=False, shuffle=False
    ),
    "elastic-loss": dict(loss="elastic", momentum=0.5),
    "no-momentum-l2": dict(momentum=0.0, alpha=0.1),
    "no-momentum-l1": dict(momentum=0.0, alpha=0.1, l1_ratio=1.0),
    "plain": dict(momentum=0.0),
    "first-layer-frozen": dict(trainable=["w2", "b2"], alpha=0.1),
    "optimal": dict(learning_rate="optimal", momentum=0.0, alpha=5.0, l1_ratio=0.5),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_epochs_in_one_call_match_batch_by_batch(make_regressor, data, case, dtype):
    X, y, weight = data
    X, y = X.astype(dtype), y.astype(dtype)
    params = dict(learning_rate_init=0.02, batch_size=16, max_iter=3, random_state=0)
    params.update(CASES[case])
    fast = make_regressor(mlp_model(dtype), **params).fit(X, y, weight)
    slow = by_batch(make_regressor(mlp_model(dtype), **params)).fit(X, y, weight)
    assert fast._engine is not None and slow._engine is False
    (wf, vf), (ws, vs) = state_of(fast), state_of(slow)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for name in ws:
        np.testing.assert_allclose(wf[name], ws[name], atol=tol, rtol=tol, err_msg=name)
    assert vf.keys() >= vs.keys()
    for name in vs:
        np.testing.assert_allclose(vf[name], vs[name], atol=tol, rtol=tol, err_msg=name)
    np.testing.assert_allclose(fast.train_losses_, slow.train_losses_, rtol=tol)
    assert fast.n_iter_ == slow.n_iter_ == 3 and fast.t_ == slow.t_ == 3 * len(X)


# -- against references outside ortbridge ---------------------------------------
#
# The cases above compare two paths that share ortbridge's loss and update code.
# Here the expected weights come from scikit-learn, or from torch autograd of the
# loss README.rst documents ("Training inside onnxruntime") with the documented
# update, written out below.


def sklearn_optimal_rate(alpha, t):
    """scikit-learn's ``optimal`` rate for the sample after ``t`` seen
    (sklearn/linear_model/_sgd_fast): ``1 / (alpha * (optimal_init + t))`` with
    ``optimal_init = 1 / (eta0 * alpha)``, ``eta0 = typw / max(1, dloss(-typw, 1))``,
    ``typw = sqrt(1 / sqrt(alpha))``; ``dloss(-typw, 1) < 0`` for its regression losses."""
    typw = np.sqrt(1.0 / np.sqrt(alpha))
    return 1.0 / (alpha * (1.0 / (typw * alpha) + t))


ROW_LOSSES = {
    "squared_error": lambda r: 0.5 * r**2,
    "absolute_error": torch.abs,
    "elastic": lambda r: 0.5 * r.abs() + 0.25 * r**2,
}


def torch_mlp(model):
    """:func:`mlp_model`'s network in torch: its parameters (named as the
    initializers, in their dtypes) and its forward."""
    params = {
        init.name: torch.tensor(numpy_helper.to_array(init), requires_grad=True)
        for init in model.graph.initializer
    }

    def forward(x):
        h = x @ params["w1"] + params["b1"]
        h = torch.relu(h) if x.dtype == torch.float32 else h  # as mlp_model
        return (h.to(params["w2"].dtype) @ params["w2"]).to(x.dtype) + params["b2"]

    return params, forward


def reference_epochs(params, forward, X, y, w, epochs, batch, coefficients=("w1", "w2"), **hyper):
    """Train ``params`` (a dict of tensors ``forward`` reads) by the documented rule, in torch.

    A batch's loss is the sum of its rows' weighted losses plus ``alpha *
    (l1_ratio |W|_1 + (1 - l1_ratio) / 2 |W|^2)`` on the ``coefficients``; its
    gradient is divided by the sum of the batch's weights; then ``v = momentum
    v - lr g`` and ``W += v`` (Nesterov ``W += momentum v - lr g``), the rate set
    at the start of each epoch from the samples seen. An epoch's loss is its
    batches' losses over their weights, averaged over the rows. Batches in order
    (``shuffle=False``). Returns the velocities and the epoch losses.
    """
    velocity = {name: torch.zeros_like(p) for name, p in params.items()}
    momentum, nesterov = hyper.get("momentum", 0.9), hyper.get("nesterovs_momentum", True)
    alpha, l1_ratio = hyper.get("alpha", 0.0), hyper.get("l1_ratio", 0.0)
    row_loss = ROW_LOSSES.get(hyper.get("loss", "squared_error"))
    schedule, lr0 = hyper.get("learning_rate", "constant"), hyper.get("learning_rate_init", 0.001)
    X, y, w = (torch.from_numpy(a).reshape(len(X), -1) for a in (X, y, w))
    losses, seen = [], 0
    for _ in range(epochs):
        if schedule == "optimal":
            lr = sklearn_optimal_rate(alpha, seen)
        else:  # MLPRegressor's: constant, or lr0 / (t + 1) ** power_t
            lr = lr0 / (seen + 1) ** hyper.get("power_t", 0.5) if schedule == "invscaling" else lr0
        total = 0.0
        for start in range(0, len(X), batch):
            rows = slice(start, start + batch)
            xb, yb, wb = X[rows], y[rows], w[rows]
            penalty = alpha * sum(
                l1_ratio * params[c].abs().sum() + 0.5 * (1 - l1_ratio) * (params[c] ** 2).sum()
                for c in coefficients
            )
            pred = forward(xb)
            if row_loss is None:  # log_loss on the raw score, y in {0, 1}
                per_row = torch.nn.functional.softplus(pred) - yb * pred
            else:
                per_row = row_loss(pred - yb)
            batch_loss = (wb * per_row).sum() + penalty
            grads = torch.autograd.grad(batch_loss, list(params.values()))
            with torch.no_grad():
                for (name, p), g in zip(params.items(), grads):
                    g = g / wb.sum()
                    velocity[name] = momentum * velocity[name] - lr * g
                    p += momentum * velocity[name] - lr * g if nesterov else velocity[name]
            total += batch_loss.item() / wb.sum().item() * len(xb)
        losses.append(total / len(X))
        seen += len(X)
    return {n: v.numpy() for n, v in velocity.items()}, losses


def assert_trained_like(reg, params, velocities, losses, tol):
    """The estimator's weights, velocities (where momentum is used) and losses."""
    ours, our_velocities = state_of(reg)
    assert sorted(ours) == sorted(params)
    for name, value in params.items():
        np.testing.assert_allclose(
            ours[name], value.detach().numpy(), rtol=tol, atol=tol, err_msg=name
        )
    if reg.momentum:
        for name, value in velocities.items():
            np.testing.assert_allclose(
                our_velocities[name], value, rtol=tol, atol=tol, err_msg=f"velocity of {name}"
            )
    np.testing.assert_allclose(reg.train_losses_, losses, rtol=tol)


REFERENCE_CASES = {
    "absolute-momentum": dict(loss="absolute_error", nesterovs_momentum=False),
    "absolute-nesterov-invscaling": dict(
        loss="absolute_error", learning_rate="invscaling", learning_rate_init=0.1
    ),
    "elastic-loss-l2-penalty": dict(loss="elastic", momentum=0.5, alpha=0.05),
    "l1-penalty": dict(momentum=0.0, alpha=0.1, l1_ratio=1.0),
    "elastic-penalty-nesterov": dict(alpha=0.05, l1_ratio=0.3),
    # (its first rate, alpha ** -0.25, is large: a strong penalty keeps it stable)
    "optimal": dict(learning_rate="optimal", momentum=0.0, alpha=10.0),
}


@pytest.mark.parametrize(
    "case,dtype",
    [(case, np.float64) for case in REFERENCE_CASES]
    + [("elastic-penalty-nesterov", np.float32)],  # float32 has the Relu
    ids=[*REFERENCE_CASES, "elastic-penalty-nesterov-float32"],
)
def test_epochs_match_the_documented_rule_in_torch(make_regressor, case, dtype):
    rng = np.random.default_rng(4)
    X = rng.normal(size=(72, 5)).astype(dtype)  # batches of 16, the last of 8
    y = (X[:, 0] - 2 * X[:, 1] + np.sin(X[:, 2])).astype(dtype)
    weight = rng.uniform(0.5, 2.0, size=len(X)).astype(dtype)
    hyper = {"learning_rate_init": 0.02, **REFERENCE_CASES[case]}
    reg = make_regressor(mlp_model(dtype), batch_size=16, max_iter=3, shuffle=False, **hyper).fit(
        X, y, weight
    )
    assert reg._engine is not None  # the epoch graph ran
    params, forward = torch_mlp(mlp_model(dtype))
    velocities, losses = reference_epochs(params, forward, X, y, weight, 3, 16, **hyper)
    assert_trained_like(reg, params, velocities, losses, 1e-10 if dtype == np.float64 else 2e-5)
    if hyper.get("learning_rate") == "optimal":
        assert reg.learning_rate_ == pytest.approx(sklearn_optimal_rate(10.0, 2 * len(X)))


def test_classifier_epochs_match_the_documented_rule_in_torch(backend):
    """Binary log loss on the raw score, the positive class being ``classes_[1]``."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(72, 5))
    labels = np.where(X[:, 0] - X[:, 1] + 0.3 * rng.normal(size=len(X)) > 0, "yes", "no")
    weight = rng.uniform(0.5, 2.0, size=len(X))
    hyper = dict(learning_rate_init=0.05, alpha=0.01, l1_ratio=0.5)
    clf = OnnxSGDClassifier(
        mlp_model(np.float64), batch_size=16, max_iter=3, shuffle=False, backend=backend, **hyper
    ).fit(X, labels, weight)
    assert clf._engine is not None and list(clf.classes_) == ["no", "yes"]
    params, forward = torch_mlp(mlp_model(np.float64))
    target = (labels == "yes").astype(np.float64)
    velocities, losses = reference_epochs(
        params, forward, X, target, weight, 3, 16, loss="log_loss", **hyper
    )
    assert_trained_like(clf, params, velocities, losses, 1e-10)


def test_absolute_error_matches_sgdregressor(make_regressor):
    """SGDRegressor's epsilon-insensitive loss with epsilon 0 is the absolute error;
    with batches of one row and an L2 penalty its update is the documented one."""
    from sklearn.linear_model import SGDRegressor

    rng = np.random.default_rng(5)
    X = rng.normal(size=(40, 5))
    y = X @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + rng.normal(scale=0.3, size=len(X))
    model = linear_model(5, 1)
    for init in model.graph.initializer:
        init.CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name)
        )
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    start = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    hyper = dict(learning_rate="constant", alpha=0.01, shuffle=False)
    reg = make_regressor(
        model,
        loss="absolute_error",
        learning_rate_init=0.05,
        batch_size=1,
        max_iter=3,
        momentum=0.0,
        **hyper,
    ).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tolerance: it warns that it did not converge
        ref = SGDRegressor(
            loss="epsilon_insensitive",
            epsilon=0.0,
            penalty="l2",
            eta0=0.05,
            max_iter=3,
            tol=None,
            **hyper,
        ).fit(X, y, coef_init=start["weight"].ravel(), intercept_init=start["bias"])
    weights = state_of(reg)[0]
    np.testing.assert_allclose(weights["weight"].ravel(), ref.coef_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights["bias"], ref.intercept_, rtol=1e-10, atol=1e-12)


def test_classifier_epochs_match_batch_by_batch(backend, data):
    X, y, weight = data
    X, labels = X.astype(np.float32), np.where(y > 0, "a", "b")
    params = dict(learning_rate_init=0.05, batch_size=16, max_iter=3, random_state=0, alpha=0.01)
    params["backend"] = backend
    fast = OnnxSGDClassifier(mlp_model(), **params).fit(X, labels, weight)
    slow = by_batch(OnnxSGDClassifier(mlp_model(), **params)).fit(X, labels, weight)
    for name, value in state_of(slow)[0].items():
        np.testing.assert_allclose(state_of(fast)[0][name], value, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(fast.train_losses_, slow.train_losses_, rtol=2e-5)


@pytest.mark.parametrize("rows,calls_per_epoch", [(128, 1), (120, 2)])
def test_one_onnxruntime_call_an_epoch(make_regressor, data, monkeypatch, rows, calls_per_epoch):
    """One call an epoch, two with a shorter last batch; the module is never run."""
    X, y, _ = data
    X = np.concatenate([X, X])[:rows].astype(np.float32)
    y = np.concatenate([y, y])[:rows].astype(np.float32)
    calls = {"epoch": 0, "module": 0}
    run, forward = EpochGraph.run, OnnxModule.forward

    def counted_run(self, *args, **kwargs):
        calls["epoch"] += 1
        return run(self, *args, **kwargs)

    def counted_forward(self, *args, **kwargs):
        calls["module"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(EpochGraph, "run", counted_run)
    monkeypatch.setattr(OnnxModule, "forward", counted_forward)
    reg = make_regressor(mlp_model(), batch_size=16, max_iter=4, random_state=0).fit(X, y)
    assert calls == {"epoch": 4 * calls_per_epoch, "module": 0}
    assert sorted(rows for rows, _ in reg._epoch_graphs) == sorted({16, rows % 16 or 16})


def test_divergence_keeps_the_last_finite_weights(make_regressor, data):
    """A loss that overflows at the fourth batch: both paths stop there, same weights."""
    X, y, _ = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    y[50] = 3e38  # rows 48:64, the fourth batch of 16
    params = dict(learning_rate_init=0.01, batch_size=16, shuffle=False, max_iter=2)
    fast = make_regressor(mlp_model(), **params)
    slow = by_batch(make_regressor(mlp_model(), **params))
    messages = []
    for est in (fast, slow):
        with pytest.raises(TrainingDivergedError, match=r"became inf at epoch 1, rows 48:64") as e:
            est.fit(X, y)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    (wf, vf), (ws, vs) = state_of(fast), state_of(slow)
    for name in ws:
        assert np.isfinite(wf[name]).all()
        np.testing.assert_allclose(wf[name], ws[name], atol=1e-6, err_msg=name)
        np.testing.assert_allclose(vf[name], vs[name], atol=1e-6, err_msg=name)
    # Three batches were learnt: the weights moved from the model's.
    fresh = state_of(make_regressor(mlp_model(), **params).partial_fit(X[:48], y[:48]))[0]
    for name in ws:
        np.testing.assert_allclose(wf[name], fresh[name], atol=1e-6, err_msg=name)


def test_state_dict_loaded_between_fits_is_used(make_regressor, data):
    """The parameters are views of the epoch graph's state: loading weights reaches it."""
    X, y, _ = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    params = dict(learning_rate_init=0.02, batch_size=16, shuffle=False, momentum=0.0)
    reg = make_regressor(mlp_model(), max_iter=3, **params).fit(X, y)
    start = make_regressor(mlp_model(seed=5), **params).partial_fit(X[:1], y[:1])
    reg.module_.load_state_dict(start.module_.state_dict())
    reg.partial_fit(X, y)
    start.partial_fit(X, y)
    for name, value in state_of(start)[0].items():
        np.testing.assert_allclose(state_of(reg)[0][name], value, atol=1e-6, err_msg=name)


def test_batch_norm_models_train_batch_by_batch(make_regressor, data):
    """BatchNormalization's running statistics need the module: no epoch graph."""
    X, y, _ = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    net = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    ).train()
    onx = export(net, (torch.zeros(4, 5),))
    reg = make_regressor(onx, learning_rate_init=0.02, batch_size=16, max_iter=5, shuffle=False)
    reg.fit(X, y)
    assert reg._engine is None and not reg._epoch_graphs
    # torch's BatchNorm in train mode, trained by the documented rule (no penalty).
    params = dict(net.named_parameters())
    ones = np.ones(len(X), np.float32)
    velocities, losses = reference_epochs(
        params, net, X, y, ones, 5, 16, coefficients=(), learning_rate_init=0.02
    )
    assert_trained_like(reg, params, velocities, losses, 2e-5)
    for name, value in net.named_buffers():
        if "running" in name:
            np.testing.assert_allclose(
                reg.module_.get_buffer(name).numpy(), value.numpy(), rtol=2e-5, err_msg=name
            )
    # Predictions use the running statistics the fit tracked: a row predicts
    # the same alone or in a batch, and the exported model carries them.
    np.testing.assert_allclose(reg.predict(X[:1]), reg.predict(X)[:1], rtol=1e-5, atol=1e-6)
    exported = reg.to_onnx()
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    np.testing.assert_allclose(session.run(None, {name: X})[0].ravel(), reg.predict(X), rtol=1e-5)
    inits = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    tracked = {n: b.numpy() for n, b in reg.module_.named_buffers() if "running_mean" in n}
    assert tracked and all(np.abs(b).sum() > 0 for b in tracked.values())
    for n, value in tracked.items():
        np.testing.assert_array_equal(inits[n], value)


def test_small_steps_run_on_one_thread():
    """Waking a second thread costs more than a small step: one thread under 4e6 multiply-adds."""
    from ortbridge.training._estimator_in_graph import _epoch_session_options

    assert _epoch_session_options(15 * 5_600).intra_op_num_threads == 1
    big = _epoch_session_options(64 * 200_000).intra_op_num_threads
    assert big == torch.get_num_threads()


def test_mixed_precision_weights_train_batch_by_batch(make_regressor, data):
    """Weights of two types cannot share one flat state: the batch-by-batch path."""
    X, y, _ = data
    model = mlp_model()
    w2 = next(init for init in model.graph.initializer if init.name == "w2")
    w2.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w2).astype(np.float64), "w2"))
    model.graph.node[3].CopyFrom(helper.make_node("Cast", ["h"], ["h64"], to=TensorProto.DOUBLE))
    model.graph.node.insert(4, helper.make_node("MatMul", ["h64", "w2"], ["o64"]))
    model.graph.node.insert(5, helper.make_node("Cast", ["o64"], ["o0"], to=TensorProto.FLOAT))
    X, y = X.astype(np.float32), y.astype(np.float32)
    reg = make_regressor(model, learning_rate_init=0.02, batch_size=16, max_iter=5, shuffle=False)
    reg.fit(X, y)
    assert reg._engine is None
    params, forward = torch_mlp(model)  # w2 in float64, as in the graph
    ones = np.ones(len(X), np.float32)
    velocities, losses = reference_epochs(
        params, forward, X, y, ones, 5, 16, learning_rate_init=0.02
    )
    assert_trained_like(reg, params, velocities, losses, 2e-5)


def test_dropout_models_train_in_the_epoch_graph(make_regressor, data):
    """Dropout is active while training (in the Loop), off in predictions."""
    X, y, _ = data
    X, y = X.astype(np.float32), y.astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(5, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
    ).train()
    onx = export(net, (torch.zeros(4, 5),))
    reg = make_regressor(onx, learning_rate_init=0.02, batch_size=16, max_iter=20, random_state=0)
    reg.fit(X, y)
    assert reg._engine is not None and reg._epoch_graphs
    assert reg.train_losses_[-1] < 0.5 * reg.train_losses_[0]
    # Predictions are torch's network in eval mode (no Dropout) with the trained weights.
    net.load_state_dict(reg.module_.state_dict())
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(X)).numpy().ravel()
    np.testing.assert_allclose(reg.predict(X), expected, rtol=1e-5, atol=1e-6)
    # Training draws masks: two fits from the same start differ, predictions do not vary.
    again = make_regressor(onx, learning_rate_init=0.02, batch_size=16, max_iter=1, random_state=0)
    first = make_regressor(onx, learning_rate_init=0.02, batch_size=16, max_iter=1, random_state=0)
    assert not np.array_equal(again.fit(X, y).predict(X), first.fit(X, y).predict(X))
