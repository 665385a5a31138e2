"""Reductions in a reverse graph with static shapes, put on onnxruntime's fast paths.

Run on the onnxruntime engine's backward once its other rewrites are done.
The same elements are reduced; onnxruntime may add them in another order
(float rounding may differ in the last place). A reduction that keeps its
axes only for a ``Reshape`` to drop them drops them itself
(:func:`reductions_dropping_axes`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _unique

from ._optimize import Facts, _const, facts, reduce_axes, replace_nodes
from ._simplify import _constants, _live, _static, reshape

#: Reductions onnxruntime runs slowly where a unit axis follows the reduced ones.
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})


def fast_reductions(model: onnx.ModelProto, found: Facts | None = None) -> None:
    """Reductions on onnxruntime's fast paths (in place).

    - A reduction of a tensor with axes of size 1 reduces its view without
      them. onnx-ad's seed axis (size 1) trails every adjoint, and
      onnxruntime takes a slow strided path for a reduced axis followed by a
      unit one: a ReduceMean over the 256 features of (16, 64, 256, 1) took
      273 us on 2 cores, of (16, 64, 256) 50 us. Views are free.
    - A float ``ReduceSum`` over leading axes (a bias gradient: the sum over
      the batch) is a product with a row of ones, which onnxruntime's GEMV
      runs faster: (1024, 2048) summed over its rows, 510 against 320 us.
    """
    if not any(n.op_type in _REDUCTIONS for n in model.graph.node):
        return
    found = facts(model) if found is None else found
    if found is not None:
        constants = _constants(model.graph)
        replace_nodes(model.graph, lambda n: _fast_reduction(n, found, constants))


def _fast_reduction(node, found, constants) -> list | None:
    if node.op_type not in _REDUCTIONS or node.domain:
        return None
    shape, out = found.shapes.get(node.input[0]), found.shapes.get(node.output[0])
    listed = reduce_axes(node, constants)
    if not _static(shape) or not _static(out) or not listed:
        return None
    axes = {int(a) % len(shape) for a in listed}
    kept = [a for a, d in enumerate(shape) if d != 1]
    squeezed_shape = [shape[a] for a in kept]
    reduced = [kept.index(a) for a in sorted(axes) if shape[a] != 1]
    if not reduced:  # only unit axes reduced: a view, collapse_views's
        return None
    dtype = found.types.get(node.input[0])
    leading = reduced == list(range(len(reduced))) and len(reduced) < len(kept)
    if node.op_type == "ReduceSum" and leading and dtype in _GEMV_TYPES:
        rows = int(np.prod(squeezed_shape[: len(reduced)]))
        squeezed_shape = [rows, int(np.prod(squeezed_shape[len(reduced) :]))]
    elif 1 not in shape:
        return None
    else:
        rows = None
    base, taken = node.output[0], found.taken
    squeezed, reduced_name, operand = (
        _unique(f"{base}/{s}", taken) for s in ("squeezed", "reduced", "operand")
    )
    nodes = reshape(node.input[0], squeezed_shape, squeezed, taken)
    if rows is not None:
        ones = np.ones((1, rows), helper.tensor_dtype_to_np_dtype(dtype))
        nodes.append(
            helper.make_node("Constant", [], [operand], value=numpy_helper.from_array(ones))
        )
        nodes.append(helper.make_node("MatMul", [operand, squeezed], [reduced_name]))
    elif len(node.input) < 2:  # an opset where the axes are an attribute
        nodes.append(
            helper.make_node(node.op_type, [squeezed], [reduced_name], axes=reduced, keepdims=1)
        )
    else:
        nodes.append(_const(operand, reduced))
        nodes.append(
            helper.make_node(node.op_type, [squeezed, operand], [reduced_name], keepdims=1)
        )
    return nodes + reshape(reduced_name, out, base, taken, node.name)


_GEMV_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def reductions_dropping_axes(model: onnx.ModelProto, found: Facts) -> None:
    """A reduction keeping its axes (``keepdims=1``) read only by ``Reshape``
    nodes, one to its shape without them (a BatchNorm's weight gradient,
    ``(1, C, 1, 1)`` to ``(C,)``), writes that shape itself (``keepdims=0``)
    and the others view it: a node less, the same values. The reduced
    tensor's shape is the inferred one or, where a pass added it since, its
    producing ``Reshape``'s constant target. In place.
    """
    graph = model.graph
    _vector_sums(graph, found)
    kept_axes = [
        n for n in graph.node
        if n.op_type in _REDUCTIONS and not n.domain
        and next((a.i for a in n.attribute if a.name == "keepdims"), 1) == 1
    ]  # fmt: skip
    if not kept_axes:
        return
    constants = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output}
    sums = {n.output[0] for n in kept_axes}
    users_of = {name: [] for name in sums}
    for node in graph.node:
        for name in set(node.input) & sums:
            users_of[name].append(node)
    outputs = {o.name for o in graph.output}
    dropped = set()
    for node in kept_axes:
        if node.output[0] in outputs:
            continue
        users = users_of[node.output[0]]
        targets = [_target(user, constants) for user in users]
        shape = _shape_of(node.input[0], found, producer, constants)
        listed = reduce_axes(node, constants)
        if not users or None in targets or shape is None or not listed:
            continue
        axes = {int(a) % len(shape) for a in listed}
        dropping = [d for a, d in enumerate(shape) if a not in axes]
        if dropping not in targets:
            continue
        for attribute in node.attribute:
            if attribute.name == "keepdims":
                attribute.i = 0
                break
        else:
            node.attribute.append(helper.make_attribute("keepdims", 0))
        same = users[targets.index(dropping)]
        for user in users:  # the other views view the reduction's output
            user.input[0] = same.output[0]
        node.output[0] = same.output[0]
        dropped.add(id(same))
    if dropped:
        kept = _live([n for n in graph.node if id(n) not in dropped], outputs)
        del graph.node[:]
        graph.node.extend(kept)


def _vector_sums(graph: onnx.GraphProto, found: Facts) -> None:
    """A sum over leading axes as a row of ones times ``X (R, C)`` (see
    :func:`fast_reductions`) read only by a ``Reshape`` to ``(C,)`` (a bias's
    gradient) is the vector of ones times ``X``, written under the Reshape's
    name: a node less, the same values. In place."""
    constants = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs, taken = {o.name for o in graph.output}, _all_names(graph)
    dropped, added = set(), []
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain or node.output[0] in outputs:
            continue
        ones, users = constants.get(node.input[0]), readers.get(node.output[0], [])
        if ones is None or ones.ndim != 2 or ones.shape[0] != 1 or not np.all(ones == 1):
            continue
        # X of two axes only: a batched product's rows would not be one vector.
        rows = _shape_of(node.input[1], found, producer, constants)
        if len(users) != 1 or rows is None or len(rows) != 2 or rows[0] != ones.shape[1]:
            continue
        target = _target(users[0], constants)
        if target is None or len(target) != 1:
            continue
        vector = _unique(f"{node.input[0]}/vector", taken)
        added.append(
            helper.make_node(
                "Constant", [], [vector], value=numpy_helper.from_array(ones.reshape(-1))
            )
        )
        node.input[0] = vector
        node.output[0] = users[0].output[0]
        dropped.add(id(users[0]))
    if dropped:  # the rows of ones and the Reshapes' targets no node reads go too
        kept = _live(added + [n for n in graph.node if id(n) not in dropped], outputs)
        del graph.node[:]
        graph.node.extend(kept)


def _target(node, constants) -> list | None:
    """A ``Reshape``'s constant target without 0 (a size copied from its input)."""
    if node.op_type != "Reshape" or node.domain or len(node.input) < 2:
        return None
    target = constants.get(node.input[1])
    if target is None or not np.all(np.ravel(target) != 0):
        return None
    return np.ravel(target).tolist()


def _shape_of(name, found, producer, constants) -> list | None:
    shape = found.shapes.get(name)
    if _static(shape):
        return list(shape)
    view = producer.get(name)
    if view is not None and view.op_type == "Reshape" and view.input[1] in constants:
        target = np.ravel(constants[view.input[1]]).tolist()
        if all(d > 0 for d in target):
            return target
    return None
