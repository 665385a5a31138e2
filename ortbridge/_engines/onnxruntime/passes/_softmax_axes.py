"""A Softmax over an inner axis as the reductions it stands for.

onnxruntime's CPU ``Softmax`` and ``LogSoftmax`` (opset 13 and later: one
axis) over an axis other than the last move it last and back around their
kernel: YOLOv8's DFL head, a softmax over axis 1 of (4, 16, 4, 2100), took
4.2 ms a run, against 0.16-0.6 ms as ``ReduceMax``, ``Sub``, ``Exp``,
``ReduceSum`` and ``Div`` (1.31.1, 2 cores). So in the forward graph, once
onnx-ad has differentiated the node as one (its rule reads the output; a
``ReduceMax``'s own gradient would scatter), such a node becomes those
five; a ``LogSoftmax`` is ``x - max - Log(ReduceSum(Exp(x - max)))``. The
kernel's algorithm, so equal to rounding. Float and double only (the CPU
provider's reductions of float16 vary by version).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _all_names, _unique

from ._optimize import _const, _inferred, _shapes_and_types, replace_nodes

_SOFTMAX = frozenset({"Softmax", "LogSoftmax"})
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def softmax_reductions(model: onnx.ModelProto, shapes: dict | None) -> None:
    """Rewrite ``model``'s main graph in place; ``shapes`` (the caller's, where
    kept) gets those of the tensors added."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13 or not any(n.op_type in _SOFTMAX for n in graph.node):
        return
    # Most softmaxes are over the last axis (attention's): the types, one
    # inference of the whole forward, only where the known ranks leave another.
    if shapes is not None and not any(_maybe_inner(n, shapes) for n in graph.node):
        return
    inferred = _inferred(model)
    if inferred is None:
        return
    found, types = _shapes_and_types(inferred)
    taken = _all_names(graph)
    added: dict = {}
    replace_nodes(graph, lambda node: _reduced(node, found, types, taken, opset, added))
    if shapes is not None:
        shapes.update(added)


def _inner(node, shapes) -> int | None:
    """The axis a softmax ``node`` normalises over where it is not its input's
    last (None: the last, the kernel's own fast path, or unknown)."""
    if node.op_type not in _SOFTMAX or node.domain not in ("", "ai.onnx"):
        return None
    shape = shapes.get(node.input[0])
    if not shape:
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1) % len(shape)
    return None if axis == len(shape) - 1 else axis


def _maybe_inner(node, shapes) -> bool:
    """Whether softmax ``node``'s axis is not its input's last, or its rank unknown."""
    is_softmax = node.op_type in _SOFTMAX and node.domain in ("", "ai.onnx")
    return is_softmax and (not shapes.get(node.input[0]) or _inner(node, shapes) is not None)


def _reduced(node, shapes, types, taken, opset, added) -> list | None:
    axis = _inner(node, shapes)
    if axis is None or types.get(node.input[0]) not in _FLOATS:
        return None
    x, out = node.input[0], node.output[0]
    shape = shapes[x]
    name = {k: _unique(f"{out}/{k}", taken) for k in ("axes", "max", "shifted", "exp", "sum")}
    kept = tuple(1 if i == axis else d for i, d in enumerate(shape))
    added.update({name["max"]: kept, name["sum"]: kept})
    added.update({name["shifted"]: tuple(shape), name["exp"]: tuple(shape)})
    if opset >= 18:  # ReduceMax's axes an input from opset 18
        top = helper.make_node("ReduceMax", [x, name["axes"]], [name["max"]], keepdims=1)
    else:
        top = helper.make_node("ReduceMax", [x], [name["max"]], axes=[axis], keepdims=1)
    nodes = [
        _const(name["axes"], [axis]),
        top,
        helper.make_node("Sub", [x, name["max"]], [name["shifted"]]),
        helper.make_node("Exp", [name["shifted"]], [name["exp"]]),
        helper.make_node("ReduceSum", [name["exp"], name["axes"]], [name["sum"]], keepdims=1),
    ]
    if node.op_type == "Softmax":
        return [*nodes, helper.make_node("Div", [name["exp"], name["sum"]], [out], name=node.name)]
    log = _unique(f"{out}/log", taken)
    added[log] = kept
    return [
        *nodes,
        helper.make_node("Log", [name["sum"]], [log]),
        helper.make_node("Sub", [name["shifted"], log], [out], name=node.name),
    ]
