"""The onnxruntime engine: residuals in autograd, double backward, Dropout, choosing engines."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from _measure import saved_bytes
from conftest import ENGINES, export, scaled_atol
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortbridge import OnnxModule
from ortbridge._engines.onnxruntime import _engine as _onnxruntime
from ortbridge._engines.onnxruntime import _split
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge.examples import linear_model
from ortbridge.exceptions import (
    MissingDependencyError,
    NotDifferentiableError,
    OnnxInputError,
    OrtBridgeError,
)

ORT = "onnxruntime"
needs_engine = pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")


def _tanh_model(dtype=TensorProto.FLOAT):
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["y"])],
        "tanh",
        [helper.make_tensor_value_info("x", dtype, ["n", 3])],
        [helper.make_tensor_value_info("y", dtype, ["n", 3])],
        [numpy_helper.from_array(np.linspace(0.5, 1.5, 3).astype(np_type), "w")],
    )
    return make_model(graph)


def _mlp64(engine=ORT):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    layer = OnnxModule(export(model, (x,)), backend=engine)
    assert layer.backend == ORT  # "auto" too: the engine whose backward is differentiable
    return model, layer


# -- choosing an engine -------------------------------------------------------


def test_unknown_backend_lists_the_choices():
    with pytest.raises(OnnxInputError, match=r"backend must be one of \['auto', 'training-agent'"):
        OnnxModule(linear_model(3, 2), backend="tensorrt")


def test_training_agent_without_the_training_build_names_the_extra(monkeypatch):
    monkeypatch.setattr(_ort, "has_training", lambda: False)
    with pytest.raises(MissingDependencyError, match=r"ortbridge\[cpu\]"):
        OnnxModule(linear_model(3, 2), backend="training-agent")


@needs_engine
def test_onnxruntime_engine_without_onnx_ad_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx_ad", None)
    with pytest.raises(MissingDependencyError, match=r"pip install onnx-ad"):
        OnnxModule(linear_model(3, 2), backend=ORT)


@needs_engine
def test_auto_says_which_engine_runs_and_why():
    layer = OnnxModule(linear_model(3, 2))
    assert layer.backend in ENGINES
    if not _ort.has_training():
        assert layer.backend == ORT
        assert "training build is not installed" in layer.backend_reason
    # A graph with a Loop is never handed to the training build's builder.
    lstm = nn.LSTM(3, 4, batch_first=True, bidirectional=True)
    layer = OnnxModule(export(lstm, (torch.randn(2, 5, 3),), dynamic_batch=False))
    assert layer.backend == ORT


@needs_engine
def test_a_node_onnx_ad_gets_wrong_is_refused_by_name():
    # y = Det(A * w): Det on the path from w is refused when w is asked
    # for; freezing w (nothing on a gradient path) leaves a module that runs.
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["a", "w"], ["aw"]),
            helper.make_node("Det", ["aw"], ["y"], name="determinant"),
        ],
        "det",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.ones((3, 3), np.float32), "w")],
    )
    with pytest.raises(NotDifferentiableError, match=r"node 'determinant' \(op type Det\)"):
        OnnxModule(make_model(graph), trainable=["w"], backend=ORT)
    # By default the weight before it stays frozen, named.
    with pytest.warns(UserWarning, match=r"'determinant' \(op type Det\).*1 weights before it"):
        layer = OnnxModule(make_model(graph), backend=ORT)
    assert not layer.onnx_weight("w").requires_grad
    torch.testing.assert_close(layer(torch.eye(3) * 2), torch.tensor(8.0))
    frozen = OnnxModule(make_model(graph), trainable=[], backend=ORT)
    torch.testing.assert_close(frozen(torch.eye(3) * 2), torch.tensor(8.0))


# -- residuals in torch's autograd --------------------------------------------


@needs_engine
def test_interleaved_forwards_backwards_and_freeing():
    layer = OnnxModule(_tanh_model(), backend=ORT)
    w = layer.onnx_weight("w").detach().clone().requires_grad_()
    x1, x2 = torch.randn(5, 3), torch.randn(2, 3)
    y1, y2 = layer(x1), layer(x2)
    (y2**2).sum().backward()
    g2 = layer.onnx_weight("w").grad.clone()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y2.sum().backward()  # its residuals were freed with its backward
    layer.zero_grad()
    (y1**3).sum().backward()
    g1 = layer.onnx_weight("w").grad.clone()
    (torch.tanh(x2 * w) ** 2).sum().backward()
    torch.testing.assert_close(g2, w.grad)
    w.grad = None
    (torch.tanh(x1 * w) ** 3).sum().backward()
    torch.testing.assert_close(g1, w.grad)


@needs_engine
def test_retain_graph_reuses_the_residuals_without_running_forward_again(monkeypatch):
    layer = OnnxModule(_tanh_model(), backend=ORT)
    x = torch.randn(4, 3, requires_grad=True)
    y = layer(x)
    runs = []
    real = _onnxruntime._Built.forward
    monkeypatch.setattr(_onnxruntime._Built, "forward", lambda *a: runs.append(1) or real(*a))
    y.sum().backward(retain_graph=True)
    first = layer.onnx_weight("w").grad.clone()
    y.sum().backward()
    torch.testing.assert_close(layer.onnx_weight("w").grad, 2 * first)
    assert runs == []


def _saved_bytes(module, x) -> int:
    """Bytes a forward keeps for backward, weights and the input excluded."""
    own = {t.untyped_storage().data_ptr() for t in [x, *module.parameters(), *module.buffers()]}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return sum(kept.values())


@needs_engine
def test_backward_keeps_no_copy_of_an_input():
    """The zero-interleaved, padded input a ConvTranspose with overlapping windows
    becomes is redone in the backward, not saved: a UNet decoder block keeps at
    most 1.2x torch's bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        nn.GroupNorm(2, 4), nn.ReLU(),
        nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(4, 2, 3, padding=1),
    )  # fmt: skip
    x = torch.randn(2, 8, 6, 6)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    ours, torchs = _saved_bytes(layer, x), _saved_bytes(model, x)
    assert ours <= 1.2 * torchs, (ours, torchs)


@needs_engine
@pytest.mark.parametrize(
    ("c_in", "stride", "padding", "batch"), [(1, 1, 0, 4), (3, 2, 1, 5), (4, 1, 2, 1), (2, 3, 1, 3)]
)
def test_conv_weight_gradient_by_im2col_matches_torch(c_in, stride, padding, batch):
    """The weight gradient onnx-ad writes as a Conv over transposed tensors runs as
    im2col and a batched MatMul (``passes/_conv_grad.py``): same gradients as torch."""
    torch.manual_seed(c_in)
    model = nn.Sequential(
        nn.Conv2d(c_in, 5, 3, stride=stride, padding=padding), nn.Tanh(), nn.Conv2d(5, 2, 2)
    )  # float32: onnxruntime has no float64 Conv on the CPU
    x = torch.randn(batch, c_in, 11, 9)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    layer(x).sum().backward()
    model(x).sum().backward()
    atol = scaled_atol(1e-5, *(p.grad for p in model.parameters()))
    for name, param in model.named_parameters():
        torch.testing.assert_close(layer.get_parameter(name).grad, param.grad, rtol=1e-5, atol=atol)
    graph = layer._bridge.gradient_graph("train", [False, *[True] * 4], x.device, [x])
    built = graph.static_built([x])
    ops = [(n.op_type, n.output[0]) for n in built.split.backward.graph.node]
    # A batch of one too (its Transposes became Reshapes): the weight-gradient
    # Conv's huge kernel costs as much there (YOLOv8n at batch 1: 0.82x the step).
    rewritten = sum(1 for op, out in ops if op == "Conv" and out.endswith("/cols"))
    assert rewritten == 2, ops


@needs_engine
@pytest.mark.parametrize(
    ("kernel", "padding", "size", "gathered"),
    [(3, 1, 20, (3, 3)), (3, 1, 19, (3, 3)), (5, 2, 20, (5, 5)), (3, 0, 19, (3, 3))],
    ids=["3x3-overhang", "3x3-exact", "5x5-overhang", "3x3-unpadded"],
)
def test_strided_conv_weight_gradient_gathers_only_the_kernels_taps(
    kernel, padding, size, gathered
):
    """A stride-2 convolution whose padded input overhangs its last window: onnx-ad
    computes its weight gradient one row and column past the kernel and crops
    it; the im2col form gathers only the taps the crop keeps (a 3x3 gathered
    16 before, a 5x5's 36 taps kept onnx-ad's Conv). Torch's gradients."""
    torch.manual_seed(kernel + size)
    model = nn.Sequential(
        nn.Conv2d(6, 32, kernel, stride=2, padding=padding), nn.Tanh(), nn.Conv2d(32, 2, 1)
    )
    x = torch.randn(3, 6, size, size)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x])
    backward = graph.static_built([x]).split.backward.graph
    kernels = [
        tuple(n.attribute[0].t.dims[2:]) for n in backward.node
        if n.op_type == "Constant" and n.output[0].endswith("/onehot")
    ]  # fmt: skip
    assert kernels == [gathered], kernels


@needs_engine
@pytest.mark.parametrize(
    ("scale", "mode", "block"),
    [(2, "nearest", True), ((2, 3), "nearest", True), (1.5, "nearest", False),
     (2, "bilinear", False)],
)  # fmt: skip
def test_nearest_upsampling_gradient_sums_each_block(scale, mode, block):
    """A nearest Resize by integer factors (a feature pyramid's upsampling) has its
    gradient as one Reshape and a ReduceSum over each block, not onnx-ad's
    interpolation matrices between Transposes; other Resizes keep onnx-ad's
    rule. Torch's gradients, both."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=scale, mode=mode), nn.Tanh()
    )
    x = torch.randn(2, 3, 6, 8)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 3, x.device, [x])
    reverse = graph.static_built([x]).reverse.graph
    matrices = [n for n in reverse.node if n.op_type == "MatMul" and "a_resize" in n.output[0]]
    assert (not matrices) == block, [n.output[0] for n in matrices]


@needs_engine
@pytest.mark.parametrize(
    "kernel, stride, padding, output_padding",
    [(2, 2, 0, 0), (4, 2, 1, 0), (3, 2, 1, 1), (3, 1, 1, 0)],
    ids=["db-head-2x2", "gan-4x4", "unet-3x3", "stride-1"],
)
def test_trained_conv_transpose_runs_onnxruntimes_kernel_forward(
    kernel, stride, padding, output_padding
):
    """A trained 2-D ConvTranspose stays one ConvTranspose in the forward graph
    (onnxruntime's kernel, not patches or a Conv over a zero-inserted input);
    its input gradient is a Conv, its weight gradient im2col and a product.
    Torch's gradients."""
    torch.manual_seed(kernel)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(),
        nn.ConvTranspose2d(6, 4, kernel, stride, padding, output_padding), nn.Tanh(),
    )  # fmt: skip
    x = torch.randn(2, 3, 7, 9)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x])
    split = graph.static_built([x]).split
    assert [n.op_type for n in split.forward.graph.node].count("ConvTranspose") == 1
    backward = split.backward.graph.node
    assert "ConvTranspose" not in [n.op_type for n in backward]
    assert sum(n.op_type == "Conv" and n.output[0].endswith("/cols") for n in backward) == 2


@needs_engine
@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("rounding", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize(
    "transform",
    ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "asymmetric",
     "tf_half_pixel_for_nn", "align_corners"],
)  # fmt: skip
def test_nearest_upsampling_gradient_under_every_coordinate_mode(transform, rounding, factor):
    """Every coordinate transform and rounding of a nearest Resize, by 2 and 3:
    the gradient sums the output gradient at the input element each output
    element reads, as onnxruntime's kernel reads it (an index probe through
    the same Resize), whether the block form applies or onnx-ad's rule."""
    shape = (2, 3, 5, 4)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    scales = numpy_helper.from_array(np.array([1, 1, factor, factor], np.float32), "scales")
    attrs = dict(mode="nearest", coordinate_transformation_mode=transform, nearest_mode=rounding)
    resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)
    model = make_model(helper.make_graph([resize], "g", [x], [y], [scales]), opset=13)
    probe = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    index = (
        _ort.runtime()
        .InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        .run(None, {"x": probe})[0]
        .astype(np.int64)
    )
    layer = OnnxModule(model, backend=ORT)
    xt = torch.from_numpy(probe).requires_grad_()
    weights = torch.randn(index.shape)
    (layer(xt) * weights).sum().backward()
    expected = np.zeros(probe.size, np.float32)
    np.add.at(expected, index.ravel(), weights.numpy().ravel())
    np.testing.assert_allclose(xt.grad.numpy().ravel(), expected, rtol=1e-6, atol=1e-6)


@needs_engine
def test_a_bias_gradient_is_one_product_by_a_vector_of_ones():
    """A bias's gradient, the sum over leading axes, runs as the vector of ones
    times the gradient, written as the bias's shape: no Reshape after the
    product (28 nodes fewer in ConvNeXt's backward, 44 in ViT's). Torch's
    gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    x = torch.randn(5, 4, 6)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 7, x.device, [x])
    backward = graph.static_built([x]).split.backward.graph
    producer = {o: n for n in backward.node for o in n.output}
    biases = [o.name for o in backward.output if o.name.endswith("bias_value")]
    assert len(biases) == 3, [o.name for o in backward.output]
    assert [producer[b].op_type for b in biases] == ["MatMul"] * 3


@needs_engine
@pytest.mark.parametrize(
    ("c_in", "c_out", "batch", "size"), [(3, 5, 4, (6, 5)), (64, 96, 2, (4, 3)), (8, 4, 1, (5, 7))]
)
def test_pointwise_conv_weight_gradient_is_one_matmul(c_in, c_out, batch, size):
    """A 1x1 convolution's weight gradient, onnx-ad's Conv whose one window is
    its whole input, runs as one MatMul (``passes/_conv_grad.py``), whether
    the im2col form would take it or not (64 -> 96 channels: its product too
    large), taken in the filters' order; a strided 1x1 (a dilated window) is
    left to the other forms. Torch's gradients."""
    torch.manual_seed(c_in)
    model = nn.Sequential(
        nn.Conv2d(c_in, c_out, 1), nn.Tanh(), nn.Conv2d(c_out, 3, 1, stride=2), nn.Tanh()
    )
    x = torch.randn(batch, c_in, *size)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x])
    backward = graph.static_built([x]).split.backward.graph
    products = [
        n.output[0] for n in backward.node
        if n.op_type == "MatMul" and n.output[0].endswith(("/product", "_swapped"))
    ]  # fmt: skip
    # taken in the filters' order (passes/_weight_products.py): onnx-ad's
    # transpose of the (C_in, C_out) product is gone
    assert len(products) == 1 and products[0].endswith("_swapped"), products


@needs_engine
@pytest.mark.parametrize(
    "kernel, stride, padding, dilation, as_conv",
    [
        (3, 1, 1, 1, True),
        (3, 1, 0, 2, True),
        (3, 2, 1, 1, False),
        (5, 1, 2, 1, True),
        (7, 1, 3, 1, True),
        (9, 1, 4, 1, False),
    ],
    ids=["3x3", "3x3-dilated", "3x3-strided", "5x5", "7x7", "9x9"],
)
def test_depthwise_input_gradient_of_stride_one_is_a_depthwise_conv(
    kernel, stride, padding, dilation, as_conv, monkeypatch
):
    """A depthwise kernel of stride 1 up to 7x7: its input gradient runs as the
    depthwise Conv with the flipped kernel (onnxruntime's depthwise
    ConvTranspose is slower); strided or larger kernels keep the
    ConvTranspose; torch's gradients. (The Conv kept: over this small image
    it would become products first.)"""
    from ortbridge._engines.onnxruntime.passes import _dense_depthwise

    monkeypatch.setattr(_dense_depthwise, "MAX_ONE_HOT", 0)
    torch.manual_seed(kernel)
    model = nn.Sequential(
        nn.Conv2d(6, 6, kernel, stride=stride, padding=padding, dilation=dilation, groups=6),
        nn.Tanh(),
    )
    x = torch.randn(3, 6, 9, 8)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    _compare(model, layer, x)
    graph = layer._bridge.gradient_graph("train", [True] * 3, x.device, [x])
    ops = [n.op_type for n in graph.static_built([x]).split.backward.graph.node]
    assert ("ConvTranspose" not in ops) == as_conv, ops


@needs_engine
def test_large_kernel_of_few_filters_keeps_one_convolution_for_its_weight_gradient():
    """A stem's 7x7 kernel over 3 channels into 8 filters: im2col by one-hot
    kernels would cost 64 products a window element against the 8 of the
    product after it, so onnx-ad's one convolution stays; torch's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 7, stride=2, padding=3), nn.Tanh())
    x = torch.randn(4, 3, 16, 16)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    layer(x).sum().backward()
    model(x).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(layer.get_parameter(name).grad, param.grad, rtol=1e-4, atol=1e-4)
    graph = layer._bridge.gradient_graph("train", [False, True, True], x.device, [x])
    backward = graph.static_built([x]).split.backward.graph
    assert not [n for n in backward.node if n.op_type == "Conv" and n.output[0].endswith("/cols")]


@needs_engine
@pytest.mark.parametrize(
    "stride, padding, dilation, size",
    [(1, 0, 1, 9), (2, 1, 1, 9), (2, 0, 1, 8), (1, 2, 2, 10), (3, 1, 1, 11)],
)
def test_conv_input_gradient_by_col2im_matches_torch(stride, padding, dilation, size):
    """The input gradient as MatMul and Col2Im, not ConvTranspose: strided (also
    where the last rows are in no window), padded and dilated, against torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride, padding, dilation), nn.Tanh())
    x = torch.randn(2, 3, size, size + 1)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True, True, True], x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert "Col2Im" in ops and "ConvTranspose" not in ops, ops


@needs_engine
@pytest.mark.parametrize(
    "stride, padding, dilation, size, col2im",
    [(2, 1, 1, 20, True), (3, 0, 1, 17, True), (2, 2, 2, 15, True), (1, 1, 1, 20, False)],
)
def test_strided_1d_conv_input_gradient_by_col2im_matches_torch(
    stride, padding, dilation, size, col2im
):
    """A strided 1-D Conv (Whisper's audio stem) has its input gradient as MatMul
    and Col2Im over an image of one row; stride 1 keeps onnxruntime's faster 1-D
    ConvTranspose. Gradients as torch's either way."""
    torch.manual_seed(stride)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, stride, padding, dilation), nn.Tanh())
    x = torch.randn(2, 3, size)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True, True, True], x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert ("Col2Im" in ops and "ConvTranspose" not in ops) == col2im, ops


@needs_engine
@pytest.mark.parametrize(
    "batch, kernel, padding, dilation, as_conv",
    [
        (2, 3, 1, 1, True),
        (1, 3, 1, 1, False),
        (2, (3, 5), (1, 2), 1, True),
        (3, 3, 0, 2, True),
    ],
    ids=["3x3", "3x3-few-positions", "3x5", "3x3-dilated"],
)
def test_dense_input_gradient_of_stride_one_over_many_positions_is_a_conv(
    batch, kernel, padding, dilation, as_conv, monkeypatch
):
    """A dense convolution of stride 1 over many output positions has its input
    gradient as the Conv of the gradient by the flipped kernel, its channel
    axes swapped (onnxruntime's Col2Im runs on one thread); over fewer, MatMul
    and Col2Im; torch's gradients either way. (The threshold lowered to this
    small image's positions.)"""
    from ortbridge._engines.onnxruntime.passes import _conv_grad

    monkeypatch.setattr(_conv_grad, "_FLIPPED_POSITIONS", 250)
    torch.manual_seed(batch)
    model = nn.Sequential(nn.Conv2d(3, 5, kernel, 1, padding, dilation), nn.Tanh())
    x = torch.randn(batch, 3, 14, 15)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True, True, True], x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert "ConvTranspose" not in ops, ops
    assert ("Col2Im" not in ops) == as_conv, ops


@needs_engine
@pytest.mark.parametrize(
    "batch, channels, size, one_product",
    [(4, 32, 4, True), (1, 32, 4, True), (2, 4, 12, False)],
    ids=["deep", "deep-batch-1", "shallow"],
)
def test_weight_gradient_of_many_channels_over_few_positions_is_one_product(
    batch, channels, size, one_product
):
    """Where one product per image would hold many times the activations (a deep
    layer: many channels, few positions), the weight gradient is one product
    over every image's positions instead (not onnx-ad's convolution, 1.5-2.4x
    slower there); a shallow layer keeps the batched products. Torch's
    gradients either way."""
    torch.manual_seed(channels)
    model = nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.Tanh())
    x = torch.randn(batch, channels, size, size)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True, True, True], x.device, [x])
    backward = built.static_built([x]).split.backward.graph
    made = {o.rsplit("/", 1)[-1] for n in backward.node for o in n.output}
    assert "cols" in made, made  # the im2col form, not onnx-ad's convolution
    assert ("cols2_t" in made) == one_product, made


class _ViewThenMatMul(nn.Module):
    """A transposed activation, reshaped, which a MatMul's weight gradient reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, x):
        h = self.lin(x).view(-1, 2, 3).transpose(1, 2).reshape(-1, 6)
        return torch.tanh(h @ self.w)


@needs_engine
def test_forward_returns_the_tensor_a_saved_view_views():
    """onnxruntime copies a Reshape's output to return it: the forward returns
    the tensor viewed and the backward takes the view (gradients as torch's)."""
    torch.manual_seed(0)
    model = _ViewThenMatMul()
    x = torch.randn(5, 4)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True] * 4, x.device, [x]).static_built([x])
    forward = built.split.forward.graph
    producer = {o: n for n in forward.node for o in n.output}
    returned = [o.name for o in forward.output][built.n_primal :]
    assert returned, "the backward reads no forward tensor"
    views = [
        n for n in returned if producer.get(n) is not None and producer[n].op_type == "Reshape"
    ]
    assert views == [], views
    assert "Reshape" in [n.op_type for n in built.split.backward.graph.node]


def _counting_builds(monkeypatch) -> list:
    """Record (static shapes, check only) of each onnxruntime-engine build."""
    built = []
    original = _onnxruntime._Built.__init__

    def counting(self, *args, static=None, check_only=False):
        built.append((static, check_only))
        original(self, *args, static=static, check_only=check_only)

    monkeypatch.setattr(_onnxruntime._Built, "__init__", counting)
    return built


@needs_engine
def test_construction_only_checks_and_the_first_call_builds_once(monkeypatch):
    """OnnxModule(...) runs onnx-ad's reverse pass alone, on a stand-in shape
    (what cannot be differentiated is still refused there); the graphs that
    run are built at the first call for its shapes, once, and not the
    shape-generic ones."""
    built = _counting_builds(monkeypatch)
    layer = OnnxModule(_tanh_model(), backend=ORT)
    assert built == [(((2, 3),), True)]
    for _ in range(2):
        layer(torch.randn(5, 3)).sum().backward()
    assert built[1:] == [(((5, 3),), False)]
    assert all(p.grad is not None for p in layer.parameters())


@needs_engine
def test_construction_check_of_a_graph_needing_static_shapes_uses_a_stand_in(monkeypatch):
    """A depthwise Conv's weight gradient over dynamic heights and widths needs
    static shapes: the construction's check runs the reverse pass on stand-in
    shapes, once (no shape-generic pass runs until it fails), and the first
    call builds for its own."""
    built = _counting_builds(monkeypatch)
    conv = nn.Conv2d(2, 2, 3, padding=1, groups=2)
    x = torch.randn(4, 2, 6, 5)
    dims = {0: torch.export.Dim("n", min=1), 2: torch.export.Dim("h", min=2)}
    dims[3] = torch.export.Dim("w", min=2)
    layer = OnnxModule(export(conv, (x,), dynamic_shapes=(dims,)), backend=ORT)
    assert built == [(((2, 2, 2, 2),), True)]  # every dynamic dimension as 2
    layer(x).sum().backward()
    assert built[1:] == [(((4, 2, 6, 5),), False)]


@needs_engine
def test_construction_check_falls_back_to_the_shape_generic_graph(monkeypatch):
    """A graph no stand-in shape builds is checked shape-generic (and accepted
    where that works); where that needs static shapes too, the stand-in's
    error is the one raised."""
    built = _counting_builds(monkeypatch)
    original = _onnxruntime._Built.__init__

    def no_stand_in(self, *args, static=None, check_only=False):
        if static is not None:
            raise NotDifferentiableError(f"stand-in {static}")
        original(self, *args, static=static, check_only=check_only)

    monkeypatch.setattr(_onnxruntime._Built, "__init__", no_stand_in)
    layer = OnnxModule(_tanh_model(), backend=ORT)  # accepted: the generic graph works
    assert layer(torch.randn(5, 3)).shape == (5, 3)

    conv = nn.Conv2d(2, 2, 3, padding=1, groups=2)
    x = torch.randn(4, 2, 6, 5)
    dims = {0: torch.export.Dim("n", min=1), 2: torch.export.Dim("h", min=2)}
    dims[3] = torch.export.Dim("w", min=2)
    with pytest.raises(NotDifferentiableError, match=r"stand-in \(\(32, 2, 32, 32\),\)"):
        OnnxModule(export(conv, (x,), dynamic_shapes=(dims,)), backend=ORT)
    # What reached the engine: the tanh graph's generic check and (its call's
    # static build refused) generic graphs; the Conv's generic check.
    assert built == [(None, True), (None, False), (None, True)]


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize(
    "axes, keepdims",
    [([2], 1), ([-2], 0), ([0, 2], 1), ([1, 3], 1), ([1], 1), ([1, 2], 0), ([0], 1), ([0, 1], 0)],
)
@pytest.mark.parametrize("opset", [18, 11])
def test_reductions_take_onnxruntime_fast_paths(op, axes, keepdims, opset):
    """onnxruntime reduces an axis followed by a unit one slowly: the reduction
    reads a view without unit axes; a sum over leading axes is a product with
    a row of ones. The result is the same (up to the order of float
    additions). Reducing unit axes only is left alone (a view, for
    collapse_views). Before opset 18 (13 for ReduceSum) the axes are an
    attribute (TorchScript's LayerNorm backward at opset 17)."""

    from ortbridge._engines.onnxruntime.passes._reductions import fast_reductions

    shape = [3, 1, 5, 1]
    if opset >= 18:
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
        inits = [numpy_helper.from_array(np.array(axes, np.int64), "axes")]
    else:
        node, inits = helper.make_node(op, ["x"], ["y"], axes=axes, keepdims=keepdims), []
    graph = helper.make_graph(
        [node],
        "reduce",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = make_model(graph, opset)
    rewritten = make_model(graph, opset)
    fast_reductions(rewritten)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    expected = _ort_run(model, {"x": x})[0]
    np.testing.assert_allclose(_ort_run(rewritten, {"x": x})[0], expected, rtol=1e-6, atol=1e-6)
    assert _ort_run(rewritten, {"x": x})[0].shape == expected.shape
    ops = [n.op_type for n in rewritten.graph.node]
    reduced = {a % len(shape) for a in axes if shape[a] != 1}
    if not reduced:  # unit axes only: untouched
        assert ops == [op], ops
    elif op == "ReduceSum" and reduced == {0}:  # the batch axis: a GEMV
        assert op not in ops and "MatMul" in ops, ops
    else:
        (node,) = [n for n in rewritten.graph.node if n.op_type == op]
        assert node.input[0] != "x", ops  # a view without the unit axes


@pytest.mark.parametrize(
    "shape, perm, ops",
    [
        ((2, 4, 3, 5, 1), [1, 4, 0, 2, 3], ["Reshape", "Transpose", "Reshape"]),
        ((6, 4, 1, 3, 3), [1, 0, 3, 4, 2], ["Reshape", "Transpose", "Reshape"]),
        ((2, 1, 3, 1), [1, 3, 0, 2], ["Reshape"]),  # only unit axes move: a view
        ((2, 4, 3, 1), [1, 0, 2, 3], ["Transpose"]),  # the unit axis stays: left alone
    ],
)
def test_transposes_that_move_a_unit_axis_transpose_the_other_axes(shape, perm, ops):
    """onnxruntime's Transpose is up to 12x slower where a unit axis moves than
    its squeezed form: such a Transpose becomes views around the Transpose of
    the other axes (a view alone where only unit axes move); the same values."""

    from ortbridge._engines.onnxruntime.passes._optimize import _shapes
    from ortbridge._engines.onnxruntime.passes.unit_axes._transposes import squeezed_transposes

    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=perm),
            helper.make_node("Neg", ["t"], ["y"]),
        ],
        "transpose",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = make_model(graph)
    rewritten = make_model(graph)
    squeezed_transposes(rewritten, _shapes(rewritten))
    assert [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"] == [*ops, "Neg"]
    feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}

    np.testing.assert_array_equal(_ort_run(rewritten, feeds)[0], _ort_run(model, feeds)[0])


@needs_engine
def test_conv1d_weight_gradient_transposes_without_moving_the_seed_axis():
    """A 1-D Conv's weight gradient: onnx-ad moves its seed axis with the
    gradient's batch (Whisper's stem); after the optimiser no Transpose of the
    backward moves a unit axis, and the gradients are torch's."""
    from ortbridge._engines.onnxruntime.passes._optimize import _perm, _shapes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 2, 3, stride=2))
    x = torch.randn(5, 3, 12)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x]).static_built([x])
    backward = built.split.backward
    shapes = _shapes(backward)
    transposes = [n for n in backward.graph.node if n.op_type == "Transpose"]
    assert transposes
    for node in transposes:
        shape = shapes[node.input[0]]
        perm = _perm(node) or list(reversed(range(len(shape))))
        units = [a for a, d in enumerate(shape) if d == 1]
        assert units == [k for k, a in enumerate(perm) if shape[a] == 1], (shape, perm)


@pytest.mark.parametrize(
    "big, small, spread",
    [
        ((1024, 8, 1), (1024, 1, 1), True),  # a value per row (LayerNorm's statistics)
        ((16, 64, 8), (16, 64, 1), True),
        ((16, 64, 8, 1), (8, 1), False),  # a vector along the rows: no step moved
        ((1024, 64), (1024, 1), False),  # long rows: the row loop costs less
        ((100, 8), (100, 1), False),  # few rows
        ((16, 64, 8), (16, 1, 8), False),  # neither per row nor along the rows
        ((1024, 8), (1, 1), False),  # one element
    ],
)
@pytest.mark.parametrize("op", ["Sub", "Div"])
def test_short_broadcasts_spread_their_operand_first(big, small, spread, op):
    """onnxruntime broadcasts row by row, about 9 ns a row: a value per short row
    is spread by a product with ones and the op runs on same-shaped operands;
    the values are the same bits (the operand first, for Sub and Div, keeps
    its slot)."""

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes._short_broadcasts import spread_short_broadcasts

    graph = helper.make_graph(
        [helper.make_node(op, ["s", "x"], ["y"])],
        "broadcast",
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, small),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, big),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = make_model(graph)
    rewritten = make_model(graph)
    spread_short_broadcasts(rewritten, facts(rewritten))
    (node,) = [n for n in rewritten.graph.node if n.op_type == op]
    assert (node.input[0] != "s") == spread and node.input[1] == "x"
    assert ("MatMul" in [n.op_type for n in rewritten.graph.node]) == spread
    rng = np.random.default_rng(0)
    feeds = {
        "s": rng.uniform(0.5, 2.0, small).astype(np.float32),
        "x": rng.standard_normal(big).astype(np.float32),
    }

    np.testing.assert_array_equal(_ort_run(rewritten, feeds)[0], _ort_run(model, feeds)[0])


@needs_engine
def test_layer_norm_over_few_channels_spreads_its_broadcasts():
    """LayerNorm over 8 channels of 1024 rows: its backward's per-row statistics
    are spread before their ops; torch's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())
    x = torch.randn(16, 64, 8)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x]).static_built([x])
    outputs = [n.output[0] for n in built.split.backward.graph.node if n.op_type == "MatMul"]
    assert any("/spread_" in name for name in outputs), outputs


@pytest.mark.parametrize("operand", ["initializer", "Constant", "computed"])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_one_element_operands_get_the_rank_of_a_result_with_unit_axes(operand, shape):
    """onnxruntime broadcasts a one-element operand of a lower rank over a
    tensor with a trailing unit axis (onnx-ad's seed axis) one element at a
    time, 80x slower than the same element at full rank: the operand is
    reshaped to (1,) * rank, the result unchanged. A result without unit axes
    is left alone."""

    from ortbridge._engines.onnxruntime.passes._optimize import facts
    from ortbridge._engines.onnxruntime.passes._scalar_operands import full_rank_scalars

    value = np.full(shape, 1.5, np.float32)
    nodes, inits = [], []
    if operand == "initializer":
        inits.append(numpy_helper.from_array(value, "c"))
    elif operand == "Constant":
        nodes.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value)))
    else:
        inits.append(numpy_helper.from_array(value, "c0"))
        nodes.append(helper.make_node("Neg", ["c0"], ["c"]))
    nodes += [
        helper.make_node("Div", ["x", "c"], ["y"]),
        helper.make_node("Mul", ["c", "z"], ["w"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scalars",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 1]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, None),
        ],
        inits,
    )
    model = make_model(graph)
    rewritten = make_model(graph)
    full_rank_scalars(rewritten, facts(rewritten))
    by_output = {n.output[0]: n for n in rewritten.graph.node}
    divisor = by_output["y"].input[1]
    assert divisor != "c"
    assert facts(rewritten).shapes[divisor] == (1, 1, 1)
    assert by_output["w"].input[0] == "c"  # (4, 3) has no unit axis: untouched
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((4, 3, 1)).astype(np.float32),
        "z": rng.standard_normal((4, 3)).astype(np.float32),
    }

    for got, expected in zip(_ort_run(rewritten, feeds), _ort_run(model, feeds)):
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


class _TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 4, 3),
            nn.BatchNorm2d(4),
            nn.Tanh(),
        )

    def forward(self, x):
        return self.net(x)


def _scaled_by_exponentials(opset: int) -> onnx.ModelProto:
    """``tanh(tanh(x * exp(a)) * exp(b))``: two vectors (``exp(a)``, ``exp(b)``)
    the backward reads."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), n) for n in "ab"]
    nodes = [
        helper.make_node("Exp", ["a"], ["ea"]),
        helper.make_node("Mul", ["x", "ea"], ["xa"]),
        helper.make_node("Tanh", ["xa"], ["h"]),
        helper.make_node("Exp", ["b"], ["eb"]),
        helper.make_node("Mul", ["h", "eb"], ["hb"]),
        helper.make_node("Tanh", ["hb"], ["y"]),
    ]
    return make_model(helper.make_graph(nodes, "g", [x], [y], weights), opset=opset)


@needs_engine
def test_small_vectors_cross_to_torch_as_one_residual():
    """The vectors the backward reads (an eval BatchNorm's per-channel factor and
    deviation) cross to torch as one tensor, concatenated in the forward and
    split in the backward: each tensor handed over and back costs about 1 us,
    more than the two nodes. Torch's gradients."""
    torch.manual_seed(0)
    model = _TwoNorms().eval()
    x = torch.randn(3, 3, 7, 6)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT).eval()
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("eval", [True] * 11, x.device, [x]).static_built([x])
    packed = [r for r in built.split.residuals if r.startswith("packed_residuals")]
    assert len(packed) == 1, built.split.residuals
    (unpack,) = [n for n in built.split.backward.graph.node if packed[0] in n.input]
    assert unpack.op_type == "Split" and len(unpack.output) == 4, unpack
    types = _split._value_infos(built.split.forward)
    vectors = [
        r
        for r in built.split.residuals
        if len(types[r].type.tensor_type.shape.dim) == 1 and r not in packed
    ]
    assert not vectors, vectors


@needs_engine
def test_packed_residuals_of_a_hand_written_graph():
    """Two vectors the backward reads (``exp(a)``, ``exp(b)``) cross as one;
    outputs and gradients as torch's."""
    layer = OnnxModule(_scaled_by_exponentials(17), backend=ORT)
    x = torch.randn(3, 5, requires_grad=True)
    a, b = (layer.get_parameter(n).detach().clone().requires_grad_() for n in "ab")
    ref = torch.tanh(torch.tanh(x * a.exp()) * b.exp())
    out = layer(x)
    torch.testing.assert_close(out, ref)
    ref.square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    out.square().sum().backward()
    torch.testing.assert_close(x.grad, expected)
    for name, mine in zip("ab", (a, b)):
        torch.testing.assert_close(layer.get_parameter(name).grad, mine.grad)
    built = layer._bridge.gradient_graph("train", [True] * 3, x.device, [x]).static_built([x])
    (unpack,) = [n for n in built.split.backward.graph.node if n.op_type == "Split"]
    assert sorted(unpack.output) == ["ea", "eb"], unpack


@needs_engine
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_layer_norm_backward_reads_the_forward_statistics(exporter):
    """The backward of LayerNormalization reads the Mean and InvStdDev its forward
    node returned instead of computing them again; gradients as torch's. At
    TorchScript's opset 17 the recomputation's ReduceMeans take their axes as
    an attribute."""
    from conftest import export_torchscript

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 6)
    if exporter == "dynamo":
        exported = export(model, (x,), dynamic_batch=False)
    else:
        exported = export_torchscript(model, (x,))
    layer = OnnxModule(exported, backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True] * 7, x.device, [x]).static_built([x])
    (norm,) = [n for n in built.split.forward.graph.node if n.op_type == "LayerNormalization"]
    assert set(norm.output[1:]) <= set(built.split.residuals), built.split.residuals
    ops = [n.op_type for n in built.split.backward.graph.node]
    assert "ReduceMean" in ops and "Sqrt" not in ops and "Reciprocal" not in ops, ops


@needs_engine
@pytest.mark.parametrize("rows", [(5,), (2, 5), (3, 1, 4), (2, 3, 5)])
def test_weight_gradient_of_a_linear_is_one_product_in_the_weight_layout(rows):
    """A Linear on a matrix or on batches of them (one or more batch axes): the
    weight's gradient is one product ``G^T X`` written in the weight's layout,
    not ``(X^T G)`` transposed and copied, nor products per batch summed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 4))
    x = torch.randn(*rows, 6)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [True] * 5, x.device, [x]).static_built([x])
    backward = built.split.backward.graph
    producer = {o: n for n in backward.node for o in n.output}
    for weight in ("0.weight", "2.weight"):
        (grad,) = [o.name for o in backward.output if o.name == f"adj_{weight}_value"]
        node = producer[grad]
        while node.op_type == "Identity":
            node = producer[node.input[0]]
        assert node.op_type == "MatMul", (weight, node.op_type)
    # The only Transposes left turn the output gradients (batch-sized), not weights.
    # (an output gradient is a graph input: no node writes it)
    transposed = [
        producer[n.input[0]].op_type if n.input[0] in producer else "input"
        for n in backward.node
        if n.op_type == "Transpose"
    ]
    assert all(op != "MatMul" for op in transposed), transposed


@needs_engine
def test_first_shapes_get_graphs_of_their_own_then_the_generic_one_runs():
    layer = OnnxModule(_tanh_model(), backend=ORT)
    w = layer.onnx_weight("w").detach().clone().requires_grad_()
    limit = _onnxruntime.SPECIALISED_SHAPES
    for batch in range(1, limit + 3):
        layer.zero_grad()
        w.grad = None
        x = torch.randn(batch, 3)
        (layer(x) ** 2).sum().backward()
        (torch.tanh(x * w) ** 2).sum().backward()
        torch.testing.assert_close(layer.onnx_weight("w").grad, w.grad)
    (graph,) = layer._bridge._gradient_graphs.values()
    assert len(graph._by_shape) == limit and graph._generic_used


@needs_engine
def test_in_place_change_of_a_saved_output_raises():
    layer = OnnxModule(_tanh_model(), backend=ORT)
    y = layer(torch.randn(4, 3, requires_grad=True))
    (graph,) = [g for g in layer._bridge._gradient_graphs.values() if 0 in g.grad_slots]
    assert graph.save_outputs == [0]  # Tanh's gradient reads its output
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# -- double backward ----------------------------------------------------------


@needs_engine
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: no worker to spin")
def test_new_sessions_workers_do_not_spin_before_their_first_run():
    """A pool allowed to spin starts spinning; the engine stops it when it
    creates the session, so layers just built leave the cores to torch."""
    import time

    layers = [OnnxModule(linear_model(64, 64), backend=ORT) for _ in range(4)]
    start = time.process_time()
    time.sleep(0.05)
    busy = time.process_time() - start
    assert busy < 0.005, f"{busy * 1e3:.1f} ms of CPU in 50 ms after building {len(layers)} layers"


@needs_engine
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: no worker to spin")
def test_workers_stop_spinning_when_a_run_returns():
    """The engine's workers may spin within a run; the CPU time of the process
    while it sleeps right after backward runs shows none left spinning (one
    would take about all of it), so torch has the cores between runs."""
    import time

    layer = OnnxModule(linear_model(64, 64), backend=ORT)
    x = torch.randn(32, 64)
    grad = torch.ones_like(layer(x))
    graph = next(iter(layer._bridge._gradient_graphs.values()))
    tensors = [x, *(p.detach() for p in layer.parameters())]
    outputs, residuals, token = graph.forward(tensors)
    saved = {i: outputs[i] for i in graph.save_outputs}

    def busy_while_sleeping() -> float:
        """Mean CPU time of the process in 5 ms sleeps, each right after a run."""
        total = 0.0
        for _ in range(10):
            graph.backward([grad], token, residuals, tensors, saved)
            start = time.process_time()
            time.sleep(0.005)
            total += time.process_time() - start
        return total / 10

    # The least of a few rounds: other threads of the process (earlier tests',
    # torch's) may be busy for a while, a worker left spinning is in every one.
    least = min(busy_while_sleeping() for _ in range(4))
    assert least < 0.002, f"{least * 1e3:.2f} ms of CPU in each 5 ms sleep after a run"


# "auto" runs the onnxruntime engine, whose backward is itself differentiable.
@needs_engine
@pytest.mark.parametrize("engine", [ORT, "auto"])
def test_gradient_penalty_matches_torch(engine):
    model, layer = _mlp64(engine)
    x = torch.randn(5, 4, dtype=torch.float64)
    for net in (model, layer):
        xi = x.clone().requires_grad_()
        out = net(xi)
        (gx,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
        loss = out.pow(2).mean() + (gx.norm(dim=1) - 1).pow(2).mean()
        loss.backward()
    params = dict(model.named_parameters())
    for name, p in layer.named_onnx_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-10, atol=1e-12)


@needs_engine
@pytest.mark.parametrize("engine", [ORT, "auto"])
def test_hessian_vector_product_matches_torch(engine):
    model, layer = _mlp64(engine)
    x = torch.randn(5, 4, dtype=torch.float64)
    v = torch.randn(5, 4, dtype=torch.float64)
    _, ref = torch.autograd.functional.hvp(lambda t: model(t).pow(3).sum(), x, v)
    _, ours = torch.autograd.functional.hvp(lambda t: layer(t).pow(3).sum(), x, v)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.engines("training-agent")
def test_training_agent_refuses_double_backward(backend):
    layer = OnnxModule(_tanh_model(), backend=backend)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(OrtBridgeError, match="double backward .* backend='onnxruntime'"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(layer(x).sum(), x)  # first order still works
    assert gx.shape == x.shape


@needs_engine
def test_auto_double_backward_in_train_mode_updates_statistics_once():
    """Train mode with BatchNormalization under ``auto``: a gradient penalty's
    second-order terms and one running-statistics update, as torch's."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).double()
    layer = OnnxModule(export(model, (torch.randn(5, 3, dtype=torch.float64),))).train()
    model.train()
    x = torch.randn(5, 3, dtype=torch.float64)
    for net in (model, layer):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(net(xi).sum(), xi, create_graph=True)
        gx.pow(2).sum().backward()
    params = dict(model.named_parameters())
    # Relative to the largest gradient: the BatchNorm bias's is zero up to rounding.
    scale = max(float(p.grad.abs().max()) for p in params.values())
    for name, p in layer.named_onnx_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-7, atol=1e-9 * scale)
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(layer.get_buffer(name), model.get_buffer(name))


# -- Dropout from torch's generator -------------------------------------------


@needs_engine
def test_dropout_masks_come_from_torch_generator():
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.4), nn.Linear(32, 2))
    layer = OnnxModule(export(model.train(), (torch.randn(3, 6),)), backend=ORT).train()
    x = torch.randn(7, 6)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        layer.zero_grad()
        out = layer(x)
        out.sum().backward()
        runs.append((out.detach(), layer.onnx_weight("0.weight").grad.clone()))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    torch.manual_seed(12)
    assert not torch.equal(layer(x).detach(), runs[0][0])


# -- torch layers the training build cannot train -----------------------------


class _UpBlock(nn.Module):
    """A UNet decoder step: ConvTranspose, GroupNorm, Upsample, PixelShuffle."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.norm = nn.GroupNorm(2, 4)
        self.resize = nn.Upsample(scale_factor=2, mode="bilinear")
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x):
        return self.shuffle(self.resize(torch.relu(self.norm(self.up(x)))))


class _Misc(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.p = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        y = torch.einsum("bi,ij->bj", x, self.w).cumsum(1)
        return y.abs().pow(self.p) + y.amax(dim=1, keepdim=True)


class _Recurrent(nn.Module):
    """A recurrent layer whose outputs are flat (sequence, last hidden state)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, hidden = self.rnn(x)
        return out, hidden[0] if isinstance(hidden, tuple) else hidden


_LAYERS = {
    "lstm-bidirectional-2-layers": (
        lambda: _Recurrent(nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)),
        (2, 5, 3),
    ),
    "gru": (lambda: _Recurrent(nn.GRU(3, 4, batch_first=True)), (2, 5, 3)),
    "rnn": (lambda: _Recurrent(nn.RNN(3, 4, batch_first=True)), (2, 5, 3)),
    "unet-up-block": (_UpBlock, (2, 4, 3, 3)),
    "instance-norm": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 6)),
    "conv-transpose-1d": (lambda: nn.ConvTranspose1d(3, 2, 4, stride=2, padding=1), (2, 3, 7)),
    "einsum-cumsum-amax-pow": (_Misc, (4, 3)),
    "conv-same-even-kernel": (lambda: nn.Conv2d(2, 3, 4, padding="same"), (2, 2, 6, 6)),
}


#: What the training build's builder crashes on, refuses or gets wrong: "auto"
#: must route these to the onnxruntime engine. (Conv with auto_pad=SAME_*, which
#: TorchScript writes for padding="same", is rewritten with explicit pads and
#: stays on the training agent.)
_TRAINING_BUILD_CANNOT = {
    ("lstm-bidirectional-2-layers", "dynamo"),
    ("lstm-bidirectional-2-layers", "torchscript"),
    ("unet-up-block", "dynamo"),
    ("unet-up-block", "torchscript"),
    ("conv-transpose-1d", "dynamo"),
    ("conv-transpose-1d", "torchscript"),
}


@needs_engine
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(_LAYERS))
def test_torch_layers_train_with_torch_gradients(name, exporter):
    factory, shape = _LAYERS[name]
    torch.manual_seed(0)
    model = factory().eval()
    x = torch.randn(*shape)
    if exporter == "dynamo":
        proto = export(model, (x,), dynamic_batch=False)
    else:
        proto = _export_torchscript(model, x)
    layer = OnnxModule(proto)
    if _ort.has_training() and (name, exporter) in _TRAINING_BUILD_CANNOT:
        assert layer.backend == ORT, layer.backend_reason
    _compare(model, layer, x)


def _ort_run(model, feeds, outputs=None) -> list:
    """``model`` run by a plain onnxruntime session: the reference a rewrite's
    graph is compared with."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def _compare(model, layer, x):
    """Outputs, the input's gradient, and each weight's gradient found by name.

    The TorchScript exporter renames (and for GRU/RNN repacks) recurrent
    weights: those are checked through the input gradient and the outputs.
    """
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [net(xi) for net, xi in zip((model, layer), xs)]
    ref, ours = (o if isinstance(o, tuple) else (o,) for o in outs)
    assert len(ref) == len(ours)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=scaled_atol(1e-5, r))
    for out in (ref, ours):
        sum((o.float() ** 2).sum() for o in out).backward()
    torch.testing.assert_close(
        xs[1].grad, xs[0].grad, rtol=1e-4, atol=scaled_atol(1e-5, xs[0].grad)
    )
    params = dict(model.named_parameters())
    atol = scaled_atol(1e-5, *(p.grad for p in params.values() if p.grad is not None))
    matched = 0
    for name, param in layer.named_onnx_parameters():
        if name in params:
            torch.testing.assert_close(param.grad, params[name].grad, rtol=1e-4, atol=atol)
            matched += 1
    assert matched or not params or any("onnx::" in n for n, _ in layer.named_onnx_parameters())


def _export_torchscript(model, x):
    import io
    import warnings

    import onnx

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=17)
    return onnx.load_from_string(buffer.getvalue())


@needs_engine
@pytest.mark.parametrize("dims", [[2, 3, 7, 7], ["N", 3, "H", "W"]], ids=["static", "dynamic"])
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_with_pads_trains_as_torch(count_include_pad, dims):
    # Pads and strides together: torch's gradient on whichever engine "auto"
    # picks (tests/engines/test_builder_limits.py checks the training build itself).
    # Dynamic sizes without a Conv form (count_include_pad=0): a crash of the
    # training build's AveragePoolGrad, which no rule may apply to the other
    # engine; auto trains it there.
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node(
                "AveragePool",
                ["xw"],
                ["y"],
                kernel_shape=[3, 3],
                strides=[2, 2],
                pads=[1, 1, 1, 1],
                count_include_pad=count_include_pad,
            ),
        ],
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.linspace(0.5, 1.5, 3).reshape(3, 1, 1).astype("f4"), "w")],
    )
    layer = OnnxModule(make_model(graph))
    x = torch.randn(2, 3, 7, 7)
    w = layer.onnx_weight("w").detach().clone().requires_grad_()
    ref = torch.nn.functional.avg_pool2d(
        x * w, 3, 2, padding=1, count_include_pad=bool(count_include_pad)
    )
    out = layer(x)
    torch.testing.assert_close(out, ref)
    (ref**2).sum().backward()
    (out**2).sum().backward()
    torch.testing.assert_close(layer.onnx_weight("w").grad, w.grad)


@needs_engine
@pytest.mark.parametrize("relu", [False, True], ids=["pool", "relu_pool"])
@pytest.mark.parametrize("size", [(8, 8), (9, 7)], ids=["even", "odd"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_max_pool_gradient_follows_torch_also_on_ties(ties, size, relu):
    """The first maximum of a window in scan order gets the gradient, as in torch;
    a non-overlapping pool's gradient needs no indices (``passes/_pool_grad.py``),
    and a ReLU before it is masked at the pooled size."""
    layers = [nn.Conv2d(2, 3, 3, padding=1), nn.ReLU()] if relu else [nn.Conv2d(2, 3, 3, padding=1)]
    model = nn.Sequential(*layers, nn.MaxPool2d(2), nn.Flatten())
    x = torch.randn(4, 2, *size)
    if ties:
        with torch.no_grad():  # integer weights and inputs: many equal values (and zeros)
            model[0].weight.copy_(torch.randint(-1, 2, model[0].weight.shape).float())
            model[0].bias.zero_()
        x = torch.randint(0, 2, x.shape).float()
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [False, True, True], x.device, [x])
    nodes = built.static_built([x]).split.backward.graph.node
    ops = [n.op_type for n in nodes]
    # The rewrite ran: no index scatter, no layout moves, the pool and the tie-break pool.
    assert "ScatterND" not in ops and "DepthToSpace" not in ops, ops
    assert ops.count("MaxPool") == 2, ops
    if relu:  # the ReLU's mask compares the pooled maximum, not the input
        pooled = {n.output[0] for n in nodes if n.op_type == "MaxPool"}
        greater = [n for n in nodes if n.op_type == "Greater"]
        assert greater and all(n.input[0] in pooled for n in greater), greater


@needs_engine
@pytest.mark.parametrize("after", ["conv", "flatten_linear"])
def test_max_pool_gradient_reads_the_forward_maximum_where_it_is_kept(after):
    """Where the next layer's weight gradient keeps the pool's output (or its
    flattened view), the pool's gradient reads it instead of pooling again;
    ties included, the gradients stay torch's."""
    if after == "conv":
        head = [nn.Conv2d(3, 2, 3), nn.Flatten()]
    else:
        head = [nn.Flatten(), nn.Linear(48, 2)]
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), *head)
    with torch.no_grad():  # integer weights and inputs: ties in the windows
        model[0].weight.copy_(torch.randint(-1, 2, model[0].weight.shape).float())
        model[0].bias.zero_()
    x = torch.randint(0, 2, (4, 2, 8, 8)).float()
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    built = layer._bridge.gradient_graph("train", [False] + [True] * 4, x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert "ScatterND" not in ops and ops.count("MaxPool") == 1, ops  # the tie-break only


@needs_engine
@pytest.mark.parametrize("at", [(2, 2), (2, 3), (3, 2), (3, 3)])
def test_max_pool_gradient_of_a_window_holding_nan_follows_the_forward(at):
    """onnxruntime's MaxPool may skip a NaN (torch returns it): the gradient goes
    where the forward's value came from, or nowhere where that value is NaN (no
    window-wide tie-break hands it to every position). Other windows as torch."""
    model = nn.Sequential(nn.MaxPool2d(2), nn.Flatten())
    x = torch.randn(2, 3, 6, 6)
    x[1, 2, at[0], at[1]] = float("nan")
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    seed = torch.randn(2, 3 * 9)
    out = layer(ours)
    out.backward(seed)
    model(theirs).backward(seed)
    window = torch.zeros_like(x, dtype=torch.bool)
    window[1, 2, 2:4, 2:4] = True
    torch.testing.assert_close(ours.grad[~window], theirs.grad[~window])
    value, got = out[1, 22].item(), ours.grad[1, 2, 2:4, 2:4].flatten()
    expected = torch.zeros(4)
    if value == value:  # not NaN: the first position holding it
        expected[(x[1, 2, 2:4, 2:4].flatten() == value).nonzero()[0]] = seed[1, 22]
    torch.testing.assert_close(got, expected)


def test_reverse_sequence_with_an_empty_sequence_keeps_its_row():
    # onnxruntime 1.19.2 leaves the row of a length-0 sequence unwritten
    # (uninitialised memory); ortbridge clamps the lengths to 1, which
    # reverses the same. Checked against torch for output, gradient and eval.
    node = helper.make_node("ReverseSequence", ["x", "lens"], ["y"], batch_axis=0, time_axis=1)
    graph = helper.make_graph(
        [node],
        "reverse_sequence",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5]),
            helper.make_tensor_value_info("lens", TensorProto.INT64, [4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])],
    )
    module = OnnxModule(make_model(graph, opset=13))
    lens = torch.tensor([0, 1, 3, 5])
    x = torch.randn(4, 5, requires_grad=True)
    seed = torch.randn(4, 5)

    def reference(t):
        rows = [torch.cat([r[:n].flip(0), r[n:]]) for r, n in zip(t, lens.tolist())]
        return torch.stack(rows)

    y = module(x, lens)
    torch.testing.assert_close(y, reference(x.detach()))
    y.backward(seed)
    torch.testing.assert_close(x.grad, reference(seed))
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(module(x, lens), reference(x.detach()))


@needs_engine
def test_gather_adjoints_of_an_unbind_are_one_concat():
    """q, k and v taken out of one in-projection (three Gathers): their adjoints,
    three scatters into zeros and a Sum, become one Concat; gradients as torch's."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    x = torch.randn(3, 5, 8)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    needs = [True] + [True] * len(list(layer.named_onnx_parameters()))
    built = layer._bridge.gradient_graph("train", needs, x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert "ScatterND" not in ops and "Concat" in ops, ops


@pytest.mark.parametrize(
    "pads, tiles",
    [
        ([[0, 3, 0, 0], [0, 0, 0, 2], [0, 2, 0, 1]], True),  # out of order, one axis
        ([[0, 0, 0, 2], [0, 1, 0, 0]], False),  # overlap
        ([[0, 0, 0, 2], [0, 3, 0, 0]], False),  # a gap
        ([[0, 0, 0, 3], [1, 2, 0, 0]], False),  # two axes padded
    ],
)
def test_zero_pads_tiling_one_axis_sum_as_a_concat(pads, tiles):
    """A Sum of zero Pads (the adjoints of Slices) whose pieces tile one axis,
    each once, is their Concat; anything else is left as it was."""

    from ortbridge._engines.onnxruntime.passes._scatter_sums import concat_scatter_sums

    rng = np.random.default_rng(0)
    feeds, nodes, inits, summed = {}, [], [], []
    for i, p in enumerate(pads):
        shape = [2 - p[0] - p[2], 4 - p[1] - p[3]]
        feeds[f"x{i}"] = rng.standard_normal(shape).astype(np.float32)
        inits.append(numpy_helper.from_array(np.array(p, np.int64), f"p{i}"))
        nodes.append(helper.make_node("Pad", [f"x{i}", f"p{i}"], [f"y{i}"]))
        summed.append(f"y{i}")
    graph = helper.make_graph(
        [*nodes, helper.make_node("Sum", summed, ["out"])],
        "tiles",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])],
        inits,
    )
    model, rewritten = make_model(graph), make_model(graph)
    concat_scatter_sums(rewritten)

    np.testing.assert_array_equal(_ort_run(rewritten, feeds)[0], _ort_run(model, feeds)[0])
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops == (["Concat"] if tiles else ["Pad"] * len(pads) + ["Sum"]), ops


@needs_engine
def test_lstm_gate_slices_adjoints_are_concats():
    """An LSTM's weights are cut into four gates (Slices): their adjoints, zero
    Pads summed, become Concats; gradients as torch's."""

    class Lstm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    model = Lstm()
    x = torch.randn(2, 5, 3)
    layer = OnnxModule(export(model, (x,), dynamic_batch=False), backend=ORT)
    _compare(model, layer, x)
    needs = [True] * (1 + len(list(layer.named_onnx_parameters())))
    built = layer._bridge.gradient_graph("train", needs, x.device, [x])
    ops = [n.op_type for n in built.static_built([x]).split.backward.graph.node]
    assert "Pad" not in ops and "Concat" in ops, ops


@needs_engine
def test_rewritten_backward_keeps_no_unread_initializer():
    """The pool and convolution rewrites leave the index path's constants unread:
    they are dropped, not loaded (onnxruntime would warn about each)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    x = torch.randn(3, 1, 10, 10)
    layer = OnnxModule(export(model, (x,)), backend=ORT)
    layer(x).sum().backward()
    built = layer._bridge.gradient_graph("train", [False, True, True], x.device, [x])
    graph = built.static_built([x]).split.backward.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    assert [i.name for i in graph.initializer if i.name not in read] == []


@needs_engine
def test_backward_reshapes_read_no_reshape():
    """A BatchNorm's parameter gradients are reductions that end in a view, and
    the gradient's own view follows: the chain is one Reshape (the chains cost
    MobileViT's backward 3% of its step), and the gradients stay torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
    ).eval()
    x = torch.randn(4, 3, 10, 10)
    layer = OnnxModule(export(model, (x,)), backend=ORT).eval()
    _compare(model, layer, x)
    needs = [True] * (1 + len(list(layer.named_onnx_parameters())))
    built = layer._bridge.gradient_graph("eval", needs, x.device, [x])
    graph = built.static_built([x]).split.backward.graph
    views = {o for n in graph.node if n.op_type == "Reshape" for o in n.output}
    chained = [n.name for n in graph.node if n.op_type == "Reshape" and n.input[0] in views]
    assert sum(n.op_type == "Reshape" for n in graph.node) and not chained, chained


def _softmax_graph(nan_masked: bool):
    """x (4, 5) -> Softmax -> [Where(IsNaN(y), 0, y)] -> MatMul w (5, 3)."""
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    read = "y"
    if nan_masked:  # the exporters' NaN-robust attention: a masked row's output is 0
        nodes += [
            helper.make_node("IsNaN", ["y"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "y"], ["clean"]),
        ]
        read = "clean"
    nodes.append(helper.make_node("MatMul", [read, "w"], ["out"]))
    inits = [
        numpy_helper.from_array(np.zeros((), np.float64), "zero"),
        numpy_helper.from_array(np.random.default_rng(0).normal(size=(5, 3)), "w"),
    ]
    graph = helper.make_graph(
        nodes,
        "softmax",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 5])],
        [helper.make_tensor_value_info("out", TensorProto.DOUBLE, [4, 3])],
        inits,
    )
    return make_model(graph)


@needs_engine
@pytest.mark.parametrize("nan_masked", [False, True], ids=["unmasked", "nan_masked"])
def test_softmax_masked_row_correction_only_where_a_node_can_mask_it(nan_masked):
    """A fully masked row (all -inf) is NaN after Softmax. Masked further on, its
    derivative is 0 (``_engines/onnxruntime/_rules.py`` corrects onnx-ad's NaN); where nothing
    can mask it, torch's softmax backward is NaN too and the costly correction
    (IsNaN + Where over the output) is not built."""
    layer = OnnxModule(_softmax_graph(nan_masked), backend=ORT)
    x = torch.randn(4, 5, dtype=torch.float64)
    x[2] = float("-inf")
    ours = x.clone().requires_grad_()
    seed = torch.randn(4, 3, dtype=torch.float64)
    layer(ours).backward(seed)
    w = layer.onnx_weight("w").detach()
    theirs = x.clone().requires_grad_()
    y = torch.softmax(theirs, -1)
    if nan_masked:
        y = torch.where(torch.isnan(y), 0.0, y)
    (y @ w).backward(seed)
    rows = [0, 1, 3]
    torch.testing.assert_close(ours.grad[rows], theirs.grad[rows])
    if nan_masked:
        assert not ours.grad[2].any()
    else:
        assert torch.isnan(ours.grad[2]).all() and torch.isnan(theirs.grad[2]).all()
    built = layer._bridge.gradient_graph("train", [True, False], x.device, [x])
    ops = {n.op_type for n in built.static_built([x]).split.backward.graph.node}
    assert ("IsNaN" in ops) == nan_masked, ops


def test_backward_graph_opset_raised_to_18_where_exact():
    """A backward graph of opset 17 reads as opset 18 (Col2Im's, for the input
    gradient of a convolution) where each node means the same: reductions'
    axes attributes become inputs, the values are unchanged; a graph holding
    an op whose schema changed (Split) keeps its opset."""

    from ortbridge._engines.onnxruntime.passes._opset18 import raise_to_opset18

    def model(extra=()):
        nodes = [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
            helper.make_node("Sub", ["x", "m"], ["y"]),
            *extra,
        ]
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outputs
        )
        return make_model(graph, 17)

    raised = model()
    assert raise_to_opset18(raised)
    onnx.checker.check_model(raised, full_check=True)
    assert raised.opset_import[0].version == 18
    (mean,) = [n for n in raised.graph.node if n.op_type == "ReduceMean"]
    assert len(mean.input) == 2 and not [a for a in mean.attribute if a.name == "axes"]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)

    np.testing.assert_array_equal(_ort_run(raised, {"x": x})[0], _ort_run(model(), {"x": x})[0])
    kept = model([helper.make_node("Split", ["y"], ["a", "b"], axis=0)])
    assert not raise_to_opset18(kept)
    assert kept.opset_import[0].version == 17


@needs_engine
@pytest.mark.parametrize(
    "activation, fused, spelled, fewer",
    [(nn.GELU, "Gelu", "Erf", 2), (nn.SiLU, "QuickGelu", "Sigmoid", 1)],
    ids=["gelu", "silu"],
)
def test_activation_runs_as_one_kernel_and_saves_its_input_only(
    activation, fused, spelled, fewer, monkeypatch
):
    """TorchScript spells nn.GELU() out (Div, Erf, Add, Mul, Mul) and nn.SiLU()
    (Sigmoid, Mul): the forward runs each as one onnxruntime kernel and the
    backward reads its input alone, as torch's does, with torch's gradients
    (GELU: x / sqrt(2) and 1 + erf no longer kept; SiLU: the sigmoid); a
    float64 one (the kernels are float32's) stays spelled out."""
    from conftest import export_torchscript

    from ortbridge._engines.onnxruntime.passes._fused_activations import fused_activations

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), activation(), nn.Linear(16, 3))
    x = torch.randn(5, 6)
    exported = export_torchscript(net, (x,))
    layer = OnnxModule(exported, backend=ORT)
    _compare(net, layer, x)
    graph = list(layer._bridge._gradient_graphs.values())[-1].static_built([x])
    ops = [(n.domain, n.op_type) for n in graph.split.forward.graph.node]
    assert ("com.microsoft", fused) in ops and ("", spelled) not in ops, ops
    backward = graph.split.backward.graph
    ones = {
        n.output[0]
        for n in backward.node
        if n.op_type == "Constant" and numpy_helper.to_array(n.attribute[0].t).tolist() == 1.0
    } | {i.name for i in backward.initializer if numpy_helper.to_array(i).tolist() == 1.0}
    # no product by 1 (a SiLU's alpha) over the activation
    assert not [n for n in backward.node if n.op_type == "Mul" and ones & set(n.input)]
    from ortbridge._engines.onnxruntime.passes import _pipeline

    monkeypatch.setattr(_pipeline, "fused_activations", lambda model: 0)
    spelled_out = OnnxModule(exported, backend=ORT)
    size = x.shape[0] * 16 * 4  # bytes of one (5, 16) float32 tensor
    ours = x.clone().requires_grad_()
    assert saved_bytes(spelled_out, ours) - saved_bytes(layer, ours) == fewer * size

    double = export_torchscript(net.double(), (x.double(),))
    assert fused_activations(double) == 0 and spelled in [n.op_type for n in double.graph.node]


class _Doubled(nn.Module):
    def forward(self, x):
        return x * 2


@needs_engine
def test_the_forward_graph_declares_a_fused_kernels_output():
    """onnx's shape inference knows no com.microsoft Gelu: the forward graph
    declares its output, so the shapes of what reads it are known too (the
    session's thread count reads them, ``_work.py``); the GELU's output read
    only inside the forward (by a product by 2, whose output the next Linear
    saves)."""
    from conftest import export_torchscript

    from ortbridge._engines.onnxruntime._work import session_threads
    from ortbridge._engines.onnxruntime.passes._optimize import _shapes

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), _Doubled(), nn.Linear(16, 3))
    x = torch.randn(5, 6)
    layer = OnnxModule(export_torchscript(net, (x,)), backend=ORT)
    _compare(net, layer, x)
    forward = list(layer._bridge._gradient_graphs.values())[-1].static_built([x]).split.forward
    assert "Gelu" in [n.op_type for n in forward.graph.node]
    shapes = _shapes(forward)
    assert all(shapes.get(o) is not None for n in forward.graph.node for o in n.output)
    assert session_threads(forward) == 1


def test_gelu_spelled_with_the_half_first_and_a_product_by_one_over_sqrt2_is_fused():
    """0.5 * x first, x * 0.7071 inside the Erf: the same GELU, one node, the
    same values; an intermediate read elsewhere keeps the graph as it is."""

    from ortbridge._engines.onnxruntime.passes._fused_activations import fused_activations

    def model(extra_output=False):
        scalar = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
        nodes = [
            helper.make_node("Mul", ["x", "c"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["a"]),
            helper.make_node("Mul", ["half", "x"], ["h"]),
            helper.make_node("Mul", ["h", "a"], ["y"]),
        ]
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])]
        if extra_output:
            outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 3]))
        graph = helper.make_graph(
            nodes,
            "gelu",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
            outputs,
            [scalar("c", 0.70710678), scalar("one", 1.0), scalar("half", 0.5)],
        )
        return make_model(graph)

    fused = model()
    assert fused_activations(fused) == 1
    assert [(n.domain, n.op_type) for n in fused.graph.node] == [("com.microsoft", "Gelu")]
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)

    np.testing.assert_allclose(
        _ort_run(fused, {"x": x}, ["y"])[0],
        _ort_run(model(), {"x": x}, ["y"])[0],
        rtol=1e-6,
        atol=1e-6,
    )
    kept = model(extra_output=True)
    assert fused_activations(kept) == 0 and len(kept.graph.node) == 5
