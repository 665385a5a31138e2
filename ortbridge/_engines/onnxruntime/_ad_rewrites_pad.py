"""``Pad`` in reflect, edge or wrap mode as ``Gather``, for :mod:`._ad_rewrites`.

onnx-ad 0.3.0 differentiates constant-mode ``Pad`` only (reflect, edge and
wrap copy values, whose gradients must be added back). With constant widths, the
padded tensor is a ``Gather`` per padded axis, whose adjoint onnx-ad
accumulates (ScatterND add): constant indices where the axis length is
static, else indices computed from it at run time. Silero VAD's STFT
reflects 64 samples at the end of its input.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ortbridge._prepare._onnx_utils import NodeBuilder, attr

from ._ad_rewrites_conv import ints


def copying_pad(node, b, widths, dims, axes_value=None):
    """The nodes of ``node`` (a reflect, edge or wrap Pad) as Gathers, or None.

    ``widths``: its pads (an array, None if not constant); ``dims``: its
    input's shape (None where unknown); ``axes_value``: its axes input's value.
    """
    mode = attr(node, "mode", "constant")
    if mode not in ("reflect", "edge", "wrap") or widths is None or dims is None:
        return None
    rank = len(dims)
    if len(node.input) > 3 and node.input[3]:
        if axes_value is None:
            return None
        axes = [int(a) % rank for a in np.asarray(axes_value).reshape(-1)]
    else:
        axes = list(range(rank))
    widths = [int(w) for w in np.asarray(widths).reshape(-1)]
    if len(widths) != 2 * len(axes) or min(widths, default=0) < 0:
        return None
    x = node.input[0]
    for axis, before, after in zip(axes, widths[: len(axes)], widths[len(axes) :]):
        if before == after == 0:
            continue
        length = dims[axis]
        if length is None:
            index = _computed_index(b, x, axis, before, after, mode)
        else:
            index = _index(length, before, after, mode)
            if index is None:
                return None  # wider than the axis: onnxruntime's Pad refuses it, named
            index = ints(b, index)
        x = b.op("Gather", x, index, axis=axis)
    if x == node.input[0]:
        b.op("Identity", x)
    return b.replacing(node)


def _index(length, before, after, mode):
    """Positions of the padded axis's values in the input's axis, or None."""
    index = np.arange(-before, length + after)
    if mode == "edge":
        return None if length < 1 else np.clip(index, 0, length - 1)
    if mode == "wrap":
        return None if length < 1 else index % length
    if length < 2 or max(before, after) > length - 1:
        return None
    index = np.abs(index)  # reflect: the edge itself is not repeated
    return np.where(index > length - 1, 2 * (length - 1) - index, index)


def _computed_index(b, x, axis, before, after, mode):
    """:func:`_index` computed from the axis length at run time (int64 ops).

    A reflection wider than the axis gives an index past its end, so the
    Gather fails as onnxruntime's Pad does, never a wrong value.
    """
    n = NodeBuilder(TensorProto.INT64, b.fresh, b.prefix)

    def scalar(value):
        return n.op("Constant", value=numpy_helper.from_array(np.array(value, np.int64)))

    length = n.op("Gather", n.op("Shape", x), scalar(axis))
    last = n.op("Sub", length, scalar(1))
    index = n.op("Range", scalar(-before), n.op("Add", length, scalar(after)), scalar(1))
    if mode == "edge":
        index = n.op("Min", n.op("Max", index, scalar(0)), last)
    elif mode == "wrap":
        index = n.op("Mod", index, length)  # an integer Mod takes the divisor's sign
    else:
        mirrored = n.op("Abs", index)
        beyond = n.op("Greater", mirrored, last)
        back = n.op("Sub", n.op("Mul", scalar(2), last), mirrored)
        index = n.op("Where", beyond, back, mirrored)
        too_wide = n.op("Greater", scalar(max(before, after)), last)
        index = n.op("Where", too_wide, n.op("Add", index, length), index)
    b.nodes.extend(n.nodes)
    return index
