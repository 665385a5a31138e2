"""A ``Transpose`` that moves an axis of size 1 as a transpose of the other axes.

onnx-ad's seed axis (size 1, last) is moved by the Transposes of its
Conv weight gradients (``[1, 4, 0, 2, 3]``: the seed axis second), and
models carry unit axes of their own (a 1-D signal as a 2-D image of one
row). onnxruntime's CPU Transpose takes a slow path for such a permutation
that its squeezed form does not take (2 cores, both onnxruntime versions):

- (16, 384, 3, 16, 1) by ``[1, 4, 0, 2, 3]`` (PP-OCRv6's recogniser):
  1009 us, squeezed (16, 384, 3, 16) by ``[1, 0, 2, 3]`` 86 us;
- (32, 16, 1, 3, 3) by ``[1, 0, 3, 4, 2]``: 16.8 us, squeezed 5.2 us;
- (16, 16, 20, 1) by ``[1, 3, 0, 2]`` (Whisper's stem): 16.5 us, squeezed 2.7 us;

while a permutation that leaves the unit axes in place ran as fast as its
squeezed form. So a Transpose that moves a unit axis becomes ``Reshape`` to
the input without its unit axes, the ``Transpose`` of the rest, and
``Reshape`` to the output's shape (both views); one that moves only unit
axes is the ``Reshape`` alone. Exact: the same elements in the same order.
Static shapes only; the views then collapse with their neighbours.

A ``Transpose`` of a ``Transpose`` is one (:func:`composed_transposes`):
the weight gradients' rewrites and onnx-ad's own end one with a
transpose that the next undoes or extends.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _all_names, _unique

from .._optimize import _perm, replace_nodes
from .._simplify import _static, reshape


def squeezed_transposes(model: onnx.ModelProto, shapes: dict) -> None:
    """Rewrite ``model``'s main graph in place; ``shapes`` (every tensor's, static)
    gets those of the tensors added."""
    graph = model.graph
    if not any(n.op_type == "Transpose" for n in graph.node):
        return
    taken = _all_names(graph)
    # A graph output the final Reshape wrote would be copied out (a forward's
    # residual, read back as the view it is, is :mod:`.._split`'s business).
    returned = {o.name for o in graph.output}
    replace_nodes(graph, lambda node: _squeezed(node, shapes, taken, returned))


def _squeezed(node, shapes, taken, returned) -> list | None:
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    if node.output[0] in returned:
        return None
    shape = shapes.get(node.input[0])
    if not _static(shape):
        return None
    perm = _perm(node) or list(reversed(range(len(shape))))
    out = node.output[0]
    out_shape = [shape[a] for a in perm]
    kept = [a for a in range(len(shape)) if shape[a] != 1]
    moved = [a for a in perm if shape[a] != 1]
    if moved == sorted(moved):  # only unit axes move (or none): a view
        if out_shape == list(shape):
            return [helper.make_node("Identity", [node.input[0]], [out], name=node.name)]
        return reshape(node.input[0], out_shape, out, taken, node.name)
    units = [a for a, d in enumerate(shape) if d == 1]
    if not units or units == [k for k, a in enumerate(perm) if shape[a] == 1]:
        return None  # no unit axis moves: onnxruntime's fast path already
    squeezed = [shape[a] for a in kept]
    inner = [kept.index(a) for a in moved]
    flat, flipped = _unique(f"{out}/squeezed", taken), _unique(f"{out}/transposed", taken)
    shapes[flat] = tuple(squeezed)
    shapes[flipped] = tuple(squeezed[i] for i in inner)
    return [
        *reshape(node.input[0], squeezed, flat, taken),
        helper.make_node("Transpose", [flat], [flipped], perm=inner),
        *reshape(flipped, out_shape, out, taken, node.name),
    ]


def composed_transposes(model: onnx.ModelProto, shapes: dict) -> None:
    """Each ``Transpose`` of a ``Transpose`` in ``model``'s main graph as one
    (the inner one stays where another node reads it), then
    :func:`squeezed_transposes` (in place; ``shapes`` as there)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        inner = producer.get(node.input[0]) if node.op_type == "Transpose" else None
        while inner is not None and inner.op_type == "Identity" and not inner.domain:
            inner = producer.get(inner.input[0])
        if inner is None or inner.op_type != "Transpose" or node.domain or inner.domain:
            continue
        rank = len(shapes.get(inner.input[0]) or ())
        first, second = _perm(inner), _perm(node)
        if not rank or first is None or second is None:  # a reversing default: rare
            continue
        perm = [first[a] for a in second]
        del node.attribute[:]
        if perm == sorted(perm):
            node.op_type = "Identity"  # which onnxruntime drops
        else:
            node.attribute.append(helper.make_attribute("perm", perm))
        node.input[0] = inner.input[0]
    squeezed_transposes(model, shapes)
