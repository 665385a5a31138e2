"""One-element operands of broadcasting ops given the rank of the result.

Run on the onnxruntime engine's backward graph. onnx-ad's seed axis (size 1)
trails every adjoint, and onnxruntime broadcasts a one-element operand of a
lower rank over such a tensor one element at a time: ``Mul`` of a
(16, 8, 8, 32, 1) tensor by a (1,) or () constant took 240 us on 2 cores,
by a (1, 1, 1, 1, 1) one 3 us (onnxruntime 1.19 and 1.31 alike; a GELU's
gradient divides by such a constant). The operand reshaped to the result's
rank holds the same element: exact.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _unique

from ._optimize import Facts
from ._simplify import _static, reshape

#: Standard ops that broadcast their operands against each other.
_BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where",
     "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor"}
)  # fmt: skip


def full_rank_scalars(model: onnx.ModelProto, found: Facts) -> None:
    """Give each one-element operand of a broadcasting op with a unit axis in
    its result that result's rank (in place; ``found``: the graph's facts)."""
    graph = model.graph
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    made: dict[tuple, str] = {}  # (operand, rank) -> its full-rank form
    rewritten = []
    for node in graph.node:
        out = found.shapes.get(node.output[0]) if node.output else None
        if (
            node.op_type in _BROADCASTING
            and not node.domain
            and out is not None
            and 1 in out
            and any(_scalar_below(found.shapes.get(i), len(out)) for i in node.input)
        ):
            for slot, name in enumerate(node.input):
                if _scalar_below(found.shapes.get(name), len(out)):
                    key = (name, len(out))
                    if key not in made:
                        made[key] = _full_rank(name, len(out), found, constants, rewritten)
                    node.input[slot] = made[key]
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)


def _scalar_below(shape, rank: int) -> bool:
    """Whether ``shape`` is that of one element, of a rank below ``rank``."""
    return (
        shape is not None
        and len(shape) < rank
        and (not shape or _static(shape))
        and (int(np.prod(shape)) == 1)
    )


def _full_rank(name: str, rank: int, found: Facts, constants: dict, rewritten: list) -> str:
    """The name of ``name``'s element at shape ``(1,) * rank``, its nodes appended."""
    target = _unique(f"{name}/rank{rank}", found.taken)
    source = found.inits.get(name)
    value = None
    if source is not None:
        value = numpy_helper.to_array(source)
    elif name in constants and constants[name].attribute[0].name == "value":
        value = numpy_helper.to_array(constants[name].attribute[0].t)
    if value is not None:
        tensor = numpy_helper.from_array(np.reshape(value, (1,) * rank), target)
        rewritten.append(helper.make_node("Constant", [], [target], value=tensor))
    else:
        rewritten.extend(reshape(name, [1] * rank, target, found.taken))
    return target
