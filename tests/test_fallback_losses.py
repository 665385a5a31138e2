"""scikit-learn-convention losses, penalties, schedules and updates of the fallback
training (``ortbridge.training._losses``): each against numpy, torch autograd and
scikit-learn."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from sklearn.linear_model import SGDRegressor
from sklearn.neural_network._stochastic_optimizers import SGDOptimizer

from ortbridge import OnnxModule
from ortbridge.exceptions import OnnxInputError, OnnxModelError
from ortbridge.training import _losses
from ortbridge.training._sgd import SklearnSGD

LOSSES = _losses.LOSSES
DTYPES = {
    "float32": (torch.float32, onnx.TensorProto.FLOAT, 1e-5),
    "float64": (torch.float64, onnx.TensorProto.DOUBLE, 1e-12),
}


def torch_loss(loss, p, y, w):
    """The losses written with torch operators, for autograd's gradient."""
    r = p - y
    if loss == "squared_error":
        rows = 0.5 * r * r
    elif loss == "absolute_error":
        rows = r.abs()
    elif loss == "elastic":
        rows = 0.5 * r.abs() + 0.5 * 0.5 * r * r
    else:
        rows = torch.nn.functional.binary_cross_entropy_with_logits(p, y, reduction="none")
    return (rows * w.reshape(-1, 1)).sum()


def random_batch(loss, n_rows, n_cols, dtype, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n_rows, n_cols, generator=gen, dtype=dtype) * 2
    if loss == "log_loss":
        y = (torch.rand(n_rows, n_cols, generator=gen) > 0.5).to(dtype)
        p[0, 0] = 0.0  # the derivative at a raw score of 0 is 1/2 - y
    else:
        y = torch.randn(n_rows, n_cols, generator=gen, dtype=dtype)
    if weighted:
        w = torch.rand(n_rows, generator=gen, dtype=dtype) * 3
        w[1] = 0.0
    else:
        w = torch.ones(n_rows, dtype=dtype)
    return p, y, w


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_cols", [1, 3])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.usefixtures("backend")
def test_loss_value_and_gradient(loss, n_cols, dtype, weighted):
    """ORT forward/backward of the loss graph == numpy reference == torch autograd."""
    tdtype, elem, tol = DTYPES[dtype]
    p, y, w = random_batch(loss, 9, n_cols, tdtype, weighted)
    np_value = _losses.loss_value(loss, p.numpy(), y.numpy(), w.numpy())
    np_grad = _losses.loss_gradient(loss, p.numpy(), y.numpy(), w.numpy())

    p_torch = p.clone().requires_grad_(True)
    torch_value = torch_loss(loss, p_torch, y, w)
    torch_value.backward()

    module = OnnxModule(_losses.loss_model(loss, elem, n_cols))
    p_ort = p.clone().requires_grad_(True)
    ort_value = module(p_ort, y, w.reshape(-1, 1))
    ort_value.backward()

    assert ort_value.dtype == tdtype and ort_value.shape == ()
    np.testing.assert_allclose(torch_value.item(), np_value, rtol=tol)
    np.testing.assert_allclose(ort_value.item(), np_value, rtol=tol)
    np.testing.assert_allclose(p_torch.grad.numpy(), np_grad, rtol=tol, atol=tol)
    np.testing.assert_allclose(p_ort.grad.numpy(), np_grad, rtol=tol, atol=tol)
    if weighted:
        # A row of weight 0 has no gradient: the weights are one a row.
        assert not p_ort.grad[1].any()


@pytest.mark.usefixtures("backend")
def test_gradient_signs():
    """Gradients point away from the target: the L1 sign defect must not come back."""
    p = torch.tensor([[2.0], [-2.0]], requires_grad=True)
    y = torch.zeros(2, 1)
    w = torch.ones(2, 1)
    expected = {"squared_error": [2.0, -2.0], "absolute_error": [1.0, -1.0], "elastic": [1.5, -1.5]}
    for loss, grad in expected.items():
        p.grad = None
        OnnxModule(_losses.loss_model(loss))(p, y, w).backward()
        assert p.grad.ravel().tolist() == grad, loss
    p.grad = None
    OnnxModule(_losses.loss_model("log_loss"))(p, torch.tensor([[0.0], [1.0]]), w).backward()
    sig = torch.sigmoid(torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(p.grad.ravel(), torch.stack([sig[0], sig[1] - 1]))


def test_sample_weight_shape_is_one_per_row():
    """(n,) weights never broadcast against (n, 1) predictions into (n, n)."""
    p, y = np.array([1.0, 2.0, 3.0]), np.zeros(3)
    w = np.array([1.0, 0.0, 2.0])
    assert _losses.loss_value("absolute_error", p, y, w) == 7.0
    assert _losses.loss_gradient("absolute_error", p, y, w).shape == (3, 1)
    session = ort.InferenceSession(_losses.loss_model("absolute_error").SerializeToString())
    feeds = {
        "prediction": p.reshape(-1, 1).astype(np.float32),
        "ortbridge_target": y.reshape(-1, 1).astype(np.float32),
        "ortbridge_sample_weight": w.reshape(-1, 1).astype(np.float32),
    }
    assert session.run(None, feeds)[0] == 7.0
    with pytest.raises(OnnxInputError, match="sample_weight has 2 values, expected one per row"):
        _losses.loss_value("squared_error", p, y, w[:2])


def test_append_loss_keeps_model_and_checks_names():
    """The prediction is reshaped to (n, k); name clashes and bad outputs are refused."""
    base = _losses.loss_model("squared_error")
    with pytest.raises(OnnxModelError, match="already uses the name 'ortbridge_target'"):
        _losses.append_loss(base, "squared_error", loss_name="other")
    with pytest.raises(OnnxModelError, match="has no output 'nope'"):
        _losses.append_loss(base, "squared_error", output="nope", loss_name="l2")
    with pytest.raises(OnnxInputError, match="loss='hinge' is not supported"):
        _losses.append_loss(base, "hinge")
    assert not [i for i in base.graph.initializer if i.data_type != onnx.TensorProto.INT64], (
        "float constants of the loss must not be initializers (they would be trained)"
    )


@pytest.mark.parametrize("l1_ratio", [0.0, 0.3, 1.0])
def test_penalty_value_and_gradient(l1_ratio):
    """Elastic penalty: numpy value and gradient == torch autograd."""
    gen = torch.Generator().manual_seed(1)
    weights = [
        torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True),
    ]
    alpha = 0.7
    value = sum(
        alpha * (l1_ratio * w.abs().sum() + 0.5 * (1 - l1_ratio) * (w * w).sum()) for w in weights
    )
    value.backward()
    arrays = [w.detach().numpy() for w in weights]
    np.testing.assert_allclose(_losses.penalty_value(arrays, alpha, l1_ratio), value.item())
    for w, arr in zip(weights, arrays):
        np.testing.assert_allclose(_losses.penalty_gradient(arr, alpha, l1_ratio), w.grad)


@pytest.mark.parametrize("l1_ratio", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_penalty_in_update_graph(l1_ratio, momentum):
    """SklearnSGD adds the penalty divided by the batch, times the learning rate."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    w = torch.nn.Parameter(w0.clone())
    alpha, lr, batch = 0.5, 0.1, 8
    opt = SklearnSGD([w], lr=lr, momentum=momentum, nesterov=False, alpha=alpha, l1_ratio=l1_ratio)
    expected, v = w0.numpy(), np.zeros((6, 4))
    for _ in range(3):
        w.grad = g.clone()
        full = (g.numpy() + _losses.penalty_gradient(expected, alpha, l1_ratio)) / batch
        expected, v = _losses.sgd_update(expected, full, v, lr=lr, momentum=momentum)
        opt.step(grad_scale=1.0 / batch)
    np.testing.assert_allclose(w.detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_penalised_initializers_are_coefficients():
    """MLPRegressor's convention: coefficients (MatMul/Gemm weights) yes, biases no."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.ones((2, 2), np.float32), n) for n in "WBC"]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "B"], ["z"]),
        helper.make_node("Gemm", ["z", "C"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        inits,
    )
    assert _losses.penalised_initializers(helper.make_model(graph)) == {"W", "C"}


# -- schedules ----------------------------------------------------------------


def test_schedule_constant_and_invscaling_match_mlp():
    """The learning rate scikit-learn's SGDOptimizer sets after an epoch of t samples."""
    for schedule in ("constant", "invscaling"):
        opt = SGDOptimizer([np.zeros(2)], learning_rate_init=0.2, lr_schedule=schedule, power_t=0.3)
        for t in (0, 10, 1000, 12345):
            opt.iteration_ends(t)
            value = _losses.learning_rate(schedule, 0.2, t, power_t=0.3)
            assert value == pytest.approx(opt.learning_rate, rel=1e-15), (schedule, t)
    assert _losses.learning_rate("invscaling", 0.1, 99, power_t=0.5) == pytest.approx(0.01)


def test_schedule_optimal_matches_sgdregressor():
    """``optimal``: the first two steps of SGDRegressor on one feature give eta(0), eta(1)."""
    alpha = 0.01
    X, y = np.array([[1.0], [1.0]]), np.array([1.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg = SGDRegressor(
            learning_rate="optimal",
            alpha=alpha,
            penalty=None,
            fit_intercept=False,
            max_iter=1,
            tol=None,
            shuffle=False,
        )
        reg.fit(X[:1], y[:1], coef_init=np.zeros(1))
        w1 = reg.coef_[0]  # 0 - eta0 * (0 - 1)
        reg.fit(X, y, coef_init=np.zeros(1))
        w2 = reg.coef_[0]  # w1 - eta1 * (w1 - 1)
    eta0 = _losses.learning_rate("optimal", 123.0, 0, alpha=alpha)
    eta1 = _losses.learning_rate("optimal", 123.0, 1, alpha=alpha)
    assert eta0 == pytest.approx(w1, rel=1e-12)
    assert eta1 == pytest.approx((w1 - w2) / (w1 - 1), rel=1e-9)
    with pytest.raises(OnnxInputError, match="needs alpha > 0"):
        _losses.learning_rate("optimal", 0.1, 0, alpha=0.0)
    with pytest.raises(OnnxInputError, match="learning_rate='adaptive' is not supported"):
        _losses.learning_rate("adaptive", 0.1, 0)


# -- updates ------------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum,nesterov",
    [(0.0, False), (0.9, False), (0.9, True)],
    ids=["plain", "momentum", "nesterov"],
)
def test_updates_match_sklearn_optimizer(momentum, nesterov):
    """SklearnSGD (ORT graph) == numpy reference == scikit-learn's SGDOptimizer, 20 steps."""
    rng = np.random.default_rng(3)
    shapes = [(5, 4), (1, 4), (4,)]
    start = [rng.normal(size=s) for s in shapes]
    params = [torch.nn.Parameter(torch.tensor(a)) for a in start]
    ref = [a.copy() for a in start]
    sk = [a.copy() for a in start]
    opt = SklearnSGD(params, lr=0.05, momentum=momentum, nesterov=nesterov)
    sk_opt = SGDOptimizer(sk, learning_rate_init=0.05, momentum=momentum, nesterov=nesterov)
    velocities = [np.zeros(s) for s in shapes]
    for _ in range(20):
        grads = [rng.normal(size=s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g * 4)  # summed over a batch of 4
        opt.step(grad_scale=0.25)
        sk_opt.update_params(sk, grads)  # scikit-learn gets the mean gradient
        for i, g in enumerate(grads):
            ref[i], velocities[i] = _losses.sgd_update(
                ref[i], g, velocities[i], lr=0.05, momentum=momentum, nesterov=nesterov
            )
    for p, r, s in zip(params, ref, sk):
        np.testing.assert_allclose(p.detach().numpy(), s, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(r, s, rtol=1e-12, atol=1e-12)
    if momentum:
        for p, v in zip(params, sk_opt.velocities):
            np.testing.assert_allclose(opt.state[p]["velocity"].numpy(), v, atol=1e-12)
