"""Forward outputs and gradients match torch autograd on the source models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import compare_with_torch, export
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortbridge import OnnxModule
from ortbridge._prepare._onnx_utils import make_model

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")


def test_mlp():
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    x = torch.randn(9, 6)
    layer = OnnxModule(export(model, (x,)))
    compare_with_torch(model, layer, [x.requires_grad_()])


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    with torch.no_grad():  # non-trivial running statistics
        for bn in (model[1], model[5]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    model.eval()
    return model, export(model, (torch.randn(3, 2, 8, 8),))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_conv_batchnorm_pool(cnn, mode):
    model, proto = cnn
    model = __import__("copy").deepcopy(model)
    layer = OnnxModule(proto)
    getattr(model, mode)()
    getattr(layer, mode)()
    for _ in range(2):  # the second step sees updated running statistics
        model.zero_grad()
        layer.zero_grad()
        x = torch.randn(5, 2, 8, 8, requires_grad=True)
        compare_with_torch(model, layer, [x])
        for name in ("1.running_mean", "1.running_var", "5.running_mean", "5.running_var"):
            torch.testing.assert_close(
                layer.get_buffer(name), model.get_buffer(name), rtol=1e-5, atol=1e-6, msg=name
            )


def test_transformer_encoder_layer():
    model = nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    x = torch.randn(2, 5, 16)
    proto = export(model.eval(), (x,))
    assert {"CastLike", "LayerNormalization"} <= {n.op_type for n in proto.graph.node}
    layer = OnnxModule(proto)
    assert len(list(layer.named_onnx_parameters())) == 12
    compare_with_torch(model, layer, [torch.randn(3, 5, 16, requires_grad=True)])


def test_embedding_int64_ids():
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(8 * 4, 2))
    ids = torch.randint(0, 20, (6, 4))
    layer = OnnxModule(export(model, (ids,)))
    compare_with_torch(model, layer, [torch.randint(0, 20, (5, 4))])


class TwoInTwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x, z):
        h = self.a(x) * torch.sigmoid(self.b(z))
        return h.sum(dim=1, keepdim=True), torch.tanh(self.b(z))


def test_two_inputs_two_outputs_one_in_loss():
    model = TwoInTwoOut()
    x, z = torch.randn(3, 4), torch.randn(3, 5)
    layer = OnnxModule(export(model, (x, z)))
    assert layer.input_names == ["x", "z"] and len(layer.output_names) == 2
    compare_with_torch(
        model, layer, [x.requires_grad_(), z.requires_grad_()], loss_fn=lambda out: out[0].sum()
    )


class WithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, y > 0, (y > 0).sum(dim=1)


def test_bool_and_integer_outputs():
    model = WithMask()
    x = torch.randn(5, 4)
    layer = OnnxModule(export(model, (x,)))
    x = x.requires_grad_()
    out = compare_with_torch(model, layer, [x], loss_fn=lambda out: (out[0] ** 2).sum())
    assert out[1].dtype == torch.bool and out[2].dtype == torch.int64
    assert not out[1].requires_grad and not out[2].requires_grad


def test_sklearn_mlp_converted_by_skl2onnx():
    sklearn = pytest.importorskip("sklearn.neural_network")
    skl2onnx = pytest.importorskip("skl2onnx")
    from skl2onnx.common.data_types import FloatTensorType

    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 5)).astype(np.float32)
    y = X @ rng.standard_normal(5) + 0.1
    reg = sklearn.MLPRegressor(hidden_layer_sizes=(7,), max_iter=50, random_state=0).fit(X, y)
    proto = skl2onnx.convert_sklearn(
        reg, initial_types=[("X", FloatTensorType([None, 5]))], target_opset=18
    )
    layer = OnnxModule(proto)
    named = dict(layer.named_onnx_parameters())
    assert sorted(named) == ["coefficient", "coefficient1", "intercepts", "intercepts1"]
    # The same network in torch, from scikit-learn's fitted arrays.
    ref_params = {
        "coefficient": reg.coefs_[0],
        "intercepts": reg.intercepts_[0].reshape(1, -1),
        "coefficient1": reg.coefs_[1],
        "intercepts1": reg.intercepts_[1].reshape(1, -1),
    }
    leaves = {
        k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in ref_params.items()
    }
    xt = torch.from_numpy(X)
    hidden = torch.relu(xt @ leaves["coefficient"] + leaves["intercepts"])
    ref = hidden @ leaves["coefficient1"] + leaves["intercepts1"]
    out = layer(xt)
    torch.testing.assert_close(out.reshape(-1), ref.reshape(-1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.detach().numpy().ravel(), reg.predict(X), rtol=1e-4, atol=1e-4)
    (ref**2).sum().backward()
    (out**2).sum().backward()
    for name, param in named.items():
        torch.testing.assert_close(param.grad, leaves[name].grad, rtol=1e-4, atol=1e-5)


def _small_double_model():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4))
    b = rng.standard_normal(4)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["a"]),
            helper.make_node("Tanh", ["a"], ["t"]),
            helper.make_node("Mul", ["t", "a"], ["y"]),
        ],
        "small_double",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["n", 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return make_model(graph)


def test_gradcheck_float64():
    layer = OnnxModule(_small_double_model())
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = layer.onnx_weight("w")
    b = layer.onnx_weight("b")
    assert torch.autograd.gradcheck(
        lambda x_, w_, b_: _with_weights(layer, x_, w_, b_), (x, w, b), eps=1e-6, atol=1e-6
    )


def _with_weights(layer, x, w, b):
    # gradcheck perturbs tensors in place: feed them through the generated
    # autograd Function directly, weights included.
    return layer.function.apply(layer._bridge, "train", x, w, b)[0]


def test_function_class_per_graph():
    a = OnnxModule(_small_double_model())
    b = OnnxModule(_small_double_model())
    assert issubclass(a.function, torch.autograd.Function)
    assert a.function.__name__ == "Small_doubleFunction"
    assert a.function is not b.function
    y = a(torch.randn(2, 3, dtype=torch.float64, requires_grad=True))
    assert type(y.grad_fn).__name__.startswith("Small_doubleFunction")


def test_onnx_roundtrip_keeps_graph():
    layer = OnnxModule(_small_double_model())
    exported = layer.to_onnx()
    assert isinstance(exported, onnx.ModelProto)
    assert [n.op_type for n in exported.graph.node] == ["MatMul", "Add", "Tanh", "Mul"]


def test_initializers_listed_as_inputs_old_ir():
    proto = linear_model_ir3()
    layer = OnnxModule(proto)
    assert layer.input_names == ["x"]
    x = torch.randn(4, 3, requires_grad=True)
    w, b = layer.onnx_weight("weight"), layer.onnx_weight("bias")
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    out = layer(x)
    want = ref[0] @ ref[1].T + ref[2]
    torch.testing.assert_close(out, want)
    upstream = torch.randn(out.shape)
    out.backward(upstream)
    want.backward(upstream)
    for got, expected in zip((x, w, b), ref):
        torch.testing.assert_close(got.grad, expected.grad)


def linear_model_ir3():
    from ortbridge.examples import linear_model

    proto = linear_model(3, 2)
    for init in proto.graph.initializer:  # as IR < 4 models do
        proto.graph.input.append(
            helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        )
    proto.ir_version = 3
    del proto.opset_import[:]
    proto.opset_import.append(helper.make_opsetid("", 9))
    return proto
