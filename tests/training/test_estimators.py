"""OnnxSGDRegressor / OnnxSGDClassifier: scikit-learn's conventions and protocol."""

from __future__ import annotations

import copy
import doctest
import functools
import importlib
import pickle
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import sklearn.exceptions
from skl2onnx import to_onnx
from sklearn.base import clone
from sklearn.metrics import accuracy_score, r2_score
from sklearn.model_selection import GridSearchCV
from sklearn.neural_network import MLPRegressor

from ortbridge.examples import linear_model
from ortbridge.exceptions import OnnxInputError, OrtBridgeError, TrainingDivergedError
from ortbridge.training import OnnxSGDClassifier, OnnxSGDRegressor
from ortbridge.training._estimators import NotFittedError


@pytest.fixture
def make_regressor(backend):
    """``OnnxSGDRegressor`` on the gradient source under test (each one installed)."""
    return functools.partial(OnnxSGDRegressor, backend=backend)


@pytest.fixture
def make_classifier(backend):
    """``OnnxSGDClassifier`` on the gradient source under test."""
    return functools.partial(OnnxSGDClassifier, backend=backend)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 6)).astype(np.float32)
    y = (X[:, 0] - 2 * X[:, 1] + np.sin(X[:, 2])).astype(np.float32)
    return X, y


@pytest.fixture(scope="module")
def fitted_mlp(data):
    """An MLPRegressor (float32, Relu) after a few epochs, and its ONNX conversion."""
    X, y = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlp = MLPRegressor(hidden_layer_sizes=(8, 4), max_iter=5, random_state=0).fit(X, y)
    return mlp, to_onnx(mlp, X[:1], target_opset=18)


def weights_of(est):
    return {n: p.detach().numpy().copy() for n, p in est.module_.named_onnx_parameters()}


def velocities_of(est):
    params = dict(est.module_.named_onnx_parameters())
    return {n: est.optimizer_.state[p]["velocity"].numpy().copy() for n, p in params.items()}


def assert_same_weights(a, b, atol=0.0):
    wa, wb = weights_of(a), weights_of(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], atol=atol, rtol=0, err_msg=name)


def mlp_weights(mlp):
    """MLPRegressor's weights under the initializer names skl2onnx gives them."""
    names = {}
    for i, (coef, intercept) in enumerate(zip(mlp.coefs_, mlp.intercepts_)):
        suffix = "" if i == 0 else str(i)
        names[f"coefficient{suffix}"] = coef
        names[f"intercepts{suffix}"] = intercept.reshape(1, -1)
    return names


# -- correct against scikit-learn ---------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.3], ids=["alpha0", "alpha0.3"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_one_epoch_matches_mlpregressor_partial_fit(
    make_regressor, data, fitted_mlp, nesterov, alpha
):
    """Same start, one epoch without shuffling: the weights of MLPRegressor.partial_fit."""
    X, y = data
    mlp, onx = copy.deepcopy(fitted_mlp)
    # A fresh SGD optimizer (zero velocities) for scikit-learn, as ours starts with.
    del mlp._optimizer
    hyper = dict(
        learning_rate_init=0.01,
        momentum=0.9,
        nesterovs_momentum=nesterov,
        batch_size=15,
        shuffle=False,
        alpha=alpha,
        learning_rate="constant",
    )
    mlp.set_params(solver="sgd", **hyper)
    ours = make_regressor(onx, **hyper)
    mlp.partial_fit(X, y)
    ours.partial_fit(X, y)
    expected = mlp_weights(mlp)
    got = weights_of(ours)
    assert got.keys() == expected.keys()
    diff = max(np.abs(got[n] - expected[n]).max() for n in got)
    assert diff <= 1e-4, diff
    assert ours.loss_ == pytest.approx(mlp.loss_, rel=1e-5)


def test_invscaling_epochs_match_mlpregressor(make_regressor, data, fitted_mlp):
    """The learning rate changes between epochs as MLPRegressor's does."""
    X, y = data
    mlp, onx = copy.deepcopy(fitted_mlp)
    del mlp._optimizer
    mlp.t_ = 0  # samples seen: ours counts from the start of training on the ONNX model
    hyper = dict(
        learning_rate_init=0.05,
        momentum=0.5,
        batch_size=40,
        shuffle=False,
        alpha=0.0,
        learning_rate="invscaling",
        power_t=0.5,
    )
    mlp.set_params(solver="sgd", **hyper)
    ours = make_regressor(onx, **hyper)
    for _ in range(3):
        mlp.partial_fit(X, y)
        ours.partial_fit(X, y)
    got, expected = weights_of(ours), mlp_weights(mlp)
    assert max(np.abs(got[n] - expected[n]).max() for n in got) <= 1e-4
    assert ours.t_ == mlp.t_ == 3 * len(X)
    assert ours.learning_rate_ == pytest.approx(0.05 / (2 * len(X) + 1) ** 0.5)


# -- fit, predict, score, to_onnx -------------------------------------------


def test_regressor_learns_and_exports(make_regressor, data, tmp_path):
    X, y = data
    y2 = X @ np.array([1.0, -2.0, 0.5, 0, 0, 3.0], dtype=np.float32)
    path = tmp_path / "linear.onnx"
    path.write_bytes(linear_model(6, 1).SerializeToString())
    reg = make_regressor(str(path), learning_rate_init=0.02, max_iter=40, random_state=0)
    assert reg.fit(X, y2) is reg
    assert len(reg.train_losses_) == reg.n_iter_ == 40
    assert reg.train_losses_[-1] < 0.01 * reg.train_losses_[0]
    prediction = reg.predict(X)
    assert prediction.shape == (len(X),)
    assert reg.score(X, y2) == pytest.approx(r2_score(y2, prediction))
    assert reg.score(X, y2) > 0.99
    session = ort.InferenceSession(reg.to_onnx().SerializeToString())
    np.testing.assert_array_equal(session.run(None, {"x": X})[0].ravel(), prediction)


def test_regressor_multi_output_and_losses(make_regressor, data):
    X, _ = data
    Y = np.stack([X[:, 0], -X[:, 1]], axis=1)
    for loss in ("squared_error", "absolute_error", "elastic"):
        reg = make_regressor(
            linear_model(6, 2), loss=loss, learning_rate_init=0.05, max_iter=25, random_state=0
        ).fit(X, Y)
        assert reg.predict(X).shape == (len(X), 2)
        assert reg.score(X, Y) > 0.9, loss


def test_classifier(make_classifier, data):
    X, _ = data
    labels = np.where(X[:, 0] + X[:, 1] > 0, "pos", "neg")
    clf = make_classifier(
        linear_model(6, 1), learning_rate_init=0.1, max_iter=20, random_state=0
    ).fit(X, labels)
    assert list(clf.classes_) == ["neg", "pos"]
    proba = clf.predict_proba(X)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    predicted = clf.predict(X)
    np.testing.assert_array_equal(predicted, clf.classes_[(proba[:, 1] > 0.5).astype(int)])
    assert clf.score(X, labels) == accuracy_score(labels, predicted) > 0.95
    session = ort.InferenceSession(clf.to_onnx().SerializeToString())
    np.testing.assert_array_equal(session.run(None, {"x": X})[0][:, 0], clf.decision_function(X))
    with pytest.raises(OnnxInputError, match=r"binary classifier: y holds 3 class\(es\)"):
        clf.fit(X, np.arange(len(X)) % 3)
    with pytest.raises(OnnxInputError, match="unseen in classes_"):
        clf.partial_fit(X, np.where(labels == "pos", "pos", "other"))


def test_classifier_partial_fit_with_classes(make_classifier, data):
    X, _ = data
    y = (X[:, 0] > 0).astype(int)
    clf = make_classifier(linear_model(6, 1), learning_rate_init=0.1, random_state=0)
    clf.partial_fit(X[y == 1], y[y == 1], classes=[0, 1])
    clf.partial_fit(X, y)
    assert list(clf.classes_) == [0, 1] and clf.n_iter_ == 2


# -- sample weights -------------------------------------------------------------


def test_sample_weights_are_rows(make_regressor, data):
    """Zero weights drop rows, integer weights repeat them (one batch, no shuffle)."""
    X, y = data
    hyper = dict(learning_rate_init=0.05, max_iter=3, shuffle=False, batch_size=1000)
    keep = np.arange(len(X)) % 3 != 0
    weighted = make_regressor(linear_model(6, 1), **hyper).fit(X, y, keep.astype(float))
    dropped = make_regressor(linear_model(6, 1), **hyper).fit(X[keep], y[keep])
    assert_same_weights(weighted, dropped, atol=1e-6)
    assert weighted.loss_ == pytest.approx(dropped.loss_, rel=1e-5)
    twice = np.where(keep, 2.0, 1.0)
    repeated = make_regressor(linear_model(6, 1), **hyper).fit(X, y, twice)
    stacked = make_regressor(linear_model(6, 1), **hyper).fit(
        np.concatenate([X, X[keep]]), np.concatenate([y, y[keep]])
    )
    assert_same_weights(repeated, stacked, atol=1e-6)
    with pytest.raises(OnnxInputError, match=r"sample_weight has 3 values, expected one per row"):
        make_regressor(linear_model(6, 1)).fit(X, y, [1.0, 2.0, 3.0])


# -- warm start, partial_fit, protocol ------------------------------------------


def test_warm_start_resumes_weights_and_velocities(make_regressor, data, fitted_mlp):
    X, y = data
    _, onx = fitted_mlp
    hyper = dict(learning_rate_init=0.01, random_state=0, batch_size=16)
    once = make_regressor(onx, max_iter=5, **hyper).fit(X, y)
    resumed = make_regressor(onx, max_iter=3, **hyper).fit(X, y)
    resumed.set_params(warm_start=True, max_iter=2).fit(X, y)
    assert_same_weights(once, resumed)
    for name, v in velocities_of(once).items():
        np.testing.assert_array_equal(v, velocities_of(resumed)[name])
    assert resumed.n_iter_ == 5 and resumed.train_losses_ == once.train_losses_
    # Without warm start, fit starts again from the model's weights.
    restarted = resumed.set_params(warm_start=False, max_iter=5).fit(X, y)
    assert_same_weights(once, restarted)


def test_partial_fit_is_an_epoch(make_regressor, data):
    X, y = data
    hyper = dict(learning_rate_init=0.02, shuffle=False, batch_size=32)
    fitted = make_regressor(linear_model(6, 1), max_iter=4, **hyper).fit(X, y)
    partial = make_regressor(linear_model(6, 1), **hyper)
    for _ in range(4):
        partial.partial_fit(X, y)
    assert_same_weights(fitted, partial)
    assert partial.train_losses_ == fitted.train_losses_


def test_clone_params_pickle_deepcopy(make_regressor, data, fitted_mlp):
    X, y = data
    _, onx = fitted_mlp
    reg = make_regressor(onx, learning_rate_init=0.01, max_iter=2, random_state=0)
    params = reg.get_params()
    assert params["learning_rate_init"] == 0.01 and params["model"] is onx
    reg.set_params(momentum=0.5)
    reg.fit(X, y)
    cloned = clone(reg)
    assert not hasattr(cloned, "module_") and cloned.get_params()["momentum"] == 0.5
    for restored in (pickle.loads(pickle.dumps(reg)), copy.deepcopy(reg)):
        np.testing.assert_array_equal(restored.predict(X), reg.predict(X))
        for name, v in velocities_of(reg).items():
            np.testing.assert_array_equal(velocities_of(restored)[name], v)
        assert restored.train_losses_ == reg.train_losses_
        # Both go on the same way: velocities, schedule and random state came along.
        restored.partial_fit(X, y)
    reg.partial_fit(X, y)
    assert_same_weights(reg, restored)


def test_verbose_prints_scikit_learns_line_per_epoch(make_regressor, make_classifier, data, capsys):
    X, y = data
    reg = make_regressor(linear_model(6, 1), max_iter=3, random_state=0, verbose=True).fit(X, y)
    reg.partial_fit(X, y)  # one more epoch, numbered on
    expected = [f"Iteration {i + 1}, loss = {v:.8f}" for i, v in enumerate(reg.train_losses_)]
    assert capsys.readouterr().out.splitlines() == expected
    assert len(expected) == reg.n_iter_ == 4
    clf = make_classifier(linear_model(6, 1), max_iter=2, verbose=1).fit(X, y > 0)
    assert capsys.readouterr().out.splitlines()[-1] == f"Iteration 2, loss = {clf.loss_:.8f}"
    make_regressor(linear_model(6, 1), max_iter=2).fit(X, y)
    assert capsys.readouterr().out == ""  # quiet by default


def test_verbose_is_a_scikit_learn_parameter(make_regressor, data, capsys):
    X, y = data
    reg = make_regressor(linear_model(6, 1), max_iter=2, random_state=0)
    assert reg.get_params()["verbose"] is False
    assert clone(reg.set_params(verbose=True)).get_params()["verbose"] is True
    reg.fit(X, y)
    assert capsys.readouterr().out.count("Iteration") == 2
    # An estimator pickled before the parameter existed loads quiet, and fits on.
    state = reg.__getstate__()
    del state["verbose"]
    old = OnnxSGDRegressor.__new__(OnnxSGDRegressor)
    old.__setstate__(state)
    assert old.get_params()["verbose"] is False
    np.testing.assert_array_equal(old.predict(X), reg.predict(X))
    old.partial_fit(X, y)
    assert capsys.readouterr().out == ""


def test_grid_search(backend, data):
    X, y = data
    search = GridSearchCV(
        OnnxSGDRegressor(linear_model(6, 1), max_iter=5, random_state=0, backend=backend),
        {"learning_rate_init": [1e-4, 0.05]},
        cv=2,
    )
    search.fit(X, y)
    assert search.best_params_ == {"learning_rate_init": 0.05}
    assert search.best_estimator_.n_iter_ == 5
    assert search.best_estimator_.get_params()["backend"] == backend


def test_not_fitted_error_is_sklearns(make_regressor):
    reg = make_regressor(linear_model(6, 1))
    with pytest.raises(sklearn.exceptions.NotFittedError, match="not fitted yet"):
        reg.predict(np.zeros((2, 6), np.float32))
    with pytest.raises(NotFittedError) as info:
        reg.to_onnx()
    assert isinstance(info.value, OrtBridgeError)


def test_divergence_stops_with_a_clear_error(make_regressor, data):
    X, y = data
    reg = make_regressor(linear_model(6, 1), learning_rate_init=1e6, max_iter=50)
    with pytest.raises(TrainingDivergedError, match=r"training loss became (nan|inf) at epoch"):
        reg.fit(X, y * 1e3)


@pytest.mark.parametrize(
    "params,message",
    [
        ({"loss": "log_loss"}, "loss='log_loss' is not supported by OnnxSGDRegressor"),
        ({"learning_rate": "adaptive"}, "learning_rate='adaptive' is not supported"),
        ({"learning_rate": "optimal"}, "needs alpha > 0"),
        ({"momentum": 1.5}, r"momentum must be a number >= 0 and <= 1, got 1.5"),
        ({"batch_size": 0}, "batch_size must be a positive integer or 'auto', got 0"),
        ({"l1_ratio": -0.1}, "l1_ratio must be a number >= 0"),
        (
            {"backend": "tensorflow"},
            r"backend must be one of \['auto', 'training-agent', 'onnxruntime'\], got 'tensorflow'",
        ),
    ],
)
def test_invalid_parameters(make_regressor, data, params, message):
    X, y = data
    with pytest.raises(OnnxInputError, match=message):
        make_regressor(linear_model(6, 1), **params).fit(X, y)


def test_schedules_and_penalty_run(make_regressor, data):
    X, y = data
    for schedule in ("invscaling", "optimal"):
        reg = make_regressor(
            linear_model(6, 1),
            learning_rate=schedule,
            alpha=0.01,
            l1_ratio=0.5,
            learning_rate_init=0.05,
            max_iter=3,
            random_state=0,
        ).fit(X, y)
        assert np.isfinite(reg.train_losses_).all()
        assert reg.learning_rate_ < (0.05 if schedule == "invscaling" else 10.0)
    # A strong L1 penalty shrinks the coefficients, not the bias
    # (the penalty is divided by the batch size, as MLPRegressor's).
    fits = {
        alpha: weights_of(
            make_regressor(
                linear_model(6, 1),
                alpha=alpha,
                l1_ratio=1.0,
                learning_rate_init=0.005,
                max_iter=30,
                random_state=0,
            ).fit(X, y + 5)
        )
        for alpha in (0.0, 300.0)
    }
    assert np.abs(fits[0.0]["weight"]).max() > 1.5
    assert np.abs(fits[300.0]["weight"]).max() < 0.15
    assert fits[300.0]["bias"][0] > 4


@pytest.mark.parametrize(
    "name",
    ["ortbridge.training._losses", "ortbridge.training._sgd", "ortbridge.training._estimators"],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
