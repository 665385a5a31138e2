"""The onnxruntime engine's optimiser: one contract, one ordered list of passes."""

from __future__ import annotations

import pytest

from ortbridge._engines.onnxruntime import passes
from ortbridge._engines.onnxruntime.passes import _pipeline


def _recording(monkeypatch, fail=None):
    calls = []

    def make(one):
        def call(graphs):
            calls.append(one.name)
            if one.name == fail:
                raise ValueError("broken")

        return passes.Pass(one.name, one.stage, one.static, call)

    monkeypatch.setattr(_pipeline, "PASSES", tuple(make(one) for one in passes.PASSES))
    return calls


def test_a_stage_runs_its_passes_in_the_lists_order(monkeypatch):
    calls = _recording(monkeypatch)
    for stage in (passes.PRIMAL, passes.REVERSE, passes.BACKWARD):
        passes.run(stage, passes.Graphs(), static=True)
    assert calls == [one.name for one in passes.PASSES]


def test_shape_generic_graphs_get_only_the_passes_that_need_no_static_shapes(monkeypatch):
    calls = _recording(monkeypatch)
    for stage in (passes.PRIMAL, passes.REVERSE, passes.BACKWARD):
        passes.run(stage, passes.Graphs(), static=False)
    assert calls == [one.name for one in passes.PASSES if not one.static]
    assert calls  # folding and the fused activations run on every graph


def test_an_error_names_the_pass_it_came_from(monkeypatch):
    name = next(one.name for one in passes.PASSES if one.stage == passes.BACKWARD)
    _recording(monkeypatch, fail=name)
    with pytest.raises(ValueError, match="broken") as info:
        passes.run(passes.BACKWARD, passes.Graphs(), static=True)
    assert f"optimiser pass {name!r}" in "".join(info.value.__notes__)


def test_every_pass_has_a_known_stage_and_a_unique_name():
    names = [one.name for one in passes.PASSES]
    assert len(set(names)) == len(names)
    assert {one.stage for one in passes.PASSES} <= {passes.PRIMAL, passes.REVERSE, passes.BACKWARD}
    # The view collapsing runs after every pass that leaves views behind.
    backward = [one.name for one in passes.PASSES if one.stage == passes.BACKWARD]
    collapsed = backward.index("unit axes out of transposes, views collapsed")
    assert collapsed > backward.index("Scan outputs without copies")


def test_view_simplification_infers_shapes_once(monkeypatch):
    """The view rounds share one shape inference (each round keeps the names and
    shapes of what it rewrites and records those it adds), and change no value."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from ortbridge._engines.onnxruntime.passes import _simplify

    # y = ((x viewed with a unit axis) * (w viewed with one)), summed, viewed back.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])
    shape = numpy_helper.from_array(np.array([4, 3, 1], np.int64), "shape")
    back = numpy_helper.from_array(np.array([4, 3], np.int64), "back")
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["xv"]),
        helper.make_node("Reshape", ["w", "shape"], ["wv"]),
        helper.make_node("Mul", ["xv", "wv"], ["p"]),
        helper.make_node("Add", ["p", "xv"], ["q"]),
        helper.make_node("Reshape", ["q", "back"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "views", [x], [y], [shape, back, w]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    feed = {"x": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)}
    want = ReferenceEvaluator(model).run(None, feed)[0]
    calls = []
    original = _simplify._inferred
    monkeypatch.setattr(_simplify, "_inferred", lambda m: calls.append(1) or original(m))
    simplified = onnx.ModelProto()
    simplified.CopyFrom(model)
    _simplify.simplify(simplified)
    assert len(calls) == 1
    assert [n.op_type for n in simplified.graph.node].count("Reshape") < 3
    np.testing.assert_array_equal(ReferenceEvaluator(simplified).run(None, feed)[0], want)


def test_a_slice_that_crops_nothing_is_a_view_and_a_reversing_one_is_not():
    """onnx-ad crops a weight gradient to the kernel's size, which it often has
    already: that Slice joins the chain of views around it (one Reshape)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from ortbridge._engines.onnxruntime.passes import _simplify

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "r")]
    consts = {
        "starts": [0], "ends": [3], "axes": [1], "last": [-1], "before": [-(2**62)],
        "back": [-1], "unit": [2, 3, 1], "flat": [3, 2],
    }  # fmt: skip
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    nodes = [
        helper.make_node("Reshape", ["x", "unit"], ["xu"]),
        helper.make_node("Slice", ["xu", "starts", "ends", "axes"], ["whole"]),
        helper.make_node("Reshape", ["whole", "flat"], ["y"]),
        helper.make_node("Slice", ["x", "last", "before", "axes", "back"], ["r"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "crops", [x], outs, inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    want = ReferenceEvaluator(model).run(None, feed)
    _simplify.simplify(model)
    ops = [n.op_type for n in model.graph.node if n.op_type != "Constant"]
    assert ops.count("Slice") == 1 and ops.count("Reshape") == 1, ops
    for got, expected in zip(ReferenceEvaluator(model).run(None, feed), want):
        np.testing.assert_array_equal(got, expected)


def test_a_reduction_whose_views_drop_its_kept_axes_drops_them_itself():
    """A BatchNorm's weight gradient: summed over (N, H, W) keeping the axes,
    then viewed as (C,) and as onnx-ad's (C, 1): the sum writes (C,), the
    other view reads it; one node less, the same values."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from ortbridge._engines.onnxruntime.passes import _optimize, _reductions

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("c", "col")]
    consts = {"axes": [0, 2], "flat": [3], "column": [3, 1]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
        helper.make_node("Reshape", ["s", "column"], ["col"]),
        helper.make_node("Reshape", ["s", "flat"], ["c"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "sums", [x], outs, inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    feed = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
    want = ReferenceEvaluator(model).run(None, feed)
    _reductions.reductions_dropping_axes(model, _optimize.facts(model))
    assert [n.op_type for n in model.graph.node] == ["ReduceSum", "Reshape"]
    for got, expected in zip(ReferenceEvaluator(model).run(None, feed), want):
        np.testing.assert_array_equal(got, expected)


def _viewed_product(reader: str):
    """x, w (4, 3) viewed with a unit axis and multiplied (a product lifting makes
    a view), that view read by ``reader`` ("Tanh": a computing op; "Squeeze":
    a view whose axes are an input, so no shape inference sees its shape)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = numpy_helper.from_array(np.array([4, 3, 1], np.int64), "shape")
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    read = helper.make_node(reader, ["p"] + (["axes"] if reader == "Squeeze" else []), ["y"])
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["xv"]),
        helper.make_node("Reshape", ["w", "shape"], ["wv"]),
        helper.make_node("Mul", ["xv", "wv"], ["p"]),
        read,
    ]
    return helper.make_model(
        helper.make_graph(nodes, "views", [x, axes], [y], [shape, w]),
        opset_imports=[helper.make_opsetid("", 17)],
    )


@pytest.mark.parametrize("reader, rounds", [("Tanh", 1), ("Squeeze", 2)])
def test_view_lifting_runs_again_only_where_a_new_view_is_read_through_another_view(
    monkeypatch, reader, rounds
):
    """Lifting sees through Reshapes and Identities, each lifted node before its
    readers: a second round can find more only where a new view is read
    through a view it does not see through (collapsed into a Reshape in
    between). The rounds counted; the values unchanged."""
    import numpy as np
    from onnx.reference import ReferenceEvaluator

    from ortbridge._engines.onnxruntime.passes import _simplify

    model = _viewed_product(reader)
    feed = {"x": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)}
    if reader == "Squeeze":
        feed["axes"] = np.array([2], np.int64)
    want = ReferenceEvaluator(model).run(None, feed)[0]
    calls = []
    original = _simplify._lift_views
    monkeypatch.setattr(_simplify, "_lift_views", lambda m, s: calls.append(1) or original(m, s))
    _simplify.simplify(model)
    assert len(calls) == rounds
    assert "Mul" in [n.op_type for n in model.graph.node]
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, feed)[0], want, rtol=1e-6)


def test_handed_over_facts_equal_a_whole_inference(monkeypatch):
    """The passes that read the facts the pass before them read (the norms
    after the view simplification; the known-shape forms after the view
    collapse, extended by the nodes added since) see what a whole inference
    of the graph as it is gives: a small transformer block (LayerNorm, GELU,
    attention products) built on the onnxruntime engine."""
    import torch
    from conftest import ENGINES, export
    from torch import nn

    from ortbridge import OnnxModule
    from ortbridge._engines.onnxruntime.passes import _optimize

    if "onnxruntime" not in ENGINES:
        pytest.skip("onnx-ad is not installed")
    compared = []

    def reverse_checked(original):
        def call(g):
            shapes, types = g.reverse_shapes
            whole = _optimize.facts(g.reverse)
            for name, node in whole.producer.items():
                # Its own shape constants' shapes, and added tensors' types, it does not hand over.
                if node.op_type != "Constant" and name in whole.shapes:
                    assert shapes.get(name) == whole.shapes[name], name
                if name in types:
                    assert types[name] == whole.types.get(name), name
            norms = [n for n in g.reverse.graph.node if n.op_type == "LayerNormalization"]
            assert norms and all(n.input[0] in types for n in norms)
            compared.append("reverse")
            return original(g)

        return call

    def backward_checked(original):
        def call(g):
            found = _pipeline._current_facts(g)
            whole = _optimize.facts(g.backward)
            for name in whole.producer:
                assert found.shapes.get(name) == whole.shapes.get(name), name
                assert found.types.get(name) == whole.types.get(name), name
            assert found.producer.keys() == whole.producer.keys()
            assert found.readers == whole.readers
            assert found.taken >= set(whole.taken)
            compared.append("backward")
            return original(g)  # its own facts: the hand-over was taken above

        return call

    wrapped = []
    for one in passes.PASSES:
        if one.call is _pipeline._known_shape_forms:
            one = passes.Pass(one.name, one.stage, one.static, backward_checked(one.call))
        elif one.name == "norms' backward reads forward statistics":
            one = passes.Pass(one.name, one.stage, one.static, reverse_checked(one.call))
        wrapped.append(one)
    monkeypatch.setattr(_pipeline, "PASSES", tuple(wrapped))
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(4, 5, 16)
    layer = OnnxModule(export(block, (x,)), backend="onnxruntime")
    layer(x).sum().backward()
    assert compared == ["reverse", "backward"]


@pytest.mark.parametrize("x_shape, vector", [((6, 4), True), ((2, 6, 4), False)])
def test_a_row_of_ones_times_a_matrix_becomes_a_vector_product_only_for_a_matrix(x_shape, vector):
    """``ones (1, R) @ X`` viewed as one vector is ``ones (R,) @ X`` where ``X`` is
    ``(R, C)``; a batched ``X (B, R, C)`` keeps its product and the view (the
    vector product would be ``(B, C)``, not the view's one axis)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes._reductions import reductions_dropping_axes
    from ortbridge._prepare._onnx_utils import make_model

    ones = numpy_helper.from_array(np.ones((1, 6), np.float32))
    nodes = [
        helper.make_node("Constant", [], ["ones"], value=ones),
        helper.make_node("MatMul", ["ones", "x"], ["sum"]),
        helper.make_node("Constant", [], ["flat"], value=numpy_helper.from_array(np.array([-1]))),
        helper.make_node("Reshape", ["sum", "flat"], ["y"]),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    model = make_model(helper.make_graph(nodes, "g", [x], [out]))
    reductions_dropping_axes(model, facts(model))
    ops = [n.op_type for n in model.graph.node]
    assert ("Reshape" not in ops) == vector, ops
    product = next(n for n in model.graph.node if n.op_type == "MatMul")
    assert (product.output[0] == "y") == vector


def _run(model, feeds) -> list:
    """``model``'s outputs on ``feeds`` in plain onnxruntime (CPU)."""
    from ortbridge._runtime._ort import runtime

    cpu = ["CPUExecutionProvider"]
    return runtime().InferenceSession(model.SerializeToString(), providers=cpu).run(None, feeds)


def _seeded_backward():
    """A graph in the form onnx-ad's reverse writes, with every form the seed
    axis's removal reads: seeds and primal values given a unit axis last, an
    elementwise chain, a transpose, reductions keeping and dropping axes, a
    product of a stack with the unit axis first, a unit row as a vector, a
    transposed matrix by a unit column (kept), and readers that need the axis
    (a Concat, a Softmax, graph outputs)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from ortbridge._prepare._onnx_utils import make_model

    def const(name, value, dtype=np.int64):
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype), name)
        )

    nodes = [
        const("s4", [2, 3, 4, 1]), const("s31", [3, 1, 1]), const("first", [1, 2, 3, 4]),
        const("back", [2, 3, 5, 1]), const("col", [3, 1]), const("row", [1, 3]),
        const("ax1", [1]), const("ax13", [1, 3]), const("ones", np.ones((1, 1)), np.float32),
        const("s11", [1, 1]),
        helper.make_node("Reshape", ["adj", "s4"], ["seed"]),
        helper.make_node("Reshape", ["p", "s4"], ["p_unit"]),
        helper.make_node("Reshape", ["v", "s31"], ["v_unit"]),  # a reshape either way
        helper.make_node("Mul", ["seed", "p_unit"], ["m"]),
        helper.make_node("Mul", ["m", "v_unit"], ["m2"]),
        helper.make_node("Add", ["m2", "ones"], ["m3"]),
        helper.make_node("Erf", ["m3"], ["e"]),
        helper.make_node("Transpose", ["e"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("ReduceSum", ["t", "ax1"], ["kept"], keepdims=1),
        helper.make_node("ReduceSum", ["t", "ax1"], ["dropped"], keepdims=0),
        helper.make_node("ReduceSum", ["t", "ax13"], ["plain"], keepdims=0),
        helper.make_node("Reshape", ["m3", "first"], ["stack"]),
        helper.make_node("MatMul", ["stack", "w"], ["prod"]),
        helper.make_node("Reshape", ["prod", "back"], ["prod_back"]),
        helper.make_node("Reshape", ["adj2", "col"], ["column"]),
        helper.make_node("Transpose", ["qt"], ["q"], perm=[1, 0]),
        helper.make_node("MatMul", ["q", "column"], ["by_column"]),  # kept: see the pass
        helper.make_node("Reshape", ["adj2", "row"], ["unit_row"]),
        helper.make_node("MatMul", ["unit_row", "q2"], ["by_row"]),
        helper.make_node("Concat", ["m2", "m2"], ["both"], axis=0),
        helper.make_node("Softmax", ["prod_back"], ["soft"], axis=2),
        # An all-ones operand whose twin lacks its first axis: read as it was.
        helper.make_node("Reshape", ["adj3", "s11"], ["one_unit"]),
        helper.make_node("Transpose", ["one_unit"], ["one_t"], perm=[1, 0]),
        helper.make_node("Mul", ["m", "one_t"], ["m_one"]),
    ]  # fmt: skip
    shapes = {"adj": [2, 3, 4], "p": [2, 3, 4], "v": [3], "w": [4, 5], "adj2": [3]}
    shapes.update({"qt": [3, 5], "q2": [3, 4], "adj3": [1]})
    outputs = ["kept", "dropped", "plain", "by_column", "by_row", "both", "soft", "m_one"]
    graph = helper.make_graph(
        nodes,
        "seeded",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    return make_model(graph), feeds


def test_the_seed_axis_goes_from_every_form_and_the_values_stay():
    """Each adjoint read without its unit axis: the seeds' and primal values'
    unsqueezes go, the chain computes on the squeezed tensors, and a reader
    that needs the axis (a Concat, a Softmax on the product, the graph's
    outputs) reads it made again by one view; every output as before."""
    import numpy as np

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes.unit_axes._seed import without_seed_axis

    model, feeds = _seeded_backward()

    before = _run(model, feeds)
    without_seed_axis(model, facts(model))
    after = _run(model, feeds)
    for name, a, b in zip([o.name for o in model.graph.output], before, after):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max(), err_msg=name)
    nodes = {n.output[0]: n for n in model.graph.node}
    read = {name for n in model.graph.node for name in n.input}
    # The seeds', the primal values' and the stack's unit axes are read nowhere.
    assert not read & {"seed", "p_unit", "stack", "prod", "unit_row", "m", "e", "t"}
    # The computing nodes read the squeezed tensors: the inputs themselves.
    assert any(n.op_type == "Mul" and n.input[:2] == ["adj", "p"] for n in model.graph.node)
    assert any(n.op_type == "MatMul" and n.input[:2] == ["adj2", "q2"] for n in model.graph.node)
    # What needs the axis reads it made again, by one Reshape each.
    for name in ("m2", "kept", "dropped", "prod_back", "by_row", "column"):
        assert nodes[name].op_type == "Reshape", name
    # A matrix times a unit column stays a product by the column: onnxruntime's
    # fused transposed product by a vector is wrong (the Transpose above it).
    assert nodes["by_column"].op_type == "MatMul" and nodes["by_column"].input[1] == "column"
    # The reduction over the unit axis and another writes its plain output itself.
    assert nodes["plain"].op_type == "ReduceSum"
    assert nodes["plain"].input[0] != "t"


def test_a_transpose_of_a_transpose_is_one_and_undoing_ones_are_none():
    """Two Transposes through an Identity compose into one; a pair that undoes
    itself (a weight gradient's, transposed back) leaves an Identity, and one
    permuting unit axes only is no transpose; the values stay."""
    import numpy as np
    from onnx import TensorProto, helper

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes.unit_axes._transposes import composed_transposes
    from ortbridge._prepare._onnx_utils import make_model

    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0, 2, 3]),
        helper.make_node("Identity", ["a"], ["b"]),
        helper.make_node("Transpose", ["b"], ["undone"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["b"], ["moved"], perm=[2, 0, 3, 1]),
        helper.make_node("Transpose", ["u"], ["c"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["c"], ["units"], perm=[1, 0, 3, 2]),
        helper.make_node("Relu", ["units"], ["read"]),  # a graph output's Transpose stays
    ]
    shapes = {"x": [2, 3, 4, 5], "u": [6, 2, 1, 1]}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("undone", "moved", "read")
        ],
    )
    model = make_model(graph)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}

    before = _run(model, feeds)
    composed_transposes(model, facts(model).shapes)
    for a, b in zip(before, _run(model, feeds)):
        np.testing.assert_array_equal(a, b)
    by_output = {n.output[0]: n for n in model.graph.node}
    assert by_output["undone"].op_type == "Identity" and by_output["undone"].input[0] == "x"
    assert by_output["moved"].op_type == "Transpose" and by_output["moved"].input[0] == "x"
    assert by_output["units"].op_type in ("Identity", "Reshape")
    assert by_output["units"].input[0] == "u"


@pytest.mark.parametrize("opset", [17, 18])
def test_a_softmax_over_an_inner_axis_runs_as_its_reductions(opset):
    """onnxruntime's Softmax and LogSoftmax over an axis other than the last
    transpose around their kernel: the forward graph computes them as a max,
    an exp and a sum instead (the last axis keeps the kernel); the values
    stay, at both spellings of ReduceMax's axes."""
    import numpy as np
    from onnx import TensorProto, helper

    from ortbridge._engines.onnxruntime.passes._softmax_axes import softmax_reductions
    from ortbridge._prepare._onnx_utils import make_model

    nodes = [
        helper.make_node("Softmax", ["x"], ["inner"], axis=1),
        helper.make_node("LogSoftmax", ["x"], ["log_inner"], axis=-2),
        helper.make_node("Softmax", ["x"], ["last"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 3, 5])],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("inner", "log_inner", "last")
        ],
    )
    model = make_model(graph, opset=opset)
    x = {"x": np.random.default_rng(0).standard_normal((2, 16, 3, 5)).astype(np.float32) * 4}

    before = _run(model, x)
    shapes = {}
    softmax_reductions(model, shapes)
    for a, b in zip(before, _run(model, x)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softmax") == 1 and "LogSoftmax" not in ops  # the last axis kept
    assert ops.count("ReduceMax") == 2 and ops.count("Exp") == 2
    assert all(len(shapes[n.output[0]]) == 4 for n in model.graph.node if n.op_type == "Exp")


def test_a_model_with_an_inner_softmax_trains_as_torch():
    """End to end (YOLOv8's DFL form: a softmax over the channels): no Softmax
    node runs in the forward graph, and outputs and gradients are torch's."""
    import torch
    from conftest import ENGINES, export
    from torch import nn

    from ortbridge import OnnxModule

    if "onnxruntime" not in ENGINES:
        pytest.skip("onnx-ad is not installed")

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 1)

        def forward(self, x):
            return torch.softmax(self.conv(x), dim=1) * torch.arange(16.0).reshape(1, 16, 1, 1)

    torch.manual_seed(0)
    head = Head().eval()
    x = torch.randn(2, 3, 4, 5)
    layer = OnnxModule(export(head, (x,)), backend="onnxruntime").eval()
    weights = torch.randn(2, 16, 4, 5)
    (layer(x) * weights).sum().backward()
    (head(x) * weights).sum().backward()
    torch.testing.assert_close(layer(x), head(x), rtol=1e-5, atol=1e-6)
    for name, p in layer.named_onnx_parameters():
        torch.testing.assert_close(
            p.grad, dict(head.named_parameters())[name].grad, rtol=1e-4, atol=1e-6
        )
    ran = [b for g in layer._bridge._gradient_graphs.values() for b in g._in_use()]
    ops = {n.op_type for built in ran for n in built.split.forward.graph.node}
    assert ran and "Softmax" not in ops and "ReduceMax" in ops


def test_views_that_keep_their_input_s_shape_are_dropped_and_the_values_stay():
    """A view whose output has its input's shape is read through (a chain of
    them too); one writing a graph output is dropped where its source's node
    can write that name instead, not where the source is a graph input, is
    another output's source, or a loop body reads it; every output as before."""
    import numpy as np
    from onnx import TensorProto, helper

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes.unit_axes._identity_views import (
        drop_identity_views,
    )
    from ortbridge._prepare._onnx_utils import make_model

    f = TensorProto.FLOAT
    shape = helper.make_node("Constant", [], ["shape"], value_ints=[2, 3])
    branches = [
        helper.make_graph(
            [helper.make_node(op, ["seen"], [f"{op}_seen"])],
            op,
            [],
            [helper.make_tensor_value_info(f"{op}_seen", f, [2, 3])],
        )
        for op in ("Neg", "Abs")
    ]
    nodes = [
        shape,
        helper.make_node("Tanh", ["x"], ["t"]),
        helper.make_node("Constant", [], ["shape_t"], value_ints=[2, 3]),
        helper.make_node("Reshape", ["t", "shape_t"], ["t1"]),  # a chain of two
        helper.make_node("Identity", ["t1"], ["t2"]),
        helper.make_node("Mul", ["t2", "x"], ["m"]),
        helper.make_node("Reshape", ["m", "shape"], ["out_m"]),  # writes an output
        helper.make_node("Reshape", ["x", "shape"], ["out_x"]),  # of a graph input
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Reshape", ["e", "shape"], ["out_e1"]),  # two outputs, one source
        helper.make_node("Reshape", ["e", "shape"], ["out_e2"]),
        helper.make_node("Sigmoid", ["x"], ["g"]),
        helper.make_node("Reshape", ["g", "shape"], ["seen"]),  # a loop body reads it
        helper.make_node("Constant", [], ["yes"], value=helper.make_tensor("c", 9, [], [1])),
        helper.make_node(
            "If", ["yes"], ["out_s"], then_branch=branches[0], else_branch=branches[1]
        ),
        helper.make_node("Reshape", ["m", "shape"], ["flat"]),  # changes the shape: kept
        helper.make_node("Neg", ["flat"], ["out_n"]),
    ]
    nodes[-2] = helper.make_node("Reshape", ["m", "six"], ["flat"])
    six = helper.make_tensor("six", TensorProto.INT64, [1], [6])
    outs = ["out_m", "out_x", "out_e1", "out_e2", "out_s", "out_n"]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f, [2, 3])],
        [helper.make_tensor_value_info(o, f, None) for o in outs],
        [six],
    )
    model = make_model(graph, opset=18)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
    before = _run(model, feeds)
    dropped = drop_identity_views(model, facts(model).shapes)
    for name, a, b in zip(outs, before, _run(model, feeds)):
        np.testing.assert_array_equal(b, a, err_msg=name)
    writer = {o: n for n in model.graph.node for o in n.output}
    assert dropped == 4  # t1, t2, out_m, one of out_e1/out_e2
    assert writer["out_m"].op_type == "Mul" and writer["out_m"].input[0] == "t"
    assert writer["out_x"].op_type == "Reshape"  # a graph input has no node to write it
    assert sorted(writer[o].op_type for o in ("out_e1", "out_e2")) == ["Exp", "Reshape"]
    assert writer["seen"].op_type == "Reshape"  # read from outside by the loop body
    assert writer["flat"].op_type == "Reshape"
    # A shape only dropped views read goes with them; one still read stays.
    assert "shape_t" not in writer
    assert writer["shape"].op_type == "Constant"  # out_x's and seen's views read it still
