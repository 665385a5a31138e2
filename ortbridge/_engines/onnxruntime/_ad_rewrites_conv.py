"""Convolutions and pools in forms onnx-ad 0.3.0 differentiates correctly.

Part of :func:`ortbridge._engines.onnxruntime._ad_rewrites.prepare_for_reverse`; every function
here returns the nodes replacing one node, or None to keep it.

onnx-ad's adjoint of a Conv's input, and of AveragePool and LpPool, is a
``ConvTranspose`` given ``output_shape``. onnxruntime then derives the
padding from ``output_shape`` and splits it evenly: asymmetric pads come out
wrong, and so do symmetric ones when a stride leaves two or more padded
input rows unread. Those nodes get a window that reads the whole padded
input and symmetric pads, the rest as an explicit ``Pad`` (or ``Slice``).

A pool's pads and ``ceil_mode`` become explicit padding, sized as
onnxruntime >= 1.20 sizes pools (no window starts in the end padding; onnx's
shape inference and onnxruntime-training 1.19 let one).

onnx-ad refuses the weight of a grouped Conv and of a ConvTranspose: those
become one Conv per group (``Split``, ``Concat``; a depthwise Conv, or one of
more than :data:`SPLIT_GROUPS` groups, stays one node, its weight gradient
given by ortbridge's own reverse rule) and a stride-1 Conv over a
zero-inserted input with the flipped weight (one MatMul where the
ConvTranspose's windows tile its output). They need static channel (and,
for ConvTranspose, spatial) sizes; the batch may be dynamic. The onnxruntime
engine builds its graphs per input shape where onnx-ad refuses them unrewritten
(:data:`ortbridge._engines.onnxruntime._reverse_prep.STATIC_HINT`).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._onnx_utils import NodeBuilder, attr, np_dtype


def ints(b: NodeBuilder, values) -> str:
    """A ``Constant`` int64 vector: onnx-ad reads axes, pads and shapes from constants."""
    array = np.asarray(list(values), dtype=np.int64)
    return b.op("Constant", value=numpy_helper.from_array(array))


#: Grouped Convs with a trained weight, several input channels a group and at
#: most this many groups become one Conv per group; with more, or depthwise,
#: ortbridge's reverse rule for the weight
#: (:func:`ortbridge._engines.onnxruntime._rules._conv`) keeps them one node (ConvNeXt's
#: 8-channel depthwise 7x7, batch 16: 0.47 ms of backward kernels split, 0.27
#: as one node, onnxruntime 1.19). Training
#: steps on 2 cores (onnxruntime 1.31, forward and backward): 4 groups
#: 32->64 channels 47 ms split, 55 ms one node; depthwise 128 channels
#: 16x16, batch 16: 159 ms split, 129 ms one node; depthwise 384 channels
#: 6x40: 125 ms split, 79 ms one node, and 4.5 s against 0.03 s to build.
SPLIT_GROUPS = 8


def copy_node(node: onnx.NodeProto, inputs=None, drop=(), **attrs) -> onnx.NodeProto:
    """``node`` with other inputs, without the ``drop`` attributes, with ``attrs`` set."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    if inputs is not None:
        del new.input[:]
        new.input.extend(inputs)
    del new.attribute[:]
    new.attribute.extend(a for a in node.attribute if a.name not in set(drop) | set(attrs))
    new.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    return new


def _static(dims) -> bool:
    return dims is not None and None not in dims


def _same_pads(n, k, s, d, mode):
    total = max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
    small, large = total // 2, total - total // 2
    return (small, large) if mode == "SAME_UPPER" else (large, small)


def explicit_pads(node, spatial, kernel, strides, dilations):
    """(begin, end) pads, ``auto_pad`` resolved; None when that needs unknown sizes."""
    auto = attr(node, "auto_pad", "NOTSET")
    rank = len(kernel)
    if auto == "VALID":
        return [0] * rank, [0] * rank
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        if not _static(spatial):
            return None
        pairs = [_same_pads(*geo, auto) for geo in zip(spatial, kernel, strides, dilations)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    pads = list(attr(node, "pads", [0] * 2 * rank))
    return pads[:rank], pads[rank:]


def _unread(n, b, e, k, s, d) -> int:
    """Padded input rows past the last window."""
    return (n + b + e - (k - 1) * d - 1) % s


def _needs_exact_window(spatial, begin, end, kernel, strides, dilations) -> bool:
    """Whether onnxruntime's split of the adjoint's padding misses the begin pads.

    It puts ``ceil(total / 2)`` first (0 when negative), ``total`` being the
    pads less the unread rows: found by probing ConvTranspose, not documented.
    """
    for n, b, e, k, s, d in zip(spatial, begin, end, kernel, strides, dilations):
        total = b + e - _unread(n, b, e, k, s, d)
        if max(0, total - total // 2) != b:
            return True
    return False


def pad_or_crop(b: NodeBuilder, x: str, dims, before, after, first: int = 2) -> str:
    """``x`` padded with zeros (positive widths) or cropped (negative) from axis ``first`` on.

    onnx-ad's Pad adjoint mishandles negative widths, so crops are Slices.
    """
    axes = list(range(first, first + len(dims)))
    if any(w < 0 for w in list(before) + list(after)):
        starts = [max(0, -w) for w in before]
        ends = [n - max(0, -w) for n, w in zip(dims, after)]
        x = b.op("Slice", x, ints(b, starts), ints(b, ends), ints(b, axes))
    if any(w > 0 for w in list(before) + list(after)):
        lead = [0] * first
        widths = lead + [max(0, w) for w in before] + lead + [max(0, w) for w in after]
        x = b.op("Pad", x, ints(b, widths))
    return x


def _window(node, shape):
    """A Conv's or ConvTranspose's operands and window: (x, w, shape of x, shape of w,
    kernel, strides, dilations, spatial size or None); None when the kernel is unknown."""
    x, w = node.input[0], node.input[1]
    xs, ws = shape(x), shape(w)
    kernel = attr(node, "kernel_shape") or (list(ws[2:]) if _static(ws) else None)
    if kernel is None:
        return None
    return (x, w, xs, ws, kernel, *_geometry(node, xs, kernel))


def _geometry(node, xs, kernel):
    """Strides, dilations and the input's spatial size (None if unknown) of a window."""
    rank = len(kernel)
    strides = list(attr(node, "strides", [1] * rank))
    dilations = list(attr(node, "dilations", [1] * rank))
    spatial = list(xs[2:]) if xs is not None and len(xs) == rank + 2 else None
    return strides, dilations, spatial


def conv(node, b: NodeBuilder, shape, is_constant):
    """A Conv with explicit pads and exact windows; grouped with a trained weight, split."""
    window = _window(node, shape)
    if window is None:
        return None
    x, w, xs, ws, kernel, strides, dilations, spatial = window
    pads = explicit_pads(node, spatial, kernel, strides, dilations)
    if pads is None:
        return None
    begin, end = pads
    geo = (kernel, strides, dilations)
    source, explicit = x, begin + end
    if _static(spatial) and _needs_exact_window(spatial, begin, end, *geo):
        # The last window ends the padded input and the pads are symmetric:
        # onnxruntime's split of the adjoint's padding is then the right one.
        extra_before, extra_after, sym = [], [], []
        for n, p, q, k, s, d in zip(spatial, begin, end, *geo):
            q -= _unread(n, p, q, k, s, d)
            sym.append(max(0, min(p, q)))
            extra_before.append(p - sym[-1])
            extra_after.append(q - sym[-1])
        source, explicit = pad_or_crop(b, x, spatial, extra_before, extra_after), sym + sym
    group = attr(node, "group", 1)
    if (
        1 < group <= SPLIT_GROUPS
        and not is_constant(w)
        and xs is not None
        and xs[1]
        and xs[1] > group  # depthwise: one node is faster
        and ws
        and ws[0]
    ):
        bias = node.input[2] if len(node.input) > 2 else ""
        attrs = dict(_kept(node, ["auto_pad", "group"]), pads=explicit)
        per_group(b, source, w, bias, (xs[1], ws[0], group), attrs)
        return b.replacing(node)
    if source == x and attr(node, "auto_pad", "NOTSET") == "NOTSET":
        return None
    inputs = [source, *node.input[1:]]
    return [*b.nodes, copy_node(node, inputs, drop=["auto_pad"], pads=explicit)]


def per_group(b: NodeBuilder, x, w, bias, sizes, attrs) -> None:
    """Append one Conv per group between a Split and a Concat to ``b``.

    Faster here than im2col and a batched MatMul, even depthwise: a
    16x128x16x16 input, 3x3 kernel, 128 groups took 37 ms forward and
    backward split, 54 ms as im2col (onnxruntime 1.31, 2 CPU cores); see
    :data:`SPLIT_GROUPS` for where one grouped node is faster.
    """
    channels, cout, group = sizes
    parts = []
    for name, extent in ((x, channels), (w, cout), (bias, cout)):
        if not name:
            parts.append([""] * group)
            continue
        outs = [b.fresh(f"{b.prefix}group") for _ in range(group)]
        split = ints(b, [extent // group] * group)
        b.nodes.append(helper.make_node("Split", [name, split], outs, outs[0], axis=int(name == x)))
        parts.append(outs)
    convs = [b.op("Conv", *[n for n in ins if n], **attrs) for ins in zip(*parts)]
    b.op("Concat", *convs, axis=1)


def _transpose_pads(node, spatial, kernel, strides, dilations, padding):
    """ConvTranspose (begin, end) pads, ``output_shape`` and ``auto_pad`` resolved."""
    rank = len(kernel)
    auto = attr(node, "auto_pad", "NOTSET")
    out = attr(node, "output_shape")
    if out is None and auto not in ("SAME_UPPER", "SAME_LOWER"):
        if auto == "VALID":
            return [0] * rank, [0] * rank
        pads = list(attr(node, "pads", [0] * 2 * rank))
        return pads[:rank], pads[rank:]
    if not _static(spatial):
        return None
    out = list(out)[-rank:] if out is not None else [n * s for n, s in zip(spatial, strides)]
    begin, end = [], []
    for n, k, s, d, p, o in zip(spatial, kernel, strides, dilations, padding, out):
        total = s * (n - 1) + p + (k - 1) * d + 1 - o
        # onnxruntime: SAME_UPPER pads more at the end, every other setting at the start;
        # a longer output than the windows reach gets zeros (a negative end pad) at the end
        head = max(0, total // 2 if auto == "SAME_UPPER" else total - total // 2)
        begin.append(head)
        end.append(total - head)
    return begin, end


#: A trained ConvTranspose of one group and these spatial ranks stays itself:
#: onnxruntime's kernel forward, the weight gradient ortbridge's rule
#: (:func:`.._rules._conv_transpose`). A DB head's 2x2 upsampling of 24
#: channels at 80x80, batch 4, on 2 cores: 1.3 ms against 8.4 ms as patches
#: (:func:`_patches`). Others keep a Conv over a zero-inserted input.
NATIVE_TRANSPOSE_RANKS = (2,)


def conv_transpose(node, b: NodeBuilder, shape, is_constant):
    """A ConvTranspose with explicit pads, or (trained weight) a Conv over a zero-inserted input."""
    window = _window(node, shape)
    if window is None:
        return None
    x, w, xs, ws, kernel, strides, dilations, spatial = window
    rank = len(kernel)
    padding = list(attr(node, "output_padding", [0] * rank))
    group = attr(node, "group", 1)
    pads = _transpose_pads(node, spatial, kernel, strides, dilations, padding)
    if pads is None:
        return None
    begin, end = pads
    if is_constant(w) or not (_static(spatial) and xs[1] and _static(ws)):
        if attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID") and attr(node, "output_shape"):
            return None  # onnx-ad handles output_shape itself
        if attr(node, "auto_pad", "NOTSET") == "NOTSET" or min(begin + end) < 0:
            return None
        return [copy_node(node, drop=["auto_pad", "output_shape"], pads=begin + end)]
    channels = xs[1]
    if group == 1 and rank in NATIVE_TRANSPOSE_RANKS and min(begin + end) >= 0:
        return [copy_node(node, drop=["auto_pad", "output_shape"], pads=begin + end)]
    if group == 1 and kernel == strides and set(dilations) == {1} and not any(begin + end):
        return _patches(node, b, (x, w), channels, ws[1], kernel, spatial)
    up, lengths = x, list(spatial)
    if any(s > 1 for s in strides):
        # zero insertion: [.., n, 1] padded to [.., n, s] and merged is x with s-1 zeros after each
        grid = [v for n in spatial for v in (n, 1)]
        spread = b.op("Reshape", x, ints(b, [0, channels, *grid]))
        zeros = [0] * (2 + 2 * rank) + [0, 0] + [v for s in strides for v in (0, s - 1)]
        spread = b.op("Pad", spread, ints(b, zeros))
        lengths = [n * s for n, s in zip(spatial, strides)]
        up = b.op("Reshape", spread, ints(b, [0, channels, *lengths]))
    geo = zip(kernel, dilations, begin, end, padding, strides)
    before = [(k - 1) * d - p for k, d, p, _, _, _ in geo]
    geo = zip(kernel, dilations, begin, end, padding, strides)
    after = [(k - 1) * d + op - q - (s - 1) for k, d, _, q, op, s in geo]
    source = pad_or_crop(b, up, lengths, before, after)
    cout = ws[1] * group
    # [C, cout/g, k..] -> [cout, C/g, k..], each group's block transposed, taps flipped
    filters = b.op("Reshape", w, ints(b, [group, channels // group, ws[1], *kernel]))
    filters = b.op("Transpose", filters, perm=[0, 2, 1, *range(3, 3 + rank)])
    filters = b.op("Reshape", filters, ints(b, [cout, channels // group, *kernel]))
    for axis, k in enumerate(kernel, start=2):
        filters = b.op("Gather", filters, ints(b, range(k - 1, -1, -1)), axis=axis)
    bias = node.input[2] if len(node.input) > 2 else ""
    attrs = {"dilations": dilations, "kernel_shape": list(kernel)}
    if group == 1:
        b.op("Conv", *[n for n in (source, filters, bias) if n], **attrs)
    else:
        per_group(b, source, filters, bias, (channels, cout, group), attrs)
    return b.replacing(node)


def _patches(node, b: NodeBuilder, operands, channels, cout, kernel, spatial):
    """A ConvTranspose whose windows tile the output (kernel = strides, no pads):
    each input pixel's channels times the weight is one output patch. One MatMul
    ``[N, *spatial, C] @ [C, cout * k..]`` and the patches put in place, instead
    of a Conv over an input with zeros inserted (k^rank times the work; on 2
    cores the UNet decoder's forward Conv took 2 ms)."""
    x, w = operands
    rank = len(kernel)
    pixels = b.op("Transpose", x, perm=[0, *range(2, 2 + rank), 1])
    flat = b.op("Reshape", w, ints(b, [channels, cout * math.prod(kernel)]))
    patches = b.op("MatMul", pixels, flat)
    patches = b.op("Reshape", patches, ints(b, [0, *spatial, cout, *kernel]))
    # [N, n.., cout, k..] -> [N, cout, n_1, k_1, n_2, k_2, ..]
    interleaved = [v for i in range(rank) for v in (1 + i, 2 + rank + i)]
    placed = b.op("Transpose", patches, perm=[0, 1 + rank, *interleaved])
    sizes = [n * k for n, k in zip(spatial, kernel)]
    out = b.op("Reshape", placed, ints(b, [0, cout, *sizes]))
    if len(node.input) > 2 and node.input[2]:
        bias = b.op("Reshape", node.input[2], ints(b, [cout] + [1] * rank))
        b.op("Add", out, bias)
    return b.replacing(node)


def _pool_size(n, b, e, k, s, d, ceil) -> int:
    """onnxruntime's pooled size: with ceil_mode, no window starts past the begin pad and input."""
    room = n + b + e - (k - 1) * d - 1
    size = (-(-room // s) if ceil else room // s) + 1
    return size - 1 if ceil and (size - 1) * s >= n + b else size


def _window_counts(n, b, e, k, s, d, outs, include_pad):
    low, high = (-b, n + e) if include_pad else (0, n)
    starts = np.arange(outs) * s - b
    taps = starts[:, None] + np.arange(k)[None, :] * d
    return ((taps >= low) & (taps < high)).sum(axis=1)


def pool(node, b: NodeBuilder, shape, elem_type):
    """A pool with explicit pads, exact windows or (AveragePool) explicit zero padding."""
    x = node.input[0]
    xs = shape(x)
    kernel = list(attr(node, "kernel_shape", []))
    if not kernel:  # required by the standard; onnx-ad names the node
        return None
    strides, dilations, spatial = _geometry(node, xs, kernel)
    pads = explicit_pads(node, spatial, kernel, strides, dilations)
    if pads is None:
        return None
    begin, end = pads
    geo = (kernel, strides, dilations)
    auto = attr(node, "auto_pad", "NOTSET") != "NOTSET"
    exact = _static(spatial) and _needs_exact_window(spatial, begin, end, *geo)
    ceil = attr(node, "ceil_mode", 0)
    sizes = None
    if _static(spatial):
        sizes = [_pool_size(n, p, q, *g, ceil) for n, p, q, *g in zip(spatial, begin, end, *geo)]
    if node.op_type == "AveragePool" and sizes and (exact or ceil):
        return _average_pool(node, b, spatial, sizes, geo, pads, elem_type)
    if node.op_type == "MaxPool" and sizes and ceil:
        # onnx's shape inference misses onnxruntime's last-window rule, and onnx-ad sizes the
        # seed from it: the same windows come from end pads (ignored by a max) and floor rounding
        floor = []
        for n, p, o, k, s, d in zip(spatial, begin, sizes, *geo):
            q = max(0, (o - 1) * s + (k - 1) * d + 1 - n - p)
            floor.append(q if q < k and _pool_size(n, p, q, k, s, d, 0) == o else None)
        if None not in floor:  # onnxruntime wants pads below the kernel
            return [copy_node(node, drop=["auto_pad", "ceil_mode"], pads=begin + floor)]
    if node.op_type == "LpPool" and exact and not ceil:
        # |0|^p adds nothing: zero padding is the pool's own
        trimmed = [e - _unread(n, p, e, *g) for n, p, e, *g in zip(spatial, begin, end, *geo)]
        sym = [max(0, min(p, q)) for p, q in zip(begin, trimmed)]
        before = [p - m for p, m in zip(begin, sym)]
        after = [q - m for q, m in zip(trimmed, sym)]
        padded = pad_or_crop(b, x, spatial, before, after)
        return [*b.nodes, copy_node(node, [padded], drop=["auto_pad"], pads=sym + sym)]
    if auto:
        return [copy_node(node, drop=["auto_pad"], pads=begin + end)]
    return None


def _average_pool(node, b, spatial, outs, geo, pads, elem_type):
    """Pad explicitly, pool without pads, rescale the windows that counted fewer elements."""
    kernel, strides, dilations = geo
    begin, end = pads
    needed = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(outs, strides, kernel, dilations)]
    after = [m - n - p for m, n, p in zip(needed, spatial, begin)]
    padded = pad_or_crop(b, node.input[0], spatial, begin, after)
    drop = ["auto_pad", "pads", "ceil_mode", "count_include_pad"]
    pooled = b.op("AveragePool", padded, **_kept(node, drop))
    include = attr(node, "count_include_pad", 0)
    counts = np.ones([1, 1], dtype=np.float64)
    for n, p, q, k, s, d, o in zip(spatial, begin, end, kernel, strides, dilations, outs):
        counts = counts[..., None] * _window_counts(n, p, q, k, s, d, o, include)
    if np.any(counts != math.prod(kernel)):
        scale = (math.prod(kernel) / counts).astype(np_dtype(elem_type))
        b.op("Mul", pooled, b.op("Constant", value=numpy_helper.from_array(scale)))
    return b.replacing(node)


def _kept(node, drop):
    return {
        a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in set(drop)
    }
