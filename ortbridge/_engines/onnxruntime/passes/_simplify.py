"""Fewer nodes in a reverse graph whose shapes are static: chains of views become one.

Used on the onnxruntime engine's graphs built for one input shape and on
the training package's gradient graphs. Both run many small steps (an epoch
graph's ``Loop`` body runs once a batch), and on small models a step's time
is mostly the dispatch of its nodes, about a microsecond each. onnx-ad's reverse graph
carries its seed axis (of size 1) through ``Unsqueeze``/``Squeeze``/``Reshape``
chains, and sums adjoints over axes that have size 1; with static shapes
both are views of their input:

- a chain of ``Identity``/``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten``
  nodes is one ``Reshape`` of the chain's first input (an ``Identity`` when
  the shapes are equal, which onnxruntime removes);
- a ``ReduceSum`` over axes of size 1 is such a view, and so is a
  ``Slice`` that crops nothing (the same shape out, no reversing step);
- an elementwise ``Mul``/``Add``/``Sub``/``Div`` of two views of same-shaped
  tensors (or of one view and a one-element tensor) is the view of the
  operation on the tensors; an ``Expand`` feeding one of them is left out
  where the other operand has the result's shape already;
- a ``MatMul`` of a matrix and a stack of one matrix is a view of the
  product of two matrices (the 2-D kernel, not the batched one);
- a ``ReduceSum`` of a view that only inserts or drops axes of size 1 is a
  view of the sum of the viewed tensor;
- nodes computing the same op on the same inputs are one (onnx-ad's rules
  write the two halves of ``x * x``'s derivative apart);
- nodes whose outputs nothing reads are dropped.

Exact: only the shapes change, never a value. Shapes come from onnx's
shape inference; a node is rewritten only where its input and output
shapes are fully known and have no zero-size dimension.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _unique
from ortbridge._prepare._onnx_utils import node_reads

from ._optimize import _const, _inferred, _shapes, _shapes_and_types

_VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
#: Rounds of lifting views (one lifts a chain; another may find more once collapsed).
_MAX_PASSES = 3


def simplify(model: onnx.ModelProto) -> tuple[dict, dict] | None:
    """Apply every rewrite of this module to ``model``'s main graph in place.

    Returns the shapes of the graph it leaves (every tensor it kept, and the
    views it added; not its shape constants') and the element types of the
    tensors it kept, for the next pass to read; None where shape inference
    failed (nothing rewritten).
    """
    # One shape inference for every round: the rewrites keep each tensor's
    # name and shape and record the shapes of the tensors they add.
    inferred = _inferred(model)
    if inferred is None:
        return None
    shapes, types = _shapes_and_types(inferred)
    collapse_views(model, shapes)
    for _ in range(_MAX_PASSES):  # a lifted view may be lifted again by the next node
        changed, more = _lift_views(model, shapes)
        if not changed:
            break
        collapse_views(model, shapes)
        if not more:
            break
    merge_duplicates(model.graph)
    return shapes, types


def collapse_views(model: onnx.ModelProto, shapes: dict | None = None) -> None:
    """Chains of views as one view, ``ReduceSum`` over unit axes as a view (in place).

    ``shapes``: every tensor's, where the caller knows them (inferred if not).
    """
    shapes = _shapes(model) if shapes is None else shapes
    if shapes is None:
        return
    graph = model.graph
    taken = _all_names(graph)
    constants = _constants(graph)
    origin: dict[str, str] = {}  # output of a view -> the tensor it views
    made: dict[tuple, str] = {}  # (tensor, shape) -> the view of it made first
    rewritten = []
    for node in graph.node:
        source = _viewed(node, shapes, constants)
        if source is None:
            rewritten.append(node)
            continue
        source = origin.get(source, source)
        out = node.output[0]
        if _static(shapes.get(source)) and _static(shapes.get(out)):
            origin[out] = source
            key = (source, tuple(shapes[out]))
            if key in made:  # the same view twice: onnxruntime drops the Identity
                rewritten.append(helper.make_node("Identity", [made[key]], [out], name=node.name))
            else:
                made[key] = out
                rewritten.extend(_view(source, out, shapes, taken, node.name))
        else:
            rewritten.append(node)
    del graph.node[:]
    graph.node.extend(_live(rewritten, {o.name for o in graph.output}))


def merge_reshapes(graph: onnx.GraphProto) -> None:
    """A ``Reshape`` to a constant shape of a view reads the view's input; unread nodes go.

    Exact whatever the shapes: the shape has no 0 (which would copy a
    dimension of the input it reads), and a reshape keeps the elements'
    order. Works on a subgraph body too (names it reads from outside stay).
    """
    constants = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            continue
        inner = producer.get(node.input[0])  # a view's first: the shape is read then
        if inner is None or inner.op_type not in _VIEWS or inner.domain not in ("", "ai.onnx"):
            continue
        target = constants.get(node.input[1]) if len(node.input) > 1 else None
        if target is None or not np.all(np.ravel(target) != 0):
            continue
        while inner is not None and inner.op_type in _VIEWS and inner.domain in ("", "ai.onnx"):
            node.input[0] = inner.input[0]
            inner = producer.get(inner.input[0])
    kept = _live(list(graph.node), {o.name for o in graph.output})
    del graph.node[:]
    graph.node.extend(kept)


#: Ops whose every run draws new values: never merged.
_RANDOM = frozenset(
    {"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli",
     "Multinomial", "Dropout"}
)  # fmt: skip


def merge_duplicates(graph: onnx.GraphProto) -> None:
    """Keep the first of nodes with the same op, inputs and attributes; readers use it."""
    seen: dict[tuple, onnx.NodeProto] = {}
    rename: dict[str, str] = {}
    kept = []
    for node in graph.node:
        node.input[:] = [rename.get(name, name) for name in node.input]
        if node.op_type in _RANDOM or any(a.g.node or a.graphs for a in node.attribute):
            kept.append(node)
            continue
        key = (
            node.domain,
            node.op_type,
            tuple(node.input),
            len(node.output),
            tuple(a.SerializeToString() for a in node.attribute),
        )
        first = seen.get(key)
        if first is None:
            seen[key] = node
            kept.append(node)
        else:
            rename.update(zip(node.output, first.output))
    for out in graph.output:  # a graph output keeps its name
        if out.name in rename:
            kept.append(helper.make_node("Identity", [rename[out.name]], [out.name]))
    del graph.node[:]
    graph.node.extend(kept)


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


class _Constants(Mapping):
    """A graph's constant tensors (initializers, ``Constant`` values) by name, each
    made a numpy array when first read: the passes read a few axes and shapes,
    and converting every tensor took a fifth of the view simplification's time."""

    def __init__(self, graph: onnx.GraphProto):
        self._tensors = {i.name: i for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self._tensors[node.output[0]] = node.attribute[0].t
        self._arrays: dict = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self._tensors[name])
        return self._arrays[name]

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        """A constant a rewrite adds (as a node of its own)."""
        self._tensors[name] = None
        self._arrays[name] = value

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _constants(graph: onnx.GraphProto) -> _Constants:
    return _Constants(graph)


def _viewed(node: onnx.NodeProto, shapes: dict, constants: dict) -> str | None:
    """The tensor ``node`` only reshapes (None: the node computes something)."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.input:
        return None
    if node.op_type in _VIEWS:
        return node.input[0]
    if node.op_type == "Slice":
        return _whole_slice(node, shapes, constants)
    if node.op_type != "ReduceSum":
        return None
    shape = shapes.get(node.input[0])
    if not _static(shape):
        return None
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return None
        axes = [int(a) for a in np.ravel(constants[node.input[1]])]
    else:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), [])
    if not axes:  # every axis, or none with noop_with_empty_axes
        axes = list(range(len(shape)))
    if all(shape[a] == 1 for a in axes):
        return node.input[0]
    return None


def _whole_slice(node: onnx.NodeProto, shapes: dict, constants: dict) -> str | None:
    """A ``Slice`` cropping nothing (onnx-ad's crop of a weight gradient of the
    kernel's size already): its input; a reversing one is no view."""
    shape, steps = shapes.get(node.input[0]), node.input[4] if len(node.input) > 4 else ""
    if not _static(shape) or shapes.get(node.output[0]) != shape:
        return None
    reverses = steps and (steps not in constants or np.any(np.ravel(constants[steps]) < 0))
    return None if reverses else node.input[0]


def _view(source: str, out: str, shapes: dict, taken: set, name: str) -> list:
    if shapes[source] == shapes[out]:
        return [helper.make_node("Identity", [source], [out], name=name)]
    return reshape(source, shapes[out], out, taken, name)


def reshape(source: str, shape, out: str, taken: set, name: str = "") -> list:
    """``out = Reshape(source, shape)`` with its constant shape: two nodes."""
    target = _unique(f"{out}/shape", taken)
    return [_const(target, list(shape)), helper.make_node("Reshape", [source, target], [out], name)]


def _live(nodes: list, outputs: set) -> list:
    """``nodes`` without those whose outputs no node and no graph output read."""
    needed = set(outputs)
    kept = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(node_reads(node))
    return kept[::-1]


_ELEMENTWISE = frozenset({"Mul", "Add", "Sub", "Div", "Sum"})


def _lift_views(model: onnx.ModelProto, shapes: dict) -> tuple[bool, bool]:
    """Move views below the elementwise ops and MatMuls that read them. Returns
    whether any moved, and whether another round may move more once the views
    have collapsed. ``shapes`` gets the shapes of the tensors it adds."""
    graph = model.graph
    taken = _all_names(graph)
    producer = {o: n for n in graph.node for o in n.output}

    def source(name):  # the tensor a chain of Reshape/Identity of static shapes views
        found, node = None, producer.get(name)
        while node is not None and node.op_type in ("Reshape", "Identity") and not node.domain:
            if not _static(shapes.get(node.input[0])):
                break
            found, node = node.input[0], producer.get(node.input[0])
        return found

    def size_one(name):
        shape = shapes.get(name)
        return _static(shape) and int(np.prod(shape)) == 1

    constants = _constants(graph)
    rewritten, changed, views = [], False, []
    for node in graph.node:
        out = node.output[0] if node.output else ""
        if node.domain or not _static(shapes.get(out)):
            rewritten.append(node)
            continue
        new = None
        if node.op_type in _ELEMENTWISE and len(node.input) == 2:
            ins = [_unexpanded(i, producer, shapes, shapes[out], node.input) for i in node.input]
            srcs = [source(i) for i in ins]
            same = shapes.get(ins[0]) == shapes.get(ins[1])  # no broadcasting between views
            if all(srcs) and same and shapes[srcs[0]] == shapes[srcs[1]]:
                new = srcs
            elif srcs[0] and size_one(ins[1]):
                new = [srcs[0], _scalar(ins[1], shapes, taken, rewritten)]
            elif srcs[1] and size_one(ins[0]):
                new = [_scalar(ins[0], shapes, taken, rewritten), srcs[1]]
            elif ins != list(node.input):
                node.input[:] = ins
                changed = True
            if new is not None:
                lifted = np.broadcast_shapes(*(shapes[n] for n in new))
        elif node.op_type == "MatMul":
            new = _matrix_operands(node, shapes, taken, rewritten)
            if new is not None:
                lifted = (shapes[new[0]][0], shapes[new[1]][1])
        elif node.op_type == "ReduceSum" and source(node.input[0]):
            new = _reduced_source(node, source(node.input[0]), shapes, constants, taken, rewritten)
            if new is not None:
                summed = set(np.ravel(constants.get(new[1], [])).tolist())
                lifted = tuple(1 if a in summed else d for a, d in enumerate(shapes[new[0]]))
        if new is None:
            rewritten.append(node)
            continue
        inner = _unique(f"{out}/lifted", taken)
        attrs = {"keepdims": 1} if node.op_type == "ReduceSum" else {}
        rewritten.append(helper.make_node(node.op_type, new, [inner], **attrs))
        # What comes next sees the new view: a chain of lifts in one pass.
        shapes[inner] = tuple(int(d) for d in lifted)
        view = _view(inner, out, shapes, taken, node.name)
        rewritten.extend(view)
        producer[out] = view[-1]
        views.append(out)
        changed = True
    del graph.node[:]
    graph.node.extend(_live(rewritten, {o.name for o in graph.output}))
    return changed, _hidden_views(graph, views, shapes, constants)


def _hidden_views(graph: onnx.GraphProto, views: list, shapes: dict, constants) -> bool:
    """Whether a reader of the new ``views`` (through Reshapes and Identities)
    is a view the lifting does not see through: only then can another round
    lift more. Each node reading a new view through Reshapes and Identities
    was seen with it already (lifted nodes come before their readers), and
    the collapse before the first round made every other view of static
    shapes a Reshape; what is left is a Squeeze, Unsqueeze, Flatten or
    unit-axis ReduceSum whose shapes inference did not give. ``constants``:
    the lifting's (the readers' axes are among them)."""
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    todo = list(views)
    while todo:
        for reader in readers.get(todo.pop(), []):
            if reader.domain not in ("", "ai.onnx"):
                continue
            if reader.op_type in ("Reshape", "Identity"):
                todo.append(reader.output[0])
            elif reader.op_type in _VIEWS or _viewed(reader, shapes, constants) is not None:
                return True
    return False


def _scalar(name: str, shapes: dict, taken: set, rewritten: list) -> str:
    """A one-element tensor as a scalar: broadcasting it then keeps the other operand's rank."""
    scalar = _unique(f"{name}/scalar", taken)
    rewritten.extend(reshape(name, [], scalar, taken))
    shapes[scalar] = ()
    return scalar


def _unexpanded(name, producer, shapes, out_shape, operands) -> str:
    """``name``, or the input of the ``Expand`` writing it where broadcasting does its work."""
    node = producer.get(name)
    if node is None or node.op_type != "Expand" or node.domain:
        return name
    other = operands[1] if operands[0] == name else operands[0]
    if shapes.get(other) == out_shape and shapes.get(node.output[0]) == out_shape:
        return node.input[0]
    return name


def _reduced_source(node, source, shapes, constants, taken, rewritten) -> list | None:
    """Operands of a ``ReduceSum`` of ``source`` equal to ``node``'s sum of a view of it.

    Only for a view that inserts or drops axes of size 1: the other axes are
    ``source``'s, in order, so the summed axes map onto its own.
    """
    view, shape = shapes[node.input[0]], shapes[source]
    if len(node.input) < 2 or node.input[1] not in constants:
        return None
    axes = [int(a) % len(view) for a in np.ravel(constants[node.input[1]])]
    kept_view = [a for a, d in enumerate(view) if d != 1]
    kept_source = [a for a, d in enumerate(shape) if d != 1]
    if [view[a] for a in kept_view] != [shape[a] for a in kept_source]:
        return None
    mapped = [kept_source[kept_view.index(a)] for a in axes if view[a] != 1]
    if not mapped:
        return None  # a view itself: collapse_views's
    target = _unique(f"{node.output[0]}/axes", taken)
    rewritten.append(_const(target, mapped))
    constants[target] = np.array(mapped)
    return [source, target]


def _matrix_operands(node, shapes, taken, rewritten) -> list | None:
    """Operands of a 2-D product for ``MatMul`` (m, k) x (1, k, n), or (1, m, k) x (k, n)."""
    a, b = (shapes.get(i) for i in node.input)
    if not (_static(a) and _static(b)):
        return None
    if len(a) == 2 and len(b) == 3 and b[0] == 1:
        pos, shape = 1, b[1:]
    elif len(a) == 3 and len(b) == 2 and a[0] == 1:
        pos, shape = 0, a[1:]
    else:
        return None
    matrix = _unique(f"{node.input[pos]}/matrix", taken)
    rewritten.extend(reshape(node.input[pos], shape, matrix, taken))
    shapes[matrix] = tuple(shape)
    operands = list(node.input)
    operands[pos] = matrix
    return operands
