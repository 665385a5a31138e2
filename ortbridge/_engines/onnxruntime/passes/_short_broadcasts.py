"""A value per short row, broadcast by an elementwise op, spread out first.

onnxruntime's CPU kernels for ``Add``/``Sub``/``Mul``/``Div`` broadcast an
operand row by row: a value per row ((R, 1) over (R, C): a LayerNorm
backward's mean, inverse deviation and row sums) costs about 9 ns a row
whatever C, so on short rows the op is several times its same-shape form
(2 cores, one thread: 1024 rows of 8, 9.4 us against 4.0 spread first; 4096
rows of 8, 37 us against 9.5; 1024 rows of 16, 10.6 against 4.7; both
onnxruntime versions alike). The backward of a LayerNorm over few channels
(ConvNeXt's and SegFormer's first stages, 8) is made of such ops.

The value is spread to (R, C) by a product with ones of inner size 1,
``MatMul(s, ones(1, C))`` between views, and the op then runs on same-shaped
operands. Exact: each spread element is the value times 1. Applied where
shapes are static, the operand equals the result's shape on the leading axes
and is 1 on the trailing ones, rows number at least :data:`_MIN_ROWS` and
hold at most :data:`_MAX_SPAN` elements (past those the row loop costs less
than spreading). A vector along the rows ((C,) over (R, C)) is as slow to
broadcast, but spreading it moved no step (ConvNeXt, SegFormer) and each node
costs the session's creation, so it is left.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique

from ._optimize import Facts, _const
from ._simplify import _static

_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
#: Rows at most this long are spread (256 rows of 32: 3.6 us broadcast, 3.3 spread).
_MAX_SPAN = 32
#: Fewer rows than this cost the row loop less than spreading.
_MIN_ROWS = 512
_FLOATS = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64}


def spread_short_broadcasts(model: onnx.ModelProto, found: Facts) -> None:
    """Rewrite ``model``'s main graph in place (``found``: its facts)."""
    graph = model.graph
    made: dict[tuple, str] = {}  # constants made once: ones, Reshape targets
    spread: dict[tuple, str] = {}  # (operand, output shape) -> its spread form
    rewritten = []
    for node in graph.node:
        plan = _plan(node, found)
        if plan is not None:
            slot, rows, span, dtype = plan
            out = tuple(found.shapes[node.output[0]])
            key = (node.input[slot], out)
            if key not in spread:
                spread[key] = _spread(
                    node.input[slot], out, rows, span, dtype, found, made, rewritten
                )
            node.input[slot] = spread[key]
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)


def _plan(node, found):
    """(operand slot, rows, span, numpy type) where ``node`` qualifies."""
    if node.op_type not in _OPS or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    out = found.shapes.get(node.output[0])
    dtype = _FLOATS.get(found.types.get(node.output[0]))
    shapes = [found.shapes.get(name) for name in node.input]
    if dtype is None or not _static(out) or not all(_static(s) for s in shapes):
        return None
    full = [tuple(s) == tuple(out) for s in shapes]
    if full.count(True) != 1:
        return None
    slot = full.index(False)
    small = list(shapes[slot])
    if len(small) != len(out) or math.prod(small) == 1:
        return None
    last = max(a for a, d in enumerate(small) if d != 1) + 1
    if small[:last] != list(out[:last]):  # not a value per row of the trailing axes
        return None
    rows, span = math.prod(out[:last]), math.prod(out[last:])
    if span > _MAX_SPAN or rows < _MIN_ROWS:
        return None
    return slot, rows, span, dtype


def _spread(name, out, rows, span, dtype, found, made, rewritten) -> str:
    taken = found.taken
    flat, product, result = (_unique(f"{name}/spread_{s}", taken) for s in ("flat", "mm", "out"))
    rewritten.append(
        helper.make_node("Reshape", [name, _shape((rows, 1), found, made, rewritten)], [flat])
    )
    rewritten.append(
        helper.make_node("MatMul", [flat, _ones(span, dtype, found, made, rewritten)], [product])
    )
    rewritten.append(
        helper.make_node("Reshape", [product, _shape(out, found, made, rewritten)], [result])
    )
    for tensor, shape in ((flat, (rows, 1)), (product, (rows, span)), (result, out)):
        found.shapes[tensor] = tuple(shape)
    return result


def _ones(span, dtype, found, made, rewritten) -> str:
    key = ("ones", span, dtype)
    if key not in made:
        made[key] = _unique("ones_for_spread", found.taken)
        value = numpy_helper.from_array(np.ones((1, span), dtype))
        rewritten.append(helper.make_node("Constant", [], [made[key]], value=value))
    return made[key]


def _shape(shape, found, made, rewritten) -> str:
    """A Reshape's target, made once (each node costs the session's creation too)."""
    key = ("shape", tuple(shape))
    if key not in made:
        made[key] = _unique("spread_shape", found.taken)
        rewritten.append(_const(made[key], list(shape)))
    return made[key]
