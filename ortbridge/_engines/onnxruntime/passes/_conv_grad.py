"""A convolution's gradients: a 2-D one's weight gradient as im2col and one
batched MatMul (a 1x1 one's as one MatMul), the input gradient of a 2-D one
or a strided 1-D one as one MatMul and ``Col2Im``.

onnx-ad writes the weight gradient of ``Conv(X, W)`` as a convolution of the
input by the output gradient with batch and channels swapped::

    dW' = Conv(Transpose(X, [1, 0, 2, 3]), Transpose(G, [1, 0, 2, 3]))

onnxruntime runs that slowly on the CPU: both Transposes copy whole
activations through its generic kernel, and the Conv has one huge kernel (the
output gradient's spatial size) over few outputs. Measured on 2 cores for a
small CNN's two layers: 2.8 and 1.7 ms, against 1.0 and 0.34 ms for the form
below, which reads ``X`` and ``G`` where they are:

- ``P = Conv(X, E, group=C_in)``: a depthwise convolution with one-hot
  kernels ``E`` gathers every window element of ``X`` (im2col without a
  Gather), ``P[n, (i, a, b), y, x] = X[n, i, a + y*d0, b + x*d1]``;
- ``dW'[o, (i, a, b)] = sum_n G[n, o, :] @ P[n, (i, a, b), :]^T``: a batched
  MatMul over the flattened spatial axis, summed over the batch.

Where the weight-gradient Conv's one window is its whole unpadded input (a
1x1 convolution of stride 1), it is one product instead, ``A (C_in, N*h*w)
@ F (C_out, N*h*w)^T``, however large (:func:`_full_window`).

With a batch of one, onnx-ad's Transposes move unit axes only and become
Reshapes; the huge-kernel Conv costs as much, so the form applies there too
(YOLOv8n's step at batch 1, 320x320, 2 cores: 0.82x; PP-OCRv6's detector
0.92x).

Where onnx-ad computes the gradient past the kernel and crops it (a strided
convolution whose padded input overhangs its last window: 4x4 for a 3x3 of
stride 2), only the taps the crop keeps are gathered (YOLOv8n's step 0.92x at
batch 4, PP-OCRv6's detector 0.94-0.96x, with the Resize rule of
:mod:`.._rules`).

Where the batched product would be large next to the activations (it holds
``N * C_out * C_in * KH * KW`` values: the deep layers of few positions and
many channels), the batch joins the positions of one product instead.
Applied to graphs with static shapes only, to group 1 and unit strides of the
gradient convolution (the forward's dilation 1), and to kernels of at most 16
taps or fewer taps than filters.

The input gradient onnx-ad writes as ``ConvTranspose(G, W)``, which
onnxruntime runs slowly on the CPU, and more slowly still with workers that
spin within a run, as the engine's do (a small CNN's 64x16x11x11 gradient on 2
cores: 0.45 ms, 0.87 ms spinning, against 0.40 ms for the form below). The
same sums, as ``ConvTranspose`` defines them:

- ``cols = W'^T @ G'``, ``W'`` the weight as (C_out, C_in*KH*KW) and ``G'`` the
  gradient as (N, C_out, h*w): every window's contributions;
- ``Col2Im(cols)`` adds them up at their places in the input (opset 18).

Applied to static shapes, group 1, no bias, and where ``Col2Im``'s window
count for the input's shape, strides, pads and dilations is the gradient's
``h x w`` (output padding would break that). A 1-D convolution (Whisper's
audio stem) takes the form at strides above 1 only, as an image of one row.

A stride-1 input gradient is instead the ``Conv`` of the gradient by the
flipped kernel where onnxruntime runs that faster: a depthwise one's (kernels
up to 7x7), a dense 2-D one's over many output positions (its ``Col2Im``
runs on one thread).

The module stays one module: the input gradients' pass reads the shapes the
weight gradients' pass inferred (its ``found``), and both read the same
layout helpers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _unique
from ortbridge._prepare._onnx_utils import attr

from ._optimize import Facts, _const, _perm, facts, replace_nodes
from ._simplify import _constants

#: Kernels of at most this many taps (window elements) always take the im2col
#: form (3x3 layers: measured faster whatever their filters).
_SMALL_KERNEL = 16
#: The batched product may hold this many times the larger of ``X`` and ``G``.
_MAX_PRODUCT_RATIO = 4


def conv_weight_gradients(model: onnx.ModelProto) -> Facts | None:
    """Rewrite onnx-ad's weight-gradient convolutions of ``model`` in place; the
    facts read (None: none), which still hold for the tensors it did not add."""
    graph = model.graph
    if not any(n.op_type == "Conv" for n in graph.node):
        return None
    found = facts(model)
    if found is not None:
        crops = _crops(graph, found)
        replace_nodes(graph, lambda node: _full_window(node, found) or _rewrite(node, found, crops))
    return found


def _crops(graph: onnx.GraphProto, found: Facts) -> dict:
    """Tensor -> the window ``(kh, kw)`` its one reader, a ``Slice`` from 0 with
    unit steps over axes 2 and 3, keeps of it: onnx-ad's crop of a weight
    gradient computed past the kernel (a strided convolution whose padded input
    overhangs its last window: 4x4 taps for a 3x3 kernel of stride 2)."""
    constants, outputs = _constants(graph), {o.name for o in graph.output}
    crops = {}
    for node in graph.node:
        if node.op_type != "Slice" or len(node.input) < 4 or node.input[0] in outputs:
            continue
        if found.readers.get(node.input[0]) != 1:
            continue
        kept = found.shapes.get(node.output[0])
        try:
            starts, axes = (np.ravel(constants[n]).tolist() for n in node.input[1:4:2])
            steps = np.ravel(constants[node.input[4]]).tolist() if len(node.input) > 4 else [1, 1]
        except KeyError:  # computed at run time
            continue
        if _static(kept) and len(kept) == 4 and sorted(a % 4 for a in axes) == [2, 3]:
            if not any(starts) and steps == [1, 1]:
                crops[node.input[0]] = tuple(kept[2:])
    return crops


def conv_input_gradients(model: onnx.ModelProto, found: Facts | None = None) -> None:
    """Rewrite the ``ConvTranspose`` nodes of ``model`` as MatMul and Col2Im (a
    depthwise one of stride 1 as a depthwise Conv), in place.

    ``found``: facts read before rewrites that left the ``ConvTranspose``
    nodes and what they read as they were (the weight gradients'): their
    shapes are read from it, the names taken since from the graph."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not any(n.op_type == "ConvTranspose" for n in graph.node):
        return
    if found is None:
        found = facts(model)
        if found is None:
            return
    else:
        found = dataclasses.replace(found, taken=_all_names(graph))

    def rewrite(node):
        flipped = _flipped_conv(node, found)
        return flipped if flipped is not None or opset < 18 else _col2im(node, found)

    replace_nodes(graph, rewrite)


#: Depthwise kernels of at most this many taps (7x7) have their input gradient
#: as a depthwise Conv. onnxruntime's depthwise ConvTranspose against that Conv
#: on 2 cores (AMD EPYC), 96 channels 80x80, batch 4: 3x3 3.7 against 1.8 ms,
#: 7x7 47 against 14 ms (1.31.1; 73 against 14 ms in 1.19.2); 7x7 over 128
#: channels 14x14, batch 16: 3.6 against 2.4 ms. Steps: PP-OCRv6's detector
#: (its 7x7s) 0.88-0.90x, two ConvNeXt blocks 0.80-1.00x. Larger kernels are
#: unmeasured and keep the ConvTranspose.
_DEPTHWISE_TAPS = 49
#: A dense 2-D input gradient of stride 1 over at least this many output
#: positions (batch times height times width) has it as a Conv: onnxruntime's
#: Conv (im2col and its threaded product) against the product and Col2Im (one
#: thread), 3x3 on 2 cores (AMD EPYC), batch 4: 64 channels 40x40 1.39 against
#: 1.72 ms, 32 channels 80x80 1.99 against 2.88, 48 channels 48x48 at batch 8
#: 2.68 against 3.50; even at 6400 positions (16 channels 40x40), slower below
#: (64 channels 20x20: 0.66 against 0.44 ms; 40x40 at batch 1: 0.65 against 0.47).
_FLIPPED_POSITIONS = 6400


def _flipped_conv(node, found):
    """A ``ConvTranspose`` of stride 1 as the ``Conv`` it equals: the kernel
    flipped (its two channel axes swapped where dense), pads ``d (k - 1) - p``.
    Depthwise, on 2 cores: SegFormer's 3x3 over 16x16x8x8 113 -> 79 us, over
    16x32x4x4 98 -> 80 us; MobileViT's over 16x32x16x16, whose gradients are
    denormal numbers with random weights, 9.7 -> 4.9 ms. Dense: see
    :data:`_FLIPPED_POSITIONS`."""
    if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.input) != 2 or attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    g_shape, w_shape = found.shapes.get(node.input[0]), found.shapes.get(node.input[1])
    if not (_static(g_shape) and _static(w_shape)) or len(w_shape) < 3:
        return None
    group, spatial = attr(node, "group", 1), len(w_shape) - 2
    depthwise = group > 1 and w_shape[0] == group and w_shape[1] == 1 and g_shape[1] == group
    dense = (
        group == 1
        and spatial == 2
        and int(np.prod([g_shape[0], *g_shape[2:]])) >= (_FLIPPED_POSITIONS)
    )
    if not (depthwise or dense):
        return None
    if any(s != 1 for s in attr(node, "strides", [1] * spatial)):
        return None
    if any(attr(node, "output_padding", [0] * spatial)) or attr(node, "output_shape", None):
        return None
    kernel, dilations = w_shape[2:], list(attr(node, "dilations", [1] * spatial))
    if depthwise and int(np.prod(kernel)) > _DEPTHWISE_TAPS:
        return None
    pads = list(attr(node, "pads", [0] * (2 * spatial)))
    reach = [d * (k - 1) for d, k in zip(dilations, kernel)] * 2
    flipped_pads = [r - p for r, p in zip(reach, pads)]
    if min(flipped_pads) < 0:
        return None
    stem, taken = node.output[0], found.taken
    starts, ends, axes, steps, flipped, swapped = (
        _unique(f"{stem}/{s}", taken)
        for s in ("starts", "ends", "axes", "steps", "flipped", "swapped")
    )
    weight, swap = node.input[1], []
    if dense:  # (C_out, C_in, k...) of the forward -> the adjoint's (C_in, C_out, k...)
        swap = [helper.make_node("Transpose", [weight], [swapped], perm=[1, 0, 2, 3])]
        weight = swapped
    return [
        *swap,
        _const(starts, [-1] * spatial),
        _const(ends, [-(2**62)] * spatial),
        _const(axes, list(range(2, 2 + spatial))),
        _const(steps, [-1] * spatial),
        helper.make_node("Slice", [weight, starts, ends, axes, steps], [flipped]),
        helper.make_node(
            "Conv",
            [node.input[0], flipped],
            [stem],
            node.name,
            group=group,
            dilations=dilations,
            pads=flipped_pads,
        ),
    ]


def _col2im(node, found):
    if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.input) != 2:  # a bias: not onnx-ad's gradient
        return None
    shapes, taken = found.shapes, found.taken
    g, w = node.input
    g_shape, w_shape, out = shapes.get(g), shapes.get(w), shapes.get(node.output[0])
    if not all(_static(s) for s in (g_shape, w_shape, out)):
        return None
    rank = len(g_shape)
    if rank not in (3, 4) or len(w_shape) != rank or len(out) != rank:
        return None
    if attr(node, "group", 1) != 1 or attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    spatial = rank - 2
    strides = list(attr(node, "strides", [1] * spatial))
    dilations = list(attr(node, "dilations", [1] * spatial))
    pads = list(attr(node, "pads", [0] * (2 * spatial)))
    if spatial == 1:
        if strides[0] == 1:
            # onnxruntime's 1-D ConvTranspose of stride 1 is the faster one
            # (Whisper's 16x16x20, 2 cores: 23 against 31 us; 41 against 22
            # us at stride 2).
            return None
        # Col2Im takes two spatial axes or more: the 1-D one as (1, L).
        g_shape, w_shape, out = (
            [*g_shape[:2], 1, g_shape[2]],
            [*w_shape[:2], 1, w_shape[2]],
            [*out[:2], 1, out[2]],
        )
        strides, dilations, pads = [1, *strides], [1, *dilations], [0, pads[0], 0, pads[1]]
    n, c_out, h, w_ = g_shape
    c_in, kernel = w_shape[1], w_shape[2:]
    if w_shape[0] != c_out or tuple(out[:2]) != (n, c_in):
        return None
    image = out[2:]
    # Col2Im reads as many windows as a convolution of the input would make.
    for axis, count in enumerate((h, w_)):
        span = image[axis] + pads[axis] + pads[axis + 2] - dilations[axis] * (kernel[axis] - 1) - 1
        if span < 0 or span // strides[axis] + 1 != count:
            return None
    stem = node.output[0]
    w2, wt, g3, cols, w_shape_name, g_shape_name, image_name, block_name = (
        _unique(f"{stem}/{s}", taken)
        for s in ("w2", "wt", "g3", "cols", "w_shape", "g_shape", "image", "block")
    )
    placed = stem if spatial == 2 else _unique(f"{stem}/image4", taken)
    nodes = [
        _const(w_shape_name, [c_out, c_in * kernel[0] * kernel[1]]),
        helper.make_node("Reshape", [w, w_shape_name], [w2]),
        helper.make_node("Transpose", [w2], [wt], perm=[1, 0]),
        _const(g_shape_name, [n, c_out, h * w_]),
        helper.make_node("Reshape", [g, g_shape_name], [g3]),
        helper.make_node("MatMul", [wt, g3], [cols]),
        _const(image_name, list(image)),
        _const(block_name, list(kernel)),
        helper.make_node(
            "Col2Im",
            [cols, image_name, block_name],
            [placed],
            node.name if spatial == 2 else "",
            dilations=dilations,
            pads=pads,
            strides=strides,
        ),
    ]
    if spatial == 1:
        flat = _unique(f"{stem}/flat", taken)
        nodes += [
            _const(flat, [n, c_in, image[1]]),
            helper.make_node("Reshape", [placed, flat], [stem], node.name),
        ]
    return nodes


def _full_window(node, found):
    """A Conv whose one window is its whole unpadded input, as one MatMul.

    onnx-ad's weight gradient of a 1x1 convolution is such a Conv: ``(C_in,
    N, h, w)`` by filters ``(C_out, N, h, w)`` into ``(C_in, C_out, 1, 1)``,
    which onnxruntime runs as im2col with a kernel the image's size. The same
    sums as ``A (B, K) @ F (O, K)^T``: PP-OCRv6's recogniser's (768, 16, 3,
    16) by (384, 16, 3, 16), 8.7 ms a step -> 1.3 ms on 2 cores.
    """
    shapes, taken = found.shapes, found.taken
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if attr(node, "group", 1) != 1 or attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return None
    a, f, out = (shapes.get(n) for n in (*node.input, node.output[0]))
    if not (_static(a) and _static(f) and _static(out)) or len(a) < 3 or len(a) != len(f):
        return None
    spatial = len(a) - 2
    if any(attr(node, "pads", [0] * 2 * spatial)) or any(
        d != 1 for d in attr(node, "dilations", [1] * spatial)
    ):
        return None
    if tuple(a[2:]) != tuple(f[2:]) or a[1] != f[1] or any(d != 1 for d in out[2:]):
        return None
    window = int(np.prod(a[1:]))
    stem = node.output[0]
    names = [_unique(f"{stem}/{s}", taken) for s in ("rows", "filters", "filters_t", "product")]
    shape_names = [
        _unique(f"{stem}/{s}", taken) for s in ("rows_shape", "filters_shape", "out_shape")
    ]
    rows, filters, filters_t, product = names
    return [
        _const(shape_names[0], [a[0], window]),
        helper.make_node("Reshape", [node.input[0], shape_names[0]], [rows]),
        _const(shape_names[1], [f[0], window]),
        helper.make_node("Reshape", [node.input[1], shape_names[1]], [filters]),
        helper.make_node("Transpose", [filters], [filters_t], perm=[1, 0]),
        helper.make_node("MatMul", [rows, filters_t], [product]),
        _const(shape_names[2], list(out)),
        helper.make_node("Reshape", [product, shape_names[2]], [node.output[0]], node.name),
    ]


def _rewrite(node, found, crops):
    producer, shapes, types, taken = found.producer, found.shapes, found.types, found.taken
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if attr(node, "group", 1) != 1 or attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return None
    if any(s != 1 for s in attr(node, "strides", [1, 1])):
        return None
    x = _batch_first(node.input[0], producer, shapes)
    g = _filters_source(node.input[1], producer, shapes)
    out = shapes.get(node.output[0])
    if x is None or g is None or not _static(out) or len(out) != 4:
        return None
    n, c_in, _, _ = shapes[x]
    g_shape = shapes[g]
    c_out, (h, w) = g_shape[1], g_shape[2:4]
    kh, kw = out[2], out[3]
    if tuple(out[:2]) != (c_in, c_out) or g_shape[0] != n or x not in types:
        return None
    pads, strides = attr(node, "pads", [0, 0, 0, 0]), attr(node, "dilations", [1, 1])
    kept = crops.get(node.output[0])
    if kept is not None and all(
        (size + p + q - k) // s + 1 == count
        for size, p, q, k, s, count in zip(shapes[x][2:], pads[:2], pads[2:], kept, strides, (h, w))
    ):
        # Only the window elements the crop keeps (its Slice then keeps all):
        # YOLOv8n's stride-2 3x3 layers gathered 16 taps for 9.
        kh, kw = kept
    if kh * kw > max(c_out - 1, _SMALL_KERNEL):
        # Each one-hot column costs the depthwise Conv kh*kw products a
        # window element, the product that follows c_out: a large kernel of
        # few filters (ResNet's stem, 7x7 stride 2, 3 -> 64 channels: 3.6 ms
        # a step, 3.2 ms without, 2 cores) keeps onnx-ad's one convolution.
        return None
    product = n * c_out * c_in * kh * kw
    batched = product <= _MAX_PRODUCT_RATIO * max(np.prod(shapes[x]), np.prod(g_shape))
    stem = node.output[0]
    names = [_unique(f"{stem}/{s}", taken) for s in ("onehot", "cols", "cols3", "g3", "prod")]
    onehot, cols, cols3, g3, prod = names
    shape_names = [_unique(f"{stem}/{s}", taken) for s in ("cols_shape", "g_shape", "w_shape")]
    axes, summed, w4 = (_unique(f"{stem}/{s}", taken) for s in ("axes", "summed", "w4"))
    colst = _unique(f"{stem}/cols_t", taken)
    # Output channel (i, a, b) of the depthwise Conv picks X[i] at (a, b).
    kernels = one_hot_kernels(kh, kw, c_in, helper.tensor_dtype_to_np_dtype(types[x]))
    return [
        helper.make_node("Constant", [], [onehot], value=numpy_helper.from_array(kernels)),
        helper.make_node(
            "Conv",
            [x, onehot],
            [cols],
            group=c_in,
            strides=strides,
            pads=pads,
        ),
        _const(shape_names[0], [n, c_in * kh * kw, h * w]),
        helper.make_node("Reshape", [cols, shape_names[0]], [cols3]),
        _const(shape_names[1], [n, c_out, h * w]),
        helper.make_node("Reshape", [g, shape_names[1]], [g3]),
        *(
            _batched_product(cols3, g3, colst, prod, axes, summed)
            if batched
            else _one_product(cols3, g3, [n, c_in * kh * kw, c_out, h * w], summed, taken)
        ),
        _const(shape_names[2], [c_out, c_in, kh, kw]),
        helper.make_node("Reshape", [summed, shape_names[2]], [w4]),
        helper.make_node("Transpose", [w4], [node.output[0]], node.name, perm=[1, 0, 2, 3]),
    ]


def _batched_product(cols3, g3, colst, prod, axes, summed):
    """``sum_n G[n] @ P[n]^T``: one product per image, then their sum."""
    return [
        helper.make_node("Transpose", [cols3], [colst], perm=[0, 2, 1]),
        helper.make_node("MatMul", [g3, colst], [prod]),
        _const(axes, [0]),
        helper.make_node("ReduceSum", [prod, axes], [summed], keepdims=0),
    ]


def _one_product(cols3, g3, sizes, summed, taken):
    """The same sums as one product over every image's positions, ``G' (C_out,
    N*h*w) @ P' (C_in*kh*kw, N*h*w)^T``, where the batched product would hold
    many times the activations (:data:`_MAX_PRODUCT_RATIO`): the batch moved
    inside costs a copy of the columns and of the gradient, not a tensor the
    size of ``N`` weights. On 2 cores (AMD EPYC), 3x3 at batch 4: 128 -> 256
    channels from 20x20 at stride 2 0.65 ms, 256 channels 10x10 1.29 ms,
    against 1.94 and 3.08 ms for onnx-ad's convolution (YOLOv8n's deepest
    layers)."""
    n, taps, c_out, positions = sizes
    names = [_unique(f"{summed}/{s}", taken) for s in ("cols_t", "cols2", "g_t", "g2")]
    cols_t, cols2, g_t, g2 = names
    rows, filters = _unique(f"{summed}/rows", taken), _unique(f"{summed}/filters", taken)
    cols2_t = _unique(f"{summed}/cols2_t", taken)
    return [
        helper.make_node("Transpose", [cols3], [cols_t], perm=[1, 0, 2]),
        _const(rows, [taps, n * positions]),
        helper.make_node("Reshape", [cols_t, rows], [cols2]),
        helper.make_node("Transpose", [g3], [g_t], perm=[1, 0, 2]),
        _const(filters, [c_out, n * positions]),
        helper.make_node("Reshape", [g_t, filters], [g2]),
        helper.make_node("Transpose", [cols2], [cols2_t], perm=[1, 0]),
        helper.make_node("MatMul", [g2, cols2_t], [summed]),
    ]


def one_hot_kernels(kh, kw, copies=1, dtype=np.float32) -> np.ndarray:
    """``copies * kh * kw`` Conv kernels of one input channel, kernel ``c * kh
    * kw + t`` one at window element ``t`` (row-major): convolved with ``group=
    copies`` they gather every window element of each image (im2col)."""
    taps = kh * kw
    return np.tile(np.eye(taps, dtype=dtype), (copies, 1)).reshape(copies * taps, 1, kh, kw)


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


def _batch_first(name, producer, shapes):
    """``X`` (N, C, H, W) where ``name`` is ``X`` with batch and channels swapped."""
    node = producer.get(name)
    if node is None:
        return None
    source = node.input[0] if node.input else None
    shape, swapped = shapes.get(source), shapes.get(name)
    if not _static(shape) or not _static(swapped) or len(shape) != 4:
        return None
    if tuple(swapped) != (shape[1], shape[0], *shape[2:]):
        return None
    if node.op_type == "Transpose" and _perm(node) == [1, 0, 2, 3]:
        return source
    # A swap with a unit axis is a Reshape (see _optimize's unit-axis Transposes).
    if node.op_type == "Reshape" and 1 in shape[:2]:
        return source
    return None


def _unit_batch_source(reshape, producer, shapes):
    """``G`` (1, C_out, h, w[, 1]) behind Reshapes only: with a batch of one,
    onnx-ad's Transpose moves unit axes alone and became a Reshape (see
    _optimize's unit-axis Transposes), so the filters are ``G`` as it lies."""
    filters = shapes.get(reshape.output[0])
    if not _static(filters) or len(filters) != 4 or filters[1] != 1:
        return None
    name = reshape.input[0]
    while True:
        shape = shapes.get(name)
        if (
            _static(shape)
            and len(shape) in (4, 5)
            and shape[0] == 1
            and shape[4:] in ((), (1,))
            and tuple(filters) == (shape[1], 1, *shape[2:4])
        ):
            return name
        node = producer.get(name)
        if node is None or node.op_type != "Reshape":
            return None
        name = node.input[0]


def _filters_source(name, producer, shapes):
    """``G`` (N, C_out, h, w[, 1]) where ``name`` is it as Conv filters (C_out, N, h, w):
    onnx-ad writes ``Reshape(Transpose(G, [1, 4, 0, 2, 3]))`` with its seed axis last."""
    reshape = producer.get(name)
    if reshape is None or reshape.op_type != "Reshape":
        return None
    transpose = producer.get(reshape.input[0])
    if transpose is None or transpose.op_type != "Transpose":
        return _unit_batch_source(reshape, producer, shapes)
    source = transpose.input[0]
    shape, filters = shapes.get(source), shapes.get(name)
    if not _static(shape) or not _static(filters) or len(filters) != 4:
        return None
    if _perm(transpose) == [1, 4, 0, 2, 3] and len(shape) == 5 and shape[4] == 1:
        return source if tuple(filters) == (shape[1], shape[0], *shape[2:4]) else None
    if _perm(transpose) == [1, 0, 2, 3] and len(shape) == 4:
        return source if tuple(filters) == (shape[1], shape[0], *shape[2:4]) else None
    return None
