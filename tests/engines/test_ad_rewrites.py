"""onnx-ad 0.3.0's defects, and the rewrites that avoid them
(``ortbridge._engines.onnxruntime._ad_rewrites``).

Each case builds a tiny graph and checks three things: onnx-ad differentiates
the original wrong or refuses it (when that check fails, onnx-ad has fixed
the defect and the rewrite can go); the rewritten graph computes the same
outputs; its onnx-ad gradients equal central finite differences of its
onnxruntime inference. Float64 where onnxruntime has the kernels; Conv and
pools are float32 with a step of 1e-2, exact but for rounding on graphs
linear in each input.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

onnx_ad = pytest.importorskip("onnx_ad")
ort = pytest.importorskip("onnxruntime")

from ortbridge._engines.onnxruntime._ad_rewrites import (  # noqa: E402
    known_wrong,
    prepare_for_reverse,
    upgrade_opset,
)
from ortbridge._engines.onnxruntime._rules import own_rules  # noqa: E402
from ortbridge.exceptions import OnnxModelError  # noqa: E402

F, D, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
Refused = onnx_ad.UnsupportedOperator


def _recent_ort():
    return tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 20)


# The rewrites follow maintained onnxruntime: onnxruntime-training 1.19 ignores
# noop_with_empty_axes and lets a ceil_mode pool's last window start in the end padding.
RECENT_ORT = pytest.mark.skipif(
    not _recent_ort(), reason=f"onnxruntime {ort.__version__} computes these nodes differently"
)


def _model(nodes, inputs, inits=(), opset=18):
    """A model of ``nodes`` reading ``inputs`` ((name, type, shape)), writing output ``y``."""
    values = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()]
    y = helper.make_tensor_value_info("y", inputs[0][1], None)
    graph = helper.make_graph(nodes, "case", values, [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    return onnx.shape_inference.infer_shapes(model)


def _one(op, inputs, inits=(), opset=18, **attrs):
    node = helper.make_node(op, [n for n, *_ in inputs] + list(dict(inits)), ["y"], **attrs)
    return _model([node], inputs, inits, opset)


def _runner(model):
    if model.opset_import[0].version > 26:  # beyond onnxruntime 1.31
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        return lambda names, feeds: evaluator.run(names, feeds)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # onnxruntime 1.19's GatherSliceToSplitFusion gives two nodes one name on reverse graphs
    disabled = ["GatherSliceToSplitFusion"] if not _recent_ort() else None
    session = ort.InferenceSession(
        model.SerializeToString(), options, ["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    return session.run


def _feeds(model, rng):
    feeds = {}
    for value in model.graph.input:
        kind = value.type.tensor_type
        shape = [d.dim_value for d in kind.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(kind.elem_type)
        feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _gradient_error(model, feeds, wrt):
    """Largest error of onnx-ad's gradients against finite differences, relative to their size.

    Infinite when a gradient has the wrong shape or is not finite.
    """
    run = _runner(model)
    (y,) = run(["y"], feeds)
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(y.dtype)
    reverse = onnx_ad.reverse(model, inputs=wrt, outputs=["y"], layout="onnx")
    adjoints = _runner(reverse)([f"adj_{w}" for w in wrt], {**feeds, "adj_y": seed[..., None]})
    step = 1e-6 if y.dtype == np.float64 else 1e-2
    worst = 0.0
    for name, adjoint in zip(wrt, adjoints):
        x = feeds[name]
        numeric = np.zeros(x.shape)
        for i in np.ndindex(x.shape):
            ends = []
            for sign in (1, -1):
                moved = x.copy()
                moved[i] += sign * step
                ends.append(np.sum(run(["y"], {**feeds, name: moved})[0] * seed, dtype=np.float64))
            numeric[i] = (ends[0] - ends[1]) / (2 * step)
        if adjoint.shape != x.shape + (1,) or not np.all(np.isfinite(adjoint)):
            return np.inf
        scale = max(1.0, np.abs(numeric).max(initial=0.0))
        worst = max(worst, np.abs(adjoint[..., 0] - numeric).max(initial=0.0) / scale)
    return worst


def _check(model, wrt, feeds=None, tol=None):
    """Rewrite ``model``; check its outputs and its gradients; return the rewritten model."""
    feeds = feeds if feeds is not None else _feeds(model, np.random.default_rng(0))
    rewritten = prepare_for_reverse(model)
    (before,) = _runner(model)(["y"], feeds)
    (after,) = _runner(rewritten)(["y"], feeds)
    float32 = before.dtype == np.float32
    np.testing.assert_allclose(after, before, rtol=1e-5 if float32 else 1e-12, atol=1e-6)
    tol = tol if tol is not None else (2e-3 if float32 else 1e-6)
    assert _gradient_error(rewritten, feeds, wrt) < tol
    return rewritten


def _ops(model):
    return [n.op_type for n in model.graph.node]


# --- opset ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, indices, attrs",
    [
        ("Gather", [0, 2, 2], {"axis": 1}),
        ("GatherElements", [[0, 2], [1, 1]], {"axis": 1}),
        ("GatherND", [[0, 1], [1, 2]], {}),
    ],
)
def test_gathers_below_opset_16_are_upgraded(op, indices, attrs):
    model = _one(op, [("x", D, [2, 3])], {"i": np.array(indices)}, opset=13, **attrs)
    with pytest.raises(Refused, match="opset 16"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x"])
    assert rewritten.opset_import[0].version == 16


def test_upgrade_opset_raises_the_ir_version_only_as_needed():
    model = _one("Relu", [("x", F, [2])], opset=11)
    model.ir_version = 6
    upgraded = upgrade_opset(model, 16)
    assert (upgraded.opset_import[0].version, upgraded.ir_version) == (16, 8)
    model.ir_version = 10
    assert upgrade_opset(model, 16).ir_version == 10
    assert upgrade_opset(upgraded, 16) is upgraded


def test_a_model_the_converter_refuses_keeps_its_opset():
    model = _model([helper.make_node("Foo", ["x"], ["y"])], [("x", F, [2])], opset=11)
    with pytest.raises(OnnxModelError, match="opset 11 to 16.*re-export"):
        upgrade_opset(model)
    assert prepare_for_reverse(model).opset_import[0].version == 11


# --- reductions -------------------------------------------------------------------------------

EMPTY = {"axes": np.zeros(0, np.int64)}


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize(
    "op",
    ["ReduceMean", "ReduceMax", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"],
)
def test_reduction_with_empty_axes_reduces_everything(op, keepdims):
    # onnxruntime 1.19 has no float64 ReduceProd, and a float64 ReduceL2 off by 1e-2
    dtype = F if op in ("ReduceProd", "ReduceL2") else D
    model = _one(op, [("x", dtype, [2, 3])], EMPTY, keepdims=keepdims)
    x = np.random.default_rng(0).random((2, 3)) + 0.5
    feeds = {"x": x.astype(helper.tensor_dtype_to_np_dtype(dtype))}
    assert _gradient_error(model, feeds, ["x"]) > 0.05
    rewritten = _check(model, ["x"], feeds)
    assert len(rewritten.graph.node[-1].input) == 1


@RECENT_ORT
@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceSumSquare"])
def test_reduction_noop_with_empty_axes_is_the_elementwise_op(op):
    # onnxruntime computes |x| or x*x there; onnx-ad differentiates the identity
    model = _one(op, [("x", D, [2, 3])], EMPTY, noop_with_empty_axes=1)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3))}
    assert _gradient_error(model, feeds, ["x"]) > 0.05
    assert _ops(_check(model, ["x"], feeds)) == ["Mul" if op == "ReduceSumSquare" else "Abs"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the (NaN) means of nothing
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceLogSum"])
def test_reduction_over_an_empty_tensor_has_an_empty_gradient(op):
    model = _one(op, [("x", D, [0, 3])], {"axes": np.array([0])}, keepdims=0)
    feeds = {"x": np.zeros((0, 3))}
    try:
        assert _gradient_error(model, feeds, ["x"]) == np.inf
    except ort.capi.onnxruntime_pybind11_state.Fail:
        pass  # ReduceMean's adjoint divides by the (zero) output size
    _check(model, ["x"], feeds)


# --- convolutions -----------------------------------------------------------------------------

CONV = [("x", F, [2, 4, 9, 6]), ("w", F, [3, 4, 3, 2])]


@pytest.mark.parametrize(
    "attrs",
    [
        {"pads": [0, 1, 2, 0]},
        {"pads": [1, 0, 0, 1], "strides": [2, 3]},
        {"pads": [1, 1, 1, 1], "strides": [3, 3]},  # symmetric, two padded rows unread
        {"pads": [2, 0, 1, 1], "strides": [3, 1], "dilations": [2, 1]},
    ],
)
def test_conv_input_gradient_with_uneven_padding(attrs):
    model = _one("Conv", CONV, **attrs)
    feeds = _feeds(model, np.random.default_rng(0))
    assert _gradient_error(model, feeds, ["x"]) > 0.1
    rewritten = _check(model, ["x", "w"], feeds)
    assert "Pad" in _ops(rewritten) or "Slice" in _ops(rewritten)


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad_becomes_explicit(mode):
    model = _one("Conv", CONV, auto_pad=mode, strides=[2, 1])
    if mode != "VALID":
        with pytest.raises(Refused, match="auto_pad"):
            onnx_ad.reverse(model, inputs=["x", "w"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x", "w"])
    assert all(a.name != "auto_pad" for n in rewritten.graph.node for a in n.attribute)


@pytest.mark.parametrize(
    "x, w, attrs",
    [
        ([2, 4, 5, 6], [6, 2, 3, 3], {"group": 2, "pads": [1, 1, 1, 1]}),
        ([1, 8, 7, 6], [4, 2, 3, 3], {"group": 4, "strides": [2, 2], "pads": [1, 0, 1, 1]}),
        ([1, 6, 9], [6, 2, 3], {"group": 3, "dilations": [2], "strides": [3]}),
    ],
    ids=["group2", "group4-strided", "1d-dilated"],
)
def test_grouped_conv_weight_gradient(x, w, attrs):
    model = _one("Conv", [("x", F, x), ("w", F, w), ("b", F, [w[0]])], **attrs)
    with pytest.raises(Refused, match="grouped Conv"):
        onnx_ad.reverse(model, inputs=["x", "w"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x", "w", "b"])
    assert _ops(rewritten).count("Conv") == attrs["group"] and "Split" in _ops(rewritten)


def test_grouped_conv_with_a_constant_weight_stays():
    model = _one(
        "Conv", [("x", F, [1, 4, 5, 5])], {"w": np.ones((4, 1, 3, 3), np.float32)}, group=4
    )
    assert _ops(prepare_for_reverse(model)) == ["Conv"]


@pytest.mark.parametrize(
    "x, w, attrs, kept",
    [
        ([2, 3, 4, 3], [3, 2, 3, 3], {}, True),
        ([1, 3, 4, 3], [3, 2, 3, 2], {"strides": [2, 3], "pads": [1, 0, 2, 1]}, True),
        ([1, 2, 3, 4], [2, 3, 3, 3], {"strides": [2, 2], "output_padding": [1, 0]}, True),
        ([2, 3, 4, 3], [3, 2, 2, 2], {"strides": [2, 2]}, True),
        ([1, 4, 3], [4, 1, 3], {"group": 2, "strides": [2], "dilations": [2], "pads": [1, 3]},
         False),
        ([1, 2, 3, 3], [2, 2, 3, 3], {"strides": [2, 2], "output_shape": [6, 5]}, True),
        ([1, 2, 3, 3], [2, 2, 3, 3], {"strides": [3, 2], "output_shape": [10, 8]}, False),
        ([1, 2, 3, 3], [2, 2, 2, 3], {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, True),
        ([1, 2, 3, 3], [2, 2, 2, 3], {"strides": [2, 2], "auto_pad": "SAME_LOWER"}, True),
    ],
    ids="plain strided-asym out-padding tiles grouped out-shape out-shape-longer same-up same-lo"
    .split(),
)  # fmt: skip
def test_conv_transpose_weight_gradient(x, w, attrs, kept):
    """onnx-ad refuses a ConvTranspose's weight. A 2-D one of one group stays
    itself, its pads explicit (onnxruntime's kernel runs it), and ortbridge's
    rule gives the weight's gradient; others (grouped, 1-D, an output longer
    than the windows reach) become a Conv over a zero-inserted input. Finite
    differences, both."""
    bias = ("b", F, [w[1] * attrs.get("group", 1)])
    model = _one("ConvTranspose", [("x", F, x), ("w", F, w), bias], **attrs)
    with pytest.raises(Refused, match="auto_pad|weight"):
        onnx_ad.reverse(model, inputs=["x", "w"], outputs=["y"], layout="onnx")
    with own_rules():
        rewritten = _check(model, ["x", "w", "b"])
    assert ("ConvTranspose" in _ops(rewritten)) == kept
    for node in rewritten.graph.node:
        if node.op_type == "ConvTranspose":
            assert {a.name for a in node.attribute}.isdisjoint({"auto_pad", "output_shape"})


@pytest.mark.parametrize(
    "x, w, bias",
    [([3, 2, 5], [2, 4, 3], False), ([1, 2, 2, 3, 2], [2, 3, 2, 1, 2], True)],
    ids=["1d-no-bias", "3d"],
)
def test_conv_transpose_whose_windows_tile_the_output_is_one_matmul(x, w, bias):
    """kernel = strides, no pads (a UNet's up-convolution), 1-D or 3-D: the
    trained weight's ConvTranspose is one MatMul and the patches put in place,
    no Conv (a 2-D one keeps onnxruntime's kernel, above)."""
    inputs = [("x", F, x), ("w", F, w)] + ([("b", F, [w[1]])] if bias else [])
    model = _one("ConvTranspose", inputs, strides=w[2:])
    rewritten = _check(model, [name for name, *_ in inputs])
    assert "MatMul" in _ops(rewritten), _ops(rewritten)
    assert not {"Conv", "ConvTranspose", "Pad"} & set(_ops(rewritten)), _ops(rewritten)


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER"])
def test_conv_transpose_with_a_constant_weight_gets_explicit_pads(mode):
    weight = {"w": np.random.default_rng(0).standard_normal((2, 2, 2, 3)).astype(np.float32)}
    model = _one("ConvTranspose", [("x", F, [1, 2, 3, 3])], weight, strides=[2, 2], auto_pad=mode)
    with pytest.raises(Refused, match="auto_pad"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    assert _ops(_check(model, ["x"])) == ["ConvTranspose"]


# --- pools ------------------------------------------------------------------------------------

POOL = [("x", F, [1, 2, 7, 5])]
K3 = {"kernel_shape": [3, 3]}


@pytest.mark.parametrize(
    "op, attrs",
    [
        ("AveragePool", {"pads": [0, 1, 2, 1], "count_include_pad": 1}),
        ("AveragePool", {"pads": [0, 1, 2, 1]}),
        ("AveragePool", {"pads": [1, 1, 1, 1], "strides": [3, 3], "kernel_shape": [2, 2]}),
        ("LpPool", {"pads": [0, 1, 2, 1]}),
        ("LpPool", {"pads": [1, 1, 1, 1], "strides": [3, 3], "kernel_shape": [2, 2]}),
    ],
    ids=["avg-include", "avg-exclude", "avg-unread", "lp-asym", "lp-unread"],
)
def test_pool_gradient_with_uneven_padding(op, attrs):
    model = _one(op, POOL, **{"kernel_shape": [3, 3], **attrs})
    feeds = _feeds(model, np.random.default_rng(0))
    assert _gradient_error(model, feeds, ["x"]) > 0.1
    _check(model, ["x"], feeds)


@pytest.mark.parametrize(
    "op, attrs",
    [
        ("MaxPool", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        ("AveragePool", {"auto_pad": "SAME_LOWER", "strides": [2, 1]}),
        ("LpPool", {"auto_pad": "SAME_UPPER"}),
        ("AveragePool", {"ceil_mode": 1, "strides": [2, 2]}),
        ("AveragePool", {"ceil_mode": 1, "strides": [2, 2], "pads": [1, 1, 1, 1], **K3}),
        ("AveragePool", {"ceil_mode": 1, "strides": [2, 2], "pads": [1, 1, 1, 1], "cip": 1, **K3}),
    ],
    ids=["max-same", "avg-same", "lp-same", "avg-ceil", "avg-ceil-pads", "avg-ceil-include"],
)
def test_pool_refusals_become_explicit_padding(op, attrs):
    attrs = dict(attrs)
    if attrs.pop("cip", 0):
        attrs["count_include_pad"] = 1
    # onnxruntime has float64 MaxPool: finite differences need no wide step across a max
    pool = [("x", D if op == "MaxPool" else F, POOL[0][2])]
    model = _one(op, pool, **{"kernel_shape": [3, 2], **attrs})
    with pytest.raises(Refused, match="auto_pad|ceil_mode"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    _check(model, ["x"])


@RECENT_ORT
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_ceil_mode_output_size_is_onnxruntimes(op):
    # onnx infers 3 outputs, onnxruntime gives 2 (no window may start in the end padding),
    # and onnx-ad sizes its seed from the declared output
    model = _one(op, [("x", D if op == "MaxPool" else F, [1, 2, 6])], kernel_shape=[2],
                 strides=[3], pads=[0, 1], ceil_mode=1)  # fmt: skip
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [1, 2, 3]
    feeds = _feeds(model, np.random.default_rng(0))
    error = "adj_y" if op == "MaxPool" else "ceil_mode"
    with pytest.raises((ort.capi.onnxruntime_pybind11_state.InvalidArgument, Refused), match=error):
        _gradient_error(model, feeds, ["x"])
    _check(model, ["x"], feeds)


def test_unknown_spatial_size_leaves_same_padding():
    model = _one(
        "Conv", [("x", F, [1, 4, "h", "w"]), ("w", F, [3, 4, 3, 3])], auto_pad="SAME_UPPER"
    )
    assert prepare_for_reverse(model).graph.node[0] == model.graph.node[0]


# --- other ops --------------------------------------------------------------------------------


def test_castlike_becomes_cast():
    # onnx-ad reads the "like" operand as data: y = x * CastLike(c, z) + z, differentiated in
    # z only, gets the adjoint of x * c computed and dropped. No wrong gradient seen in 0.3.0.
    nodes = [
        helper.make_node("CastLike", ["c", "z"], ["cc"]),
        helper.make_node("Mul", ["x", "cc"], ["p"]),
        helper.make_node("Add", ["p", "z"], ["y"]),
    ]
    model = _model(nodes, [("z", D, [2, 3]), ("x", D, [2, 3])], {"c": np.float32(2.0)})
    wasted = onnx_ad.reverse(model, inputs=["z"], outputs=["y"], layout="onnx")
    assert "ReduceSum" in _ops(wasted)
    rewritten = _check(model, ["z", "x"])
    assert _ops(rewritten) == ["Cast", "Mul", "Add"]
    reverse = onnx_ad.reverse(rewritten, inputs=["z"], outputs=["y"], layout="onnx")
    assert len(reverse.graph.node) < len(wasted.graph.node)


@pytest.mark.parametrize(
    "name", ["_engines.onnxruntime._ad_rewrites", "_prepare._sequences"], ids=["ad", "sequences"]
)
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"ortbridge.{name}"))
    assert result.attempted >= 3 and result.failed == 0


def test_pow_with_an_integer_exponent():
    model = _one("Pow", [("x", F, [4]), ("e", I64, [4])])
    feeds = {"x": np.array([0.5, -1.5, 2.0, 1.2], np.float32), "e": np.array([0, 1, 2, 3])}
    with pytest.raises(Refused, match="integer exponent"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    _check(model, ["x"], feeds)


def test_negative_pad_is_a_slice():
    model = _one("Pad", [("x", D, [3, 4])], {"pads": np.array([-1, 1, 0, -2])})
    feeds = _feeds(model, np.random.default_rng(0))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="Expand"):
        _gradient_error(model, feeds, ["x"])
    _check(model, ["x"], feeds)


def test_space_to_depth_crd():
    model = _one("SpaceToDepth", [("x", D, [2, 2, 4, 6])], opset=28, blocksize=2, mode="CRD")
    feeds = _feeds(model, np.random.default_rng(0))
    assert _gradient_error(model, feeds, ["x"]) > 0.5
    assert known_wrong(model.graph.node[0]) is not None
    assert "SpaceToDepth" not in _ops(_check(model, ["x"], feeds))


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
def test_resize_crop_fill_is_a_constant(mode):
    box = {"roi": np.array([0, 0, 0.4, -0.3, 1, 1, 1.2, 0.9], np.float32)}
    scales = {"scales": np.array([1, 1, 1.5, 2], np.float32)}
    model = _one(
        "Resize",
        [("x", F, [1, 2, 3, 4])],
        {**box, **scales},
        mode=mode,
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=10.0,
    )
    feeds = _feeds(model, np.random.default_rng(0))
    assert _gradient_error(model, feeds, ["x"]) > 1.0
    assert "extrapolation_value" in known_wrong(model.graph.node[0])
    rewritten = _check(model, ["x"], feeds)
    assert all(known_wrong(n) is None for n in rewritten.graph.node)


def test_batch_norm_statistics_gradients():
    names = ["x", "scale", "bias", "mean", "var"]
    shapes = [[2, 3, 2], [3], [3], [3], [3]]
    model = _one("BatchNormalization", [(n, F, s) for n, s in zip(names, shapes)], epsilon=0.1)
    feeds = _feeds(model, np.random.default_rng(0))
    feeds["var"] = np.abs(feeds["var"]) + 0.5
    assert _gradient_error(model, feeds, ["mean", "var"]) > 0.1
    _check(model, names, feeds)


def test_batch_norm_with_constant_statistics_stays():
    stats = {"mean": np.zeros(3, np.float32), "var": np.ones(3, np.float32)}
    model = _one(
        "BatchNormalization", [(n, F, s) for n, s in [("x", [2, 3]), ("s", [3]), ("b", [3])]], stats
    )
    assert _ops(prepare_for_reverse(model)) == ["BatchNormalization"]


def test_det_is_known_wrong():
    model = _one("Det", [("x", F, [3, 3])])
    feeds = _feeds(model, np.random.default_rng(0))
    assert _gradient_error(model, feeds, ["x"]) > 0.1
    assert "Det" in known_wrong(model.graph.node[0])
    assert known_wrong(helper.make_node("Conv", ["x", "w"], ["y"])) is None


# --- sequences and control flow ---------------------------------------------------------------


def _ints(name, values):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values)))


def _no_sequences(model):
    return not any("Sequence" in n.op_type for n in _all_nodes(model.graph))


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)


SEQUENCES = {
    # dynamo's torch.split: parts read back by position (negative too)
    "split-sizes-read-by-position": [
        _ints("sizes", [2, 1, 3]),
        helper.make_node("SplitToSequence", ["x", "sizes"], ["parts"], axis=1),
        _ints("last", -1),
        _ints("first", 0),
        helper.make_node("SequenceAt", ["parts", "last"], ["c"]),
        helper.make_node("SequenceAt", ["parts", "first"], ["a"]),
        helper.make_node("Concat", ["c", "a"], ["ca"], axis=1),
        helper.make_node("Tanh", ["ca"], ["y"]),
    ],
    # chunks of one size, the last one shorter, concatenated back
    "split-chunks-concatenated": [
        _ints("chunk", 4),
        helper.make_node("SplitToSequence", ["x", "chunk"], ["parts"], axis=1),
        helper.make_node("ConcatFromSequence", ["parts"], ["back"], axis=1),
        helper.make_node("Mul", ["back", "x"], ["y"]),
    ],
    # one element per row, squeezed, stacked on a new last axis, and the count
    "split-rows-stacked": [
        helper.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
        helper.make_node("ConcatFromSequence", ["rows"], ["stacked"], axis=-1, new_axis=1),
        helper.make_node("SequenceLength", ["rows"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=D),
        helper.make_node("Mul", ["stacked", "nf"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["y"]),
    ],
    "sequence-construct": [
        helper.make_node("Exp", ["x"], ["ex"]),
        helper.make_node("SequenceConstruct", ["x", "ex"], ["pair"]),
        _ints("second", 1),
        helper.make_node("SequenceAt", ["pair", "second"], ["b"]),
        helper.make_node("ConcatFromSequence", ["pair"], ["both"], axis=0),
        helper.make_node("Concat", ["both", "b"], ["y"], axis=0),
    ],
}


@pytest.mark.parametrize("case", list(SEQUENCES))
def test_sequences_of_known_length_become_tensors(case):
    model = _model(SEQUENCES[case], [("x", D, [2, 6] if case.startswith("split-") else [2, 3])])
    with pytest.raises(Refused, match="ConcatFromSequence|SequenceAt|declared"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    assert _no_sequences(_check(model, ["x"]))


def _appending_loop(axis, new_axis, bounds, dtype=D):
    """y = ConcatFromSequence of rows[i] = sum(tanh(x[start_i:end_i] * w), 0) * (i + 1).

    ``bounds="opaque"``: the rows' sizes are unknown to shape inference.
    """
    if bounds == "from-offsets":  # the bounds' length is unknown (EmbeddingBag's form)
        starts = [
            helper.make_node("Unsqueeze", ["i", "zero"], ["i1"]),
            helper.make_node("Add", ["i1", "one"], ["i2"]),
            helper.make_node("Add", ["i1", "two"], ["i3"]),
            helper.make_node("Slice", ["offsets", "i1", "i2"], ["start"]),
            helper.make_node("Slice", ["offsets", "i2", "i3"], ["end"]),
        ]
    else:  # negative bounds, wrapped
        starts = [
            helper.make_node("Unsqueeze", ["i", "zero"], ["i1"]),
            helper.make_node("Sub", ["i1", "five"], ["start"]),
            helper.make_node("Sub", ["i1", "three"], ["end"]),
        ]
    body_nodes = [
        *starts,
        helper.make_node("Slice", ["x", "start", "end"], ["rows"]),
        helper.make_node("Mul", ["rows", "w"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("ReduceSum", ["t", "zero"], ["row"], keepdims=1),
        helper.make_node("CastLike", ["i2" if bounds == "from-offsets" else "i1", "x"], ["k"]),
        helper.make_node("Mul", ["row", "k"], ["product"]),
        helper.make_node("Shape", ["product"], ["size"]),
        helper.make_node("Reshape", ["product", "size"], ["weighted"])
        if bounds == "opaque"
        else helper.make_node("Identity", ["product"], ["weighted"]),
        helper.make_node("SequenceInsert", ["acc", "weighted"], ["acc_out"]),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
    ]
    seq = helper.make_tensor_sequence_value_info
    body = helper.make_graph(
        body_nodes,
        "body",
        [
            helper.make_tensor_value_info("i", I64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            seq("acc", dtype, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            seq("acc_out", dtype, None),
        ],
    )
    nodes = [
        _ints("zero", [0]),
        _ints("one", [1]),
        _ints("two", [2]),
        _ints("three", [3]),
        _ints("five", [5]),
        _ints("trips", 3),  # no slice empty: onnx-ad's Reshape adjoints cannot size one
        _ints("offsets", [0, 2, 3, 5]),
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=dtype),
        helper.make_node("Loop", ["trips", "", "empty"], ["rows_seq"], body=body),
        helper.make_node("ConcatFromSequence", ["rows_seq"], ["y"], axis=axis, new_axis=new_axis),
    ]
    return _model(nodes, [("x", dtype, [5, 3]), ("w", dtype, [3])])


@pytest.mark.parametrize("bounds", ["from-offsets", "negative", "opaque"])
@pytest.mark.parametrize("axis, new_axis", [(0, 0), (1, 0), (-1, 0), (0, 1), (-1, 1)])
def test_loop_appending_to_a_sequence_gets_a_scan_output(axis, new_axis, bounds):
    model = _appending_loop(axis, new_axis, bounds)
    with pytest.raises(Refused, match="ConcatFromSequence"):
        onnx_ad.reverse(model, inputs=["x", "w"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x", "w"])
    assert _no_sequences(rewritten)
    body_ops = [n.op_type for n in _all_nodes(rewritten.graph)]
    assert "CastLike" not in body_ops and "Range" in body_ops  # the bounds are computed


def test_loop_appending_what_no_gradient_needs_stays():
    # Appended tensors that depend on no float input may be ragged: the loop is kept.
    model = _appending_loop(0, 0, "negative")
    body = model.graph.node[-2].attribute[0].g
    kept = [n for n in body.node if n.op_type == "SequenceInsert" or n.output[0] == "cond_out"]
    del body.node[:]
    body.node.extend(
        [
            helper.make_node("Range", ["zero_s", "i", "one_s"], ["ragged"]),
            helper.make_node("Cast", ["ragged"], ["weighted"], to=D),
            *kept,
        ]
    )
    model.graph.node.insert(0, _ints("zero_s", 0))
    model.graph.node.insert(0, _ints("one_s", 1))
    (y,) = _runner(model)(["y"], {"x": np.zeros((5, 3)), "w": np.zeros(3)})
    np.testing.assert_array_equal(y, [0, 0, 1])  # ranges of 0, 1 and 2 elements
    assert "ConcatFromSequence" in _ops(prepare_for_reverse(model))


def test_loop_appending_ragged_tensors_fails_loudly():
    # The rewrite cannot see that the slices differ in size: onnxruntime refuses the scan output.
    model = _appending_loop(0, 0, "from-offsets")
    for node in model.graph.node[-2].attribute[0].g.node:
        if node.op_type == "ReduceSum":  # append the slices themselves: 2, 1 and 2 rows
            node.CopyFrom(helper.make_node("Identity", ["t"], ["row"]))
    feeds = _feeds(model, np.random.default_rng(0))
    assert _runner(model)(["y"], feeds)[0].shape == (5, 3)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="Inconsistent shape"):
        _runner(prepare_for_reverse(model))(["y"], feeds)


def _branch(nodes, output):
    return helper.make_graph(nodes, "branch", [], [helper.make_tensor_value_info(output, D, None)])


def _dispatch(mode):
    """EmbeddingBag's mode dispatch: constant conditions around a data-dependent If."""
    data_dependent = helper.make_node(
        "If",
        ["positive"],
        ["mean"],
        name="pick",
        then_branch=_branch([helper.make_node("Mul", ["x", "w"], ["xw"])], "xw"),
        else_branch=_branch([helper.make_node("Exp", ["x"], ["sx"])], "sx"),
    )
    inner = helper.make_node(
        "If",
        ["is_mean"],
        ["other"],
        name="mean_or_max",
        then_branch=_branch([data_dependent], "mean"),
        else_branch=_branch([helper.make_node("Exp", ["w"], ["cw"])], "cw"),
    )
    otherwise = [_ints("one", 1), helper.make_node("Equal", ["mode", "one"], ["is_mean"]), inner]
    nodes = [
        _ints("mode", mode),
        _ints("zero", 0),
        helper.make_node("Equal", ["mode", "zero"], ["is_sum"]),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Cast", ["zero"], ["zero_f"], to=D),
        helper.make_node("Greater", ["total", "zero_f"], ["positive"]),
        helper.make_node(
            "If",
            ["is_sum"],
            ["picked"],
            name="sum_or_other",
            then_branch=_branch([helper.make_node("Add", ["x", "w"], ["sum"])], "sum"),
            else_branch=_branch(otherwise, "other"),
        ),
        helper.make_node("Tanh", ["picked"], ["y"]),
    ]
    return _model(nodes, [("x", D, [2, 3]), ("w", D, [2, 3])])


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_constant_conditions_are_inlined_and_if_names_cleared(mode):
    model = _dispatch(mode)
    feeds = _feeds(model, np.random.default_rng(0))
    if mode == 1:  # onnx-ad's adjoint If copies the primal's name
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="same node name"):
            _gradient_error(model, feeds, ["x", "w"])
    rewritten = _check(model, ["x", "w"], feeds)
    ifs = [n for n in _all_nodes(rewritten.graph) if n.op_type == "If"]
    assert [n.name for n in ifs] == ([""] if mode == 1 else [])


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize(
    "pads, axes",
    [([0, 2, 1, 0], None), ([1, 2, 2, 1], None), ([2, 3], [-1])],
    ids=["one-axis", "both-axes", "axes-input"],
)
def test_copying_pad_is_a_gather_per_axis(mode, pads, axes):
    inits = {"pads": np.array(pads)}
    if axes is not None:
        inits["constant_value"] = np.array(0.0)
        inits["axes"] = np.array(axes)
    model = _one("Pad", [("x", D, [3, 4])], inits, opset=19, mode=mode)
    feeds = _feeds(model, np.random.default_rng(0))
    with pytest.raises(Refused, match="constant-mode Pad"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x"], feeds)
    assert "Pad" not in _ops(rewritten) and "Gather" in _ops(rewritten)


@pytest.mark.parametrize(
    "copy",
    [
        lambda y: torch.nn.functional.pad(y, (2, 3), mode="reflect"),
        lambda y: y[:, :, 1::2],
    ],
    ids=["reflect-pad", "strided-slice"],
)
def test_copy_of_a_dynamic_length_matches_torch(copy):
    """F.pad(mode="reflect") and x[:, :, 1::2], exported with a length only the
    call tells, train as torch's do: the positions are computed at run time."""
    import ortbridge

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(2, 3, 3)

        def forward(self, x):
            return self.conv(copy(x))

    from conftest import compare_with_torch, export

    net = Net()
    dims = ({0: torch.export.Dim("batch"), 2: torch.export.Dim("length", min=4)},)
    model = export(net, (torch.randn(2, 2, 9),), dynamic_shapes=dims)
    layer = ortbridge.OnnxModule(model, backend="onnxruntime")
    for length in (9, 6):
        net.zero_grad()
        layer.zero_grad()
        compare_with_torch(net, layer, [torch.randn(2, 2, length, requires_grad=True)])


@pytest.mark.parametrize(
    "starts, ends, axes, steps",
    [
        ([0, 1], [9, 9], [0, 1], [2, 2]),  # x[0::2, 1::2], Swin's patch merging
        ([-1], [-9], [1], [-2]),  # backwards, from the end
        ([1, 0], [3, 2**62], [0, 1], [1, 3]),  # one unit-step axis, an end past the axis
    ],
    ids=["every-other", "negative-step", "mixed"],
)
def test_strided_slice_is_a_gather_per_strided_axis(starts, ends, axes, steps):
    inits = {k: np.array(v) for k, v in zip(("s", "e", "a", "t"), (starts, ends, axes, steps))}
    model = _one("Slice", [("x", D, [5, 7])], inits)
    with pytest.raises(Refused, match="step other than 1"):
        onnx_ad.reverse(model, inputs=["x"], outputs=["y"], layout="onnx")
    rewritten = _check(model, ["x"])
    assert "Gather" in _ops(rewritten)


def test_conv_input_gradient_keeps_a_shape_onnx_infers():
    """onnx-ad's ConvTranspose for a Conv's input gradient, given ``output_shape``,
    gets rank 2 from onnx's shape inference; a Reshape to the declared shape
    after it (a seed axis put back, wav2vec2's grouped positional convolution)
    then fails to load. ortbridge writes its pads out instead."""
    import ortbridge

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 6, padding=3, groups=2)

        def forward(self, x):
            return torch.nn.functional.gelu(self.conv(x)[:, :, :-1]) * x

    from conftest import compare_with_torch, export

    net = Net()
    layer = ortbridge.OnnxModule(
        export(net, (torch.randn(2, 4, 9),), dynamic_batch=False), backend="onnxruntime"
    )
    compare_with_torch(net, layer, [torch.randn(2, 4, 9, requires_grad=True)])
