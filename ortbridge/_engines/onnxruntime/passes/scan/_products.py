"""A Scan body's small products with loop-invariant weights, as one product per step.

onnx-ad's LSTM step multiplies the hidden state by each gate's recurrent
weight: four products ``h @ R_g^T`` of one left operand; its backward step
sums four products ``a_g @ R_g``. At the sizes of one step each product is a
small call, and onnxruntime dispatches each one at every step. Where the
right operands are the same at every step (read from outside the body) and
2-D, they are concatenated once before the loop:

- products of one left operand: ``L @ [R_1 | R_2 | ..]`` and a ``Split``;
- a ``Sum`` of products, each read only by it: ``[L_1 | L_2 | ..] @ [R_1; R_2; ..]``
  (one ``Concat`` of the left operands per step).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import node_reads

from .._optimize import _const
from .._simplify import _static
from ._sums import _GRAPHS, _STD, _body, _shapes, rewrite_scans


def fused_scan_products(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main-graph Scans in place (opset 13 or later: Split's
    sizes as an input)."""
    rewrite_scans(model, _fused, 13)


def _fused(scan, seen, outer, taken) -> list | None:
    body = _body(scan)
    # One wrapper per node, held: the rewrite keys nodes by their id().
    body_nodes = list(body.node)
    shapes = _shapes(seen)
    defined = {i.name for i in body.input} | {i.name for i in body.initializer}
    defined |= {o for n in body_nodes for o in n.output}
    readers: dict[str, int] = {}
    for node in body_nodes:
        many = 2 if any(a.type in _GRAPHS for a in node.attribute) else 1
        for name in node_reads(node):
            readers[name] = readers.get(name, 0) + many
    for out in body.output:
        readers[out.name] = readers.get(out.name, 0) + 2

    def weight(name):
        """The shape of ``name`` where it is a static matrix read from outside."""
        shape = outer.get(name)
        if name in defined or shape is None or len(shape) != 2 or not _static(shape):
            return None
        return shape

    before, at = [], {}  # nodes before the Scan; body node id -> nodes replacing it
    producer = {o: n for n in body_nodes for o in n.output if n.op_type == "MatMul"}
    for node in body_nodes:
        distinct = len(node.input) > 1 and len(set(node.input)) == len(node.input)
        if node.op_type == "Sum" and node.domain in _STD and distinct:
            products = [producer.get(i) for i in node.input]
            if all(p is not None and readers.get(p.output[0]) == 1 for p in products):
                fused = _summed(node, products, shapes, weight, taken)
                if fused is not None:
                    before.append(fused[0])
                    at[id(node)] = fused[1]
                    at.update({id(p): [] for p in products})
    groups: dict[tuple, list] = {}
    for node in body_nodes:
        if node.op_type == "MatMul" and node.domain in _STD and id(node) not in at:
            shape = weight(node.input[1])
            if shape is not None:
                groups.setdefault((node.input[0], shape[0]), []).append(node)
    for group in groups.values():
        if len(group) > 1:
            outside, inside = _shared_left(group, outer, taken)
            before.append(outside)
            at[id(group[0])] = inside
            at.update({id(p): [] for p in group[1:]})
    if not at:
        return None
    nodes = []
    for node in body_nodes:
        nodes.extend(at.get(id(node), [node]))
    del body.node[:]
    body.node.extend(nodes)
    return [*before, scan]


def _summed(node, products, shapes, weight, taken):
    """``Sum(L_i @ R_i)`` as ``Concat(L_i) @ Concat(R_i)``: (the weights' Concat, the
    body's nodes), or None where the operands do not line up."""
    rights = [weight(p.input[1]) for p in products]
    lefts = [shapes.get(p.input[0]) for p in products]
    if None in rights or len({r[1] for r in rights}) != 1:
        return None
    if any(left is None or not _static(left) or len(left) < 1 for left in lefts):
        return None
    if len({left[:-1] for left in lefts}) != 1:
        return None
    if any(left[-1] != right[0] for left, right in zip(lefts, rights)):
        return None
    stacked = _unique(f"{node.output[0]}/weights", taken)
    outside = helper.make_node("Concat", [p.input[1] for p in products], [stacked], axis=0)
    joined = _unique(f"{node.output[0]}/operands", taken)
    inside = [
        helper.make_node("Concat", [p.input[0] for p in products], [joined], axis=-1),
        helper.make_node("MatMul", [joined, stacked], [node.output[0]], name=node.name),
    ]
    return outside, inside


def _shared_left(group, outer, taken):
    """``L @ R_i`` for each i as ``L @ Concat(R_i)`` and a Split."""
    first = group[0].output[0]
    joined = _unique(f"{first}/weights", taken)
    outside = helper.make_node("Concat", [p.input[1] for p in group], [joined], axis=1)
    product = _unique(f"{first}/joined", taken)
    sizes = _unique(f"{first}/sizes", taken)
    widths = [outer[p.input[1]][1] for p in group]
    inside = [
        helper.make_node("MatMul", [group[0].input[0], joined], [product]),
        _const(sizes, np.array(widths, dtype=np.int64)),
        helper.make_node("Split", [product, sizes], [p.output[0] for p in group], axis=-1),
    ]
    return outside, inside
