"""A depthwise Conv over a small image trained as products by a matrix per channel.

:mod:`ortbridge._engines.onnxruntime.passes._dense_depthwise` rewrites the
layer before onnx-ad differentiates it; onnx-ad's MatMul rules then give its
gradients. Each layer is exported by torch and its output, weight and input
gradients compared with torch autograd; the graphs are read to check the
rewrite happened (or not, where the product would cost more), and that the
per-channel matrices are recomputed in the backward rather than saved.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_conv_weights import ENGINES, _built, _check_layer
from torch import nn

import ortbridge
from ortbridge import OnnxModule

ORT = "onnxruntime"
pytestmark = pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")

DENSE = {
    "convnext-7x7": (lambda: nn.Conv2d(8, 8, 7, padding=3, groups=8), [(16, 8, 8, 8)]),
    "strided-no-bias": (
        lambda: nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6, bias=False),
        [(4, 6, 7, 6), (4, 6, 5, 8)],
    ),
    "dilated": (lambda: nn.Conv2d(4, 4, 3, dilation=2, padding=2, groups=4), [(3, 4, 6, 5)]),
    "uneven-kernel": (
        lambda: nn.Conv2d(4, 4, (3, 2), padding=(1, 0), groups=4),
        [(4, 4, 5, 6)],
    ),
    "same-even-kernel": (lambda: nn.Conv2d(4, 4, 4, padding="same", groups=4), [(4, 4, 6, 5)]),
}


def _depthwise_convs(graph):
    return [n for n in graph.node if n.op_type == "Conv"]


@pytest.mark.parametrize("case", list(DENSE))
def test_small_depthwise_conv_as_products_has_torch_gradients(case):
    """torch's output and gradients at each shape; the forward runs no Conv
    (the one-hot matrices and the products instead), nor does the backward."""
    make, shapes = DENSE[case]
    torch.manual_seed(0)
    module = _check_layer(make(), shapes)
    built = list(_built(module))
    assert len(built) == len(shapes)
    for b in built:
        forward, backward = b.split.forward.graph, b.split.backward.graph
        assert not _depthwise_convs(forward) and not _depthwise_convs(backward)
        assert any(n.op_type == "OneHot" for n in forward.node)
        assert any(n.op_type == "MatMul" and "dense" in n.output[0] for n in forward.node)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), (16, 4, 16, 16)),  # 28x the work
        (lambda: nn.Conv2d(4, 4, 7, padding=3, groups=4), (1, 4, 8, 8)),  # M costs 49 rows
        (lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4), (16, 4, 4, 4)),  # two filters a group
        (lambda: nn.Conv2d(4, 4, 5, padding=2, groups=4), (16, 4, 3, 64)),  # 7.7 + 12x the work
    ],
    ids=["large-image", "batch-of-one", "multiplier", "wide-strip"],
)
def test_depthwise_conv_stays_a_conv_where_products_cost_more(make, shape):
    """A 3x3 over 16x16 pixels would do 28x the multiplications (measured 2x
    slower); a batch of one would spend more building each matrix than using
    it; several filters a channel are not one matrix per channel; a 5x5 over a
    3x64 strip at batch 16 (PP-OCR's direction classifier) would do 7.7x the
    convolution's multiplications in the product and 12x building the
    matrices (measured: the step 0.78x as Convs)."""
    torch.manual_seed(0)
    module = _check_layer(make(), [shape])
    (b,) = _built(module)
    assert _depthwise_convs(b.split.forward.graph)
    assert not any(n.op_type == "OneHot" for n in b.split.forward.graph.node)


def test_per_channel_matrices_are_recomputed_not_saved():
    """The matrices (a weight spread by a constant) and the one-hot constant are
    computed again in the backward from the weight: the forward returns the
    layer's transposed input for the backward (an activation, as torch keeps
    the input), nothing derived from the weight."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 7, padding=3, groups=8))
    module = _check_layer(layers, [(16, 8, 8, 8)])
    (b,) = _built(module)
    residuals = [name.rsplit("/", 1)[-1] for name in b.split.residuals]
    assert "dense_xc" in residuals, residuals
    assert not [r for r in residuals if r.startswith(("dense_m", "dense_s", "dense_w"))]
    backward = {o: n.op_type for n in b.split.backward.graph.node for o in n.output}
    assert "OneHot" in backward.values()
    assert any(o.endswith("dense_mf") and op == "MatMul" for o, op in backward.items())


def test_auto_pad_strided_depthwise_matches_finite_differences():
    """auto_pad SAME_LOWER with strides 2 (pads from the static sizes, more at
    the start): the one-hot matrices place the padding as onnxruntime's Conv does."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(3, 1, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=(3,)).astype(np.float32), "b")
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=3, strides=[2, 2], auto_pad="SAME_LOWER"
    )
    graph = helper.make_graph(
        [node],
        "depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 6, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3, 3, 4])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = OnnxModule(model, backend=ORT)
    x = torch.randn(4, 3, 6, 7)
    with torch.no_grad():  # the plain inference session: onnxruntime's own Conv
        expected = module.eval()(x)
    module.train()
    assert torch.allclose(module(x), expected, atol=1e-5)
    report = ortbridge.gradcheck(module, x)
    assert report, report
    built = list(_built(module))
    assert built and not any(_depthwise_convs(b.split.forward.graph) for b in built)
