"""Rewrites of onnxruntime's gradient graphs: the tanh GELU gradient, the CPU ReluGrad."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from conftest import compare_with_torch, export, requires_training_build
from onnx import TensorProto, helper
from torch import nn

from ortbridge import OnnxModule
from ortbridge._engines.training_agent._gradient_rewrites import rewrite_gradient
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge.exceptions import OnnxModelError
from ortbridge.training._graphs._gradient import gradient_model

TRAINING_AGENT = "training-agent"


def _op_types(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _gradient_models(layer: OnnxModule) -> list[onnx.ModelProto]:
    """The builder's gradient graphs the layer ran (none on the onnxruntime engine)."""
    if layer.backend != TRAINING_AGENT:
        return []
    return [g.gradient_model for g in layer._bridge._gradient_graphs.values()]


def _relu_grad_model(elem: int, typed: bool = True) -> onnx.ModelProto:
    shape = ["n"] if typed else None
    graph = helper.make_graph(
        [helper.make_node("ReluGrad", ["dy", "x"], ["dx"], name="g", domain="com.microsoft")],
        "relu_grad",
        [
            helper.make_tensor_value_info("dy", elem, shape),
            helper.make_tensor_value_info("x", elem if typed else 0, shape),
        ],
        [helper.make_tensor_value_info("dx", elem, shape)],
    )
    return make_model(graph, 17, {"com.microsoft": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.usefixtures("backend")
def test_relu_gradient_equals_torch_at_zero_and_extremes(dtype):
    # The mask is X > 0: zero, negative zero, denormals and infinities
    # must split exactly as torch's threshold_backward splits them.
    x = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0, -3.0, float("inf"), -float("inf")])
    x = x.to(dtype).repeat(4, 1)
    layer = OnnxModule(export(nn.ReLU(), (x,)))
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(x.shape, dtype=dtype)
    layer(ours).backward(upstream)
    torch.relu(ref).backward(upstream)
    assert torch.equal(ours.grad, ref.grad)
    for graph in _gradient_models(layer):
        assert "ReluGrad" not in _op_types(graph)


@pytest.mark.usefixtures("backend")
def test_float32_relu_network_gradients_match_torch_without_relu_grad():
    model = nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )
    x = torch.randn(9, 6, requires_grad=True)
    layer = OnnxModule(export(model, (x,)))
    compare_with_torch(model, layer, [x])
    graphs = _gradient_models(layer)
    assert graphs or layer.backend != TRAINING_AGENT
    for graph in graphs:
        ops = _op_types(graph)
        assert ops["ReluGrad"] == 0
        assert ops["Greater"] == ops["Cast"] == 2


@pytest.mark.usefixtures("backend")
def test_float64_relu_network_trains_on_cpu():
    # onnxruntime registers its CPU ReluGrad for float only: before the
    # rewrite a float64 network with a ReLU could not build its session.
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    layer = OnnxModule(export(model, (x,)))
    compare_with_torch(model, layer, [x], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_rewritten_graph_computes_relu_grad_exactly(elem):
    original = _relu_grad_model(elem)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(original)
    assert rewrite_gradient(rewritten, "cpu") == {"tanh_gelu": 0, "relu": 1, "quick_gelu": 0}
    assert _op_types(rewritten) == {"Constant": 1, "Greater": 1, "Cast": 1, "Mul": 1}
    assert rewritten.graph.node[-1].name == "g"  # profiles still name the node
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(dtype)
    x[:6] = [0.0, -0.0, 1e-300 if elem == TensorProto.DOUBLE else 1e-40, np.inf, -np.inf, -1e-3]
    feeds = {"dy": rng.standard_normal(64).astype(dtype), "x": x}
    # onnxruntime's CPU ReluGrad exists for float only, in the training build only
    models = [rewritten]
    if elem == TensorProto.FLOAT and _ort.has_training():
        models.append(original)
    outputs = [
        onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )[0]
        for m in models
    ]
    for out in outputs:
        np.testing.assert_array_equal(out, np.where(x > 0, feeds["dy"], 0))


def test_nodes_of_unknown_or_unsupported_type_are_left_alone():
    for model in (_relu_grad_model(TensorProto.FLOAT, typed=False),
                  _relu_grad_model(TensorProto.FLOAT16)):  # fmt: skip
        before = model.SerializeToString()
        assert rewrite_gradient(model, "cpu") == {"tanh_gelu": 0, "relu": 0, "quick_gelu": 0}
        assert model.SerializeToString() == before


def test_nodes_without_inputs_beside_a_target_are_kept():
    # A Constant node (no inputs) in a graph that has something to rewrite.
    model = _relu_grad_model(TensorProto.FLOAT)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["c"], value_float=1.0))
    assert rewrite_gradient(model, "cpu") == {"tanh_gelu": 0, "relu": 1, "quick_gelu": 0}
    assert model.graph.node[0].op_type == "Constant" and model.graph.node[0].output[0] == "c"


def test_relu_grad_stays_on_cuda():
    model = _relu_grad_model(TensorProto.FLOAT)
    before = model.SerializeToString()
    assert rewrite_gradient(model, "cuda") == {"tanh_gelu": 0, "relu": 0, "quick_gelu": 0}
    assert model.SerializeToString() == before


@requires_training_build  # the builder's kernels
def test_training_graphs_without_torch_are_rewritten_too():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(3, 4)
    proto = export(nn.Sequential(model), (x,))
    # the builder's graph of a loss: the network's output summed
    out = proto.graph.output[0].name
    proto.graph.node.append(helper.make_node("ReduceSum", [out], ["loss"], keepdims=0))
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    trainable = [i.name for i in proto.graph.initializer]
    options = onnxruntime.SessionOptions()
    built = gradient_model(proto, "loss", trainable, options, "training-agent").model
    ops = _op_types(built)
    assert ops["ReluGrad"] == 0 and ops["Greater"] == 1


# -- tanh GELU ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 16), (2, 8, 16)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.usefixtures("backend")
def test_gelu_gradients_match_torch(approximate, shape):
    # onnxruntime's builder gives Gelu(approximate="tanh") the exact GELU's
    # gradient (weight gradients off by about 1e-4 here): ortbridge replaces it.
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate=approximate), nn.Linear(32, 4))
    x = torch.randn(*shape, requires_grad=True)
    layer = OnnxModule(export(model, (x,)))
    compare_with_torch(model, layer, [x], rtol=1e-5, atol=2e-6)
    for graph in _gradient_models(layer):
        ops = _op_types(graph)
        assert ops["GeluGrad"] == (1 if approximate == "none" else 0)


@pytest.mark.usefixtures("backend")
def test_tanh_gelu_float64_trains_on_cpu():
    model = nn.Sequential(nn.Linear(5, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 1)).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    layer = OnnxModule(export(model, (x,)))
    # onnxruntime's float64 Gelu forward agrees with torch's to about 1e-7
    compare_with_torch(model, layer, [x], rtol=1e-6, atol=1e-8)


def _two_gelus(names) -> onnx.ModelProto:
    """Hand-made gradient graph: exact and tanh Gelu on the same x, then a
    GeluGrad for each, fed by the gradient inputs ``names``."""
    nodes = [
        helper.make_node("Gelu", ["x"], ["y_exact"]),
        helper.make_node("Gelu", ["x"], ["y_tanh"], approximate="tanh"),
    ]
    for k, d_y in enumerate(names):
        nodes.append(
            helper.make_node(
                "GeluGrad", [d_y, "x"], [f"dx{k}"], name=f"g{k}", domain="com.microsoft"
            )
        )
    spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64]) for n in ["x", *names]]
    outputs = [helper.make_tensor_value_info(f"dx{k}", TensorProto.FLOAT, [64]) for k in range(2)]
    graph = helper.make_graph(nodes, "two_gelus", spec, outputs)
    return make_model(graph, 20, {"com.microsoft": 1})


@requires_training_build  # the builder's kernels
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_tanh_gelu_gradient_found_by_name_when_x_feeds_both_forms(device_type):
    model = _two_gelus(["y_exact_grad", "y_tanh_grad"])
    assert rewrite_gradient(model, device_type) == {"tanh_gelu": 1, "relu": 0, "quick_gelu": 0}
    ops = _op_types(model)
    assert ops["GeluGrad"] == 1  # the exact one, untouched
    # The CUDA form (FastGeluGrad) and the CPU form (standard ops) both run
    # on the CPU: each gives torch's gradient of the tanh GELU.
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(64) * 3).astype(np.float32)
    d_y = rng.standard_normal(64).astype(np.float32)
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    exact, tanh = session.run(None, {"x": x, "y_exact_grad": d_y, "y_tanh_grad": d_y})
    for form, out in (("none", exact), ("tanh", tanh)):
        xt = torch.from_numpy(x).requires_grad_()
        torch.nn.functional.gelu(xt, approximate=form).backward(torch.from_numpy(d_y))
        np.testing.assert_allclose(out, xt.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_unmatchable_gelu_gradient_is_an_error_not_a_guess():
    model = _two_gelus(["gy_exact", "gy_tanh"])  # names that say nothing
    with pytest.raises(OnnxModelError, match="feeds both an exact and a tanh-approximate"):
        rewrite_gradient(model, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.usefixtures("backend")
def test_silu_trains_in_float32_and_float64(dtype):
    # The builder fuses x * sigmoid(x) into QuickGelu, whose CPU kernels are
    # float only: float64 graphs get standard ops back, float32 keeps them.
    model = nn.Sequential(nn.Linear(5, 8), nn.SiLU(), nn.Linear(8, 1)).to(dtype)
    x = torch.randn(7, 5, dtype=dtype, requires_grad=True)
    layer = OnnxModule(export(model, (x,)))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    compare_with_torch(model, layer, [x], rtol=tol, atol=tol)
    for graph in _gradient_models(layer):
        ops = _op_types(graph)
        quick = ops["QuickGelu"] + ops["QuickGeluGrad"]
        assert quick == (2 if dtype == torch.float32 else 0)
