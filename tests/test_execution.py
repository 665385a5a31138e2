"""How the bridge runs: gradient graphs, execution states, memory, tensors, threads."""

from __future__ import annotations

import gc

import numpy as np
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule
from ortbridge._examples import linear_model
from ortbridge._onnx_utils import make_model

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")

CPU = torch.device("cpu")


def _mlp_model(n_in=8, hidden=16, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(np.float32)
    b1 = np.zeros(hidden, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Tanh", ["hb"], ["t"]),
            helper.make_node("MatMul", ["t", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))],
    )
    return make_model(graph)


def _torch_mlp(layer):
    w1, b1, w2 = (
        layer.onnx_weight(n).detach().clone().requires_grad_() for n in ("w1", "b1", "w2")
    )

    def run(x):
        return torch.tanh(x @ w1 + b1) @ w2

    return run, {"w1": w1, "b1": b1, "w2": w2}


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_input_without_grad_gets_no_input_gradient():
    layer = OnnxModule(_mlp_model())
    layer(torch.randn(4, 8)).sum().backward()
    graphs = list(layer._bridge._gradient_graphs.values())
    assert len(graphs) == 1
    (graph,) = graphs
    assert "x" not in graph.grad_targets
    assert all(o.name != "x_grad" for o in graph.gradient_model.graph.output)
    assert not any(
        n.op_type == "MatMul" and "x_grad" in n.output for n in graph.gradient_model.graph.node
    )
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    with_input = [g for g in layer._bridge._gradient_graphs.values() if "x" in g.grad_targets]
    assert len(with_input) == 1 and x.grad is not None
    assert len(with_input[0].gradient_model.graph.node) > len(graph.gradient_model.graph.node)


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_interleaved_forwards_and_backwards():
    layer = OnnxModule(_mlp_model())
    ref, params = _torch_mlp(layer)
    x1, x2 = torch.randn(5, 8), torch.randn(3, 8)
    y1, y2 = layer(x1), layer(x2)
    assert y1.grad_fn.token is not None and y2.grad_fn.token is not None
    (y2**2).sum().backward()
    assert y2.grad_fn.token is None  # freed as soon as its backward ends
    assert y1.grad_fn.token is not None
    g2 = {n: p.grad.clone() for n, p in layer.named_onnx_parameters()}
    layer.zero_grad()
    (y1**3).sum().backward()
    assert y1.grad_fn.token is None
    g1 = {n: p.grad.clone() for n, p in layer.named_onnx_parameters()}
    (ref(x2) ** 2).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(g2[name], p.grad, rtol=1e-4, atol=1e-5)
        p.grad = None
    (ref(x1) ** 3).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(g1[name], p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_second_backward_with_retain_graph_recomputes():
    layer = OnnxModule(_mlp_model())
    x = torch.randn(4, 8, requires_grad=True)
    y = layer(x)
    y.sum().backward(retain_graph=True)
    first = layer.onnx_weight("w1").grad.clone()
    y.sum().backward()
    torch.testing.assert_close(layer.onnx_weight("w1").grad, 2 * first)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def test_dropped_forwards_leave_memory_flat():
    layer = OnnxModule(_mlp_model(n_in=256, hidden=512, n_out=256))
    x = torch.randn(64, 256)
    for _ in range(200):  # warm up allocators and caches
        layer(x)
    gc.collect()
    before = _rss_mb()
    for _ in range(2000):
        out = layer(x)  # a training forward (weights require grad), never backpropagated
        del out
    gc.collect()
    growth = _rss_mb() - before
    # Each forward keeps about 0.5 MB of activations: a leak would be ~1 GB.
    assert growth < 40, f"resident memory grew by {growth:.1f} MB over 2,000 forwards"


def test_outputs_survive_backward_and_later_steps():
    layer = OnnxModule(_mlp_model())
    kept = []
    for batch in (4, 4, 9):
        y = layer(torch.randn(batch, 8))
        kept.append((y, y.detach().clone()))
        (y**2).sum().backward()
    for y, copy in kept:
        torch.testing.assert_close(y.detach(), copy, rtol=0, atol=0)
    grads = {n: p.grad for n, p in layer.named_onnx_parameters()}
    copies = {n: g.clone() for n, g in grads.items()}
    for _ in range(3):  # later steps do not write into earlier gradients
        layer.zero_grad(set_to_none=True)
        layer(torch.randn(9, 8)).sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, copies[name], rtol=0, atol=0)
    with torch.no_grad():
        first = layer(torch.randn(4, 8))
        copy = first.clone()
        layer(torch.randn(4, 8))
    torch.testing.assert_close(first, copy, rtol=0, atol=0)


def test_non_contiguous_input():
    layer = OnnxModule(_mlp_model())
    base = torch.randn(8, 6)
    x = base.t()
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()))
    xg = x.detach().requires_grad_()
    layer(xg).sum().backward()
    assert xg.grad.shape == (6, 8)


def _mixed_types_model():
    w = np.full((3,), 2.0, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Where", ["mask", "xw", "zero"], ["y"]),
            helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["y", "kf"], ["z"]),
            helper.make_node("Greater", ["z", "zero"], ["positive"]),
            helper.make_node("Add", ["k", "k"], ["k2"]),
        ],
        "mixed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["n", 3]),
        ],
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("positive", TensorProto.BOOL, ["n", 3]),
            helper.make_tensor_value_info("k2", TensorProto.INT64, ["n", 3]),
        ],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    return make_model(graph)


def test_bool_and_integer_inputs_and_outputs():
    layer = OnnxModule(_mixed_types_model())
    x = torch.randn(4, 3, requires_grad=True)
    mask = torch.rand(4, 3) > 0.5
    k = torch.randint(-2, 3, (4, 3))
    z, positive, k2 = layer(x, mask, k)
    expected = torch.where(mask, 2 * x, 0.0) + k
    torch.testing.assert_close(z, expected)
    assert positive.dtype == torch.bool and torch.equal(positive, expected > 0)
    assert k2.dtype == torch.int64 and torch.equal(k2, 2 * k)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(mask, 2.0, 0.0))
    torch.testing.assert_close(layer.onnx_weight("w").grad, (x * mask).sum(0).detach())


def test_dynamic_batch_without_rebuilding():
    layer = OnnxModule(_mlp_model())
    for batch in (1, 7, 64):
        x = torch.randn(batch, 8)
        y = layer(x)
        assert y.shape == (batch, 3)
        y.sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(layer(x), y.detach())
    assert len(layer._bridge._gradient_graphs) == 1
    assert len(layer._bridge._inference_graphs) == 1


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_in_place_change_of_saved_output_raises():
    layer = OnnxModule(_mlp_model())
    x = torch.randn(4, 8)
    graph = layer._bridge.gradient_graph("train", [False, True, True, True], CPU)
    # Tanh's gradient reads its output; y = t @ w2 needs t, not y, so use a
    # graph ending in Tanh.
    tanh = OnnxModule(_tanh_model())
    y = tanh(torch.randn(4, 3, requires_grad=True))
    assert tanh._bridge.gradient_graph("train", [True, True], CPU).save_outputs == [0]
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert graph.save_outputs == []
    out = layer(x)
    out.mul_(2)  # not needed by backward: allowed, as in torch
    out.sum().backward()


def _tanh_model():
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["y"])],
        "tanh",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    return make_model(graph)


def test_default_session_options_share_cores_with_torch():
    layer = OnnxModule(linear_model(3, 2))
    layer(torch.randn(2, 3)).sum().backward()
    with torch.no_grad():
        layer(torch.randn(2, 3))
    graphs = [*layer._bridge._gradient_graphs.values(), *layer._bridge._inference_graphs.values()]
    sessions = [s for g in graphs for s in g.sessions]
    assert len(graphs) == 2
    for session in sessions:
        options = session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert options.intra_op_num_threads == torch.get_num_threads()


def test_session_options_can_be_overridden():
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    layer = OnnxModule(linear_model(3, 2), session_options=options)
    layer(torch.randn(2, 3)).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    for session in graph.sessions:
        used = session.get_session_options()
        assert used.intra_op_num_threads == 1
        assert used.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_input_requiring_grad_that_no_gradient_reaches():
    # y = x * w + Cast(Shape(z)): z only contributes its shape.
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Shape", ["z"], ["s"], start=1),
            helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["xw", "sf"], ["y"]),
        ],
        "shape_only",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [numpy_helper.from_array(np.full(1, 3.0, np.float32), "w")],
    )
    layer = OnnxModule(make_model(graph))
    x = torch.ones(2, 1, requires_grad=True)
    z = torch.ones(2, 1, requires_grad=True)
    y = layer(x, z)
    torch.testing.assert_close(y, torch.full((2, 1), 4.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 1), 3.0))
    assert z.grad is None  # as torch gives for an input that does not reach the loss
