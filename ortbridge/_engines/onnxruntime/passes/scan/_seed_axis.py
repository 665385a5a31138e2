"""A backward ``Scan``'s body without the seed axis: its adjoints as the primal values' shapes.

onnx-ad's reverse carries every adjoint with a trailing seed axis (of size
1 here): inside a Scan body each step then adds that axis to the primal
values it multiplies (an ``Unsqueeze`` each), and moves it to the front and
back around each product (two ``Transpose``\\ s). On a body run once per
step, each of those nodes costs its dispatch every step.

Here the body's inputs whose last axis has size 1 (the adjoints the loop
carries and the ones it reads per step) lose it at the Scan's boundary (a
``Squeeze`` before, an ``Unsqueeze`` after, once per run), and every node
that reads them inside is rewritten for the shape without it: an
elementwise node reads the primal value its ``Unsqueeze`` added the axis to,
a ``Transpose`` keeps the other axes' order (none at all: an ``Identity``),
a batched ``MatMul`` drops its unit batch axis. Where any node cannot follow
(an axis that would broadcast, an op not listed), the body stays as it was.
Exact: the same values, without a size-1 axis.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import node_reads

from .._optimize import _const, _perm
from .._simplify import _constants, _live, _static
from ._sums import _GRAPHS, _STD, _ints, _loop_inputs, _shapes, rewrite_scans

#: Elementwise ops (numpy broadcasting) the rewrite follows.
_ELEMENTWISE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Sum", "Neg", "Identity", "Sigmoid", "Tanh", "Relu", "Exp"}
    | {"Log", "Sqrt", "Reciprocal", "Abs"}
)


def scan_bodies_without_seed_axis(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main-graph Scans in place (static shapes; opset 13
    or later: Squeeze's axes as an input)."""
    rewrite_scans(model, _without_seed_axis, 13)


def _without_seed_axis(scan, seen, outer, taken) -> list | None:
    """Squeezes, the Scan with its body rewritten, Unsqueezes; None where it cannot be."""
    layout = _loop_inputs(scan)
    if layout is None:
        return None
    body, n_states, n_scan_in = layout
    n_scan_out = len(body.output) - n_states
    in_axes = _ints(scan, "scan_input_axes", n_scan_in)
    out_axes = _ints(scan, "scan_output_axes", n_scan_out)
    shapes = {**outer, **_shapes(seen)}
    dropped = {}  # value -> the position of the size-1 axis it lost
    for k, value in enumerate(body.input):
        shape = shapes.get(value.name)
        if k >= n_states and in_axes[k - n_states] != 0:
            continue
        if _static(shape) and len(shape) >= 2 and shape[-1] == 1:
            dropped[value.name] = len(shape) - 1
    if not dropped:
        return None
    rules = _Rules(body, shapes, dropped, taken)
    nodes = []
    for node in body.node:
        if not any(n in dropped for n in node_reads(node)):
            nodes.append(node)
            continue
        new = rules.rewrite(node)
        if new is None:
            return None
        nodes.extend(new)
    # A loop state keeps its shape from step to step.
    for value_in, value_out in zip(body.input[:n_states], body.output[:n_states]):
        if dropped.get(value_in.name) != dropped.get(value_out.name):
            return None
    for j, value in enumerate(body.output[n_states:]):
        if value.name in dropped and out_axes[j] != 0:
            return None
    before, after = [], []
    scan_inputs, scan_outputs = list(scan.input), list(scan.output)
    for k, value in enumerate(body.input):
        if value.name in dropped and scan_inputs[k]:
            axis = dropped[value.name] + (k >= n_states)  # a scan input's steps lead
            squeezed = _unique(f"{scan_inputs[k]}_unseeded", taken)
            before += _squeeze("Squeeze", scan_inputs[k], axis, squeezed, taken)
            scan_inputs[k] = squeezed
    for k, value in enumerate(body.output):
        if value.name in dropped and k < len(scan_outputs) and scan_outputs[k]:
            axis = dropped[value.name] + (k >= n_states)
            squeezed = _unique(f"{scan_outputs[k]}_unseeded", taken)
            after += _squeeze("Unsqueeze", squeezed, axis, scan_outputs[k], taken)
            scan_outputs[k] = squeezed
    live = _live(nodes, {o.name for o in body.output})
    del body.node[:]
    body.node.extend(live)
    for value in [*body.input, *body.output]:
        if value.name in dropped:
            _drop_dim(value, dropped[value.name])
    kept = [vi for vi in body.value_info if vi.name not in dropped]
    del body.value_info[:]
    body.value_info.extend(kept)
    del scan.input[:]
    scan.input.extend(scan_inputs)
    del scan.output[:]
    scan.output.extend(scan_outputs)
    return [*before, scan, *after]


def _squeeze(op, source, axis, out, taken) -> list:
    axes = _unique(f"{out}/axes", taken)
    return [_const(axes, [axis]), helper.make_node(op, [source, axes], [out])]


def _drop_dim(value: onnx.ValueInfoProto, axis: int) -> None:
    shape = value.type.tensor_type.shape
    if value.type.tensor_type.HasField("shape") and len(shape.dim) > axis:
        del shape.dim[axis]


class _Rules:
    """How each node reading a value without its size-1 axis is rewritten."""

    def __init__(self, body, shapes, dropped, taken):
        self.shapes = shapes
        self.dropped = dropped
        self.taken = taken
        self.producer = {o: n for n in body.node for o in n.output}
        self.constants = _constants(body)

    def rewrite(self, node) -> list | None:
        if node.domain not in _STD or len(node.output) != 1:
            return None
        if any(a.type in _GRAPHS for a in node.attribute):
            return None  # a body inside: it reads the values as they were
        out = self.shapes.get(node.output[0])
        if not _static(out):
            return None
        if node.op_type in _ELEMENTWISE:
            return self._elementwise(node, out)
        if node.op_type == "Transpose":
            return self._transpose(node)
        if node.op_type == "MatMul":
            return self._matmul(node, out)
        if node.op_type == "Expand" and self.shapes.get(node.input[0]) == out:
            return self._renamed(node, "Identity", [node.input[0]], self.dropped[node.input[0]])
        return None

    def _renamed(self, node, op, inputs, position, **attrs) -> list:
        self.dropped[node.output[0]] = position
        return [helper.make_node(op, inputs, [node.output[0]], node.name, **attrs)]

    def _elementwise(self, node, out) -> list | None:
        rank = len(out)
        aligned = {
            self.dropped[n] + rank - len(self.shapes[n]) for n in node.input if n in self.dropped
        }
        if len(aligned) != 1:
            return None
        position = aligned.pop()
        if out[position] != 1:
            return None
        inputs = []
        for name in node.input:
            shape = self.shapes.get(name)
            if name in self.dropped or (shape is not None and len(shape) < rank - position):
                inputs.append(name)  # the axis dropped, or an operand that never reached it
                continue
            source = self._unsqueezed(name, position - (rank - len(shape or ())))
            if source is None:
                return None
            inputs.append(source)
        return self._renamed(node, node.op_type, inputs, position)

    def _unsqueezed(self, name, axis) -> str | None:
        """What ``name`` is an ``Unsqueeze`` of at ``axis`` alone (None: anything else)."""
        node = self.producer.get(name)
        if node is None or node.op_type != "Unsqueeze" or node.domain not in _STD:
            return None
        shape = self.shapes.get(name)
        if shape is None or axis < 0:
            return None
        if len(node.input) > 1:
            axes = self.constants.get(node.input[1])
            axes = None if axes is None else [int(a) for a in axes.ravel()]
        else:
            axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
        if axes is None or [a % len(shape) for a in axes] != [axis]:
            return None
        return node.input[0]

    def _transpose(self, node) -> list:
        seed = self.dropped[node.input[0]]
        perm = _perm(node) or list(range(len(self.shapes[node.input[0]])))[::-1]
        kept = [a - (a > seed) for a in perm if a != seed]
        position = perm.index(seed)
        if kept == sorted(kept):
            return self._renamed(node, "Identity", [node.input[0]], position)
        return self._renamed(node, "Transpose", [node.input[0]], position, perm=kept)

    def _matmul(self, node, out) -> list | None:
        """A product over a unit batch axis: the product of the matrices."""
        rank = len(out)
        positions = set()
        for name in node.input:
            shape = self.shapes.get(name)
            if shape is None:
                return None
            if name in self.dropped:
                seed = self.dropped[name]
                if seed >= len(shape) - 2:  # a matrix axis, not a batch axis
                    return None
                positions.add(seed + rank - len(shape))
        if len(positions) != 1:
            return None
        position = positions.pop()
        for name in node.input:  # the other operand's batch axes must not reach it
            shape = self.shapes[name]
            if name not in self.dropped and len(shape) > 2 and rank - len(shape) <= position:
                return None
        return self._renamed(node, "MatMul", list(node.input), position)
