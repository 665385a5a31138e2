"""A non-overlapping MaxPool's input gradient without the pooling indices.

onnx-ad differentiates ``MaxPool`` by running it again with its ``Indices``
output and scattering the output gradient there (``ScatterND`` into zeros).
onnxruntime's MaxPool-with-indices kernel is slow on the CPU (measured on 2
cores: 1.8 ms against 0.13 ms for the plain kernel on a 64x8x26x26 input).
Where the windows do not overlap (kernel equal to strides, no padding, no
dilation: the usual 2x2 pool) the same gradient comes from the plain kernel,
with every other step elementwise in the input's own layout:

- the pooled maximum, repeated over its window (nearest upsampling by
  ``Concat``), marks the positions equal to it;
- on ties torch picks the first maximum in row-major order: each marked
  position scores by its place in the window (earlier higher), a second
  plain MaxPool finds each window's best score, and only that position takes
  the upsampled output gradient;
- a ``Slice``/``Pad`` pair leaves rows and columns no window covers at zero;
- where the forward hands the backward the pool's output (the next layer's
  weight gradient reads it), or a view of it, the maximum is read from
  there, not pooled again (CNN benchmark's backward: 0.97x).
- where the pool reads a ReLU's output, the ReLU's backward mask (its output
  above zero) is applied to the output gradient at the pooled size: at the
  position that takes the gradient the input equals the window's maximum
  (the CNN benchmark's step: 0.95x in an A/B run).

The first form of this rewrite split the windows with ``SpaceToDepth`` and
put them back with ``DepthToSpace``; onnxruntime runs those (and ``Where``)
5-15x slower than a ``Mul`` of the same size, and the CNN benchmark's
backward took 7.5 ms against 5.8 ms now (2 cores, onnxruntime 1.19.2).

Applied to graphs with static shapes only. onnxruntime's MaxPool may skip a
NaN that torch would return; the gradient follows the forward's value, and a
window whose value is NaN gets no gradient (Equal never holds for NaN).
An infinite or NaN output gradient gives its window's other positions NaN
(0 times it) where torch gives them 0; ``Where`` would avoid that at 8x the
cost of the ``Mul``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import attr

from ._optimize import _const, facts, replace_nodes
from ._simplify import _VIEWS


def maxpool_gradients(model: onnx.ModelProto, forward: onnx.ModelProto | None = None) -> None:
    """Rewrite onnx-ad's index-based MaxPool gradients of ``model`` in place.

    ``forward``: the graph whose outputs ``model`` reads; where it keeps a
    pool's output (or a view of it) for ``model``, that is read instead of
    pooling again.
    """
    graph = model.graph
    pools = {
        node.output[1]: node
        for node in graph.node
        if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]
    }
    if not pools:
        return
    found = facts(model)
    if found is None:
        return
    gates = _relu_gates(graph, found)
    gated: dict[str, tuple] = {}
    kept = _kept_pools(forward, {i.name for i in graph.input}) if forward is not None else {}
    replace_nodes(graph, lambda node: _rewrite(node, pools, found, gates, gated, kept))
    if gated:  # the ReLU's mask now applied inside the pool's gradient: its Mul is a view
        replace_nodes(graph, lambda node: _ungate(node, gated, found))


def _rewrite(node, pools, found, gates, gated, kept):
    """``node`` a ``ScatterND`` of a pool's output gradient to its indices."""
    producer, readers, shapes = found.producer, found.readers, found.shapes
    types, inits, taken = found.types, found.inits, found.taken
    if node.op_type != "ScatterND" or len(node.input) != 3:
        return None
    zeros, index, grad = node.input
    reshape = producer.get(index)
    if reshape is None or reshape.op_type != "Reshape" or readers.get(index, 0) != 1:
        return None
    pool = pools.get(reshape.input[0])
    if pool is None or not _non_overlapping(pool) or not _zeros(zeros, producer, inits):
        return None
    x, out = pool.input[0], node.output[0]
    x_shape, out_shape, g_shape = shapes.get(x), shapes.get(out), shapes.get(grad)
    k = list(attr(pool, "kernel_shape", []))
    if not all(_static(s) for s in (x_shape, out_shape, g_shape)) or len(x_shape) != 4:
        return None
    if grad not in types:
        return None
    n, c, height, width = x_shape
    h, w = height // k[0], width // k[1]
    if k[0] != k[1] or h == 0 or w == 0 or _size(g_shape) != n * c * h * w:
        return None
    if _size(out_shape) != _size(x_shape):
        return None
    block = k[0]
    stem = out
    name = lambda s: _unique(f"{stem}/{s}", taken)  # noqa: E731 - local shorthand
    nodes = []
    source = x
    if (height, width) != (h * block, w * block):  # rows and columns no window covers
        starts, ends, cut = name("starts"), name("ends"), name("cut")
        nodes += [_const(starts, [0, 0]), _const(ends, [h * block, w * block])]
        axes = name("axes")
        nodes += [_const(axes, [2, 3]), helper.make_node("Slice", [x, starts, ends, axes], [cut])]
        source = cut
    dtype = helper.tensor_dtype_to_np_dtype(types[grad])
    size = (n, c, h, w)
    pooled, g4, g_shape_name = name("max"), name("grad"), name("grad_shape")
    nodes.append(_const(g_shape_name, [n, c, h, w]))
    if (x, block) in kept:  # the forward's own result (a view of it)
        nodes.append(helper.make_node("Reshape", [kept[(x, block)], g_shape_name], [pooled]))
    else:
        nodes.append(helper.make_node("MaxPool", [source], [pooled], kernel_shape=k, strides=k))
    nodes.append(helper.make_node("Reshape", [grad, g_shape_name], [g4]))
    gate = gates.get(out)
    if gate is not None and gate[1] == x:
        # A ReLU before the pool: its mask at the position that takes the
        # gradient is the maximum's own (x equals it there), so the output
        # gradient is masked at the pooled size, not the input's.
        positive, zero, gated_g = name("positive"), name("zero"), name("gated")
        positive_f = name("positive_f")
        nodes += [
            _tensor(zero, np.array(0, dtype)),
            helper.make_node("Greater", [pooled, zero], [positive]),
            helper.make_node("Cast", [positive], [positive_f], to=types[grad]),
            helper.make_node("Mul", [g4, positive_f], [gated_g]),
        ]
        g4 = gated_g
        gated[gate[0].output[0]] = gate
    # Where each window's maximum sits, as 0/1 in the input's layout.
    spread_max, hit, hit_f = name("max_up"), name("hit"), name("hit_f")
    nodes += _upsample(pooled, spread_max, size, block, name, True, dtype)
    nodes += [
        helper.make_node("Equal", [source, spread_max], [hit]),
        helper.make_node("Cast", [hit], [hit_f], to=types[grad]),
    ]
    # Ties: each hit scored by its position (earlier scores higher, small
    # integers), and the window's best score marks the first maximum. With
    # ``below = max(best - 1, 0)``, ``Relu(score - below)`` is exactly 1 there
    # and 0 elsewhere, also in a window without a hit (a NaN: best 0): no
    # second Equal and Cast over the input's size.
    rank, score, best, one, best_less, below, below_up = (
        name(s) for s in ("rank", "score", "best", "one", "best_less", "below", "below_up")
    )
    margin, first_f = name("margin"), name("first_f")
    nodes += [
        _tensor(rank, _window_ranks(h, w, block, dtype)),
        helper.make_node("Mul", [hit_f, rank], [score]),
        helper.make_node("MaxPool", [score], [best], kernel_shape=k, strides=k),
        _tensor(one, np.array(1, dtype)),
        helper.make_node("Sub", [best, one], [best_less]),
        helper.make_node("Relu", [best_less], [below]),
    ]
    nodes += _upsample(below, below_up, size, block, name, False, dtype)
    grad_up, spread = name("grad_up"), name("spread")
    nodes += [
        helper.make_node("Sub", [score, below_up], [margin]),
        helper.make_node("Relu", [margin], [first_f]),
    ]
    nodes += _upsample(g4, grad_up, size, block, name, True, dtype)
    nodes.append(helper.make_node("Mul", [first_f, grad_up], [spread]))
    if source != x:
        pads, padded = name("pads"), name("padded")
        nodes += [
            _const(pads, [0, 0, 0, 0, 0, 0, height - h * block, width - w * block]),
            helper.make_node("Pad", [spread, pads], [padded]),
        ]
        spread = padded
    target = name("shape")
    nodes += [
        _const(target, list(out_shape)),
        helper.make_node("Reshape", [spread, target], [out], node.name),
    ]
    return nodes


def _kept_pools(forward: onnx.ModelProto, kept: set[str]) -> dict[tuple[str, int], str]:
    """``{(pool input, block): tensor}``: a non-overlapping MaxPool's output, or a
    view of it, that the forward hands on (a name in ``kept``)."""
    viewed = {}  # a view's output -> the tensor it views, through chains
    for node in forward.graph.node:
        if node.op_type in _VIEWS and node.input:
            viewed[node.output[0]] = viewed.get(node.input[0], node.input[0])
    handed = {}
    for name in kept:
        handed.setdefault(viewed.get(name, name), name)
    found = {}
    for node in forward.graph.node:
        if node.op_type == "MaxPool" and _non_overlapping(node) and node.output[0] in handed:
            k = list(attr(node, "kernel_shape"))
            if k[0] == k[1]:
                found[(node.input[0], k[0])] = handed[node.output[0]]
    return found


def _relu_gates(graph, found) -> dict:
    """``{scatter output: (Mul, x, gradient operand)}`` for each ``Mul`` of a pool
    gradient (read by nothing else, directly or through single-reader views) by
    ``Cast(Greater(x, 0))`` (through views): ReLU's backward where the pool reads
    the ReLU's output."""
    producer, readers, shapes = found.producer, found.readers, found.shapes
    views = ("Reshape", "Identity", "Unsqueeze", "Squeeze")

    def through_views(name):
        node = producer.get(name)
        while node is not None and node.op_type in views and readers.get(name, 0) == 1:
            name = node.input[0]
            node = producer.get(name)
        return name

    gates = {}
    for node in graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        for grad, mask in (node.input, node.input[::-1]):
            scatter = producer.get(through_views(grad))
            cast = producer.get(through_views(mask))
            if scatter is None or scatter.op_type != "ScatterND" or cast is None:
                continue
            if readers.get(scatter.output[0], 0) != 1 or cast.op_type != "Cast":
                continue
            greater = producer.get(cast.input[0])
            if greater is None or greater.op_type != "Greater":
                continue
            if not _zeros(greater.input[1], producer, found.inits):
                continue
            out_shape, grad_shape = shapes.get(node.output[0]), shapes.get(grad)
            if not _static(out_shape) or not _static(grad_shape):
                continue
            if _size(out_shape) != _size(grad_shape) or shapes.get(mask) != out_shape:
                continue
            gates[scatter.output[0]] = (node, greater.input[0], grad)
            break
    return gates


def _ungate(node, gated, found):
    """The ``Mul`` by the ReLU mask, now applied upstream, as a view of its gradient."""
    gate = gated.get(node.output[0])
    if gate is None or node.op_type != "Mul":
        return None
    target = _unique(f"{node.output[0]}/shape", found.taken)
    return [
        _const(target, list(found.shapes[node.output[0]])),
        helper.make_node("Reshape", [gate[2], target], [node.output[0]], node.name),
    ]


def _non_overlapping(pool) -> bool:
    k = list(attr(pool, "kernel_shape", []))
    return (
        len(k) == 2
        and list(attr(pool, "strides", [1, 1])) == k
        and not any(attr(pool, "pads", [0, 0, 0, 0]))
        and all(d == 1 for d in attr(pool, "dilations", [1, 1]))
        and not attr(pool, "ceil_mode", 0)
        and not attr(pool, "storage_order", 0)
        and attr(pool, "auto_pad", "NOTSET") in ("NOTSET", b"NOTSET")
    )


def _zeros(name, producer, inits) -> bool:
    """Whether ``name`` is zeros: a ``ConstantOfShape`` of 0, or the ``Constant`` or
    initializer onnx-ad's constant folding makes of it where the shape is static."""
    if name in inits:
        return not numpy_helper.to_array(inits[name]).any()
    node = producer.get(name)
    if node is None or node.op_type not in ("ConstantOfShape", "Constant"):
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    if node.op_type == "Constant" and value is None:
        return False
    return value is None or not numpy_helper.to_array(value).any()


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


def _size(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _upsample(src, out, size, block, name, exact, dtype):
    """Nodes writing ``out``: each element of ``src`` (shape ``size``) repeated
    over its ``block`` x ``block`` window (nearest upsampling).

    Rows are repeated by ``Concat`` (onnxruntime's ``Resize``, ``Expand`` and
    ``DepthToSpace`` took 5-15x longer here). Columns too where the copy must
    be exact; where the values are known finite (``exact=False``), a MatMul
    with a 0/1 matrix does it faster (an infinity times 0 would be NaN).
    """
    n, c, h, w = size
    wide, rows, tall_shape = name("wide"), name("rows"), name("tall_shape")
    nodes = []
    if exact or dtype not in (np.float32, np.float64):
        col, col_shape, cols, wide_shape = (
            name(s) for s in ("col", "col_shape", "cols", "wide_shape")
        )
        nodes += [
            _const(col_shape, [n, c, h, w, 1]),
            helper.make_node("Reshape", [src, col_shape], [col]),
            helper.make_node("Concat", [col] * block, [cols], axis=4),
            _const(wide_shape, [n, c, h, 1, w * block]),
            helper.make_node("Reshape", [cols, wide_shape], [wide]),
        ]
    else:
        spread, flat, wide_shape = name("spread_cols"), name("flat"), name("wide_shape")
        matrix = np.zeros((w, w * block), dtype)
        for j in range(w):
            matrix[j, j * block : (j + 1) * block] = 1
        nodes += [
            _tensor(spread, matrix),
            helper.make_node("MatMul", [src, spread], [flat]),
            _const(wide_shape, [n, c, h, 1, w * block]),
            helper.make_node("Reshape", [flat, wide_shape], [wide]),
        ]
    nodes += [
        helper.make_node("Concat", [wide] * block, [rows], axis=3),
        _const(tall_shape, [n, c, h * block, w * block]),
        helper.make_node("Reshape", [rows, tall_shape], [out]),
    ]
    return nodes


def _window_ranks(h, w, block, dtype):
    """``count - p`` at each position ``p`` (row-major) of its window, shape (1, 1, H, W)."""
    count = block * block
    within = (np.arange(block)[:, None] * block + np.arange(block)[None, :]).astype(dtype)
    return np.tile(count - within, (h, w))[None, None]


def _tensor(name, array):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))
