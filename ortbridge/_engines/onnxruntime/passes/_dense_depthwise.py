"""A depthwise convolution over a small image as one matrix per channel.

onnxruntime runs a depthwise ``Conv`` (``group`` = channels, one filter per
channel) on the CPU as one im2col and one matrix-vector product per channel
and image, on one thread, and its gradients (onnx-ad's depthwise
``ConvTranspose`` and grouped weight ``Conv``) the same way. Measured on 2
cores for ConvNeXt's 7x7 layer, batch 16, 8 channels of 8x8: 206 us forward,
237 us input gradient, 198 us weight gradient; torch takes 64 us forward.

Over a small image the convolution of channel ``c`` is a product by a matrix
``M_c`` (input positions by output positions) that holds the channel's taps:
``M_c = sum_t W[c, t] S_t``, ``S_t`` the one-hot matrix of tap ``t`` (it
places each input position under the output positions that read it through
that tap, pads, strides and dilations included). So the primal graph is
rewritten before onnx-ad differentiates it::

    M  = Reshape(MatMul(Reshape(W, [C, T]), S), [C, P, Q])    S: (T, P*Q), constant
    Yc = MatMul(Transpose(Reshape(X, [N, C, P]), [1, 0, 2]), M)    # (C, N, Q)
    Y  = Reshape(Transpose(Yc [+ B], [1, 0, 2]), [N, C, Ho, Wo])

and onnx-ad's MatMul rules give the gradients as products too:
``dX_c = dY_c M_c^T``, ``dM_c = X_c^T dY_c`` and ``dW = dM S^T``. The same
layer then takes 34 us forward and 71 us for both gradients.

The dense product does ``P / T`` times the convolution's multiplications,
and building ``M`` costs ``T / N`` times the product's: together ``P / T +
P / N`` times the convolution's. Applied where ``P <= 8 T``, ``T <= 4 N``,
that sum is at most :data:`MAX_WORK` and ``S`` holds at most
:data:`MAX_ONE_HOT` values (ConvNeXt's and MobileViT's late stages; a 3x3
over 16x16 pixels, at 28x, stays a Conv). Static shapes only, 2-D, float32
or float64, one filter per channel. Exact up to the order of the sums.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import attr

from .._ad_rewrites_conv import explicit_pads
from ._optimize import _const, facts, replace_nodes
from ._simplify import _static

#: Largest one-hot matrix ``S`` (taps x input positions x output positions).
MAX_ONE_HOT = 1 << 22
#: The dense product may do this many times the convolution's multiplications.
MAX_DENSITY = 8
#: Building ``M`` may cost this many times the product (taps per image of the batch).
MAX_TAPS_PER_ROW = 4
#: The product and building ``M`` together may do this many times the
#: convolution's multiplications. PP-OCR's direction classifier at batch 16
#: (5x5 over 3x64 pixels: 7.7 + 12) spent 38 of its step's 124 ms in two such
#: layers, 0.78x the step as Convs; MobileViT's 3x3s over 8x8 at batch 16
#: (7.1 + 4) are the same speed either way (A/B in one process, 2 cores).
MAX_WORK = 16

#: The tensors one rewrite adds, each named ``<output>/dense_<suffix>``.
_NAMES = (
    "s", "s_at", "s_depth", "s_values", "s3", "s_shape", "s_float", "wf_shape", "wf", "mf",
    "m_shape", "m", "x_shape", "x3", "xc", "yc", "b_shape", "b3", "biased", "y3", "y_shape",
)  # fmt: skip

_FLOATS = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64}


def dense_depthwise(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s small depthwise 2-D Convs in place (static shapes)."""
    graph = model.graph
    if not any(n.op_type == "Conv" and attr(n, "group", 1) > 1 for n in graph.node):
        return
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 11:  # OneHot's out-of-range indices give zeros from opset 11
        return
    found = facts(model)
    if found is None:
        return
    replace_nodes(graph, lambda node: _dense(node, found))


def _dense(node, found):
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
        return None
    shapes = found.shapes
    x, w = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 else ""
    xs, ws, ys = shapes.get(x), shapes.get(w), shapes.get(node.output[0])
    if not all(_static(s) and len(s) == 4 for s in (xs, ws, ys)):
        return None
    n, c, h, w_ = xs
    group = attr(node, "group", 1)
    if group != c or c == 1 or tuple(ws[:2]) != (c, 1) or tuple(ys[:2]) != (n, c):
        return None
    dtype = _FLOATS.get(found.types.get(x))
    if dtype is None or found.types.get(w) != found.types.get(x):
        return None
    kernel = list(ws[2:])
    strides = list(attr(node, "strides", [1, 1]))
    dilations = list(attr(node, "dilations", [1, 1]))
    pads = explicit_pads(node, [h, w_], kernel, strides, dilations)
    if pads is None:
        return None
    taps, p, q = kernel[0] * kernel[1], h * w_, ys[2] * ys[3]
    if p > MAX_DENSITY * taps or taps > MAX_TAPS_PER_ROW * n or taps * p * q > MAX_ONE_HOT:
        return None
    if p / taps + p / n > MAX_WORK:
        return None
    stem, taken = node.output[0], found.taken
    names = {suffix: _unique(f"{stem}/dense_{suffix}", taken) for suffix in _NAMES}
    nodes = [
        _const(names["wf_shape"], [c, taps]),
        helper.make_node("Reshape", [w, names["wf_shape"]], [names["wf"]]),
        *_tap_matrices(names, (h, w_), ys[2:], kernel, strides, dilations, pads[0], dtype),
        helper.make_node("MatMul", [names["wf"], names["s"]], [names["mf"]]),
        _const(names["m_shape"], [c, p, q]),
        helper.make_node("Reshape", [names["mf"], names["m_shape"]], [names["m"]]),
        _const(names["x_shape"], [n, c, p]),
        helper.make_node("Reshape", [x, names["x_shape"]], [names["x3"]]),
        helper.make_node("Transpose", [names["x3"]], [names["xc"]], perm=[1, 0, 2]),
        helper.make_node("MatMul", [names["xc"], names["m"]], [names["yc"]]),
    ]
    product = names["yc"]
    if bias:
        nodes += [
            _const(names["b_shape"], [c, 1, 1]),
            helper.make_node("Reshape", [bias, names["b_shape"]], [names["b3"]]),
            helper.make_node("Add", [product, names["b3"]], [names["biased"]]),
        ]
        product = names["biased"]
    nodes += [
        helper.make_node("Transpose", [product], [names["y3"]], perm=[1, 0, 2]),
        _const(names["y_shape"], list(ys)),
        helper.make_node("Reshape", [names["y3"], names["y_shape"]], [stem], node.name),
    ]
    return nodes


def tap_sources(image, out, kernel, strides, dilations, begin) -> np.ndarray:
    """(taps, Ho*Wo): the input position (row-major) that output position ``q``
    reads through tap ``t``, ``H*W`` where it reads padding."""
    (h, w), (ho, wo), (kh, kw) = image, out, kernel
    i, j, oy, ox = np.meshgrid(
        np.arange(kh), np.arange(kw), np.arange(ho), np.arange(wo), indexing="ij"
    )
    y = oy * strides[0] + i * dilations[0] - begin[0]
    x = ox * strides[1] + j * dilations[1] - begin[1]
    inside = (y >= 0) & (y < h) & (x >= 0) & (x < w)
    return np.where(inside, y * w + x, h * w).reshape(kh * kw, ho * wo).astype(np.int64)


def _tap_matrices(names, image, out, kernel, strides, dilations, begin, dtype) -> list:
    """Nodes computing ``S`` (taps, H*W*Ho*Wo) as a ``OneHot`` of the positions
    each tap reads: a few kilobytes in the graph where ``S`` itself may be
    megabytes, which every shape inference of the build would copy
    (onnxruntime folds it once, at session creation); an index past the
    image (padding) gives zeros."""
    sources = tap_sources(image, out, kernel, strides, dilations, begin)
    taps, positions = sources.shape[0], image[0] * image[1]
    one_hot = names["s"] if dtype == np.float32 else names["s_float"]
    nodes = [
        helper.make_node("Constant", [], [names["s_at"]], value=numpy_helper.from_array(sources)),
        _const(names["s_depth"], positions),
        helper.make_node(
            "Constant", [], [names["s_values"]], value=numpy_helper.from_array(
                np.array([0, 1], dtype=np.float32))
        ),
        helper.make_node("OneHot", [names["s_at"], names["s_depth"], names["s_values"]],
                         [names["s3"]], axis=1),
        _const(names["s_shape"], [taps, -1]),
        helper.make_node("Reshape", [names["s3"], names["s_shape"]], [one_hot]),
    ]  # fmt: skip
    if one_hot != names["s"]:  # onnxruntime's OneHot gives float32
        nodes.append(helper.make_node("Cast", [one_hot], [names["s"]], to=onnx.TensorProto.DOUBLE))
    return nodes
