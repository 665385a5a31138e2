"""What building a gradient graph costs: counted work, never wall time.

A published model's reverse graph has tens of thousands of nodes: a pass
whose name lookups grow with the square of that, or sessions made for a
graph that never runs, cost minutes there.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import ENGINES, export
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortbridge import OnnxModule
from ortbridge._engines.onnxruntime import _ad_rewrites_conv
from ortbridge._engines.onnxruntime import _engine as _onnxruntime
from ortbridge._engines.onnxruntime.passes._optimize import optimize_reverse
from ortbridge._prepare import _lookup as _graph_lookup
from ortbridge._prepare._lookup import Names, _unique
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge._runtime import _sessions as _runtime
from ortbridge.examples import linear_model

ORT = "onnxruntime"
needs_engine = pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")


@pytest.fixture
def probes(monkeypatch):
    """How many times a name is looked up in a :class:`Names`."""
    count = [0]

    def contains(self, name):
        count[0] += 1
        return set.__contains__(self, name)

    monkeypatch.setattr(Names, "__contains__", contains)
    return count


def test_fresh_names_from_one_base_take_a_few_lookups_each(probes):
    taken = Names(["t"])
    names = [_unique("t", taken) for _ in range(3000)]
    assert names[:3] == ["t_1", "t_2", "t_3"] and len(set(names)) == 3000
    assert probes[0] <= 3 * 3000  # a scan from t_1 each time: 4.5 million


def test_fresh_names_skip_names_taken_by_others(probes):
    taken = Names(["t", "t_2", "t_3"])
    assert [_unique("t", taken) for _ in range(3)] == ["t_1", "t_4", "t_5"]
    taken.add("t_6")
    assert _unique("t", taken) == "t_7"


def _unit_axis_transposes(n: int):
    """``n`` unnamed Transposes, each moving only size-1 axes (as onnx-ad writes them)."""
    nodes, current = [], "x"
    for k in range(n):
        nodes.append(helper.make_node("Transpose", [current], [f"t{k}"], perm=[0, 2, 1]))
        current = f"t{k}"
    shape = [1, 4, 1] if n % 2 == 0 else [1, 1, 4]
    graph = helper.make_graph(
        nodes,
        "transposes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, shape)],
    )
    return make_model(graph, opset=17)


def test_rewriting_thousands_of_transposes_looks_names_up_linearly(probes):
    model = _unit_axis_transposes(2000)
    optimize_reverse(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Transpose") == 0 and ops.count("Squeeze") == 2000
    # Three fresh names a Transpose; the names shared one base before: 6 million.
    assert probes[0] <= 10 * 2000


def test_all_names_keeps_its_suffixes_through_in_place_union():
    graph = _unit_axis_transposes(2).graph
    taken = _graph_lookup._all_names(graph)
    taken |= {"extra"}
    assert isinstance(taken, Names) and {"x", "t0", "t1", "extra"} <= taken


def _conv_model():
    """A Conv with a dynamic batch: onnx-ad needs its shapes, graphs are built per shape."""
    w = np.random.default_rng(0).normal(size=(2, 1, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 5, 5])],
        [numpy_helper.from_array(w, "w")],
    )
    return make_model(graph)


@needs_engine
def test_sessions_are_made_for_the_graphs_that_run_only(monkeypatch):
    """Construction builds a gradient graph on stand-in shapes to check the model
    can be differentiated; its sessions (most of a large model's build time) are
    made only if it runs. The first forward's shape makes one pair."""
    loaded = []
    real = _onnxruntime._load
    monkeypatch.setattr(
        _onnxruntime, "_load", lambda m, part, *a: loaded.append(part) or real(m, part, *a)
    )
    layer = OnnxModule(_conv_model(), backend=ORT)
    assert loaded == []
    (graph,) = layer._bridge._gradient_graphs.values()
    assert graph.sessions == [] and graph.pinnings == []
    x = torch.randn(3, 1, 5, 5)
    layer(x).sum().backward()
    assert loaded == ["forward", "backward"]
    assert len(graph.sessions) == 2
    w = layer.onnx_weight("w").detach().clone().requires_grad_()
    torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
    torch.testing.assert_close(layer.onnx_weight("w").grad, w.grad, rtol=1e-4, atol=1e-5)


def test_quantization_optimizers_are_off_for_graphs_without_quantized_nodes(monkeypatch):
    """onnxruntime's QDQ transformers each walk every node of a gradient graph
    (seconds on a large one) and have nothing to do there: off; a graph with a
    quantized node, even in a subgraph, keeps them."""
    ort = _ort.runtime()
    asked = []

    class Recording(ort.InferenceSession):
        def __init__(self, *args, disabled_optimizers=None, **kwargs):
            asked.append(set(disabled_optimizers or ()))
            super().__init__(*args, disabled_optimizers=disabled_optimizers, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Recording)
    layer = OnnxModule(linear_model(3, 2))
    layer(torch.randn(4, 3)).sum().backward()
    with torch.no_grad():
        layer.eval()(torch.randn(4, 3))
    assert len(asked) >= 2
    assert all(set(_runtime.QUANTIZATION_OPTIMIZERS) <= disabled for disabled in asked)

    assert _runtime.idle_optimizers(_conv_model()) == list(_runtime.QUANTIZATION_OPTIMIZERS)
    dq = helper.make_node("DequantizeLinear", ["q", "s"], ["y"])
    body = helper.make_graph([dq], "body", [], [helper.make_tensor_value_info("y", 1, [2])])
    branch = helper.make_node("If", ["c"], ["out"], then_branch=body, else_branch=body)
    quantized = _conv_model()
    quantized.graph.node.append(branch)
    assert _runtime.idle_optimizers(quantized) == []


# -- grouped convolutions -----------------------------------------------------

GROUPED = [
    (lambda: nn.Conv2d(12, 12, 3, padding=1, groups=12), (2, 12, 6, 7)),  # depthwise
    (lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=4), (3, 4, 9, 8)),
    (lambda: nn.Conv2d(6, 4, (1, 3), padding=(0, 2), dilation=(1, 2), groups=2), (2, 6, 5, 9)),
    (lambda: nn.Conv2d(6, 6, 2, stride=(2, 1), groups=3, bias=False), (2, 6, 7, 6)),
    (lambda: nn.Conv1d(4, 8, 3, padding=1, groups=4), (2, 4, 10)),
]


@needs_engine
@pytest.mark.parametrize("case", range(len(GROUPED)))
def test_grouped_conv_weight_gradient_is_one_grouped_conv(case, monkeypatch):
    """onnx-ad refuses a grouped Conv's weight; ortbridge's rule gives it as one
    grouped Conv (not one Conv per group): gradients as torch's, strides,
    dilations, channel multipliers, several input channels a group, 1-D."""
    monkeypatch.setattr(_ad_rewrites_conv, "SPLIT_GROUPS", 1)
    factory, shape = GROUPED[case]
    torch.manual_seed(case)
    conv = factory()
    x = torch.randn(*shape)
    layer = OnnxModule(export(conv, (x,)), backend=ORT)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(ours) ** 2).sum().backward()
    (conv(theirs) ** 2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    for (name, mine), reference in zip(layer.named_parameters(), conv.parameters()):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-4, msg=name)
    for graph in layer._bridge._gradient_graphs.values():  # input needing grad or not
        forward = graph.static_built([x]).split.forward.graph
        assert sum(n.op_type == "Conv" for n in forward.node) == 1


@needs_engine
@pytest.mark.parametrize("groups, convs", [(2, 2), (4, 1)], ids=["split", "depthwise"])
def test_few_groups_are_still_split_unless_depthwise(groups, convs):
    """Few groups of several input channels: one Conv per group; depthwise (one
    input channel a group, ConvNeXt's 8-channel 7x7) one grouped node runs
    faster, its weight gradient by the rule checked above."""
    conv = nn.Conv2d(4, 8, 3, padding=1, groups=groups)
    assert groups <= _ad_rewrites_conv.SPLIT_GROUPS
    x = torch.randn(2, 4, 5, 5)
    layer = OnnxModule(export(conv, (x,)), backend=ORT)
    (graph,) = layer._bridge._gradient_graphs.values()
    forward = graph.static_built([x]).split.forward.graph
    assert sum(n.op_type == "Conv" for n in forward.node) == convs


@needs_engine
def test_first_layer_grouped_conv_with_dynamic_sizes_is_built_per_shape(monkeypatch):
    """No input gradient asked, dynamic height and width: the weight rule asks for
    declared sizes, and the engine builds the graphs per input shape."""
    monkeypatch.setattr(_ad_rewrites_conv, "SPLIT_GROUPS", 1)
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.Tanh())
    dims = {0: torch.export.Dim("n", min=1), 2: torch.export.Dim("h", min=2)}
    dims[3] = torch.export.Dim("w", min=2)
    layer = OnnxModule(
        export(conv, (torch.randn(2, 6, 6, 7),), dynamic_shapes=(dims,)), backend=ORT
    )
    for shape in [(2, 6, 6, 7), (1, 6, 4, 9)]:
        x = torch.randn(*shape)
        layer.zero_grad()
        conv.zero_grad()
        (layer(x) ** 2).sum().backward()
        (conv(x) ** 2).sum().backward()
        for (name, mine), reference in zip(layer.named_parameters(), conv.parameters()):
            torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-4, msg=name)


@needs_engine
def test_conv_transpose_with_dynamic_sizes_is_built_per_shape():
    """A trained ConvTranspose's rewrite for onnx-ad needs static spatial sizes:
    with dynamic ones the engine builds per input shape instead of refusing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 2, 2, stride=2), nn.Tanh())
    dims = {0: torch.export.Dim("n", min=1), 2: torch.export.Dim("h", min=2)}
    dims[3] = torch.export.Dim("w", min=2)
    onnx_model = export(model, (torch.randn(2, 3, 4, 5),), dynamic_shapes=(dims,))
    layer = OnnxModule(onnx_model, backend=ORT)
    for shape in [(2, 3, 4, 5), (1, 3, 3, 6)]:
        x = torch.randn(*shape)
        layer.zero_grad()
        model.zero_grad()
        (layer(x) ** 2).sum().backward()
        (model(x) ** 2).sum().backward()
        for (name, mine), reference in zip(layer.named_parameters(), model.parameters()):
            torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-4, msg=name)


# -- constant folding: onnx-ad's result, without the sweep that only confirms ---------


def _shape_arithmetic(static: bool):
    """``Reshape(x, Concat(Shape(x)[0], 6))``, as exporters write a flatten: with a
    static ``x`` the shape folds in one sweep; with a dynamic batch ``Shape``
    stays and a second sweep may still fold it."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero_axis"], ["n1"]),
        helper.make_node("Concat", ["n1", "six"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
        numpy_helper.from_array(np.array([6], np.int64), "six"),
    ]
    batch = 4 if static else "batch"
    graph = helper.make_graph(
        nodes,
        "flatten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return make_model(graph)


@pytest.fixture
def sweeps(monkeypatch):
    """How many folding sweeps run."""
    from onnx_ad import fold

    count = [0]
    original = fold._fold_once

    def counted(model, max_elements):
        count[0] += 1
        return original(model, max_elements)

    monkeypatch.setattr(fold, "_fold_once", counted)
    return count


@needs_engine
@pytest.mark.parametrize("static", [True, False])
def test_folding_gives_onnx_ads_result_with_a_sweep_less(sweeps, static):
    from onnx_ad.fold import fold_constants as onnx_ads

    from ortbridge._engines.onnxruntime._fold import fold_constants

    model = _shape_arithmetic(static)
    theirs = onnx_ads(model)
    their_sweeps, sweeps[0] = sweeps[0], 0
    ours = fold_constants(model)
    assert ours.SerializeToString() == theirs.SerializeToString()
    if static:  # everything folds in the first sweep; onnx-ad confirms it with a second
        assert (their_sweeps, sweeps[0]) == (2, 1)
        assert [n.op_type for n in ours.graph.node] == ["Constant"] * 4 + ["Reshape", "Relu"]
    else:  # a Shape could fold, so the sweep runs; its input is dynamic: nothing folds
        assert their_sweeps == sweeps[0] == 1
        assert ours.graph.node[0].op_type == "Shape"


@needs_engine
def test_folding_runs_no_sweep_where_no_node_could_fold(sweeps):
    from ortbridge._engines.onnxruntime._fold import fold_constants

    model = linear_model(3, 2)  # every node reads the graph's input
    assert fold_constants(model) is model
    assert sweeps[0] == 0


@needs_engine
def test_folding_without_shape_queries_needs_no_shape_inference(sweeps, monkeypatch):
    """No ``Shape`` or ``Size``: ortbridge's own sweep (no shape inference of the
    whole model, constants converted when read) gives onnx-ad's bytes, in one
    sweep, folding through a ``Constant`` written with ``value_ints``."""
    from onnx_ad import _build
    from onnx_ad.fold import fold_constants as onnx_ads

    from ortbridge._engines.onnxruntime._fold import fold_constants

    nodes = [
        helper.make_node("Constant", [], ["rows"], value_ints=[4]),
        helper.make_node("Concat", ["rows", "six"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([6], np.int64), "six"),
        numpy_helper.from_array(np.ones((6, 5), np.float32), "w"),
    ]
    graph = helper.make_graph(
        nodes,
        "flatten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = make_model(graph)
    theirs = onnx_ads(model)
    sweeps[0] = 0
    inferred = []
    original = _build.Shapes.__init__
    monkeypatch.setattr(
        _build.Shapes, "__init__", lambda self, m: inferred.append(1) or original(self, m)
    )
    ours = fold_constants(model)
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert [n.op_type for n in ours.graph.node] == ["Constant", "Constant", "Reshape", "MatMul"]
    assert sweeps[0] == 0 and inferred == []


@pytest.mark.parametrize("values", [[16, 8, 64], [], 5, [[1, 2], [3, 4]], [-1, 2**40]])
def test_pass_constants_are_the_nodes_make_node_writes(values):
    """The passes' int64 ``Constant`` nodes are built without ``make_node`` and
    ``from_array`` (half the time, hundreds a build): byte for byte the same."""
    from ortbridge._engines.onnxruntime.passes._optimize import _const

    expected = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(np.array(values, dtype=np.int64))
    )
    assert _const("c", values).SerializeToString() == expected.SerializeToString()


def test_node_reads_looks_into_bodies_only_where_there_can_be_one():
    """Plain nodes' reads are their inputs (no attribute looked at); an If's
    include what its branches read from outside, as does a contrib node's body."""
    from ortbridge._prepare._onnx_utils import node_reads

    body = helper.make_graph(
        [helper.make_node("Identity", ["outer"], ["y"])],
        "body",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    plain = helper.make_node("Transpose", ["x", ""], ["t"], perm=[1, 0])
    branch = helper.make_node("If", ["cond"], ["z"], then_branch=body, else_branch=body)
    contrib = helper.make_node("Search", ["x"], ["s"], domain="com.example", decoder=body)
    assert node_reads(plain) == ["x"]
    assert node_reads(branch) == ["cond", "outer", "outer"]
    assert node_reads(contrib) == ["x", "outer"]


def _constant_if_model() -> onnx.ModelProto:
    """An ``If`` on a constant condition: onnx-ad inlines the branch taken."""
    branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["b"])],
        "then",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["c"])],
        "else",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])],
    )
    nodes = [
        helper.make_node("Constant", [], ["flag"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "branching",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return make_model(graph)


def _function_op_model() -> onnx.ModelProto:
    """A ``Celu``: the spec defines it as a function body, which onnx-ad expands."""
    graph = helper.make_graph(
        [helper.make_node("Celu", ["x"], ["y"], alpha=0.5)],
        "celu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return make_model(graph)


@needs_engine
@pytest.mark.parametrize(
    "make, plain",
    [(lambda: linear_model(3, 2), True), (_constant_if_model, False), (_function_op_model, False)],
    ids=["plain", "constant-if", "function-op"],
)
def test_onnx_ad_steps_with_nothing_to_do_are_skipped_with_its_result(make, plain, monkeypatch):
    """Inside ortbridge's context onnx-ad's reverse pass gives the bytes it gives
    alone, and on a graph with no ``If``, control flow or function to expand
    it infers the model's shapes once (its tape's), not four times."""
    from onnx_ad import _build
    from onnx_ad import reverse as onnx_ad_reverse

    from ortbridge._engines.onnxruntime._fold import in_onnx_ad

    model = make()
    alone = onnx_ad_reverse(model, layout="onnx").SerializeToString()
    inferred = []
    original = _build._infer
    monkeypatch.setattr(_build, "_infer", lambda m: inferred.append(1) or original(m))
    with in_onnx_ad():
        ours = onnx_ad_reverse(model, layout="onnx").SerializeToString()
    assert ours == alone
    if plain:
        assert len(inferred) == 1


@needs_engine
def test_facts_extended_by_added_nodes_equal_a_whole_inference():
    """A rewrite that only adds nodes (and leaves some unread) gets the new
    tensors' shapes and types from an inference of those nodes alone: the
    same as inferring the whole graph again."""
    from ortbridge._engines.onnxruntime.passes._optimize import (
        extended,
        facts,
        flattened_product,
    )

    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "g"], ["prod"]),
        helper.make_node("ReduceSum", ["prod", "axes"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "summed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5, 3]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [4, 5, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    model = make_model(graph)
    found = facts(model)
    added, product = flattened_product("x", "g", 3, 2, "flat", found.taken)
    model.graph.node.extend(added)
    grown = extended(found, model, added)
    whole = facts(model)
    for node in added:
        for name in node.output:
            assert grown.shapes[name] == whole.shapes[name]
            assert grown.types[name] == whole.types[name]
    assert grown.producer.keys() == whole.producer.keys()
    assert grown.readers == whole.readers
    assert grown.shapes[product] == (3, 2)
