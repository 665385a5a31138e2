"""Reductions in a reverse graph with static shapes, put on onnxruntime's fast paths.

Run on the onnxruntime engine's backward once its other rewrites are done.
The same elements are reduced; onnxruntime may add them in another order
(float rounding may differ in the last place).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique

from ._optimize import Facts, _const, facts, reduce_axes, replace_nodes
from ._simplify import _constants, _static, reshape

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
