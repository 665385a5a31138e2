"""A backward graph's adjoints without the seed axis: the primal values' shapes.

onnx-ad's reverse carries every adjoint with a seed axis of size 1 (last;
first around its products), so the backward adds that axis to each primal
value an adjoint meets (a ``Reshape`` each), and moves it out of the way
and back around each product and reduction (two more). On the small
graphs people fine-tune at batch 1-8, each of those nodes costs onnxruntime
its dispatch: a third of ConvNeXt's backward nodes at batch 2.

Here each tensor carrying a unit axis gets a twin without it, written by
the same node on the twins of its inputs, and the original goes where no
node needs it any more:

- a ``Reshape`` reads its input's twin (the same elements); one whose
  output has a unit axis last (else first) has a twin the reshape to the
  rest, no node at all where that is its input's shape: the seeds, and
  the primal values the reverse unsqueezed;
- an elementwise node whose output's last axis is a unit one reads its
  inputs' twins without their last axes (numpy broadcasting aligns the
  rest as before; scalars and all-ones tensors of lower rank stay);
- a ``Transpose`` permutes its input's twin by the permutation of the
  other axes; a reduction over other axes reduces the twin;
- a ``MatMul`` of a stack with a unit axis first multiplies the stack
  without it, and one of a unit row by a matrix is the product of that
  vector. Not a matrix by a unit column: onnxruntime (1.19 and 1.31)
  fuses a ``Transpose`` into the ``MatMul`` that reads it, and the fused
  kernel computes a transposed matrix times a vector wrong (2.8 off on a
  24x5 matrix, measured; right with the graph optimisations off).

A node that cannot read a twin reads the original, made again from the
twin by one ``Reshape`` where its node went. Exact: the same elements in
the same order; only where a unit axis sits differs. Static shapes only.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import node_reads

from .._optimize import Facts, _const, _perm, reduce_axes
from .._simplify import _constants, _live, _static, reshape

#: Ops computing each element from the same element of each input (numpy
#: broadcasting), with no attribute naming an axis.
_ELEMENTWISE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean", "Pow", "Where", "Neg", "Abs"}
    | {"Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Tanh", "Sigmoid", "Relu", "Cast", "Not"}
    | {"Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Sign"}
)
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})


def without_seed_axis(model: onnx.ModelProto, found: Facts) -> None:
    """Rewrite ``model``'s main graph in place (``found``: its facts, every shape static)."""
    _Rewrite(model.graph, found).run()


class _Rewrite:
    def __init__(self, graph: onnx.GraphProto, found: Facts):
        self.graph, self.shapes, self.taken = graph, found.shapes, found.taken
        self.constants = _constants(graph)
        #: tensor -> (its twin, the position of the unit axis the twin lacks)
        self.twin: dict[str, tuple[str, int]] = {}
        #: a reshape's output kept, (its source, the twin's shape, the unit
        #: axis): its twin made when a node reads it
        self.lazy: dict[str, tuple[str, tuple, int]] = {}
        #: tensors whose node went: made again from the twin where read
        self.gone: set[str] = set()
        self.nodes: list = []

    def run(self) -> None:
        for node in self.graph.node:
            made = None if node.domain not in ("", "ai.onnx") else self._rule(node)
            if made is None:
                for name in node_reads(node):
                    self._restore(name)
                self.nodes.append(node)
            else:
                self.nodes.extend(made)
                written = {o for n in made for o in n.output}
                self.gone.update(o for o in node.output if o not in written)
        outputs = [out.name for out in self.graph.output]
        for name in outputs:
            self._restore(name)
        del self.graph.node[:]  # the twins a rule made and then did not read go
        self.graph.node.extend(_live(self.nodes, set(outputs)))

    def _restore(self, name: str) -> None:
        if name in self.gone:
            self.gone.discard(name)
            self.nodes.extend(reshape(self.twin[name][0], self.shapes[name], name, self.taken))

    def _held(self, name: str) -> tuple[str, int] | None:
        """``name``'s twin and the axis it lacks (None: none)."""
        if name in self.lazy:
            source, rest, axis = self.lazy.pop(name)
            twin = self._new(name, rest)
            self.nodes.extend(reshape(source, rest, twin, self.taken))
            self.twin[name] = (twin, axis)
        return self.twin.get(name)

    def _shape(self, name):
        shape = self.shapes.get(name)
        return tuple(shape) if _static(shape) else None

    def _new(self, out: str, shape) -> str:
        name = _unique(f"{out}/unseeded", self.taken)
        self.shapes[name] = tuple(shape)
        return name

    def _rule(self, node) -> list | None:
        if len(node.output) != 1 or not node.input:
            return None
        op = node.op_type
        if op == "Reshape":
            return self._reshape(node)
        if not any(name in self.twin or name in self.lazy for name in node.input):
            return None
        out = node.output[0]
        shape = self._shape(out)
        if shape is None or any(self._shape(n) is None for n in node.input if n):
            return None
        if op == "Identity":
            held = self._held(node.input[0])
            if held is None:
                return None
            self.twin[out] = held
            return []
        if op in _ELEMENTWISE:
            return self._elementwise(node, shape)
        if op == "Transpose":
            return self._transpose(node, shape)
        if op in _REDUCTIONS:
            return self._reduction(node, shape)
        if op == "MatMul":
            return self._matmul(node, shape)
        return None

    def _reshape(self, node) -> list | None:
        x, out = node.input[0], node.output[0]
        shape, held = self._shape(out), self.twin.get(x)
        if shape is None:
            return None
        source = held[0] if held else x
        if len(shape) >= 1 and shape[-1] == 1:
            axis = len(shape) - 1
        elif len(shape) >= 2 and shape[0] == 1:
            axis = 0
        else:  # no unit axis out: the same reshape of the twin
            return None if held is None else reshape(source, shape, out, self.taken, node.name)
        rest = shape[:axis] + shape[axis + 1 :]
        if rest == self._shape(source):
            self.twin[out] = (source, axis)
            return []
        if held is None:  # a reshape either way: kept, its twin made if read
            self.lazy[out] = (source, rest, axis)
            return None
        twin = self._new(out, rest)
        self.twin[out] = (twin, axis)
        return reshape(source, rest, twin, self.taken)

    def _elementwise(self, node, shape) -> list | None:
        rank = len(shape)
        if rank == 0 or shape[-1] != 1:
            return None
        inputs = []
        for name in node.input:
            operand = self._shape(name) if name else ()
            held = self._held(name) if operand else None
            if not operand:
                inputs.append(name)
            elif held is not None and held[1] == len(operand) - 1:
                inputs.append(held[0])
            elif all(d == 1 for d in operand) and len(operand) < rank:
                self._restore(name)  # its twin lacks another axis: read as it was
                inputs.append(name)  # broadcast over every axis either way
            else:
                return None
        out = self._new(node.output[0], shape[:-1])
        self.twin[node.output[0]] = (out, rank - 1)
        copy = helper.make_node(node.op_type, inputs, [out], name=node.name)
        copy.attribute.extend(node.attribute)
        return [copy]

    def _transpose(self, node, shape) -> list | None:
        held = self._held(node.input[0])
        if held is None:
            return None
        source, axis = held
        perm = _perm(node) or list(reversed(range(len(shape))))
        at = perm.index(axis)
        inner = [a - (a > axis) for a in perm if a != axis]
        out = node.output[0]
        if inner == sorted(inner):
            self.twin[out] = (source, at)
            return []
        twin = self._new(out, shape[:at] + shape[at + 1 :])
        self.twin[out] = (twin, at)
        return [helper.make_node("Transpose", [source], [twin], perm=inner)]

    def _reduction(self, node, shape) -> list | None:
        held = self._held(node.input[0])
        if held is None or any(n in self.twin for n in node.input[1:]):
            return None
        source, axis = held
        rank = len(self._shape(node.input[0]))
        axes = reduce_axes(node, self.constants)
        attrs = {a.name: a for a in node.attribute}
        if axes is None:  # every axis (or none): left as it is
            return None
        axes = {a % rank for a in axes}
        inner = [a - (a > axis) for a in sorted(axes - {axis})]
        if not inner:
            return None
        keep = attrs["keepdims"].i if "keepdims" in attrs else 1
        out = twin = node.output[0]
        if keep or axis not in axes:  # the unit axis is in the output: its twin
            at = axis if keep else axis - sum(a < axis for a in axes)
            twin = self._new(out, shape[:at] + shape[at + 1 :])
            self.twin[out] = (twin, at)
        copy = helper.make_node(node.op_type, [source], [twin], name=node.name, keepdims=keep)
        copy.attribute.extend(a for n, a in attrs.items() if n not in ("axes", "keepdims"))
        if len(node.input) > 1:  # axes as an input (opset 18; ReduceSum's 13)
            target = _unique(f"{twin}/axes", self.taken)
            copy.input.append(target)
            return [_const(target, inner), copy]
        copy.attribute.append(helper.make_attribute("axes", inner))
        return [copy]

    def _matmul(self, node, shape) -> list | None:
        a, b = node.input
        ha, hb = self._held(a), self._held(b)
        ra, rb = len(self._shape(a)), len(self._shape(b))
        if ha and hb and ha[1] == hb[1] == 0 and ra == rb >= 3:
            inputs, at = [ha[0], hb[0]], 0  # both stacks without their unit first axis
        elif ha and not hb and ha[1] == 0 and ra >= 3 and rb < ra:
            inputs, at = [ha[0], b], 0
        elif hb and not ha and hb[1] == 0 and rb >= 3 and ra < rb:
            inputs, at = [a, hb[0]], 0
        elif ha and not hb and ha[1] == 0 and ra == 2 and rb >= 2:
            inputs, at = [ha[0], b], len(shape) - 2  # a unit row: a vector
        else:
            return None
        out = node.output[0]
        twin = self._new(out, shape[:at] + shape[at + 1 :])
        self.twin[out] = (twin, at)
        return [helper.make_node("MatMul", inputs, [twin], name=node.name)]
