"""Forms older exporters write (paddle2onnx, early opsets), on small hand-built graphs.

Each graph reproduces one form of a published paddle2onnx model: input
dimensions named ``?``, BatchNormalization with its optional statistics
outputs, an IR 7 file, a BatchNormalization whose input rank only a run can
tell. References: onnxruntime inference of the file, torch's BatchNorm, and
finite differences (:func:`ortbridge.gradcheck`).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import ortbridge
from ortbridge import OnnxModule
from ortbridge._call_checks import shared_dims
from ortbridge._engines.onnxruntime._engine import SPECIALISED_SHAPES
from ortbridge._prepare import _call_ranks
from ortbridge._prepare._load import TensorSpec
from ortbridge.exceptions import NotDifferentiableError

pytestmark = pytest.mark.usefixtures("backend")

C = 3
EPS = 1e-5
MOMENTUM = 0.9  # ONNX's: torch's momentum is 1 - 0.9


def _bn_arrays():
    rng = np.random.default_rng(0)
    return {
        "bn.weight": rng.uniform(0.5, 1.5, C).astype(np.float32),
        "bn.bias": rng.standard_normal(C).astype(np.float32),
        "bn.running_mean": rng.standard_normal(C).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 1.5, C).astype(np.float32),
    }


def _model(nodes, inputs, opset=11, ir=7, initializers=()):
    graph = helper.make_graph(
        nodes, "paddle_like", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    )
    graph.initializer.extend(initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def _bn_model(outputs=("y",), opset=11, ir=7, extra=None, before=()):
    """x -> [before] -> BatchNormalization (outputs ``outputs``) -> y, weights as initializers."""
    arrays = _bn_arrays()
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    x_in = before[-1].output[0] if before else "x"
    attrs = {"epsilon": EPS, "momentum": MOMENTUM, **(extra or {})}
    bn = helper.make_node(
        "BatchNormalization", [x_in, *arrays], list(outputs), name="bn_node", **attrs
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["?", C, "?", "?"])
    return _model([*before, bn], [x], opset, ir, inits)


def _torch_bn():
    bn = torch.nn.BatchNorm2d(C, eps=EPS, momentum=1 - MOMENTUM)
    arrays = _bn_arrays()
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(bn, name).copy_(torch.from_numpy(arrays[f"bn.{name}"]))
    return bn


def _ort_run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def _check_batch_norm_modes(model, x):
    """Eval and train mode against torch's BatchNorm2d; gradients against finite differences."""
    module = OnnxModule(model)
    assert not isinstance(module.bn.running_mean, torch.nn.Parameter)  # statistics stay buffers
    reference = _torch_bn()
    module.eval()
    reference.eval()
    torch.testing.assert_close(module(x), reference(x), rtol=1e-4, atol=1e-5)
    report = ortbridge.gradcheck(module, x.clone().requires_grad_(True))
    assert report, str(report)
    module.train()
    reference.train()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out, expected = module(xs[0]), reference(xs[1])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    (out**2).sum().backward()
    (expected**2).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(module.bn.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-5)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(
            getattr(module.bn, name), getattr(reference, name), rtol=1e-5, atol=1e-6
        )
    report = ortbridge.gradcheck(module, x.clone().requires_grad_(True))
    assert report, str(report)
    return module


def test_question_mark_dims_are_unknown_not_shared():
    # paddle2onnx names every unknown axis "?", and writes -1 for the batch.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 2, "?", "?"])
    model = _model(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])], [x]
    )
    module = OnnxModule(model)
    inp = torch.randn(3, 2, 4, 5)
    torch.testing.assert_close(module(inp), _ort_run(model, inp))
    leaf = inp.clone().requires_grad_(True)
    module(leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, -(inp > 0).float())


@pytest.mark.engines("onnxruntime")
def test_question_mark_dims_in_a_dropout_mask():
    # A train-mode Dropout draws its mask with the input's shape: the two "?"
    # axes have different sizes.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["?", "?"])
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    model = _model(
        [helper.make_node("Dropout", ["x", "ratio"], ["y"])], [x], opset=13, initializers=[ratio]
    )
    module = OnnxModule(model).train()
    # Past the shapes that get graphs of their own, the shape-generic graph
    # reads the mask's sizes from the input's axes.
    for width in range(4, 6 + SPECIALISED_SHAPES):
        leaf = torch.ones(3, width, requires_grad=True)
        out = module(leaf)
        assert out.shape == (3, width)
        assert set(out.unique().tolist()) <= {0.0, 2.0}
        out.sum().backward()
        torch.testing.assert_close(leaf.grad, out.detach())


def test_named_dims_still_tie_inputs():
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", "?"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", "?"])
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "g",
        [a, b],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    module = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]))
    assert module(torch.ones(2, 3), torch.ones(2, 1)).shape == (2, 3)  # "?" sizes differ
    with pytest.raises(ortbridge.exceptions.OnnxInputError, match="dimension 'n'"):
        module(torch.ones(2, 3), torch.ones(4, 3))


@pytest.mark.parametrize(
    ("outputs", "opset", "extra"),
    [
        (("y",), 11, None),
        (("y", "mean_out", "var_out", "saved_mean", "saved_var"), 11, None),
        (("y", "mean_out", "var_out"), 15, {"training_mode": 1}),
        (("y", "mean_out", "var_out"), 15, {"training_mode": 0}),
    ],
    ids=["one-output-opset11", "five-outputs-opset11", "three-outputs-train", "three-outputs"],
)
def test_batch_norm_with_statistics_outputs(outputs, opset, extra):
    model = _bn_model(outputs, opset, extra=extra)
    x = torch.randn(4, C, 5, 6)
    _check_batch_norm_modes(model, x)


@pytest.mark.parametrize("name, label", [("bn_node", "bn_node"), ("", "BatchNormalization_y0")])
def test_batch_norm_statistics_outputs_read_are_refused(name, label):
    """Refused by the node's name; an unnamed node (ONNX's own test cases) by the
    name normalisation gives it, its op type and first output."""
    model = _bn_model(("y0", "mean_out", "var_out", "sm", "sv"))
    (bn,) = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    bn.name = name
    model.graph.node.append(helper.make_node("Add", ["y0", "mean_out"], ["y"]))
    with pytest.raises(
        NotDifferentiableError, match=rf"'{label}' \(BatchNormalization\).*'mean_out'"
    ) as caught:
        OnnxModule(model)
    assert caught.value.node == label


def test_ir7_conv_batch_norm_file():
    # As paddle2onnx writes: IR 7, opset 11, a Conv, BatchNormalization, HardSigmoid, Clip.
    rng = np.random.default_rng(1)
    conv_w = numpy_helper.from_array(rng.standard_normal((C, 2, 3, 3)).astype(np.float32), "conv.w")
    lo = numpy_helper.from_array(np.array(0.0, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(6.0, np.float32), "hi")
    conv = helper.make_node("Conv", ["x", "conv.w"], ["c"], pads=[1, 1, 1, 1])
    hard = helper.make_node("HardSigmoid", ["y0"], ["h"], alpha=0.2, beta=0.5)
    clip = helper.make_node("Clip", ["h", "lo", "hi"], ["y"])
    model = _bn_model(outputs=("y0",), before=(conv,))
    model.graph.node.extend([hard, clip])
    model.graph.initializer.extend([conv_w, lo, hi])
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value = -1  # paddle2onnx's batch dimension
    dims[1].dim_value = 2
    assert model.ir_version == 7
    module = OnnxModule(model).eval()
    x = torch.randn(2, 2, 5, 4)
    torch.testing.assert_close(module(x), _ort_run(model, x), rtol=1e-5, atol=1e-6)
    assert isinstance(module.conv.w, torch.nn.Parameter)
    for mode in ("eval", "train"):
        getattr(module, mode)()
        report = ortbridge.gradcheck(module, x.clone().requires_grad_(True))
        assert report, str(report)


def _rank_hidden_model():
    """x reshaped to a shape computed at run time (as older paddle2onnx does), then BN."""
    float_shape = helper.make_node("Cast", ["shape"], ["shape_f"], to=TensorProto.FLOAT)
    back = helper.make_node("Cast", ["shape_f"], ["shape_i"], to=TensorProto.INT64)
    before = (
        helper.make_node("Shape", ["x"], ["shape"]),
        float_shape,
        back,
        helper.make_node("Reshape", ["x", "shape_i"], ["xr"]),
    )
    return _bn_model(before=before)


def test_batch_norm_rank_known_only_from_the_call():
    model = _rank_hidden_model()
    model.graph.input[0].type.tensor_type.ClearField("shape")  # any rank may come
    assert _call_ranks.unknown_ranks(ortbridge._prepare.normalize(model)) == ["xr"]
    x = torch.randn(4, C, 5, 6)
    module = _check_batch_norm_modes(model, x)
    module.eval()
    # Inputs of another rank: the rank is learnt again.
    x3 = torch.randn(4, C, 7)
    with torch.no_grad():
        reference = _torch_bn().eval()
        reference.running_mean.copy_(module.bn.running_mean)  # updated in train mode above
        reference.running_var.copy_(module.bn.running_var)
        expected = reference(x3.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(module(x3), expected, rtol=1e-4, atol=1e-5)


def test_batch_norm_rank_from_the_call_frozen():
    module = OnnxModule(_rank_hidden_model(), batch_norm="frozen").train()
    x = torch.randn(4, C, 5, 6)
    reference = _torch_bn().eval()
    torch.testing.assert_close(module(x), reference(x), rtol=1e-4, atol=1e-5)
    report = ortbridge.gradcheck(module, x.clone().requires_grad_(True))
    assert report, str(report)


def test_shared_dims_leave_question_marks_out():
    # Specs as a model that skipped normalisation would give them.
    specs = [
        TensorSpec("a", TensorProto.FLOAT, ("?", "n")),
        TensorSpec("b", TensorProto.FLOAT, ("?", "n")),
    ]
    assert shared_dims(specs) == {"n": [(0, 1), (1, 1)]}


def test_batch_norm_statistics_from_nodes_train_mode():
    # Statistics read through Identity nodes (exporters merge equal
    # initializers so): not tracked, yet batch statistics in train mode, and
    # the module still returns only the graph's output.
    model = _bn_model()
    bn = model.graph.node[0]
    for k in (3, 4):
        name = bn.input[k]
        bn.input[k] = f"{name}_read"
        model.graph.node.insert(0, helper.make_node("Identity", [name], [f"{name}_read"]))
    module = OnnxModule(model).train()
    x = torch.randn(4, C, 5, 6)
    with torch.no_grad():
        out = module(x)
    torch.testing.assert_close(out, _torch_bn().train()(x), rtol=1e-4, atol=1e-5)
    # The gradient graph computes the same function (batch statistics).
    leaf, ref_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, expected = module(leaf), _torch_bn().train()(ref_leaf)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    (out**2).sum().backward()
    (expected**2).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-4, atol=1e-5)
    report = ortbridge.gradcheck(module, x.clone().requires_grad_(True))
    assert report, str(report)


# -- declared output shapes the graph contradicts ------------------------------------


class _BidirectionalLstm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)

    def forward(self, x):
        out, (h_n, _) = self.rnn(x)
        return out, h_n


@pytest.mark.engines("onnxruntime")  # the agent refuses bidirectional LSTMs
def test_an_output_declared_with_a_wrong_rank_trains_as_torch():
    """torch 2.11's exporter declares this LSTM's h_n, (4, 2, 4), as (4, 1, 2, 4):
    onnxruntime runs the file, and the gradient graphs built on the declared
    shape did not load (a Scan's output of rank 4 against 3). The declaration
    is taken from what the graph computes; gradients equal torch's."""
    from conftest import compare_with_torch, export

    torch.manual_seed(0)
    ref = _BidirectionalLstm()
    x = torch.randn(2, 5, 3)
    proto = export(ref, (x,), dynamic_batch=False)
    h_n = proto.graph.output[1]
    dims = h_n.type.tensor_type.shape.dim
    del dims[:]  # torch 2.13 declares (4, 2, 4); 2.11 this
    for size in (4, 1, 2, 4):
        dims.add().dim_value = size
    assert [d.dim_value for d in h_n.type.tensor_type.shape.dim] == [4, 1, 2, 4]
    compare_with_torch(ref, OnnxModule(proto), [x.requires_grad_()])
