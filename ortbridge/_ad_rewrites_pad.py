"""``Pad`` in reflect or edge mode as ``Gather``: part of :func:`._ad_rewrites.prepare_for_reverse`.

onnx-ad 0.3.0 differentiates constant-mode ``Pad`` only (reflect and edge
copy values, whose gradients must be added back). With constant widths and
a static length on each padded axis, the padded tensor is a ``Gather`` of
constant indices per axis, whose adjoint onnx-ad accumulates (ScatterND
add). Silero VAD's STFT reflects 64 samples at the end of its input.
"""

from __future__ import annotations

import numpy as np

from ._ad_rewrites_conv import ints
from ._onnx_utils import attr


def reflect_or_edge_pad(node, b, widths, dims, axes_value=None):
    """The nodes of ``node`` (a reflect or edge Pad) as Gathers, or None.

    ``widths``: its pads (an array, None if not constant); ``dims``: its
    input's shape (None where unknown); ``axes_value``: its axes input's value.
    """
    mode = attr(node, "mode", "constant")
    if mode not in ("reflect", "edge") or widths is None or dims is None:
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
        if length is None or length < 1:
            return None
        index = np.arange(-before, length + after)
        if mode == "edge":
            index = np.clip(index, 0, length - 1)
        else:  # reflect: the edge itself is not repeated
            if length < 2 or max(before, after) > length - 1:
                return None
            index = np.abs(index)
            index = np.where(index > length - 1, 2 * (length - 1) - index, index)
        x = b.op("Gather", x, ints(b, index), axis=axis)
    if x == node.input[0]:
        b.op("Identity", x)
    return b.replacing(node)
