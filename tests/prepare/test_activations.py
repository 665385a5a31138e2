"""Activations onnxruntime cannot differentiate train through their standard-op form."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import compare_with_torch, export, scaled_atol
from torch import nn

from ortbridge import OnnxModule
from ortbridge._prepare._activations import OPS

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")

ACTIVATIONS = {
    "Elu": lambda: nn.ELU(alpha=0.7),
    "Celu": lambda: nn.CELU(alpha=1.3),
    "Selu": nn.SELU,
    "Softplus": nn.Softplus,
    "Mish": nn.Mish,
    "HardSigmoid": nn.Hardsigmoid,
    "HardSwish": nn.Hardswish,
    "PRelu": lambda: nn.PReLU(num_parameters=6, init=0.2),
}

# Joins (0, +-3 for the hard ones), values whose exp overflows float32, tiny ones.
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 2.5, -2.5, 50.0, -50.0, 100.0, -100.0]


def _op_types(layer: OnnxModule) -> collections.Counter:
    return collections.Counter(n.op_type for n in layer._bridge.model.graph.node)


@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
def test_network_with_activation_trains_like_torch(op):
    model = nn.Sequential(nn.Linear(5, 6), ACTIVATIONS[op](), nn.Linear(6, 2))
    x = torch.randn(9, 5, requires_grad=True)
    layer = OnnxModule(export(model, (x,)))
    assert op in {n.op_type for n in layer._original.graph.node}  # the exporter wrote it
    assert _op_types(layer)[op] == 0
    # No constant of the rewrite became a weight: same parameters as torch.
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == sorted(
        n for n, _ in model.named_parameters()
    )
    compare_with_torch(model, layer, [x], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
def test_gradient_at_joins_and_extremes_equals_torch(op, dtype):
    values = SPECIAL
    if op == "HardSwish":
        # torch's hardswish backward takes the inner slope at exactly +-3,
        # the rewrite the outer one (as torch's hardsigmoid does).
        values = [v for v in SPECIAL if abs(v) != 3.0]
    activation = ACTIVATIONS[op]().to(dtype)
    x = torch.tensor(values, dtype=dtype).repeat(6, 1).T.contiguous()  # (n, 6): PReLU's channels
    layer = OnnxModule(export(activation, (x,)))
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(x.shape, dtype=dtype)
    out = layer(ours)
    out.backward(upstream)
    expected = activation(ref)
    expected.backward(upstream)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-6, "atol": 1e-9}
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(ours.grad, ref.grad, **tol)
    assert torch.isfinite(ours.grad).all()
    if op == "PRelu":
        (weight,) = [p for _, p in layer.named_onnx_parameters()]
        # a sum over the batch: atol scaled with the largest (sums that cancel)
        atol = scaled_atol(tol["atol"], activation.weight.grad)
        torch.testing.assert_close(weight.grad, activation.weight.grad, rtol=tol["rtol"], atol=atol)


def test_eval_mode_and_no_grad_run_the_same_graph():
    model = nn.Sequential(nn.Linear(4, 4), nn.ELU(), nn.Linear(4, 1)).eval()
    x = torch.randn(3, 4)
    layer = OnnxModule(export(model, (x,))).eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), model(x))


def test_every_rewritten_op_is_covered():
    assert set(ACTIVATIONS) == set(OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leaky_relu_is_rewritten_for_float64_only(dtype):
    # onnxruntime has no float64 CPU kernel for LeakyRelu; float32 keeps its own.
    model = nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.1), nn.Linear(6, 2)).to(dtype)
    x = torch.randn(9, 5, dtype=dtype, requires_grad=True)
    layer = OnnxModule(export(model, (x,)))
    assert _op_types(layer)["LeakyRelu"] == (1 if dtype == torch.float32 else 0)
    # the slope is a float attribute in ONNX: 0.1 rounded to float32
    compare_with_torch(model, layer, [x], rtol=1e-6, atol=1e-7)
