"""Convolution weights and padding the onnxruntime engine trains with dynamic input shapes.

onnx-ad refuses a ConvTranspose's weight and a grouped Conv's weight; the
rewrites of :mod:`ortbridge._engines.onnxruntime._ad_rewrites_conv` lift both once channels and
sizes are known, so the engine builds such graphs per input shape. Each
layer is exported with dynamic batch and spatial axes (TorchScript exporter,
as published models and SegFormer are) and its output, weight and input
gradients compared with torch autograd, at two input shapes. The same for a
Pad whose widths the graph computes from shapes (Swin's window padding).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from conftest import ENGINES, compare_with_torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ortbridge
from ortbridge import OnnxModule
from ortbridge.exceptions import NotDifferentiableError

ORT = "onnxruntime"
pytestmark = pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")


def _export(layer: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    """TorchScript export, every axis but the channels dynamic, names kept."""
    axes = {0: "n", **{a: f"s{a}" for a in range(2, x.dim())}}
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            layer,
            (x,),
            f,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": axes, "y": axes},
            do_constant_folding=False,
            dynamo=False,
            opset_version=17,
        )
    return onnx.load_from_string(f.getvalue())


def _perturbed(layer: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _check_layer(layer, shapes, input_grad=True):
    layer = _perturbed(layer)
    model = _export(layer, torch.randn(*shapes[0]))
    module = OnnxModule(model, backend=ORT)
    for shape in shapes:
        x = torch.randn(*shape, requires_grad=input_grad)
        for p in layer.parameters():
            p.grad = None
        module.zero_grad()
        compare_with_torch(layer, module, [x], rtol=1e-4, atol=1e-4)
    return module


TRANSPOSED = {
    "1d-stride-pad-outpad": (
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        [(2, 3, 5), (1, 3, 8)],
    ),
    "1d-grouped-tiling": (
        lambda: nn.ConvTranspose1d(4, 6, 2, stride=2, groups=2),
        [(2, 4, 5), (3, 4, 3)],
    ),
    "2d-stride-pad-outpad": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1),
        [(2, 4, 5, 6), (1, 4, 3, 7)],
    ),
    "2d-tiling": (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2), [(2, 4, 3, 4), (1, 4, 5, 2)]),
    "2d-tiling-no-bias": (
        lambda: nn.ConvTranspose2d(3, 2, (2, 3), stride=(2, 3), bias=False),
        [(2, 3, 3, 2)],
    ),
    "2d-dilated-uneven": (
        lambda: nn.ConvTranspose2d(
            4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), output_padding=(1, 0)
        ),
        [(2, 4, 4, 5), (1, 4, 6, 3)],
    ),
    "2d-big-pad-outpad-dilation": (
        lambda: nn.ConvTranspose2d(2, 3, 4, stride=3, padding=2, output_padding=2, dilation=2),
        [(2, 2, 4, 3)],
    ),
    "2d-grouped": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2),
        [(2, 4, 4, 5), (1, 4, 3, 3)],
    ),
    "2d-depthwise": (
        lambda: nn.ConvTranspose2d(4, 4, 4, stride=2, padding=1, groups=4),
        [(2, 4, 5, 5), (1, 4, 3, 6)],
    ),
    "3d-stride-pad-outpad": (
        lambda: nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1, output_padding=1),
        [(2, 2, 3, 4, 3), (1, 2, 2, 3, 4)],
    ),
    "3d-grouped-tiling": (
        lambda: nn.ConvTranspose3d(2, 4, 2, stride=2, groups=2),
        [(1, 2, 2, 3, 2)],
    ),
}

GROUPED = {
    "2d-grouped": (
        lambda: nn.Conv2d(4, 8, 3, groups=2, padding=1),
        [(2, 4, 6, 5), (1, 4, 4, 7)],
    ),
    "2d-depthwise-strided": (
        lambda: nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4),
        [(2, 4, 7, 6), (1, 4, 5, 5)],
    ),
    "2d-depthwise-multiplier-dilated": (
        lambda: nn.Conv2d(3, 6, 3, groups=3, dilation=2, padding=2),
        [(2, 3, 6, 7)],
    ),
    "2d-depthwise-same-even-kernel": (
        lambda: nn.Conv2d(4, 4, 4, groups=4, padding="same"),
        [(2, 4, 6, 5), (1, 4, 7, 7)],
    ),
    "2d-grouped-asymmetric-stride": (
        lambda: nn.Conv2d(6, 9, (3, 2), stride=(2, 3), padding=(1, 2), groups=3),
        [(2, 6, 7, 8)],
    ),
    "1d-depthwise": (
        lambda: nn.Conv1d(4, 4, 5, padding=2, groups=4),
        [(2, 4, 9), (1, 4, 6)],
    ),
    "3d-depthwise": (
        lambda: nn.Conv3d(2, 4, 3, padding=1, groups=2, bias=False),
        [(1, 2, 3, 4, 3)],
    ),
}


@pytest.mark.parametrize("case", list(TRANSPOSED))
def test_conv_transpose_gradients_equal_torch(case):
    make, shapes = TRANSPOSED[case]
    _check_layer(make(), shapes)


@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_conv_gradients_equal_torch(case):
    make, shapes = GROUPED[case]
    _check_layer(make(), shapes)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4),
        lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1),
    ],
    ids=["depthwise-conv", "conv-transpose"],
)
def test_first_layer_weight_gradient_without_an_input_gradient(make):
    """A model's first layer: only the weight needs a gradient (onnx-ad asks for
    no declared input shape then, and used to refuse the weight outright)."""
    _check_layer(make(), [(2, 4, 5, 6), (1, 4, 3, 4)], input_grad=False)


def _conv_transpose_graph(attrs, w_shape, rank):
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(w_shape[1] * attrs.get("group", 1)), "b")
    bias = numpy_helper.from_array(numpy_helper.to_array(bias).astype(np.float32), "b")
    dims = ["n", w_shape[0], *[f"s{i}" for i in range(rank)]]
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], "convt", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "attrs, w_shape, x_shape",
    [
        ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, [3, 2, 3, 3], [1, 3, 3, 4]),
        ({"auto_pad": "SAME_LOWER", "strides": [2, 3]}, [3, 2, 2, 4], [2, 3, 3, 2]),
        ({"auto_pad": "SAME_UPPER", "strides": [2], "group": 3}, [3, 1, 3], [2, 3, 5]),
        ({"output_shape": [8, 7], "strides": [2, 2]}, [2, 3, 3, 3], [1, 2, 3, 3]),
    ],
    ids=["same-upper", "same-lower", "same-upper-depthwise-1d", "output-shape"],
)
def test_conv_transpose_auto_pad_and_output_shape_gradients(attrs, w_shape, x_shape):
    """Forms torch does not export, against central finite differences."""
    model = _conv_transpose_graph(attrs, w_shape, len(x_shape) - 2)
    module = OnnxModule(model, backend=ORT)
    x = torch.randn(*x_shape, requires_grad=True)
    module(x).square().sum().backward()
    assert module.onnx_weight("w").grad is not None
    report = ortbridge.gradcheck(module, torch.randn(*x_shape, requires_grad=True))
    assert report, report


class _MixFeedForward(nn.Module):
    """SegFormer's Mix-FFN: tokens back to an image by a Reshape to sizes the graph
    computes from shapes (Shape, Gather, Concat), a depthwise Conv, tokens again."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4, 8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, image):
        x = self.embed(image)
        n, _, h, w = x.shape
        tokens = self.fc(x.flatten(2).transpose(1, 2))
        x = self.depthwise(tokens.transpose(1, 2).reshape(n, 8, h, w))
        return x.flatten(2).transpose(1, 2)


def test_depthwise_conv_after_a_reshape_to_computed_sizes():
    """onnx's shape inference leaves the Conv's input shape unknown even with static
    input shapes: the shape arithmetic is folded before the Conv rewrites."""
    _check_layer(_MixFeedForward(), [(2, 3, 8, 10), (1, 3, 6, 4)])


class _WindowPad(nn.Module):
    """Swin's patch embedding and padding to whole windows: widths from the input's
    sizes (Shape, Mod, Sub, Concat, Pad in the TorchScript export)."""

    def __init__(self, patch=1, window=4):
        super().__init__()
        self.proj = nn.Conv2d(3, 4, patch, stride=patch)
        self.window = window

    def forward(self, x):
        x = self.proj(x)
        h, w = x.shape[2], x.shape[3]
        right, bottom = (-w) % self.window, (-h) % self.window
        return nn.functional.pad(x, (0, right, 0, bottom))


def test_pad_with_widths_computed_from_shapes():
    _check_layer(_WindowPad(), [(2, 3, 5, 7), (1, 3, 8, 6), (1, 3, 3, 4)])


def test_patch_embedding_larger_than_the_first_stand_in_shape():
    """The graphs built at construction for dynamic sizes of 2 cannot load (a 4x4
    kernel with stride 4 leaves nothing): sizes of 32 are tried next."""
    _check_layer(_WindowPad(patch=4, window=3), [(2, 3, 20, 28), (1, 3, 16, 8)])


def test_pad_with_widths_computed_from_data_is_refused_by_name():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("Cast", ["top"], ["width"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["width", "one"], ["w1"]),
        helper.make_node("Concat", ["zeros", "w1", "zeros", "w1"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"], "pad"),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zeros"),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(NotDifferentiableError, match="'pad'.*constant 'pads'"):
        module = OnnxModule(model, backend=ORT)
        module(torch.randn(2, 3, requires_grad=True)).sum().backward()


def _detector_like() -> onnx.ModelProto:
    """PP-OCRv6 det's forms at opset 11 with dynamic N/H/W: a strided SAME_UPPER Conv,
    an Erf GELU, a depthwise SAME_UPPER Conv, a ConvTranspose whose windows tile its
    output, a nearest Resize by scales."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array((0.5 * rng.standard_normal(shape)).astype(np.float32), name)

    same = {"auto_pad": "SAME_UPPER"}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "down", strides=[2, 2], **same),
        helper.make_node("Div", ["c1", "sqrt2"], ["s"]),
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["c1", "e1"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["gelu"]),
        helper.make_node("Conv", ["gelu", "w2"], ["c2"], "depthwise", group=4, **same),
        helper.make_node("ConvTranspose", ["c2", "w3"], ["up"], "up", strides=[2, 2]),
        helper.make_node("Resize", ["up", "roi", "scales"], ["y"], "resize", mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    ]  # fmt: skip
    inits = [
        weight("w1", 4, 3, 3, 3),
        weight("b1", 4),
        weight("w2", 4, 1, 4, 4),
        weight("w3", 4, 2, 2, 2),
        numpy_helper.from_array(np.array(2**0.5, np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, None, None])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    return model


def test_detector_forms_train_under_the_default_backend():
    """Built with the defaults: where the training build is installed, ``backend="auto"``
    routes the graph to the onnxruntime engine (no CPU kernel for ConvTranspose's and
    Resize's gradients there), whose gradients agree with finite differences."""
    module = OnnxModule(_detector_like())
    assert module.backend == ORT
    for shape in [(2, 3, 7, 6), (1, 3, 4, 5)]:
        report = ortbridge.gradcheck(module, torch.randn(*shape))
        assert report, report
    assert all(module.onnx_weight(w).requires_grad for w in ("w1", "w2", "w3"))


DEPTHWISE = {
    "3x3": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), [(2, 4, 8, 9), (3, 4, 5, 6)]),
    "strided": (lambda: nn.Conv2d(3, 3, 3, stride=2, padding=1, groups=3), [(2, 3, 9, 10)]),
    "dilated": (lambda: nn.Conv2d(2, 2, 3, dilation=2, padding=2, groups=2), [(2, 2, 7, 6)]),
    "uneven": (
        lambda: nn.Conv2d(3, 3, (1, 3), stride=(1, 2), padding=(0, 1), groups=3, bias=False),
        [(2, 3, 5, 11)],
    ),
    "2x2-unpadded": (lambda: nn.Conv2d(5, 5, 2, groups=5), [(1, 5, 6, 5)]),
}


def _built(module):
    """The forward and backward graphs the onnxruntime engine built and ran."""
    for graph in module._bridge._gradient_graphs.values():
        yield from graph._in_use()


def _backward_graphs(module):
    for built in _built(module):
        yield built.split.backward.graph


@pytest.fixture
def no_dense_depthwise(monkeypatch):
    """The depthwise Conv kept (a small image's would become products first:
    ``tests/engines/test_dense_depthwise.py``)."""
    from ortbridge._engines.onnxruntime.passes import _dense_depthwise

    monkeypatch.setattr(_dense_depthwise, "MAX_ONE_HOT", 0)


@pytest.mark.parametrize("case", list(DEPTHWISE))
def test_depthwise_weight_gradient_as_im2col(case, no_dense_depthwise):
    """A depthwise Conv of at most 9 taps over at least 16 output positions
    gets its weight gradient as im2col and a batched MatMul (onnxruntime runs
    the grouped Conv on one thread): torch's gradients at each shape, and the
    grouped weight-gradient Conv not built."""
    make, shapes = DEPTHWISE[case]
    torch.manual_seed(0)
    module = _check_layer(make(), shapes)
    graphs = list(_backward_graphs(module))
    assert len(graphs) == len(shapes)
    for graph in graphs:
        assert any(n.op_type == "MatMul" and "depthwise_w" in n.name for n in graph.node)
        assert not _grouped_weight_convs(graph)


def _grouped_weight_convs(graph):
    return [n.name for n in graph.node if n.op_type == "Conv" and "grouped_conv_w" in n.name]


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv2d(3, 3, 5, padding=2, groups=3), (2, 3, 8, 8)),  # 25 taps
        (lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3), (2, 3, 3, 3)),  # 9 positions
        (lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4), (2, 4, 8, 8)),  # two filters a group
    ],
    ids=["5x5", "small-image", "multiplier"],
)
def test_depthwise_weight_gradient_keeps_the_grouped_conv(make, shape, no_dense_depthwise):
    """Larger kernels and smaller images measured slower as im2col (a 5x5 1.6x
    on one thread, a 2x2 image 1.5x): their weight gradient stays one grouped
    Conv, as does a depthwise Conv of several filters a channel."""
    torch.manual_seed(0)
    module = _check_layer(make(), [shape])
    (graph,) = _backward_graphs(module)
    assert _grouped_weight_convs(graph)


def test_depthwise_weight_gradient_under_auto_pad_matches_finite_differences(no_dense_depthwise):
    """auto_pad SAME_UPPER with stride 2 (tf2onnx writes it): the im2col Conv
    takes the forward's window attributes as they are (float32: onnxruntime
    has no float64 Conv)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(3, 1, 3, 3)).astype(np.float32), "w")
    node = helper.make_node(
        "Conv", ["x", "w"], ["y"], group=3, strides=[2, 2], auto_pad="SAME_UPPER"
    )
    graph = helper.make_graph(
        [node],
        "depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 5])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = OnnxModule(model, backend=ORT)
    x = torch.randn(2, 3, 8, 9)
    report = ortbridge.gradcheck(module, x)
    assert report, report
    (graph,) = _backward_graphs(module)
    assert any("depthwise_w" in n.name for n in graph.node)


def _profiled_ops(monkeypatch, tmp_path, nchwc: bool) -> set[str]:
    """The op types onnxruntime ran in a depthwise Conv's gradient sessions."""
    import glob
    import json
    import os

    from conftest import export

    from ortbridge._engines.onnxruntime import _engine
    from ortbridge._runtime import _ort

    if nchwc:  # every optimiser on, as before
        real = _engine._session
        monkeypatch.setattr(_engine, "_session", lambda *a, off=(), **k: real(*a, **k))
    tmp_path.mkdir()
    options = _ort.runtime().SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tmp_path, "ort")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU()).eval()
    x = torch.randn(2, 16, 12, 40)
    layer = OnnxModule(export(net, (x,)), backend="onnxruntime", session_options=options)
    layer.eval()(x).sum().backward()
    for graph in layer._bridge._gradient_graphs.values():
        for session in graph.sessions:
            session.end_profiling()
    ops = set()
    for path in glob.glob(os.path.join(tmp_path, "*.json")):
        with open(path) as f:
            ops.update(e["args"].get("op_name") for e in json.load(f) if e.get("cat") == "Node")
    return ops


def test_a_backward_runs_its_depthwise_gathers_without_the_nchwc_layout(monkeypatch, tmp_path):
    """onnxruntime lays a Conv of constant weights out in NCHWc blocks: in a
    backward, the one-hot gather of a depthwise weight gradient (9 taps padded
    to 16 channels and reordered back: 24 ms of PP-OCRv6's recogniser's step
    at batch 8). The backward sessions keep that layout off."""
    if "onnxruntime" not in ENGINES:
        pytest.skip("onnx-ad is not installed")
    before = _profiled_ops(monkeypatch, tmp_path / "before", nchwc=True)
    if not before & {"ReorderInput", "ReorderOutput"}:
        pytest.skip("this CPU's onnxruntime lays out no NCHWc blocks here")
    monkeypatch.undo()
    assert not _profiled_ops(monkeypatch, tmp_path / "now", nchwc=False) & {
        "ReorderInput",
        "ReorderOutput",
    }
