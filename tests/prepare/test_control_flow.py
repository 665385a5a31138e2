"""If nodes resolved at the call (onnxruntime engine): the branch a call takes is differentiated.

Small graphs reproducing what Silero VAD does: an If on an int input (the
sample rate) choosing between branches with their own weights read from
the outer scope, Ifs on shape tests whose branches disagree on the output
rank, nested Ifs. Gradients against finite differences, for each branch.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import ortbridge
from ortbridge._engines.onnxruntime._resolved import ResolvedGradientGraph
from ortbridge._prepare import _control_flow
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=_init(name + "_v", value))


def _branch(name, nodes, outputs):
    return helper.make_graph(
        nodes, name, [], [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs]
    )


def _weights(rng, *names_shapes):
    return [_init(n, rng.standard_normal(s).astype(np.float32)) for n, s in names_shapes]


def sample_rate_model():
    """y = tanh(x @ w16) if sr == 16000 else x @ w8 + b8 (weights outside the branches)."""
    rng = np.random.default_rng(0)
    then = _branch(
        "then",
        [
            helper.make_node("MatMul", ["x", "w16"], ["t0"]),
            helper.make_node("Tanh", ["t0"], ["t1"]),
        ],
        ["t1"],
    )
    other = _branch(
        "else",
        [
            helper.make_node("MatMul", ["x", "w8"], ["e0"]),
            helper.make_node("Add", ["e0", "b8"], ["e1"]),
        ],
        ["e1"],
    )
    return _on_sample_rate(
        "rate", then, other, 4, _weights(rng, ("w16", (3, 4)), ("w8", (3, 4)), ("b8", (4,)))
    )


def _on_sample_rate(name, then, other, width, weights):
    """A model computing ``then`` if input ``sr`` is 16000, else ``other``, on x (n, 3)."""
    nodes = [
        _const("rate", np.array(16000, np.int64)),
        helper.make_node("Equal", ["sr", "rate"], ["is16"]),
        helper.make_node("If", ["is16"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("x", FLOAT, ["n", 3]),
            helper.make_tensor_value_info("sr", INT64, []),
        ],
        [helper.make_tensor_value_info("y", FLOAT, ["n", width])],
        weights,
    )
    return make_model(graph, opset=17)


def squeeze_model():
    """Silero's decoder: Squeeze axis 1 if it has size 1, else the tensor as it is.

    The branches disagree on the rank, so the If's output rank is unknown
    until a call decides it; a sum makes the output a scalar either way.
    """
    rng = np.random.default_rng(1)
    then = _branch(
        "then",
        [_const("ax", np.array([1], np.int64)), helper.make_node("Squeeze", ["x", "ax"], ["sq"])],
        ["sq"],
    )
    other = _branch("else", [helper.make_node("Identity", ["x"], ["same"])], ["same"])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("one_index", np.array([1], np.int64)),
        helper.make_node("Gather", ["shape", "one_index"], ["k"]),
        _const("one", np.array([1], np.int64)),
        helper.make_node("Equal", ["k", "one"], ["single"]),
        helper.make_node("If", ["single"], ["picked"], then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["picked", "w"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "squeeze",
        [helper.make_tensor_value_info("x", FLOAT, ["n", "k", 3])],
        [helper.make_tensor_value_info("y", FLOAT, [])],
        _weights(rng, ("w", (3, 2))),
    )
    return make_model(graph, opset=17)


def nested_model():
    """An If on sr whose 16 kHz branch holds an If on the batch size (1 or more)."""
    rng = np.random.default_rng(2)
    inner_then = _branch(
        "inner_then", [helper.make_node("Mul", ["x", "scale"], ["single"])], ["single"]
    )
    inner_else = _branch(
        "inner_else", [helper.make_node("Sub", ["x", "shift"], ["many"])], ["many"]
    )
    then = _branch(
        "then",
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            _const("zero", np.array([0], np.int64)),
            helper.make_node("Gather", ["shape", "zero"], ["n"]),
            _const("one", np.array([1], np.int64)),
            helper.make_node("Equal", ["n", "one"], ["lone"]),
            helper.make_node(
                "If", ["lone"], ["inner"], then_branch=inner_then, else_branch=inner_else
            ),
            helper.make_node("Sigmoid", ["inner"], ["t"]),
        ],
        ["t"],
    )
    other = _branch("else", [helper.make_node("Mul", ["x", "w8"], ["e"])], ["e"])
    return _on_sample_rate(
        "nested", then, other, 3, _weights(rng, ("scale", (3,)), ("shift", (3,)), ("w8", (3,)))
    )


def _resolved(layer) -> ResolvedGradientGraph:
    """The gradient graph of the calls with the first input needing a gradient."""
    items = layer._bridge._gradient_graphs.items()
    (graph,) = [g for (_, needs, *_), g in items if needs[0]]
    assert isinstance(graph, ResolvedGradientGraph)
    return graph


def _reference(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString())
    return session.run(None, {k: v.numpy() for k, v in feeds.items()})


@pytest.mark.parametrize("rate", [16000, 8000])
def test_sample_rate_branch_gradients(rate):
    layer = ortbridge.OnnxModule(sample_rate_model(), backend="onnxruntime")
    x = torch.randn(2, 3, requires_grad=True)
    sr = torch.tensor(rate)
    assert ortbridge.gradcheck(layer, x, sr)
    layer(x, sr).sum().backward()
    used, unused = ("w16", "w8") if rate == 16000 else ("w8", "w16")
    assert layer.onnx_weight(used).grad is not None
    # As torch leaves an unused parameter's: the branch not taken gets no gradient.
    assert layer.onnx_weight(unused).grad is None


def test_one_graph_per_resolved_condition():
    layer = ortbridge.OnnxModule(sample_rate_model(), backend="onnxruntime")
    x = torch.randn(2, 3, requires_grad=True)
    for rate in (16000, 8000, 16000, 44100, 8000):
        layer(x, torch.tensor(rate)).sum().backward()
    graphs = _resolved(layer).graphs
    # 8000 and 44100 both take the else branch: one graph for it.
    assert sorted(graphs) == [(("y", False),), (("y", True),)]


def test_eval_output_equals_onnxruntime():
    model = sample_rate_model()
    layer = ortbridge.OnnxModule(model, backend="onnxruntime").eval()
    x = torch.randn(2, 3)
    for rate in (16000, 8000):
        with torch.no_grad():
            out = layer(x, torch.tensor(rate))
        np.testing.assert_allclose(
            out.numpy(), _reference(model, {"x": x, "sr": torch.tensor(rate)})[0], rtol=1e-6
        )
        # And with gradients on: the resolved graph computes the same outputs.
        out = layer(x.clone().requires_grad_(), torch.tensor(rate))
        np.testing.assert_allclose(
            out.detach().numpy(),
            _reference(model, {"x": x, "sr": torch.tensor(rate)})[0],
            rtol=1e-6,
        )


@pytest.mark.parametrize("k", [1, 2])
def test_shape_test_with_undeclared_branch_rank(k):
    # Without the resolution onnx-ad refuses the graph: the If's output rank is unknown.
    layer = ortbridge.OnnxModule(squeeze_model(), backend="onnxruntime")
    x = torch.randn(2, k, 3, requires_grad=True)
    assert ortbridge.gradcheck(layer, x)
    decisions = list(_resolved(layer).graphs)
    assert decisions == [(("picked", k == 1),)]


@pytest.mark.parametrize("rate,n", [(16000, 1), (16000, 2), (8000, 2)])
def test_nested_if(rate, n):
    layer = ortbridge.OnnxModule(nested_model(), backend="onnxruntime")
    x = torch.randn(n, 3, requires_grad=True)
    assert ortbridge.gradcheck(layer, x, torch.tensor(rate))
    layer(x, torch.tensor(rate)).sum().backward()
    reached = {name for name, p in layer.named_onnx_parameters() if p.grad is not None}
    assert reached == ({"scale"} if n == 1 else {"shift"}) if rate == 16000 else {"w8"}
    (decisions,) = _resolved(layer).graphs
    assert len(decisions) == (2 if rate == 16000 else 1)


def test_resolve_keeps_outer_reads_and_makes_names_unique():
    # Two Ifs whose branches define the same names (allowed in sibling subgraphs).
    then = _branch("then", [helper.make_node("Neg", ["x"], ["same"])], ["same"])
    other = _branch("else", [helper.make_node("Abs", ["x"], ["same"])], ["same"])
    nodes = [
        helper.make_node("Equal", ["sr", "sr"], ["c"]),
        helper.make_node("If", ["c"], ["a"], then_branch=then, else_branch=other),
        helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "twice",
        [
            helper.make_tensor_value_info("x", FLOAT, [2]),
            helper.make_tensor_value_info("sr", INT64, []),
        ],
        [helper.make_tensor_value_info("y", FLOAT, [2])],
    )
    model = make_model(graph, opset=17)
    resolved, decisions = _control_flow.resolve(model, None, {"sr": np.array(1, np.int64)})
    assert decisions == (("a", True), ("b", True))
    onnx.checker.check_model(resolved, full_check=True)
    x = np.array([1.0, -2.0], np.float32)
    out = onnxruntime.InferenceSession(resolved.SerializeToString()).run(
        None, {"x": x, "sr": np.array(1)}
    )
    np.testing.assert_array_equal(out[0], -2 * x)


def test_condition_needing_a_gradient_is_left_to_onnx_ad():
    """An If on the sign of a weighted sum stays an If (differentiated through both branches)."""
    rng = np.random.default_rng(3)
    then = _branch("then", [helper.make_node("Mul", ["x", "w"], ["p"])], ["p"])
    other = _branch("else", [helper.make_node("Sub", ["x", "w"], ["q"])], ["q"])
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["xw"]),
        helper.make_node("ReduceSum", ["xw"], ["s"], keepdims=0),
        _const("zero", np.array(0.0, np.float32)),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "signed",
        [helper.make_tensor_value_info("x", FLOAT, [3])],
        [helper.make_tensor_value_info("y", FLOAT, [3])],
        _weights(rng, ("w", (3,))),
    )
    model = make_model(graph, opset=17)
    assert not _control_flow.call_decides(model, [])
    resolved, decisions = _control_flow.resolve(model, {"x": (3,)}, {})
    assert resolved is model and decisions == ()
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    for sign in (1.0, -1.0):
        x = (sign * torch.ones(3) * layer.onnx_weight("w").detach().sign()).requires_grad_()
        assert ortbridge.gradcheck(layer, x)
    assert list(_resolved(layer).graphs) == [()]  # one graph, the If in it


def pad_model(mode, length):
    """x padded by 2 at the start of axis 1 (widths computed from constants), times w."""
    rng = np.random.default_rng(4)
    nodes = [
        _const("half", np.array([0, 1, 0, 0], np.int64)),
        _const("two", np.array(2, np.int64)),
        helper.make_node("Mul", ["half", "two"], ["widths"]),
        helper.make_node("Pad", ["x", "widths"], ["padded"], mode=mode),
        helper.make_node("Mul", ["padded", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pad",
        [helper.make_tensor_value_info("x", FLOAT, ["n", length])],
        [helper.make_tensor_value_info("y", FLOAT, ["n", 7])],
        _weights(rng, ("w", (7,))),
    )
    return make_model(graph, opset=17)


@pytest.mark.parametrize("length", [5, "length"], ids=["static", "dynamic"])
@pytest.mark.parametrize("mode", ["reflect", "edge"])
def test_reflect_and_edge_pad_gradients(mode, length):
    # Silero's STFT reflects 64 samples at the end: onnx-ad refuses such a Pad,
    # rewritten as a Gather per padded axis (indices computed at run time where
    # the axis length is not static).
    model = pad_model(mode, length)
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    x = torch.randn(3, 5, requires_grad=True)
    assert ortbridge.gradcheck(layer, x)
    out = layer(x)
    np.testing.assert_allclose(
        out.detach().numpy(), _reference(model, {"x": x.detach()})[0], rtol=1e-6
    )


def test_reflection_wider_than_the_axis_fails_as_onnxruntime_does():
    model = pad_model("reflect", "length")
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "m"
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    with pytest.raises(ortbridge.OrtBridgeError, match="Gather"):
        layer(torch.randn(3, 2, requires_grad=True))


@pytest.mark.parametrize("k", [1, 3])
def test_condition_shape_inference_cannot_fold(k):
    # The condition reads the length of a Range over a dimension: onnx's shape
    # inference leaves it unknown, onnxruntime computes it on the call's inputs.
    model = squeeze_model()
    graph = model.graph
    old = [n for n in graph.node if n.op_type == "Equal"][0]
    index = list(graph.node).index(old)
    new = [
        _const("start", np.array(0, np.int64)),
        _const("step", np.array(1, np.int64)),
        _const("first", np.array(0, np.int64)),
        helper.make_node("Gather", ["k", "first"], ["k0"]),
        helper.make_node("Range", ["start", "k0", "step"], ["steps"]),
        helper.make_node("Size", ["steps"], ["count"]),
        _const("single_count", np.array(1, np.int64)),
        helper.make_node("Equal", ["count", "single_count"], ["single"]),
    ]
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[:index] + new + nodes[index + 1 :])
    resolved, decisions = _control_flow.resolve(model, {"x": (2, k, 3)}, {})
    assert decisions == ()  # folding alone cannot decide it
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    x = torch.randn(2, k, 3, requires_grad=True)
    assert ortbridge.gradcheck(layer, x)
    assert list(_resolved(layer).graphs) == [(("picked", k == 1),)]


def test_double_backward_through_the_branch_taken():
    layer = ortbridge.OnnxModule(sample_rate_model(), backend="onnxruntime")
    w16, w8, b8 = (layer.onnx_weight(n).detach() for n in ("w16", "w8", "b8"))
    for rate in (16000, 8000):
        x = torch.randn(2, 3, requires_grad=True)
        (g,) = torch.autograd.grad(layer(x, torch.tensor(rate)).pow(2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        xr = x.detach().clone().requires_grad_()
        yr = torch.tanh(xr @ w16) if rate == 16000 else xr @ w8 + b8
        (gr,) = torch.autograd.grad(yr.pow(2).sum(), xr, create_graph=True)
        (ggr,) = torch.autograd.grad(gr.sum(), xr)
        torch.testing.assert_close(g.detach(), gr.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gg, ggr, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rate", [16000, 8000])
def test_auto_backend_trains_weights_read_inside_branches(rate):
    # The training build's builder cannot differentiate branches that read a
    # float tensor from the outer scope (it fails, or kills the process): "auto"
    # runs the onnxruntime engine, and would not fall back to the agent here.
    layer = ortbridge.OnnxModule(sample_rate_model())
    assert layer.backend == "onnxruntime"
    if _ort.has_training():
        from ortbridge import _engines

        assert _engines.fallback("onnxruntime", layer._bridge.model) is None
    x = torch.randn(2, 3, requires_grad=True)
    assert ortbridge.gradcheck(layer, x, torch.tensor(rate))


def loop_model(condition=""):
    """n steps of s = tanh(s * w), each state also stacked; body shapes undeclared.

    Without the unrolling onnx-ad refuses it: the rank of the body's tensors is unknown.
    """
    rng = np.random.default_rng(5)
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["s_in", "w"], ["m"]),
            helper.make_node("Tanh", ["m"], ["s_out"]),
            helper.make_node("Identity", ["c_in"], ["c_out"]),
            helper.make_node("Identity", ["s_out"], ["scanned"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", FLOAT, None),
            helper.make_tensor_value_info("scanned", FLOAT, None),
        ],
    )
    nodes = [
        helper.make_node("Constant", [], ["yes"], value=_init("yes_v", np.array(True))),
        helper.make_node("Loop", ["n", condition, "x"], ["y", "ys"], body=body),
    ]
    graph = helper.make_graph(
        nodes,
        "loop",
        [
            helper.make_tensor_value_info("x", FLOAT, [3]),
            helper.make_tensor_value_info("n", INT64, []),
        ],
        [
            helper.make_tensor_value_info("y", FLOAT, [3]),
            helper.make_tensor_value_info("ys", FLOAT, None),
        ],
        _weights(rng, ("w", (3,))),
    )
    return make_model(graph, opset=17)


@pytest.mark.parametrize("condition", ["", "yes"], ids=["no-condition", "constant-true"])
def test_loop_with_a_trip_count_known_at_the_call_is_unrolled(condition):
    model = loop_model(condition)
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    for steps in (1, 3):
        x = torch.randn(3, requires_grad=True)
        assert ortbridge.gradcheck(layer, x, torch.tensor(steps))
        outs = layer(x, torch.tensor(steps))
        refs = _reference(model, {"x": x.detach(), "n": torch.tensor(steps)})
        for out, ref in zip(outs, refs):
            np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-6)
    assert sorted(_resolved(layer).graphs) == [(("y", 1),), (("y", 3),)]


def test_loop_whose_condition_may_stop_it_is_left_as_it_is():
    model = loop_model()
    body = model.graph.node[1].attribute[0].g
    body.node[2].CopyFrom(helper.make_node("Less", ["i", "i"], ["c_out"]))  # stops after one step
    resolved, decisions = _control_flow.resolve(model, {"x": (3,)}, {"n": np.array(3)})
    assert resolved is model and decisions == ()


@pytest.mark.parametrize("engine", ["auto", "onnxruntime"])
def test_weight_read_inside_a_scan_body_trains_with_torch_gradients(engine):
    """A recurrence written as a Scan whose body reads a weight from outside:
    the weight is a parameter by default and gets torch's gradient."""
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["s_in", "w"], ["sw"]),
            helper.make_node("Add", ["sw", "x_t"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "step",
        [
            helper.make_tensor_value_info("s_in", f, [3]),
            helper.make_tensor_value_info("x_t", f, [3]),
        ],
        [
            helper.make_tensor_value_info("s_out", f, [3]),
            helper.make_tensor_value_info("y_t", f, [3]),
        ],
    )
    w0 = np.array([0.5, -0.8, 1.2], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1)],
        "recurrence",
        [helper.make_tensor_value_info("x", f, [5, 3])],
        [
            helper.make_tensor_value_info("s", f, [3]),
            helper.make_tensor_value_info("ys", f, [5, 3]),
        ],
        [numpy_helper.from_array(w0, "w"), numpy_helper.from_array(np.zeros(3, np.float32), "s0")],
    )
    layer = ortbridge.OnnxModule(make_model(graph, opset=17), backend=engine)
    assert "w" in dict(layer.named_onnx_parameters())
    x = torch.randn(5, 3)
    w = torch.tensor(w0, requires_grad=True)
    s, ys = torch.zeros(3), []
    for t in range(5):
        s = torch.tanh(s * w + x[t])
        ys.append(s)
    (s.sum() + torch.stack(ys).square().sum()).backward()
    out_s, out_ys = layer(x)
    (out_s.sum() + out_ys.square().sum()).backward()
    torch.testing.assert_close(layer.onnx_weight("w").grad, w.grad, rtol=1e-4, atol=1e-5)
