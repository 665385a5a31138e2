"""A non-overlapping MaxPool's input gradient without the pooling indices.

onnx-ad differentiates ``MaxPool`` by running it again with its ``Indices``
output and scattering the output gradient there (``ScatterND`` into zeros).
onnxruntime's MaxPool-with-indices kernel is slow on the CPU (measured on 2
cores: 1.8 ms against 0.13 ms for the plain kernel on a 64x8x26x26 input).
Where the windows do not overlap (kernel equal to strides, no padding, no
dilation: the usual 2x2 pool) the same gradient comes from the plain kernel:

- ``SpaceToDepth`` then ``Split`` give one tensor per window position, in
  row-major order (``X[:, :, a::k, b::k]``);
- each position takes the output gradient where it holds the window's
  maximum and no earlier position did: torch's choice on ties (the first
  maximum in row-major order);
- ``Concat`` then ``DepthToSpace`` put the positions back, and a ``Pad``
  gives zeros to rows and columns no window covers.

Applied to graphs with static shapes only. A NaN in a window gets no gradient
here (torch gives it the NaN's position), as Equal never holds for NaN.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .._graph_lookup import _unique
from .._onnx_utils import attr
from ._optimize import _const, facts, replace_nodes


def maxpool_gradients(model: onnx.ModelProto) -> None:
    """Rewrite onnx-ad's index-based MaxPool gradients of ``model`` in place."""
    graph = model.graph
    pools = {
        node.output[1]: node
        for node in graph.node
        if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]
    }
    if not pools:
        return
    found = facts(model)
    if found is not None:
        replace_nodes(graph, lambda node: _rewrite(node, pools, found))


def _rewrite(node, pools, found):
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
    block, count = k[0], k[0] * k[1]
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
    pooled, positions = name("max"), name("positions")
    nodes.append(helper.make_node("MaxPool", [source], [pooled], kernel_shape=k, strides=k))
    nodes.append(helper.make_node("SpaceToDepth", [source], [positions], blocksize=block))
    parts = [name(f"at{p}") for p in range(count)]
    sizes = name("sizes")
    nodes += [
        _const(sizes, [c] * count),
        helper.make_node("Split", [positions, sizes], parts, axis=1),
    ]
    g4, g_shape_name = name("grad"), name("grad_shape")
    nodes += [
        _const(g_shape_name, [n, c, h, w]),
        helper.make_node("Reshape", [grad, g_shape_name], [g4]),
    ]
    zero = name("zero")
    nodes.append(
        helper.make_node(
            "Constant",
            [],
            [zero],
            value=numpy_helper.from_array(
                np.zeros((), helper.tensor_dtype_to_np_dtype(types[grad]))
            ),
        )
    )
    taken_so_far, pieces = None, []
    for p, part in enumerate(parts):
        hit = name(f"hit{p}")
        nodes.append(helper.make_node("Equal", [part, pooled], [hit]))
        if taken_so_far is not None:  # an earlier position holds the maximum: not this one
            free, first = name(f"free{p}"), name(f"first{p}")
            nodes.append(helper.make_node("Not", [taken_so_far], [free]))
            nodes.append(helper.make_node("And", [hit, free], [first]))
            if p < count - 1:
                seen = name(f"seen{p}")
                nodes.append(helper.make_node("Or", [taken_so_far, hit], [seen]))
                taken_so_far = seen
            hit = first
        else:
            taken_so_far = hit
        piece = name(f"grad{p}")
        nodes.append(helper.make_node("Where", [hit, g4, zero], [piece]))
        pieces.append(piece)
    stacked, spread = name("stacked"), name("spread")
    nodes.append(helper.make_node("Concat", pieces, [stacked], axis=1))
    nodes.append(helper.make_node("DepthToSpace", [stacked], [spread], blocksize=block))
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
