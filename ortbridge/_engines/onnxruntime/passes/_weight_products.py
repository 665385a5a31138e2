"""A transpose of ``X^T G`` computed as ``G^T X``: a weight's gradient written where it goes.

(And of ``X F^T`` as ``F X^T``: a 1x1 convolution's weight gradient, which
:mod:`._conv_grad` writes as that product in the input channels' order and
onnx-ad's adjoint then transposes to the filters'.)

A weight that a batched MatMul reads transposed (torch's ``Linear`` on
input of three or more axes: ``x @ W^T``) gets onnx-ad's gradient of
``W^T``, summed over the flattened batch as ``X^T G`` (the rewrite in
:mod:`._optimize`), and then the adjoint of the transpose: a
``Transpose`` of the weight-sized product (seed axis included), and a copy
where the graph returns it. ``(X^T G)^T = G^T X``: the product taken in that
order gives the weight's layout straight away, and onnxruntime folds the
transpose of ``G`` (a batch-sized matrix, like ``X``) into its MatMul. On
the FFN of a transformer layer (1024 rows, 256 and 2048 features) the
weight gradients' products took 3.7 and 3.4 ms instead of 3.9 and 4.1 ms
(onnxruntime 1.19, 2 cores), plus the copies. Exact: the same sums.

Input of four axes or more (a Linear on (a, b, m, k)) first gets the sum
over its batch axes as one product of the flattened batches, as three axes
get before the split (:mod:`._optimize`): onnx-ad writes a product per
batch element and a ``ReduceSum`` over a batch-times-weight-sized tensor
(an MLP on (16, 8, 8, 64): step 0.85x).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique

from ._optimize import _perm, extended, facts, flattened_product, replace_nodes
from ._simplify import _VIEWS, _constants, _static, reshape


def weight_products(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main graph in place (static shapes; views collapsed after)."""
    if not any(n.op_type == "Transpose" for n in model.graph.node):
        return
    found = facts(model)
    if found is None:
        return
    if any(n.op_type == "ReduceSum" for n in model.graph.node):
        constants = _constants(model.graph)
        added = []

        def flatten(node):
            nodes = _summed_batches(node, found, constants)
            added.extend(nodes or [])
            return nodes

        replace_nodes(model.graph, flatten)
        if added:  # the new tensors' shapes (the whole graph's where that fails)
            found = extended(found, model, added) or facts(model)
            if found is None:
                return
    replace_nodes(model.graph, lambda node: _rewrite(node, found))


def _summed_batches(node, found, constants) -> list | None:
    """``ReduceSum`` over the batch axes of ``MatMul(Transpose(X), G)``, X (..., m, k),
    G (..., m, n) with the same batch axes (and leading unit ones), as one product
    of the batches flattened: ``X'^T G'``, X' (-1, k), G' (-1, n), in its shape.

    Input of four axes or more (a Linear on (a, b, m, k)): three are rewritten
    before the split (:mod:`._optimize`). The same sums, in another order.
    """
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
        return None
    product = found.producer.get(node.input[0])
    if product is None or product.op_type != "MatMul" or found.readers.get(node.input[0]) != 1:
        return None
    left = found.producer.get(product.input[0])
    if left is None or left.op_type != "Transpose" or left.domain not in ("", "ai.onnx"):
        return None
    x, g = found.shapes.get(left.input[0]), found.shapes.get(product.input[1])
    out, summed = found.shapes.get(node.output[0]), found.shapes.get(node.input[0])
    if not all(_static(s) for s in (x, g, out, summed)) or len(x) < 3:
        return None
    rank = len(x)
    if _perm(left) != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    extra = len(g) - rank
    if extra < 0 or any(d != 1 for d in g[:extra]) or tuple(g[extra:-1]) != tuple(x[:-1]):
        return None
    k, n = x[-1], g[-1]
    # Every batch axis summed, k and n kept: the output's shape says so.
    if tuple(out[-2:]) != (k, n) or any(d != 1 for d in out[:-2]) or len(out) != len(summed):
        return None
    nodes, p = flattened_product(left.input[0], product.input[1], k, n, node.output[0], found.taken)
    return [*nodes, *reshape(p, out, node.output[0], found.taken, node.name)]


def _rewrite(node, found) -> list | None:
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    shapes = found.shapes
    viewed, out = shapes.get(node.input[0]), shapes.get(node.output[0])
    if not _static(viewed) or not _static(out):
        return None
    axes = [i for i, d in enumerate(viewed) if d != 1]
    if len(axes) != 2:
        return None
    perm = _perm(node) or list(range(len(viewed)))[::-1]
    first, second = axes
    if perm.index(first) < perm.index(second):  # the two axes keep their order
        return None
    product = _product_viewed(node.input[0], found)
    if product is None:
        return None
    kept, other, side, rows, columns = product
    # The transpose's input, unit axes aside, is the (rows, columns) product itself.
    if (viewed[first], viewed[second]) != (rows, columns):
        return None
    base = node.output[0]
    flipped, swapped = _unique(f"{base}_t", found.taken), _unique(f"{base}_swapped", found.taken)
    operands = [flipped, kept] if side == 0 else [kept, flipped]
    return [
        helper.make_node("Transpose", [other], [flipped], perm=[1, 0]),
        helper.make_node("MatMul", operands, [swapped]),
        *reshape(swapped, out, base, found.taken, node.name),
    ]


def _product_viewed(name, found):
    """Where ``name`` is a view, read once each step, of a product of two
    matrices one of which a ``Transpose`` gives: ``MatMul(Transpose(X), G)``
    (``X^T G``, transposed ``G^T X``) or ``MatMul(X, Transpose(F))`` (a 1x1
    convolution's weight gradient ``X F^T``, transposed ``F X^T``), the
    ``(X or F, the other operand, which side the Transpose was on, the
    product's rows, its columns)``; None otherwise. The transposed product is
    ``MatMul`` of the other operand transposed and the Transpose's input, in
    their sides' order swapped."""
    node = found.producer.get(name)
    while node is not None and node.op_type in _VIEWS and node.domain in ("", "ai.onnx"):
        if found.readers.get(node.output[0]) != 1:
            return None
        node = found.producer.get(node.input[0])
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    if found.readers.get(node.output[0]) != 1:
        return None
    for side in (0, 1):
        flip = found.producer.get(node.input[side])
        if flip is None or flip.op_type != "Transpose" or flip.domain not in ("", "ai.onnx"):
            continue
        kept, other = flip.input[0], node.input[1 - side]
        a, b = found.shapes.get(kept), found.shapes.get(other)
        if not _static(a) or not _static(b) or len(a) != 2 or len(b) != 2:
            return None
        if _perm(flip) not in (None, [1, 0]):
            return None
        # X^T G: (k, n) from X (m, k), G (m, n); X F^T: (m, n) from X (m, k), F (n, k)
        rows, columns = (a[1], b[1]) if side == 0 else (b[0], a[0])
        return kept, other, side, rows, columns
    return None
