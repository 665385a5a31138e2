"""``Slice`` with steps other than 1 as ``Gather``, for :mod:`._ad_rewrites`.

onnx-ad 0.3.0 differentiates unit-step slices only. Swin's patch merging
reads every other row and column (``x[:, 0::2, 1::2]``: steps of 2). A
strided slice along one axis is a ``Gather`` of the positions it keeps, whose
adjoint onnx-ad accumulates: constant positions where the axis length is
static (Python's slice rules are ONNX's), else a ``Range`` of the clamped
bounds computed at run time (positive steps). The unit-step axes stay one
``Slice``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ortbridge._prepare._onnx_utils import NodeBuilder

from ._ad_rewrites_conv import ints


def strided_slice(node, b, dims, value):
    """The nodes of ``node`` (a Slice) as a unit-step Slice and Gathers, or None.

    ``dims``: its input's shape (None where unknown); ``value(name)``: a
    tensor's value where constants and static shapes decide it, else None.
    """
    x, starts, ends, axes, steps = list(node.input) + [""] * (5 - len(node.input))
    values = [value(name) if name else None for name in (starts, ends, axes, steps)]
    if values[3] is None or values[0] is None or values[1] is None or (axes and values[2] is None):
        return None
    starts, ends, steps = (np.asarray(values[k]).reshape(-1).tolist() for k in (0, 1, 3))
    axes = np.asarray(values[2]).reshape(-1).tolist() if axes else list(range(len(starts)))
    if all(s == 1 for s in steps) or 0 in steps:
        return None
    if any(a < 0 for a in axes):
        if dims is None:
            return None
        axes = [a % len(dims) for a in axes]
    unit = [(a, s, e) for a, s, e, t in zip(axes, starts, ends, steps) if t == 1]
    strided = [(a, s, e, t) for a, s, e, t in zip(axes, starts, ends, steps) if t != 1]
    length = lambda a: None if dims is None or a >= len(dims) else dims[a]  # noqa: E731
    if any(length(a) is None and t < 0 for a, _, _, t in strided):
        return None
    if unit:
        bounds = [ints(b, [u[k] for u in unit]) for k in (1, 2, 0)]  # starts, ends, axes
        x = b.op("Slice", x, *bounds, ints(b, [1] * len(unit)))
    for a, s, e, t in strided:
        n = length(a)
        if n is not None:
            index = ints(b, np.arange(n)[slice(s, e, t)])
        else:
            index = _computed_index(b, x, a, s, e, t)
        x = b.op("Gather", x, index, axis=a)
    return b.replacing(node)


def _computed_index(b, x, axis, start, end, step):
    """``Range`` of the bounds clamped to the axis length read at run time (step > 0)."""
    n = NodeBuilder(TensorProto.INT64, b.fresh, b.prefix)

    def scalar(v):
        return n.op("Constant", value=numpy_helper.from_array(np.array(v, np.int64)))

    zero, extent = scalar(0), n.op("Gather", n.op("Shape", x), scalar(axis))

    def bound(v):
        v = max(min(v, np.iinfo(np.int64).max), np.iinfo(np.int64).min)
        wrapped = n.op("Add", scalar(v), extent) if v < 0 else scalar(v)
        return n.op("Min", n.op("Max", wrapped, zero), extent)

    index = n.op("Range", bound(start), bound(end), scalar(step))
    b.nodes.extend(n.nodes)
    return index
