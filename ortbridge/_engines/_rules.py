"""ortbridge's own reverse rules, in force only while ortbridge calls onnx-ad.

onnx-ad keeps its rules in a table; :func:`own_rules` swaps ortbridge's in
for the duration of one ``reverse`` call and puts the originals back, so other
users of onnx-ad in the process see it unchanged. Each rule handles the cases
it was written for and hands every other node to onnx-ad's own rule.

- ``MaxPool`` over non-overlapping windows (kernel = stride, no pads, no
  dilation, windows tiling the input): onnx-ad recomputes the pooling with
  indices in the backward (onnxruntime's slow kernel) and scatters the
  gradient. Here, within each window, the first position in scan order whose
  value equals the window's maximum receives the gradient, torch's rule for
  ties, with elementwise ops and one reduction over the window axes.
"""

from __future__ import annotations

import contextlib

import numpy as np
from onnx import TensorProto, helper


@contextlib.contextmanager
def own_rules():
    """onnx-ad's rule table with ortbridge's rules in it, restored on exit."""
    from onnx_ad import rules

    table = rules.REVERSE
    saved = {op: table.get(op) for op in _RULES}
    for op, rule in _RULES.items():
        original = saved[op]
        table[op] = lambda ctx, node, grads, rule=rule, original=original: rule(
            ctx, node, grads, original
        )
    try:
        yield
    finally:
        for op, original in saved.items():
            if original is None:
                table.pop(op, None)
            else:
                table[op] = original


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _tiling_window(ctx, node):
    """The window of a MaxPool whose windows tile its input, or None."""
    if len(node.output) > 1 and node.output[1]:
        return None
    shape = ctx.shapes.static(node.input[0])
    if shape is None or len(shape) < 3:
        return None
    spatial = len(shape) - 2
    kernel = _attr(node, "kernel_shape", None)
    if kernel is None or len(kernel) != spatial:
        return None
    strides = _attr(node, "strides", [1] * spatial)
    plain = (
        _attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID")
        and not any(_attr(node, "pads", [0] * 2 * spatial))
        and all(d == 1 for d in _attr(node, "dilations", [1] * spatial))
        and list(strides) == list(kernel)
        and all(size % k == 0 for size, k in zip(shape[2:], kernel))
    )
    return (list(shape), list(kernel)) if plain else None


def _max_pool(ctx, node, grads, original):
    window = _tiling_window(ctx, node)
    if window is None or grads[0] is None or ctx.opset < 18:  # ReduceMin's axes input
        return original(ctx, node, grads)
    shape, kernel = window
    x, y = node.input[0], node.output[0]
    b = ctx.b
    # (N, C, H, W) -> (N, C, H/k, k, W/k, k): each window on its own axes.
    split = list(shape[:2])
    for size, k in zip(shape[2:], kernel):
        split += [size // k, k]
    window_axes = list(range(3, len(split), 2))
    pooled = [1 if a in window_axes else d for a, d in enumerate(split)]
    x_w = b.op("Reshape", [x, b.ints(split)], stem="pool_x")
    y_w = b.op("Reshape", [y, b.ints(pooled)], stem="pool_y")
    # Position of each element in its window, in scan order (row-major).
    position = np.arange(int(np.prod(kernel)), dtype=np.int64).reshape(kernel)
    position_shape = [1] * len(split)
    for a, k in zip(window_axes, kernel):
        position_shape[a] = k
    pos = b.constant(position, TensorProto.INT64, position_shape)
    past = b.constant(int(np.prod(kernel)), TensorProto.INT64)
    is_max = b.op("Equal", [x_w, y_w], stem="pool_is_max")
    candidate = b.op("Where", [is_max, pos, past], stem="pool_candidate")
    first = b.op("ReduceMin", [candidate, b.ints(window_axes)], keepdims=1, stem="pool_first")
    chosen = b.op("Equal", [pos, first], stem="pool_chosen")
    # One seed direction: the adjoint's trailing seed axis has size 1.
    seeded = ctx.full(grads[0], y)
    g_w = b.op("Reshape", [seeded, b.ints(pooled)], stem="pool_grad")
    zero = b.constant(0.0, ctx.dtype(x))
    spread = b.op("Where", [chosen, g_w, zero], stem="pool_spread")
    return [b.op("Reshape", [spread, b.ints(list(shape) + [1])], stem="pool_adjoint")]


_RULES = {"MaxPool": _max_pool}
