"""A Scan body's work that reads no loop state, done for every step at once before the loop.

onnx-ad's backward of a recurrence recomputes each step's forward values
from the saved per-step inputs: an LSTM's backward body multiplies the
saved hidden state by the four recurrent weights, applies the gates and
their derivatives, before any adjoint (a loop state) comes in. None of that
depends on the loop: run on the stacked steps it is four batched products
and a few elementwise ops over ``[T, ...]`` tensors instead of many small
nodes at every step. Values the body still needs come back in as new scan
inputs (same direction as the steps they came from; where a node pairs
steps stacked in opposite orders, one side is reversed once); values the
same at every step (a Transpose of a weight) are computed once and read
from outside.

A node moves when its operands are per-step values (scan inputs along axis
0, or values moved before) or the same at every step,
and stacking the steps along a new first axis computes the same thing:
elementwise ops where each per-step operand has the result's rank and the
others no more; MatMul where the stacked axis lands in the batch axes;
Transpose. Anything else, and every value a body output names, stays. The moved
per-step values are held for all steps during the run (the forward keeps
as many for the backward already).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import node_reads

from .._optimize import _perm
from .._simplify import _live
from ._outputs import _reversed
from ._sums import (
    _GRAPHS,
    _STD,
    _ints,
    _loop_inputs,
    _outer_constant,
    _rebuilt,
    _set_body,
    _shapes,
    _types,
    rewrite_scans,
)

_ELEMENTWISE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Sum", "Neg", "Abs", "Sigmoid", "Tanh", "Relu", "Exp", "Log"}
    | {"Sqrt", "Reciprocal", "Identity"}
)
#: Ops moved when every operand is the same at every step: deterministic.
_INVARIANT = _ELEMENTWISE | {"Transpose", "MatMul", "Reshape", "Constant"}


def hoisted_step_work(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main-graph Scans in place (opset 13 or later)."""
    rewrite_scans(model, _hoisted, 13)


class _Moved:
    """What has moved before the loop: per body value, its outer name and how it
    varies (a direction for per-step values stacked on axis 0, None if invariant)."""

    def __init__(self, shapes, outer, taken):
        self.shapes, self.outer, self.taken = shapes, outer, taken
        self.outer_name: dict[str, str] = {}
        self.direction: dict[str, int | None] = {}
        self.nodes: list[onnx.NodeProto] = []
        self._reversed: dict[tuple[str, int], str] = {}

    def rank(self, name) -> int | None:
        shape = self.shapes.get(name, self.outer.get(name))
        return None if shape is None else len(shape)

    def in_order(self, name, direction) -> str:
        """The outer name of ``name``'s steps stacked for ``direction``: a
        per-step value stacked the other way is reversed once (one Slice)."""
        if self.direction.get(name) in (None, direction):
            return self.outer_name.get(name, name)
        if (name, direction) not in self._reversed:
            out = _unique(f"{self.outer_name[name]}_reversed", self.taken)
            self.nodes += _reversed(self.outer_name[name], 0, out, self.taken)
            self._reversed[name, direction] = out
        return self._reversed[name, direction]

    def add(self, node, direction, **attrs) -> None:
        outputs = [_unique(f"{o}_steps" if direction is not None else f"{o}_once", self.taken)
                   for o in node.output]  # fmt: skip
        inputs = [self.in_order(i, direction) if i else "" for i in node.input]
        kept = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        kept.update(attrs)
        self.nodes.append(
            helper.make_node(node.op_type, inputs, outputs, domain=node.domain, **kept)
        )
        for o, new in zip(node.output, outputs):
            self.outer_name[o], self.direction[o] = new, direction


def _hoisted(scan, seen, outer, taken) -> list | None:
    layout = _loop_inputs(scan)
    if layout is None:
        return None
    body, n_states, n_scan_in = layout
    in_axes = _ints(scan, "scan_input_axes", n_scan_in)
    in_dirs = _ints(scan, "scan_input_directions", n_scan_in)
    moved = _Moved(_shapes(seen), outer, taken)
    inside = {i.name for i in body.input[:n_states]}  # values that depend on the loop
    own = {i.name for i in body.initializer}
    for init in body.initializer:  # copied out where a moved node reads one
        moved.outer_name[init.name] = _unique(f"{init.name}_once", taken)
        moved.direction[init.name] = None
        moved.nodes.append(_outer_constant(init, moved.outer_name[init.name]))
    for k in range(n_scan_in):
        name = body.input[n_states + k].name
        if in_axes[k] == 0 and moved.rank(name) is not None:
            moved.outer_name[name], moved.direction[name] = scan.input[n_states + k], in_dirs[k]
        else:
            inside.add(name)
    returned = {o.name for o in body.output}
    kept_nodes = []
    for node in body.node:
        if (
            node.domain not in _STD
            or any(a.type in _GRAPHS for a in node.attribute)
            or any(o in returned for o in node.output)
            or any(i in inside for i in node_reads(node))
            or not _move(node, moved)
        ):
            kept_nodes.append(node)
            inside.update(node.output)
    if len(moved.nodes) == len(own):  # nothing but the copied initializers
        return None
    # What the body still reads of the moved values: per-step ones as new scan
    # inputs, the others from outside.
    renames = {
        v: moved.outer_name[v] for v, d in moved.direction.items() if d is None and v not in own
    }
    nested = {i for n in kept_nodes if any(a.type in _GRAPHS for a in n.attribute)
              for i in node_reads(n)}  # fmt: skip
    if nested & set(renames):  # a nested body would read a name that moved
        return None
    for node in kept_nodes:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
    kept_nodes = _live(kept_nodes, returned)
    read = {i for n in kept_nodes for i in node_reads(n)} | returned
    inputs, outer_inputs = list(body.input[:n_states]), list(scan.input[:n_states])
    axes, dirs = [], []
    for k in range(n_scan_in):  # scan inputs nothing reads any more go
        name = body.input[n_states + k].name
        if name in read:
            inputs.append(body.input[n_states + k])
            outer_inputs.append(scan.input[n_states + k])
            axes.append(in_axes[k])
            dirs.append(in_dirs[k])
    scanned = {body.input[n_states + k].name for k in range(n_scan_in)}
    types = _types(seen)
    for v, direction in moved.direction.items():
        if direction is None or v in scanned or v not in read:
            continue
        inputs.append(helper.make_tensor_value_info(v, types.get(v, onnx.TensorProto.FLOAT), None))
        outer_inputs.append(moved.outer_name[v])
        axes.append(0)
        dirs.append(direction)
    if not axes and n_scan_in:  # the loop's length is its scan inputs': one stays
        inputs.append(body.input[n_states])
        outer_inputs.append(scan.input[n_states])
        axes.append(in_axes[0])
        dirs.append(in_dirs[0])
    _set_body(body, kept_nodes, inputs)
    new = _rebuilt(
        scan,
        outer_inputs,
        list(scan.output),
        num_scan_inputs=len(axes),
        scan_input_axes=axes,
        scan_input_directions=dirs,
    )
    return [*_live(moved.nodes, set(outer_inputs) | read), new]


def _move(node, moved: _Moved) -> bool:
    """Move ``node`` before the loop if stacking its steps computes the same; whether it moved."""
    operands = [i for i in node.input if i]
    steps = {i for i in operands if moved.direction.get(i) is not None}
    directions = {moved.direction[i] for i in steps}
    if not steps:  # the same at every step: computed once
        if node.op_type not in _INVARIANT:
            return False
        moved.add(node, None)
        return True
    # Steps stacked in opposite orders pair up once one side is reversed: the
    # side with fewer operands is.
    order = [moved.direction[i] for i in operands if i in steps]
    direction = max(directions, key=order.count)
    ranks = {i: moved.rank(i) for i in operands}
    if None in ranks.values():
        return False
    if node.op_type in _ELEMENTWISE:
        top = max(ranks.values())
        if any(ranks[i] != top for i in steps):
            return False
        moved.add(node, direction)
        return True
    if node.op_type == "MatMul" and len(operands) == 2:
        (a, ra), (b, rb) = ((i, ranks[i]) for i in operands)
        if a in steps and b in steps:
            fits = ra == rb >= 2
        elif a in steps:  # [T, .., n, k] @ [k, m] or [k]
            fits = rb <= 2
        else:  # [n, k] or [k] @ [T, .., k, m]
            fits = ra <= 2 and rb >= 2
        if fits:
            moved.add(node, direction)
        return fits
    if node.op_type == "Transpose":
        rank = ranks[operands[0]]
        perm = _perm(node) or list(range(rank))[::-1]
        moved.add(node, direction, perm=[0, *(p + 1 for p in perm)])
        return True
    return False
