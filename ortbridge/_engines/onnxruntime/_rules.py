"""ortbridge's corrections to onnx-ad's reverse rules, in force only while ortbridge calls it.

onnx-ad keeps its rules in a table; :func:`own_rules` wraps some entries for
the duration of one ``reverse`` call and puts the originals back, so other
users of onnx-ad in the process see it unchanged. Each wrapper calls
onnx-ad's rule and corrects one case where its result is NaN and the true
derivative is zero (checked against finite differences on ONNX's node tests):

- ``Softmax``/``LogSoftmax`` of a row that is entirely masked (every input
  -inf) is NaN; exporters and the spec's Attention then mask that row's
  output (NaN-robust attention), so its derivative is 0, not NaN. Where
  every path from the output to the graph's outputs only carries a NaN on
  (arithmetic, layout, selection: :data:`_CARRIES_NAN`), nothing masks it,
  torch's own softmax backward is NaN there too, and the correction (an
  ``IsNaN`` and a ``Where`` over the whole output, 2.6% of a transformer
  layer's training step) is left out.
- ``Pow``'s exponent derivative ``y log(x)`` at ``x = 0`` is ``0 * -inf``;
  torch takes 0 there (``log`` of 1 where ``x`` is 0).

One wrapper adds what onnx-ad refuses: the weight gradient of a grouped
``Conv`` (see :func:`_conv`), otherwise one Conv per group, which made a
published OCR model's 14 depthwise convolutions 2,659 nodes forward and
about 40,000 backward (minutes of graph building and session creation); a
depthwise one of a small kernel as im2col and a MatMul
(:func:`_depthwise_weight`).
Another writes the ``ConvTranspose`` of Conv's and the pools' input gradients
with explicit pads, which onnx's shape inference gets right
(:func:`_explicit_transposes`). A ``ConvTranspose``'s weight, which onnx-ad
refuses, gets the adjoint convolution's weight gradient
(:func:`_conv_transpose`). A nearest ``Resize`` by integer factors sums each
block of its gradient instead of contracting interpolation matrices
(:func:`_resize`). And ``com.microsoft`` ``QuickGelu`` (a SiLU fused by
:mod:`.passes._fused_activations`) gets a rule of its own.

The module stays one module: the table :func:`own_rules` installs is the
contract, each wrapper sits beside the others it is installed with.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import onnx

from ortbridge._prepare._onnx_utils import node_reads

from . import _ad_rewrites_quant
from ._fold import in_onnx_ad
from .passes._conv_grad import one_hot_kernels


@contextlib.contextmanager
def own_rules(model: onnx.ModelProto | None = None):
    """onnx-ad's reverse-rule table with ortbridge's wrappers in it, and its
    constant folding without the sweep that only confirms (:mod:`._fold`),
    restored on exit.

    ``model``, the graph about to be differentiated, tells which softmax
    outputs no node can mask (without it every one is corrected).
    """
    from onnx_ad import rules

    table = rules.REVERSE
    saved = {op: table[op] for op in _WRAPPERS if op in table}
    # QuickGelu (a fused SiLU, :mod:`.passes._fused_activations`): onnx-ad has no
    # rule; its elementwise machinery takes the derivative below.
    added = "QuickGelu" not in table
    if added:
        table["QuickGelu"] = rules._elementwise_reverse
        rules.DERIVATIVE["QuickGelu"] = _d_quick_gelu
    # FakeQuantize (a QuantizeLinear/DequantizeLinear pair, :mod:`._ad_rewrites_quant`).
    table[_ad_rewrites_quant.OP] = _fake_quantize
    unmasked = _unmasked_softmaxes(model) if model is not None else set()
    for op, original in saved.items():
        wrapper = _WRAPPERS[op]
        if op in ("Softmax", "LogSoftmax"):
            wrapper = functools.partial(wrapper, unmasked=unmasked)
        table[op] = lambda ctx, node, grads, w=wrapper, o=original: w(ctx, node, grads, o)
    try:
        with in_onnx_ad():
            yield
    finally:
        table.update(saved)
        if added:
            del table["QuickGelu"], rules.DERIVATIVE["QuickGelu"]
        del table[_ad_rewrites_quant.OP]


def _d_quick_gelu(ctx, node, x, y, dtype):
    # y = x s, s = sigmoid(alpha x): y' = s (1 + alpha x (1 - s)), from x alone
    alpha = next((a.f for a in node.attribute if a.name == "alpha"), 1.702)
    b = ctx.b
    # A SiLU (alpha 1, YOLO's every activation) skips a Mul over the tensor.
    ax = x if alpha == 1.0 else b.op("Mul", [x, ctx.constant(alpha, dtype)])
    s = b.op("Sigmoid", [ax])
    gain = b.op("Mul", [ax, b.op("Sub", [ctx.constant(1.0, dtype), s])])
    return b.op("Mul", [s, b.op("Add", [ctx.constant(1.0, dtype), gain])])


def _fake_quantize(ctx, node, grads):
    """torch's fake quantization: the gradient where ``round(x / scale) +
    zero_point`` lies in the integer type's range, zero elsewhere; none for
    the zero point (it stays fixed). The scale's, where it is asked for (a
    scale named in ``trainable=``), is LSQ's, as torch's
    ``_fake_quantize_learnable_per_tensor_affine`` gives it (gradient factor
    1): ``round(x / s) - x / s`` inside the range, ``q_min - zero_point`` or
    ``q_max - zero_point`` below or above it, summed per scale."""
    from onnx import helper

    from ortbridge._prepare.quantized._lift import integer_limits

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if grads[0] is None or attrs.get("dynamic"):  # a dynamic range clips nothing
        return [grads[0]] + [None] * (len(node.input) - 1)
    x, scale, zero = node.input
    scale_name = scale
    b = ctx.b
    dtype = ctx.dtype(x)
    q_min, q_max = integer_limits(attrs["to"])
    rank = ctx.rank(x)
    axis = attrs.get("axis", 1) % rank if ctx.rank(scale) == 1 and rank > 1 else None
    if axis is not None:  # per axis: along that axis
        shape = [1] * rank
        shape[axis] = -1
        scale = b.op("Reshape", [scale, b.ints(shape)], stem="fq_scale")
        if zero:
            zero = b.op("Reshape", [zero, b.ints(shape)], stem="fq_zero_point")
    ratio = b.op("Div", [x, b.op("Cast", [scale], to=dtype)], stem="fq_ratio")
    rounded = b.op("Round", [ratio], stem="fq_level")
    offset = b.op("Cast", [zero], to=dtype) if zero else None
    level = rounded if offset is None else b.op("Add", [rounded, offset])
    inside = b.op(
        "And",
        [
            b.op("GreaterOrEqual", [level, ctx.constant(float(q_min), dtype)]),
            b.op("LessOrEqual", [level, ctx.constant(float(q_max), dtype)]),
        ],
        stem="fq_inside",
    )
    mask = b.op("Cast", [inside], to=dtype, stem="fq_mask")
    d_scale = None
    if ctx.asked_for(scale_name):
        offset = ctx.constant(0.0, dtype) if offset is None else offset
        parts = (ratio, rounded, level, inside, offset)
        facts = (q_min, q_max, dtype, rank, ctx.rank(scale_name))
        d_scale = _lsq_scale_gradient(ctx, grads[0], parts, facts, axis)
    return [b.op("Mul", [grads[0], ctx.lift(mask)], stem="a_" + x), d_scale, None]


def _lsq_scale_gradient(ctx, grad, parts, facts, axis):
    """The contribution to a fake quantization's scale (see :func:`_fake_quantize`,
    which computed ``parts``, the zero point among them as ``offset``, shaped
    along ``axis`` where the scale is per axis; ``facts``: the integer range,
    the float type, the ranks of the quantized tensor and of the scale)."""
    ratio, rounded, level, inside, offset = parts
    (q_min, q_max, dtype, rank, scale_rank), b = facts, ctx.b
    below = b.op("Less", [level, ctx.constant(float(q_min), dtype)])
    edge = b.op(
        "Where",
        [below, b.op("Sub", [ctx.constant(float(q_min), dtype), offset]),
         b.op("Sub", [ctx.constant(float(q_max), dtype), offset])],
    )  # fmt: skip
    local = b.op("Where", [inside, b.op("Sub", [rounded, ratio]), edge], stem="lsq_local")
    weighted = b.op("Mul", [grad, ctx.lift(local)], stem="lsq_weighted")  # (..., seeds)
    if axis is not None:  # one scale an index of that axis
        return ctx.reduce_sum(weighted, [a for a in range(rank) if a != axis], keepdims=0)
    summed = ctx.reduce_sum(weighted, list(range(rank)), keepdims=0)  # (seeds,)
    return ctx.unsqueeze(summed, [0]) if scale_rank == 1 else summed  # a scale of shape (1,)


def _softmax(ctx, node, grads, original, unmasked=frozenset()):
    contributions = original(ctx, node, grads)
    if not contributions or contributions[0] is None or node.output[0] in unmasked:
        return contributions
    b = ctx.b
    y = b.op("Unsqueeze", [node.output[0], b.ints([-1])], stem="softmax_y")  # seed axis
    nan = b.op("IsNaN", [y], stem="softmax_masked_row")
    zero = ctx.constant(0.0, ctx.dtype(node.output[0]))
    return [b.op("Where", [nan, zero, contributions[0]], stem="softmax_adjoint")]


def _pow(ctx, node, grads, original):
    base, exponent = node.input[0], node.input[1]
    if grads[0] is None or not ctx.asked_for(exponent) or ctx.dtype(exponent) != ctx.dtype(base):
        return original(ctx, node, grads)
    # onnx-ad's rule for the base; its exponent term is replaced (the split
    # keeps only the nodes an adjoint needs).
    contributions = list(original(ctx, node, grads))
    b = ctx.b
    dtype = ctx.dtype(node.output[0], base)
    is_zero = b.op("Equal", [base, ctx.constant(0.0, dtype)], stem="pow_base_zero")
    safe = b.op("Where", [is_zero, ctx.constant(1.0, dtype), base], stem="pow_safe_base")
    d_exponent = b.op("Mul", [node.output[0], b.op("Log", [safe])], stem="pow_d_exponent")
    product = b.op("Mul", [grads[0], ctx.lift(d_exponent)])
    contributions[1] = ctx.unbroadcast(product, ctx.rank(node.output[0]), exponent)
    return contributions[:2]


def _conv(ctx, node, grads, original):
    """A grouped Conv's weight gradient, as one grouped Conv; the rest is onnx-ad's.

    With ``g`` groups of ``ci`` input and ``co`` output channels, the weight
    gradient ``dW[j*co + c, i]`` correlates output gradient channel ``j*co + c``
    with input channel ``j*ci + i`` over the batch and every position: a
    Conv of the padded input laid out as ``ci`` images of ``g*N`` channels with
    the output gradient as ``g*co`` filters of ``N`` channels, ``group=g``,
    strides and dilations swapped (onnx-ad's own rule, for group 1, swaps the
    batch and channel axes the same way). Needs static channel, kernel and
    spatial sizes; the batch may be dynamic.
    """
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    x, w, y = node.input[0], node.input[1], node.output[0]
    if group == 1 or not ctx.asked_for(w):
        return _explicit_transposes(ctx, node, grads, original)
    xs, ws, ys = ctx.shapes.shape(x), ctx.shapes.static(w), ctx.shapes.shape(y)
    if ws is None or not _known_but_batch(xs) or not _known_but_batch(ys):
        from onnx_ad import UnsupportedOperator

        # Says "declared": the engine then builds the graph per input shape.
        raise UnsupportedOperator(
            f"the weight gradient of grouped Conv {node.name!r} needs declared sizes of "
            f"its input {x!r}, weight {w!r} and output {y!r} (all but the batch)"
        )
    asked = ctx.asked_for
    ctx.asked_for = lambda name: name != w and asked(name)  # the weight is ours
    try:
        contributions = list(_explicit_transposes(ctx, node, grads, original))
    finally:
        del ctx.asked_for
    contributions[1] = _grouped_conv_weight(ctx, node, group, xs, ws, ys, grads[0])
    return contributions


def _conv_transpose(ctx, node, grads, original):
    """A ConvTranspose's weight gradient, which onnx-ad refuses; the rest is onnx-ad's.

    ``Y = ConvTranspose(X, W)`` is the adjoint of ``X' = Conv(Y', W)`` under the
    same strides, dilations and pads, so ``dW`` is that convolution's weight
    gradient with ``dY`` as its input and ``X`` as its output's gradient:
    onnx-ad's own form for a Conv's weight, which the engine's passes then run
    as im2col and one product. Prepared only for 2-D ones of one group with
    explicit pads (:func:`._ad_rewrites_conv.conv_transpose`).
    """
    from onnx_ad import rules

    w = node.input[1]
    if not ctx.asked_for(w) or grads[0] is None:
        return original(ctx, node, grads)
    asked = ctx.asked_for
    ctx.asked_for = lambda name: name != w and asked(name)  # the weight is ours
    try:
        contributions = list(original(ctx, node, grads))
    finally:
        del ctx.asked_for
    attrs, spatial = rules._conv_attributes(ctx, node)
    attrs.pop("kernel_shape", None)
    y = node.output[0]
    incoming = ctx.squeeze(ctx.full(grads[0], y), [-1])
    ctx.shapes.declare(incoming, ctx.shapes.shape(y), ctx.dtype(y))
    adjoint = onnx.helper.make_node("Conv", [incoming, w], [node.input[0]], **attrs)
    seeded = ctx.unsqueeze(node.input[0], [-1])
    contributions[1] = rules._conv_weight_adjoint(ctx, adjoint, attrs, spatial, seeded)
    return contributions


def _explicit_transposes(ctx, node, grads, original):
    """onnx-ad's rule, its ``ConvTranspose`` nodes given pads instead of ``output_shape``.

    onnx's shape inference (1.23, and onnxruntime's) gives a ConvTranspose
    with ``output_shape`` rank 2, so a Reshape after it to the declared shape
    fails to load ("incompatible shapes": wav2vec2's positional convolution).
    onnxruntime (1.19 and 1.31) splits the padding ``output_shape`` implies
    with the odd one before (``total - total // 2``, then ``total // 2``); the
    same pads written out give the same values.
    """
    start = len(ctx.b.nodes)
    contributions = original(ctx, node, grads)
    y = ctx.shapes.static(node.output[0])
    kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    if kernel is None and len(node.input) > 1:
        w = ctx.shapes.static(node.input[1])
        kernel = None if w is None else list(w[2:])
    if y is None or kernel is None or None in kernel:
        return contributions
    for i in range(start, len(ctx.b.nodes)):
        made = ctx.b.nodes[i]
        if made.op_type == "ConvTranspose":
            ctx.b.nodes[i] = _with_pads(made, list(y[2:]), kernel) or made
    return contributions


def _with_pads(node, sizes, kernel):
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    out = attrs.get("output_shape")
    if not out or attrs.get("auto_pad", "NOTSET") != "NOTSET" or len(out) != len(sizes):
        return None
    ones = [1] * len(sizes)
    strides, dilations = attrs.get("strides", ones), attrs.get("dilations", ones)
    adjust = attrs.get("output_padding", [0] * len(sizes))
    total = [
        s * (n - 1) + a + (k - 1) * d + 1 - o
        for n, k, s, d, a, o in zip(sizes, kernel, strides, dilations, adjust, out)
    ]
    if None in sizes or min(total) < 0:
        return None
    pads = [t - t // 2 for t in total] + [t // 2 for t in total]
    attrs.pop("output_shape")
    attrs["pads"] = pads
    return onnx.helper.make_node(
        "ConvTranspose", list(node.input), list(node.output), node.name, **attrs
    )


def _known_but_batch(shape) -> bool:
    return shape is not None and len(shape) > 2 and None not in shape[1:]


#: A depthwise weight gradient of at most this many taps (3x3) over at least
#: this many output positions takes the im2col form (:func:`_depthwise_weight`).
_DEPTHWISE_TAPS, _DEPTHWISE_POSITIONS = 9, 16


def _grouped_conv_weight(ctx, node, group, xs, ws, ys, grad):
    if (
        len(ws) == 4
        and ws[0] == group
        and ws[1] == 1
        and ws[2] * ws[3] <= _DEPTHWISE_TAPS
        and ys[2] * ys[3] >= _DEPTHWISE_POSITIONS
    ):
        return _depthwise_weight(ctx, node, xs, ws, ys, grad)
    b = ctx.b
    x, y = node.input[0], node.output[0]
    spatial = len(ws) - 2
    attrs = {a.name: a for a in node.attribute}
    ones = [1] * spatial
    strides = list(attrs["strides"].ints) if "strides" in attrs else ones
    dilations = list(attrs["dilations"].ints) if "dilations" in attrs else ones
    pads = list(attrs["pads"].ints) if "pads" in attrs else [0] * (2 * spatial)
    ci, co = ws[1], ws[0] // group
    padded = list(xs[2:])
    if any(pads):
        x = b.op("Pad", [x, b.ints([0, 0, *pads[:spatial], 0, 0, *pads[spatial:]])])
        padded = [n + p + q for n, p, q in zip(padded, pads[:spatial], pads[spatial:])]
    axes = list(range(3, 3 + spatial))
    # [N, g*ci, ...] -> [ci, g*N, ...]: image i holds input channel i of every group
    images = b.op("Reshape", [x, b.ints([0, group, ci, *padded])])
    images = b.op("Transpose", [images], perm=[2, 1, 0, *axes])
    images = b.op("Reshape", [images, b.ints([ci, -1, *padded])])
    # [N, g*co, ..., 1] -> [g*co, N, ...]: filter j*co + c reads group j's N channels
    seeded = ctx.squeeze(ctx.full(grad, y), [-1])
    filters = b.op("Reshape", [seeded, b.ints([0, group, co, *ys[2:]])])
    filters = b.op("Transpose", [filters], perm=[1, 2, 0, *axes])
    filters = b.op("Reshape", [filters, b.ints([group * co, -1, *ys[2:]])])
    product = b.op(
        "Conv", [images, filters], group=group, strides=dilations, dilations=strides,
        pads=[0] * (2 * spatial), stem="grouped_conv_w",
    )  # fmt: skip
    # [ci, g*co, k'...] -> [g*co, ci, k...], the overhang past the kernel cropped
    product = ctx.slice(product, [0] * spatial, list(ws[2:]), list(range(2, 2 + spatial)))
    weight = b.op("Transpose", [product], perm=[1, 0, *range(2, 2 + spatial)])
    return ctx.unsqueeze(weight, [-1])


def _depthwise_weight(ctx, node, xs, ws, ys, grad):
    """A depthwise 2-D Conv's weight gradient as im2col and one batched MatMul.

    ``cols = Conv(X as (N*C, 1, H, W), E)``, ``E`` the ``kh*kw`` one-hot
    kernels, under the forward's pads, strides and dilations: every window
    element of every channel's image, ``(N, C, kh*kw, h*w)`` once viewed; then
    ``dW[c] = sum_n cols[n, c] @ G[n, c]``. onnxruntime runs the one grouped
    Conv of :func:`_grouped_conv_weight` on one thread with a kernel as large
    as the image; this form runs on all of them: MobileViT's (16, 32, 16, 16)
    3x3 layer 1.41 ms -> 0.71 ms on 2 cores (1.42 -> 1.22 ms on one), a 5x5's
    no faster (1.6x on one thread) and a 2x2 image's slower (1.5x).
    """
    b = ctx.b
    channels, (kh, kw), (h, w) = ws[0], ws[2:], ys[2:]
    taps = kh * kw
    kernels = one_hot_kernels(kh, kw)
    # The forward's window: its pads (or auto_pad), strides and dilations.
    window = {
        a.name: onnx.helper.get_attribute_value(a)
        for a in node.attribute
        if a.name in ("pads", "auto_pad", "strides", "dilations")
    }
    images = b.op("Reshape", [node.input[0], b.ints([-1, 1, *xs[2:]])])
    kernels = b.constant(kernels, ctx.dtype(node.input[0]))
    cols = b.op("Conv", [images, kernels], stem="depthwise_cols", **window)
    cols = b.op("Reshape", [cols, b.ints([-1, channels, taps, h * w])])
    seeded = ctx.squeeze(ctx.full(grad, node.output[0]), [-1])
    grads = b.op("Reshape", [seeded, b.ints([-1, channels, h * w, 1])])
    product = b.op("MatMul", [cols, grads], stem="depthwise_w")
    summed = ctx.reduce_sum(product, [0], keepdims=0)
    weight = b.op("Reshape", [summed, b.ints(list(ws))])
    return ctx.unsqueeze(weight, [-1])


def _resize(ctx, node, grads, original):
    """A nearest ``Resize`` that repeats each element ``s`` times along each axis
    (integer upsampling: YOLO's and the OCR detectors' feature pyramids) sums
    its gradient over each block: one Reshape and one ReduceSum. onnx-ad's rule
    contracts each axis with its interpolation matrix between two Transposes,
    which onnxruntime ran at 6-18 ns an element on YOLOv8n's 5-D gradients.
    Any other Resize is onnx-ad's."""
    factors = _block_factors(ctx, node)
    if factors is None or max(factors) == 1 or grads[0] is None:
        return original(ctx, node, grads)
    b, split, blocks = ctx.b, [], []
    for size, factor in zip(ctx.shapes.static(node.input[0]), factors):
        split.append(size)
        if factor > 1:
            blocks.append(len(split))
            split.append(factor)
    value = b.op("Reshape", [ctx.full(grads[0], node.output[0]), b.ints([*split, -1])])
    summed = ctx.reduce_sum(value, blocks, keepdims=0)
    return [summed] + [None] * (len(node.input) - 1)


def _block_factors(ctx, node) -> list[int] | None:
    """Each axis's repeat where ``node`` is a nearest Resize whose output element
    ``i`` reads input element ``i // s`` (``s`` an integer) along every axis;
    None otherwise. The input index is computed as onnxruntime's kernel does
    (float32, its coordinate transform, then its rounding)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    if node.domain not in ("", "ai.onnx") or ctx.opset < 11 or "axes" in attrs:
        return None
    mode = attrs.get("coordinate_transformation_mode", "half_pixel")
    if attrs.get("mode", "nearest") != "nearest" or mode not in _TO_INPUT:
        return None
    if attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None
    shape_in, shape_out = ctx.shapes.static(node.input[0]), ctx.shapes.static(node.output[0])
    if shape_in is None or shape_out is None or any(o % i for i, o in zip(shape_in, shape_out)):
        return None
    factors = [o // i for i, o in zip(shape_in, shape_out)]
    scales = ctx.values.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scales is not None and scales.size and list(np.ravel(scales)) != factors:
        return None
    rounding = _ROUNDING.get(attrs.get("nearest_mode", "round_prefer_floor"))
    if rounding is None:
        return None
    for size, factor in zip(shape_in, factors):
        out = np.arange(size * factor, dtype=np.float32)
        where = _TO_INPUT[mode](out, np.float32(factor), size, size * factor)
        index = np.clip(rounding(where.astype(np.float32)), 0, size - 1)
        if not np.array_equal(index, np.arange(size * factor) // factor):
            return None
    return factors


#: onnxruntime's coordinate transforms (output index, scale, input and output
#: lengths -> input coordinate), in float32.
_TO_INPUT = {
    "half_pixel": lambda x, s, n, m: (x + 0.5) / s - 0.5,
    "half_pixel_symmetric": lambda x, s, n, m: (x + 0.5) / s - 0.5 + n / 2 * (1 - m / (s * n)),
    "pytorch_half_pixel": lambda x, s, n, m: (x + 0.5) / s - 0.5 if m > 1 else 0 * x,
    "asymmetric": lambda x, s, n, m: x / s,
    "tf_half_pixel_for_nn": lambda x, s, n, m: (x + 0.5) / s,
    "align_corners": lambda x, s, n, m: x * (n - 1) / (m - 1) if m > 1 else 0 * x,
}
#: onnxruntime's nearest modes (a tie is exactly representable, so float32 decides it).
_ROUNDING = {
    "round_prefer_floor": lambda x: np.where(x == np.floor(x) + 0.5, np.floor(x), np.round(x)),
    "round_prefer_ceil": lambda x: np.where(x == np.floor(x) + 0.5, np.ceil(x), np.round(x)),
    "floor": np.floor,
    "ceil": np.ceil,
}


_WRAPPERS = {
    "Softmax": _softmax,
    "LogSoftmax": _softmax,
    "Pow": _pow,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "AveragePool": _explicit_transposes,
    "LpPool": _explicit_transposes,
    "Resize": _resize,
}


#: Operators that carry a NaN in an input on to their outputs (or drop it with
#: the element it sits in): none of them can turn a NaN row into zeros.
_CARRIES_NAN = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Neg", "MatMul", "Gemm", "Einsum", "Exp", "Log",
        "Sqrt", "Pow", "Tanh", "Sigmoid", "Erf", "Gelu", "Relu", "Softmax", "LogSoftmax",
        "LayerNormalization", "ReduceSum", "ReduceMean", "Dropout", "Identity", "Reshape",
        "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
        "Gather", "Expand", "Tile",
    }
)  # fmt: skip


def _unmasked_softmaxes(model: onnx.ModelProto) -> set[str]:
    """Outputs of the main graph's softmaxes whose every reader, and theirs on to
    the graph's outputs, is in :data:`_CARRIES_NAN` (a node whose subgraph reads
    one is not)."""
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node_reads(node):
            readers.setdefault(name, []).append(node)
    found = set()
    for node in graph.node:
        if node.op_type not in ("Softmax", "LogSoftmax") or node.domain not in ("", "ai.onnx"):
            continue
        todo, seen, masked = [node.output[0]], set(), False
        while todo and not masked:
            name = todo.pop()
            for reader in readers.get(name, ()):
                if reader.domain not in ("", "ai.onnx") or reader.op_type not in _CARRIES_NAN:
                    masked = True
                    break
                for out in reader.output:
                    if out and out not in seen:
                        seen.add(out)
                        todo.append(out)
        if not masked:
            found.add(node.output[0])
    return found
