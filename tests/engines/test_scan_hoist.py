"""The onnxruntime engine's Scans: step work reading no state before the loop, products joined."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import scaled_atol
from onnx import TensorProto, helper, numpy_helper
from test_scan_sums import _run

from ortbridge._engines.onnxruntime.passes.scan._hoist import hoisted_step_work
from ortbridge._engines.onnxruntime.passes.scan._products import fused_scan_products
from ortbridge._prepare._onnx_utils import make_model

T, N, K, M = 5, 3, 4, 2
F = TensorProto.FLOAT


def _model(x_direction, y_direction):
    """A Scan with state ``s``: ``g = sigmoid(x_t @ W^T + y_t)`` and ``1 - g``
    read no state (W from outside, 1 a body initializer); ``s_next = s * (1 - g)
    + g``; ``g`` is also a scan output; ``z_t + B`` (z_t of shape (M,), B (N, M))
    reads no state either but cannot be stacked on a new first axis."""
    nodes = [
        helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x_t", "w_t"], ["xw"]),
        helper.make_node("Add", ["xw", "y_t"], ["pre"]),
        helper.make_node("Sigmoid", ["pre"], ["g"]),
        helper.make_node("Sub", ["one", "g"], ["keep"]),
        helper.make_node("Mul", ["s", "keep"], ["kept"]),
        helper.make_node("Add", ["kept", "g"], ["s_next"]),
        helper.make_node("Identity", ["g"], ["g_out"]),
        helper.make_node("Add", ["z_t", "b"], ["zb"]),
        helper.make_node("Mul", ["zb", "s"], ["zs"]),
    ]
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("s", F, [N, M]),
            helper.make_tensor_value_info("x_t", F, [N, K]),
            helper.make_tensor_value_info("y_t", F, [N, M]),
            helper.make_tensor_value_info("z_t", F, [M]),
        ],
        [helper.make_tensor_value_info(n, F, None) for n in ("s_next", "g_out", "zs")],
        [numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one")],
    )
    outputs = ["s_last", "gs", "zss"]
    scan = helper.make_node(
        "Scan", ["s0", "xs", "ys", "zs_in"], outputs, body=body, num_scan_inputs=3,
        scan_input_directions=[x_direction, y_direction, 0],
    )  # fmt: skip
    graph = helper.make_graph(
        [scan],
        "hoist",
        [
            helper.make_tensor_value_info("s0", F, [N, M]),
            helper.make_tensor_value_info("xs", F, [T, N, K]),
            helper.make_tensor_value_info("ys", F, [T, N, M]),
            helper.make_tensor_value_info("zs_in", F, [T, M]),
            helper.make_tensor_value_info("w", F, [M, K]),
            helper.make_tensor_value_info("b", F, [N, M]),
        ],
        [helper.make_tensor_value_info(o, F, None) for o in outputs],
    )
    return make_model(graph)


def _rewritten(build, rewrite, rtol, atol=1e-6):
    """``rewrite`` applied to a model ``build()`` gives; its outputs checked against
    the model's own; the rewritten Scan and its body."""
    model, rewritten = build(), build()
    rewrite(rewritten)
    got, want = _run(rewritten, model)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=scaled_atol(atol, w))
    scan = next(n for n in rewritten.graph.node if n.op_type == "Scan")
    return rewritten, scan, next(a.g for a in scan.attribute if a.name == "body")


@pytest.mark.parametrize(("x_direction", "y_direction"), [(0, 0), (1, 1), (0, 1), (1, 0)])
def test_step_work_that_reads_no_state_runs_once_before_the_loop(x_direction, y_direction):
    """The product with the transposed weight, the gate and ``1 - g`` run on the
    stacked steps (steps stacked in opposite orders: one side reversed); what
    reads the state, returns a value, or would broadcast wrongly stays."""
    rewritten, scan, body = _rewritten(
        lambda: _model(x_direction, y_direction), hoisted_step_work, 1e-6
    )
    inside = sorted(n.op_type for n in body.node)
    assert inside == ["Add", "Add", "Identity", "Mul", "Mul"], inside
    before = [n.op_type for n in rewritten.graph.node[: list(rewritten.graph.node).index(scan)]]
    assert {"Transpose", "MatMul", "Sigmoid", "Sub"} <= set(before), before
    assert before.count("Slice") == (x_direction != y_direction), before
    # x_t and y_t are read by nothing left in the body: no longer scanned
    assert "x_t" not in {i.name for i in body.input} and "y_t" not in {i.name for i in body.input}


def test_a_nested_body_reading_a_moved_value_leaves_the_scan_alone():
    """A value the same at every step that an If's branch reads stays in the body
    (the branch would read a name that moved)."""
    model = _model(0, 0)
    scan = model.graph.node[0]
    body = next(a.g for a in scan.attribute if a.name == "body")
    branch = helper.make_graph(
        [helper.make_node("Identity", ["w_t"], ["w_t_copy"])],
        "branch",
        [],
        [helper.make_tensor_value_info("w_t_copy", F, None)],
    )
    body.node.extend(
        [
            helper.make_node("Constant", [], ["yes"], value=helper.make_tensor("c", 9, [], [1])),
            helper.make_node("If", ["yes"], ["w_again"], then_branch=branch, else_branch=branch),
        ]
    )
    body.output.append(helper.make_tensor_value_info("w_again", F, None))
    scan.output.append("w_agains")
    before = model.SerializeToString()
    hoisted_step_work(model)
    assert model.SerializeToString() == before


def test_a_loop_whose_steps_all_moved_keeps_a_scan_input_for_its_length():
    """Nothing left in the body reads a step: one scan input stays, so the loop
    still runs as many steps."""
    body = helper.make_graph(
        [
            helper.make_node("Sigmoid", ["x_t"], ["g"]),
            helper.make_node("Mul", ["s", "two"], ["s_twice"]),
            helper.make_node("Add", ["s_twice", "g"], ["unused"]),
            helper.make_node("Identity", ["s_twice"], ["s_next"]),
        ],
        "body",
        [helper.make_tensor_value_info(n, F, [N, M]) for n in ("s", "x_t")],
        [helper.make_tensor_value_info("s_next", F, None)],
        [numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    scan = helper.make_node("Scan", ["s0", "xs"], ["s_last"], body=body, num_scan_inputs=1)
    graph = helper.make_graph(
        [scan],
        "length",
        [
            helper.make_tensor_value_info("s0", F, [N, M]),
            helper.make_tensor_value_info("xs", F, [T, N, M]),
        ],
        [helper.make_tensor_value_info("s_last", F, None)],
    )
    _, scan, _ = _rewritten(lambda: make_model(graph), hoisted_step_work, 1e-6, atol=0)
    assert list(scan.input) == ["s0", "xs"], list(scan.input)


def _products_model(read_elsewhere):
    """A Scan over x_t with state h: ``p_i = h @ W_i`` (three products of h), and
    ``h_next = tanh(Sum(a_i @ V_i))`` with ``a_i = p_i * x_t``; with
    ``read_elsewhere`` one ``a_1 @ V_1`` is also a scan output."""
    ws = [f"w{i}" for i in range(3)]
    vs = [f"v{i}" for i in range(3)]
    nodes = []
    for i in range(3):
        nodes += [
            helper.make_node("MatMul", ["h", ws[i]], [f"p{i}"]),
            helper.make_node("Mul", [f"p{i}", "x_t"], [f"a{i}"]),
            helper.make_node("MatMul", [f"a{i}", vs[i]], [f"q{i}"]),
        ]
    nodes += [
        helper.make_node("Sum", ["q0", "q1", "q2"], ["summed"]),
        helper.make_node("Tanh", ["summed"], ["h_next"]),
        helper.make_node("Identity", ["q1" if read_elsewhere else "p0"], ["out"]),
    ]
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("h", F, [N, K]),
            helper.make_tensor_value_info("x_t", F, [N, M]),
        ],
        [helper.make_tensor_value_info(n, F, None) for n in ("h_next", "out")],
    )
    scan = helper.make_node("Scan", ["h0", "xs"], ["h_last", "outs"], body=body, num_scan_inputs=1)
    weights = [helper.make_tensor_value_info(w, F, [K, M]) for w in ws]
    weights += [helper.make_tensor_value_info(v, F, [M, K]) for v in vs]
    graph = helper.make_graph(
        [scan],
        "products",
        [
            helper.make_tensor_value_info("h0", F, [N, K]),
            helper.make_tensor_value_info("xs", F, [T, N, M]),
            *weights,
        ],
        [helper.make_tensor_value_info(o, F, None) for o in ("h_last", "outs")],
    )
    return make_model(graph)


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_products_with_weights_from_outside_are_one_product_per_step(read_elsewhere):
    """Products of one left operand: one product with the weights side by side and
    a Split; a Sum of products: one product of the joined operands with the
    weights stacked, unless one of them is read elsewhere."""
    _, _, body = _rewritten(lambda: _products_model(read_elsewhere), fused_scan_products, 1e-5)
    inside = [n.op_type for n in body.node]
    assert inside.count("Split") == 1, inside
    assert inside.count("MatMul") == (4 if read_elsewhere else 2), inside
    assert ("Sum" in inside) == read_elsewhere, inside
