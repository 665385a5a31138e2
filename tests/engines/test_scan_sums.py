"""The onnxruntime engine's backward Scans: weight gradients summed once after the loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ENGINES, export
from onnx import TensorProto, helper, numpy_helper
from test_engine_onnxruntime import _compare, _export_torchscript, _Recurrent
from torch import nn

from ortbridge import OnnxModule
from ortbridge._engines.onnxruntime.passes.scan._sums import hoisted_scan_sums
from ortbridge._prepare._onnx_utils import make_model

ORT = "onnxruntime"
T, N, K, M = 4, 3, 2, 5
F = TensorProto.FLOAT


def _scan_model(
    x_direction=0, left="x", step_returned=False, state_read=False, g_scanned=False, term="product"
):
    """A Scan whose state ``s`` sums ``X_t^T G_t`` over the steps; ``z`` carries
    ``G_t = tanh(y_t + z)``.

    ``term``: "product" (``X_t^T G_t``, s of shape (K, M)) or "reduced" (the
    sum of ``G_t``'s rows, ``ReduceSum`` keepdims=0, s of shape (M,));
    ``left``: "x" (X_t the scan input) or "sin" (a value computed from it);
    ``step_returned``: the stacked operand is a scan output already;
    ``state_read``: ``s`` is also read by another node (a scan output);
    ``g_scanned``: G_t is a scan input itself, stacked in the other order from X.
    """
    nodes = []
    if g_scanned:
        g_up = "y_t"
        nodes.append(helper.make_node("Identity", ["z"], ["z_next"]))
    else:
        nodes += [
            helper.make_node("Add", ["y_t", "z"], ["yz"]),
            helper.make_node("Tanh", ["yz"], ["g"]),
            helper.make_node("Identity", ["g"], ["z_next"]),
            helper.make_node("Unsqueeze", ["g", "zero_axis"], ["g_up"]),
        ]
        g_up = "g_up"
    x = "x_t"
    if left == "sin":
        nodes.append(helper.make_node("Sin", ["x_t"], ["x_sin"]))
        x = "x_sin"
    if term == "product":
        nodes += [
            helper.make_node("Transpose", [x], ["x_tr"], perm=[1, 0]),
            helper.make_node("MatMul", ["x_tr", g_up], ["p"]),
            helper.make_node("Reshape", ["p", "km"], ["p_km"]),
        ]
    else:
        nodes.append(helper.make_node("ReduceSum", [g_up, "rows"], ["p_km"], keepdims=0))
    nodes += [
        helper.make_node("Add", ["s", "p_km"], ["s_sum"]),
        helper.make_node("Identity", ["s_sum"], ["s_next"]),
    ]
    s_shape = [K, M] if term == "product" else [M]
    outputs = [g_up] if step_returned else []
    if state_read:
        nodes.append(helper.make_node("Identity", ["s"], ["s_seen"]))
        outputs.append("s_seen")
    g_shape = [1, N, M]
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("s", F, s_shape),
            helper.make_tensor_value_info("z", F, [N, M]),
            helper.make_tensor_value_info("x_t", F, [N, K]),
            helper.make_tensor_value_info("y_t", F, g_shape if g_scanned else [N, M]),
        ],
        [
            helper.make_tensor_value_info("s_next", F, s_shape),
            helper.make_tensor_value_info("z_next", F, [N, M]),
            *[helper.make_tensor_value_info(o, F, None) for o in outputs],
        ],
        [
            numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
            numpy_helper.from_array(np.array([K, M], np.int64), "km"),
            numpy_helper.from_array(np.array([0, 1], np.int64), "rows"),
        ],
    )
    scan_outputs = ["s_last", "z_last"] + [f"stacked_{i}" for i in range(len(outputs))]
    y_direction = 1 - x_direction if g_scanned else 0
    scan = helper.make_node(
        "Scan",
        ["s0", "z0", "xs", "ys"],
        scan_outputs,
        body=body,
        num_scan_inputs=2,
        scan_input_directions=[x_direction, y_direction],
    )
    graph = helper.make_graph(
        [scan],
        "scan_sums",
        [
            helper.make_tensor_value_info("s0", F, s_shape),
            helper.make_tensor_value_info("z0", F, [N, M]),
            helper.make_tensor_value_info("xs", F, [T, N, K]),
            helper.make_tensor_value_info("ys", F, [T, *(g_shape if g_scanned else [N, M])]),
        ],
        [helper.make_tensor_value_info(o, F, None) for o in scan_outputs],
    )
    return make_model(graph)


def _run(*models) -> list:
    """Each model's outputs from onnxruntime, on the same random inputs."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
        for i in models[0].graph.input
    }
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    runs = []
    for m in models:
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        runs.append(session.run(None, feeds))
    return runs


@pytest.mark.parametrize(
    "case, hoisted",
    [
        (dict(), True),
        (dict(x_direction=1), True),  # X stacked in reverse: G's steps too
        (dict(left="sin"), True),  # X computed in the body: returned by it
        (dict(step_returned=True), True),  # G_t returned already: a copy returned
        (dict(term="reduced"), True),
        (dict(term="reduced", x_direction=1, step_returned=True), True),
        (dict(x_direction=1, state_read=True), False),
        (dict(x_direction=1, g_scanned=True), False),  # steps that would not pair up
    ],
)
def test_scan_state_summing_step_products_is_one_product_after_the_loop(case, hoisted):
    """The sum is taken once after the Scan where each step's term can be
    stacked in the same order; the Scan's outputs are the same."""
    model, rewritten = _scan_model(**case), _scan_model(**case)
    hoisted_scan_sums(rewritten)
    for got, want in zip(*_run(rewritten, model)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    scan = next(n for n in rewritten.graph.node if n.op_type == "Scan")
    states = len(scan.input) - 2
    assert states == (1 if hoisted else 2), states


def _rnn_weight_gradients(model, layer, x):
    """An RNN's gradients against torch's: TorchScript writes an ONNX ``RNN``
    node, its weights stacked per direction, the two biases as one."""
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for net, xi in zip((model, layer), xs):
        sum((o**2).sum() for o in net(xi)).backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-5)
    rnn = model.rnn
    want = [
        rnn.weight_ih_l0.grad[None],
        rnn.weight_hh_l0.grad[None],
        torch.cat([rnn.bias_ih_l0.grad, rnn.bias_hh_l0.grad])[None],
    ]
    got = [p.grad for _, p in layer.named_onnx_parameters()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")
@pytest.mark.parametrize(
    "rnn, states",
    [
        (lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True), 2),
        (lambda: nn.GRU(3, 4, batch_first=True), 1),
        (lambda: nn.RNN(3, 4, batch_first=True), 1),
    ],
    ids=["lstm-bidirectional-2-layers", "gru", "rnn"],
)
def test_recurrent_weight_gradients_are_not_loop_states(rnn, states):
    """The backward Scan of a recurrent layer carries only the adjoints of its
    recurrent state (h, and c for an LSTM); gradients as torch's. (The dynamo
    exporter unrolls an ``nn.RNN``: its ``RNN`` node comes from TorchScript.)"""
    torch.manual_seed(0)
    model = _Recurrent(rnn())
    x = torch.randn(2, 5, 3)
    if isinstance(model.rnn, nn.RNN):
        layer = OnnxModule(_export_torchscript(model, x), backend=ORT)
        _rnn_weight_gradients(model, layer, x)
    else:
        layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
        _compare(model, layer, x)
    needs = [True] * (1 + len(list(layer.named_onnx_parameters())))
    graph = layer._bridge.gradient_graph("train", needs, x.device, [x])
    backward = graph.static_built([x]).split.backward.graph
    scans = [n for n in backward.node if n.op_type == "Scan"]
    assert scans
    for scan in scans:
        n_scan_in = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
        assert len(scan.input) - n_scan_in == states, scan.input


def _seeded_scan_model(broken=None):
    """A Scan carrying an adjoint ``a`` (N, M, 1) with a trailing unit (seed)
    axis: each step multiplies it by a primal value given that axis
    (Unsqueeze), adds a per-step adjoint, and takes a product with the axis
    moved to the front and back (Transposes) and a no-op Expand.

    ``broken``: "broadcast" (an operand broadcasts along the unit axis) or
    "op" (a node the rewrite does not follow reads an adjoint).
    """
    nodes = [
        helper.make_node("Unsqueeze", ["p_t", "last"], ["p_up"]),
        helper.make_node("Mul", ["a", "p_up"], ["ap"]),
        helper.make_node("Sum", ["ap", "g_t", "half"], ["s"]),
        helper.make_node("Transpose", ["s"], ["front"], perm=[2, 0, 1]),
        helper.make_node("MatMul", ["front", "w"], ["q"]),
        helper.make_node("Transpose", ["q"], ["back"], perm=[1, 2, 0]),
        helper.make_node("Tanh", ["back"], ["a_next"]),
        helper.make_node("Expand", ["a_next", "ones"], ["full"]),
        helper.make_node("Identity", ["full"], ["out_t"]),
    ]
    if broken == "broadcast":
        nodes.append(helper.make_node("Add", ["a", "row"], ["wide"]))
    elif broken == "op":
        nodes.append(helper.make_node("Softmax", ["a"], ["wide"], axis=0))
    extra = [helper.make_tensor_value_info("wide", F, None)] if broken else []
    row = [numpy_helper.from_array(np.linspace(-1, 1, M).astype(np.float32), "row")]
    row = row if broken == "broadcast" else []
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("a", F, [N, M, 1]),
            helper.make_tensor_value_info("p_t", F, [N, M]),
            helper.make_tensor_value_info("g_t", F, [N, M, 1]),
        ],
        [
            helper.make_tensor_value_info("a_next", F, [N, M, 1]),
            helper.make_tensor_value_info("out_t", F, [N, M, 1]),
            *extra,
        ],
        [
            numpy_helper.from_array(np.array([2], np.int64), "last"),
            numpy_helper.from_array(np.array([1, 1, 1], np.int64), "ones"),
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            *row,
        ],
    )
    outputs = ["a_last", "outs"] + (["wides"] if broken else [])
    scan = helper.make_node(
        "Scan", ["a0", "ps", "gs"], outputs, body=body, num_scan_inputs=2,
        scan_input_directions=[1, 0],
    )  # fmt: skip
    graph = helper.make_graph(
        [scan],
        "seeded",
        [
            helper.make_tensor_value_info("a0", F, [N, M, 1]),
            helper.make_tensor_value_info("ps", F, [T, N, M]),
            helper.make_tensor_value_info("gs", F, [T, N, M, 1]),
        ],
        [helper.make_tensor_value_info(o, F, None) for o in outputs],
        [numpy_helper.from_array(np.eye(M, dtype=np.float32)[::-1] * 0.7, "w")],
    )
    return make_model(graph)


@pytest.mark.parametrize("broken", [None, "broadcast", "op"])
def test_scan_body_adjoints_lose_the_unit_seed_axis(broken):
    """The adjoints' unit axis is squeezed before the Scan and restored after:
    inside, no Unsqueeze and no Transpose is left; the outputs are the same.
    A body where a node cannot follow is left as it was."""
    from ortbridge._engines.onnxruntime.passes.scan._seed_axis import (
        scan_bodies_without_seed_axis,
    )

    model, rewritten = _seeded_scan_model(broken), _seeded_scan_model(broken)
    scan_bodies_without_seed_axis(rewritten)
    for got, want in zip(*_run(rewritten, model)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    scan = next(n for n in rewritten.graph.node if n.op_type == "Scan")
    body = next(a.g for a in scan.attribute if a.name == "body")
    ops = [n.op_type for n in body.node]
    if broken:
        assert rewritten.graph == model.graph
    else:
        assert "Unsqueeze" not in ops and "Transpose" not in ops, ops
        assert len(body.input[0].type.tensor_type.shape.dim) == 2


def _repeated_outputs_model(direction):
    """A Scan whose body returns ``v = tanh(x_t + s)`` as its next state, as two
    scan outputs (the second stacked in ``direction``) and ``x_t`` as it came,
    each through an Identity."""
    nodes = [
        helper.make_node("Add", ["x_t", "s"], ["xs"]),
        helper.make_node("Tanh", ["xs"], ["v"]),
        helper.make_node("Identity", ["v"], ["v_copy"]),
        helper.make_node("Identity", ["v_copy"], ["s_next"]),
        helper.make_node("Identity", ["v"], ["out_1"]),
        helper.make_node("Identity", ["v"], ["out_2"]),
        helper.make_node("Identity", ["x_t"], ["out_3"]),
    ]
    body = helper.make_graph(
        nodes,
        "body",
        [helper.make_tensor_value_info(n, F, [N, M]) for n in ("s", "x_t")],
        [helper.make_tensor_value_info(n, F, None) for n in ("s_next", "out_1", "out_2", "out_3")],
    )
    outputs = ["s_last", "outs_1", "outs_2", "outs_3"]
    scan = helper.make_node(
        "Scan", ["s0", "xs_in"], outputs, body=body, num_scan_inputs=1,
        scan_output_directions=[0, direction, 0],
    )  # fmt: skip
    graph = helper.make_graph(
        [scan],
        "repeats",
        [
            helper.make_tensor_value_info("s0", F, [N, M]),
            helper.make_tensor_value_info("xs_in", F, [T, N, M]),
        ],
        [helper.make_tensor_value_info(o, F, None) for o in outputs],
    )
    return make_model(graph)


@pytest.mark.parametrize("direction", [0, 1])
def test_scan_body_returns_each_value_once_without_identities(direction):
    """A repeated scan output goes (reversed after the loop where it was stacked
    in the other order); an output that is an Identity of a computed value
    names that value. An input passed through keeps its Identity."""
    from ortbridge._engines.onnxruntime.passes.scan._outputs import (
        scan_outputs_without_copies,
    )

    model, rewritten = _repeated_outputs_model(direction), _repeated_outputs_model(direction)
    scan_outputs_without_copies(rewritten)
    got, want = _run(rewritten, model)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    scan = next(n for n in rewritten.graph.node if n.op_type == "Scan")
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert len(scan.output) == 3
    assert sorted(n.op_type for n in body.node) == ["Add", "Identity", "Identity", "Tanh"]
    assert next(n for n in body.node if n.op_type == "Tanh").output[0] == "s_next"
