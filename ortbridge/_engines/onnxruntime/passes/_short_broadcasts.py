"""Elementwise ops broadcasting over short rows take their operand spread out first.

onnxruntime's CPU kernels for ``Add``/``Sub``/``Mul``/``Div`` broadcast an
operand row by row: a per-row value (a LayerNorm backward's mean or inverse
deviation, (R, 1) over (R, C)) or a per-column vector ((C,) over (R, C)) costs
about 9 ns a row whatever C, so on short rows the op is several times its
same-shape form (2 cores, one thread: 1024 rows of 8, 9.4 us against 4.0;
4096 rows of 8, 37 us against 9.5; 1024 rows of 16, 10.6 against 4.7; both
onnxruntime versions alike). Small transformers' and ConvNeXt's LayerNorm
backward is made of such ops (8 to 32 channels).

The operand is spread to the full (R, C) by a product with ones, of inner
size 1 (``MatMul(s, ones(1, C))``, ``MatMul(ones(R, 1), v)``), and the op
then runs on same-shaped operands. Exact: each spread element is the operand's
times 1. Applied where the shapes are static, the operand varies only along
the leading axes (a per-row value) or only along the trailing ones (a
per-column vector), rows are at least :data:`_MIN_ROWS` and no longer than
:data:`_MAX_SPAN` (past them the row loop costs less than spreading).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique

from ._optimize import Facts
from ._simplify import _static, reshape

_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
#: Rows at most this long are spread (32 x 256 rows: 3.6 us broadcast, 3.3 spread).
_MAX_SPAN = 32
#: Fewer rows than this cost the row loop less than spreading.
_MIN_ROWS = 512
_FLOATS = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64}


def spread_short_broadcasts(model: onnx.ModelProto, found: Facts) -> None:
    """Rewrite ``model``'s main graph in place (``found``: its facts)."""
    graph = model.graph
    ones: dict[tuple, str] = {}  # (shape, type) -> a ones constant made
    spread: dict[tuple, str] = {}  # (operand, output shape) -> its spread form
    rewritten = []
    for node in graph.node:
        plan = _plan(node, found)
        if plan is not None:
            slot, rows, span, per_row, dtype = plan
            out = found.shapes[node.output[0]]
            key = (node.input[slot], out)
            if key not in spread:
                spread[key] = _spread(
                    node.input[slot], out, rows, span, per_row, dtype, found, ones, rewritten
                )
            node.input[slot] = spread[key]
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)


def _plan(node, found):
    """(operand slot, rows, span, per-row?, numpy type) where ``node`` qualifies."""
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
    small = [1] * (len(out) - len(shapes[slot])) + list(shapes[slot])
    if len(small) != len(out) or math.prod(small) == 1:
        return None
    varying = [a for a, d in enumerate(small) if d != 1]
    if any(small[a] != out[a] for a in varying):
        return None
    first, last = varying[0], varying[-1] + 1
    if small[:last] == list(out[:last]):  # a value per row of the trailing axes
        rows, span, per_row = math.prod(out[:last]), math.prod(out[last:]), True
    elif small[first:] == list(out[first:]):  # a vector along the trailing axes
        rows, span, per_row = math.prod(out[:first]), math.prod(out[first:]), False
    else:
        return None
    if span > _MAX_SPAN or rows < _MIN_ROWS:
        return None
    return slot, rows, span, per_row, dtype


def _spread(name, out, rows, span, per_row, dtype, found, ones, rewritten) -> str:
    taken = found.taken
    flat, product, result = (_unique(f"{name}/spread_{s}", taken) for s in ("flat", "mm", "out"))
    ones_shape = (1, span) if per_row else (rows, 1)
    key = (ones_shape, dtype)
    if key not in ones:
        ones[key] = _unique("ones_for_spread", taken)
        value = numpy_helper.from_array(np.ones(ones_shape, dtype))
        rewritten.append(helper.make_node("Constant", [], [ones[key]], value=value))
    rewritten.extend(reshape(name, [rows, 1] if per_row else [1, span], flat, taken))
    operands = [flat, ones[key]] if per_row else [ones[key], flat]
    rewritten.append(helper.make_node("MatMul", operands, [product]))
    rewritten.extend(reshape(product, list(out), result, taken))
    flat_shape = (rows, 1) if per_row else (1, span)
    for tensor, shape in ((flat, flat_shape), (product, (rows, span)), (result, out)):
        found.shapes[tensor] = tuple(shape)
    return result
