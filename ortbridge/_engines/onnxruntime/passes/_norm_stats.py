"""LayerNormalization's backward reads the statistics its forward computed.

onnx-ad's adjoint of ``LayerNormalization(x)`` computes the mean and the
inverse standard deviation of ``x`` again (two ReduceMeans, a Mul, an Add, a
Sqrt and a Reciprocal over ``x``), although the forward node returns both as
its outputs ``Mean`` and ``InvStdDev``. Where the two are the same quantity
(same axes and epsilon, float32 statistics of a float32 input), the backward
reads the forward's: the recomputation goes, and the backward is consistent
with the normalisation the forward applied (onnxruntime's kernel may round
the statistics differently in the last place). Graphs with static shapes.
"""

from __future__ import annotations

import numpy as np
import onnx

from ortbridge._prepare._onnx_utils import attr

from ._optimize import facts, reduce_axes
from ._simplify import _constants


def forward_norm_statistics(model: onnx.ModelProto, known=None) -> None:
    """Rewrite ``model``'s main graph in place. ``known``: the shapes and types
    of its tensors, where the pass before left them (else inferred here)."""
    graph = model.graph
    norms = [
        n
        for n in graph.node
        if n.op_type == "LayerNormalization" and len(n.output) == 3 and all(n.output)
    ]
    if not norms:
        return
    if known is None:
        found = facts(model)
        if found is None:
            return
        known = found.shapes, found.types
    constants = _constants(graph)
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replace = {}
    for norm in norms:
        replace.update(_statistics(norm, *known, constants, readers))
    if replace:
        for node in graph.node:
            for pos, name in enumerate(node.input):
                if name in replace:
                    node.input[pos] = replace[name]


def _statistics(norm, shapes, types, constants, readers) -> dict[str, str]:
    """``{recomputed mean: norm's Mean, recomputed inverse std: norm's InvStdDev}``."""
    x = norm.input[0]
    shape = shapes.get(x)
    if shape is None or types.get(x) != onnx.TensorProto.FLOAT:
        return {}
    if attr(norm, "stash_type", 1) != 1:
        return {}
    axes = list(range(attr(norm, "axis", -1) % len(shape), len(shape)))
    epsilon = attr(norm, "epsilon", 1e-5)
    for mean in readers.get(x, []):
        if not _mean_over(mean, x, axes, constants):
            continue
        for sub in readers.get(mean.output[0], []):
            if sub.op_type != "Sub" or list(sub.input) != [x, mean.output[0]]:
                continue
            invstd = _inverse_std(sub.output[0], axes, epsilon, readers, constants)
            if invstd is not None:
                return {mean.output[0]: norm.output[1], invstd: norm.output[2]}
    return {}


def _mean_over(node, x, axes, constants) -> bool:
    if node.op_type != "ReduceMean" or node.input[0] != x or attr(node, "keepdims", 1) != 1:
        return False
    listed = reduce_axes(node, constants)  # an input, or before opset 18 an attribute
    if listed is None:
        return False
    rank = axes[-1] + 1
    return sorted(int(a) % rank for a in listed) == axes


def _inverse_std(centred, axes, epsilon, readers, constants) -> str | None:
    """The output of ``1 / sqrt(mean(centred * centred) + epsilon)``, where so written."""
    for square in readers.get(centred, []):
        if square.op_type != "Mul" or list(square.input) != [centred, centred]:
            continue
        for var in readers.get(square.output[0], []):
            if not _mean_over(var, square.output[0], axes, constants):
                continue
            for add in readers.get(var.output[0], []):
                eps = next((constants.get(i) for i in add.input if i != var.output[0]), None)
                if add.op_type != "Add" or eps is None or eps.size != 1:
                    continue
                if not np.isclose(float(eps.ravel()[0]), epsilon, rtol=1e-6, atol=0):
                    continue
                for root in readers.get(add.output[0], []):
                    if root.op_type != "Sqrt":
                        continue
                    for inv in readers.get(root.output[0], []):
                        if inv.op_type == "Reciprocal":
                            return inv.output[0]
    return None
