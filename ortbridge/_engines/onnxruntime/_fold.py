"""onnx-ad's constant folding to its fixed point, without the sweep that only confirms it.

onnx-ad's ``fold_constants`` repeats a sweep (one shape inference of the
whole model, then each node whose inputs are known evaluated) until a sweep
changes nothing, so its last sweep only confirms. After a sweep that folded
something, the next can fold more only through a ``Shape`` or ``Size`` node
whose input's shape has become known: a node whose inputs became constants is
folded within the same sweep, the nodes being in topological order. Where no
such node is left, the fixed point is reached one sweep early; where no node
could start a fold (none reads only constants, no ``Shape`` or ``Size``), no
sweep runs at all. The result is onnx-ad's own. A build runs about five
foldings (onnx-ad's function expansion, ortbridge's shape arithmetic, the
reverse graph's; for the construction check and again for the first call's
shapes), and their confirming sweeps took 8% of ConvNeXt's construction plus
first step, 7% of MobileViT's.
"""

from __future__ import annotations

import contextlib

import onnx

#: The nodes a sweep folds from a shape, not from constant inputs.
_SHAPE_QUERIES = frozenset({"Shape", "Size"})
#: onnx-ad's own bound on the sweeps.
_SWEEPS = 16


def fold_constants(model: onnx.ModelProto, max_elements: int = 4096) -> onnx.ModelProto:
    """``onnx_ad.fold.fold_constants(model, max_elements)``, one sweep fewer where
    the last would only confirm."""
    from onnx_ad.fold import _fold_once

    if _nothing_to_fold(model):
        return model
    for _ in range(_SWEEPS):
        folded = _fold_once(model, max_elements)
        if folded is model:
            return model
        model = folded
        if not any(node.op_type in _SHAPE_QUERIES for node in model.graph.node):
            return model
    return model


def _nothing_to_fold(model: onnx.ModelProto) -> bool:
    """No node a sweep could start from: none reads only constants (initializers
    and Constant nodes, in any scope: a node's reads include what its subgraphs
    capture), and no ``Shape`` or ``Size``. Then a sweep changes nothing."""
    from onnx_ad._graph import node_reads, walk
    from onnx_ad.fold import RANDOM

    known = set()
    for scope in walk(model.graph):
        known.update(t.name for t in scope.initializer)
        known.update(n.output[0] for n in scope.node if n.op_type == "Constant")
    for node in model.graph.node:
        if node.op_type in _SHAPE_QUERIES:
            return False
        if node.op_type not in RANDOM and node.op_type != "Constant":
            if all(name in known for name in node_reads(node)):
                return False
    return True


@contextlib.contextmanager
def in_onnx_ad():
    """onnx-ad's function expansion (inside its reverse pass) folding with
    :func:`fold_constants`, restored on exit."""
    from onnx_ad import expand

    original = expand.fold_constants
    expand.fold_constants = fold_constants
    try:
        yield
    finally:
        expand.fold_constants = original
