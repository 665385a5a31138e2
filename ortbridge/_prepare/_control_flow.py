"""Control flow resolved for one call: the ``If`` branch taken, a ``Loop`` unrolled.

onnx-ad differentiates an ``If`` through both branches, and needs the rank of
its outputs, which is unknown where the branches disagree (a Squeeze in one,
an Identity in the other); onnxruntime may then refuse the reverse ``If``. An
``If`` whose condition needs no gradient (a sample rate given as an int
input, a test on shapes, constants) takes one branch per call: that branch
alone is differentiated, as torch differentiates the Python branch it ran.
Likewise a ``Loop`` whose trip count a call decides and whose condition stays
true is unrolled (its body's shapes need not be declared then).

- :func:`deciding_inputs`: the one-value int (and bool) inputs whose values
  may decide a condition or a trip count; their values and the input shapes
  are what a resolution depends on.
- :func:`resolve`: the graph with each main-graph ``If`` whose condition
  those values, the shapes and constants decide replaced by the branch it
  takes (nested ones in turn) and each such ``Loop`` unrolled, and the
  decisions made.

Plain graph code, no torch and no onnxruntime (a caller may pass a function
that runs one).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._lookup import _all_names, _infer, _unique
from ._onnx_utils import (
    FLOAT_TYPES,
    ancestors,
    attr,
    elem_type,
    node_reads,
    set_input_shapes,
    subgraphs,
)

#: A deciding input holds at most this many values (a sample rate, a flag):
#: each new value means a new resolution (about 10 ms), so larger ones
#: (EmbeddingBag's offsets, token ids) are not keyed on.
MAX_DECIDING_VALUES = 1
#: A Loop a call decides is unrolled up to this many steps (and nodes in all).
MAX_UNROLLED = 64
MAX_UNROLLED_NODES = 20000
#: Folded operands hold at most this many values (a condition comes from a few scalars).
_SMALL = 256

#: Ops folded while computing a condition (none makes a large tensor).
_FOLDED = frozenset(
    {
        "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not",
        "Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Add", "Sub", "Mul", "Div",
        "Neg", "Abs", "Min", "Max", "Gather", "Concat", "Slice", "ReduceProd", "ReduceSum",
        "ReduceMin", "ReduceMax", "Where", "Mod", "Transpose", "ConstantOfShape",
    }
)  # fmt: skip


def main_control_flow(model: onnx.ModelProto) -> bool:
    """Whether the main graph has an ``If`` or a ``Loop`` (one a call may resolve)."""
    return any(_resolvable(n) for n in model.graph.node)


def call_decides(model: onnx.ModelProto, deciding: list[str]) -> bool:
    """Whether a main-graph ``If`` has a condition a call decides (:func:`resolve`).

    ``deciding``: the names of :func:`deciding_inputs`.
    """
    keyed = _Keyed(model, deciding)
    return any(
        _resolvable(n) and all(keyed.value(i) for i in n.input[:2] if i) for n in model.graph.node
    )


def deciding_inputs(model: onnx.ModelProto, n_inputs: int) -> list[int]:
    """Positions, among the first ``n_inputs`` graph inputs, of the small int or
    bool inputs whose values an ``If`` condition or a ``Loop``'s trip count or
    condition (at any depth) may read."""
    producer = {}
    conditions = []

    def walk(graph):
        for node in graph.node:
            for out in node.output:
                producer[out] = node
            if _resolvable(node):
                conditions.extend(i for i in node.input[:2] if i)
            for a in node.attribute:
                for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                    walk(sub)

    walk(model.graph)
    # A Shape or Size reads no values (shapes are in a call's key anyway).
    seen, _ = ancestors(producer, conditions, opaque=("Shape", "Size"))
    found = []
    for pos, vi in enumerate(list(model.graph.input)[:n_inputs]):
        tensor = vi.type.tensor_type
        if vi.name not in seen or tensor.elem_type in FLOAT_TYPES or not tensor.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if None not in dims and int(np.prod(dims)) <= MAX_DECIDING_VALUES:
            found.append(pos)
    return found


def resolve(
    model: onnx.ModelProto,
    shapes: dict[str, tuple] | None,
    values: dict[str, np.ndarray],
    evaluate=None,
) -> tuple[onnx.ModelProto, tuple]:
    """``model`` with the ``If`` and ``Loop`` nodes a call decides resolved.

    ``shapes``: the call's input shapes (None: the declared ones);
    ``values``: the call's values of :func:`deciding_inputs`;
    ``evaluate(model, name)``: the value of ``name`` in ``model`` on the
    call's tensors (onnxruntime; None if it cannot tell), for conditions that
    are functions of the input shapes and deciding values but that shape
    inference cannot fold (a test on the length of a convolution's output).
    None: folding only.

    Returns the new model (``model`` itself when nothing is resolved; inputs
    keep their declared shapes) and the decisions, ``(first output name,
    branch taken or trip count)`` in the order made: equal decisions give
    equal models.
    """
    work, decisions = model, []
    while True:
        probe = onnx.ModelProto()
        probe.CopyFrom(work)
        if shapes:
            set_input_shapes(probe, shapes)
        _, known_shapes = _infer(probe)
        folder = Folder(work, values, known_shapes, _opset(work))
        keyed = _Keyed(work, set(values))
        for index, node in enumerate(work.graph.node):
            decision = _decide(node, keyed, folder, work, evaluate)
            if decision is None:
                continue
            if work is model:
                work = onnx.ModelProto()
                work.CopyFrom(model)
            if node.op_type == "If":
                _inline(work.graph, index, decision)
            else:
                _unroll(work.graph, index, decision)
            decisions.append((node.output[0], decision))
            break
        else:
            return work, tuple(decisions)


def _resolvable(node) -> bool:
    return node.op_type in ("If", "Loop") and node.domain in ("", "ai.onnx")


def _decide(node, keyed, folder, model, evaluate):
    """The branch an If takes (bool) or the trip count of a Loop unrolled (int), or None."""
    if not _resolvable(node):
        return None

    def value(name):
        if not keyed.value(name):
            return None  # it may read a tensor needing a gradient: left to onnx-ad
        found = folder.value(name)
        if found is None and evaluate is not None:
            found = evaluate(model, name)
        return None if found is None or found.size != 1 else found.reshape(-1)[0]

    if node.op_type == "If":
        taken = value(node.input[0])
        return None if taken is None else bool(taken)
    # A Loop: a trip count known at the call, a condition that stays true.
    body = attr(node, "body")
    if not node.input[0] or not _always_true(body):
        return None
    if len(node.input) > 1 and node.input[1]:
        keep_going = value(node.input[1])
        if keep_going is None or not bool(keep_going):
            return None
    count = value(node.input[0])
    if count is None or not 0 < int(count) <= MAX_UNROLLED:
        return None
    if int(count) * len(body.node) > MAX_UNROLLED_NODES:
        return None
    return int(count)


#: Ops whose output shapes follow from their operands' shapes (and attributes) alone.
_SHAPE_BY_SHAPES = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Relu", "Sigmoid", "Tanh", "Sqrt", "Exp",
        "Log", "Abs", "Neg", "Erf", "Softmax", "LogSoftmax", "Cast", "CastLike", "Identity",
        "Where", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And",
        "Or", "Xor", "Clip", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "Gelu",
        "Softplus", "Sin", "Cos", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Min", "Max",
        "Sum", "Mean", "PRelu", "Conv", "MatMul", "Gemm", "Transpose", "BatchNormalization",
        "InstanceNormalization", "LayerNormalization", "LSTM", "GRU", "RNN", "MaxPool",
        "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "Flatten", "Dropout",
        "Shape", "Size", "Gather", "GatherElements", "Einsum",
    }
)  # fmt: skip
#: Ops whose first operand's shape and other operands' values give the output shape.
_SHAPE_BY_SETTINGS = frozenset(
    {
        "Pad", "Reshape", "Slice", "Expand", "Tile", "Squeeze", "Unsqueeze", "Resize",
        "Upsample", "Split", "TopK", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
        "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare",
    }
)  # fmt: skip


class _Keyed:
    """Which main-graph tensors a call's key decides: their values (or shapes)
    follow from the input shapes, the deciding inputs' values and constants.

    A condition that is not keyed may read a value needing a gradient, or
    another the key does not hold: its If is left as it is.
    """

    def __init__(self, model, deciding):
        graph = model.graph
        self.inputs = {i.name for i in graph.input}
        self.constants = {t.name for t in graph.initializer} - self.inputs
        self.deciding = set(deciding)
        self.producer = {out: node for node in graph.node for out in node.output}
        self._values, self._shapes = {}, {}

    def value(self, name: str) -> bool:
        if name not in self._values:
            self._values[name] = False  # a cycle (none in a valid graph) decides nothing
            self._values[name] = self._value(name)
        return self._values[name]

    def _value(self, name):
        if name in self.deciding or name in self.constants:
            return True
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx") or "Random" in node.op_type:
            return False
        if node.op_type in ("Shape", "Size"):
            return self.shape(node.input[0])
        return all(self.value(n) for n in node_reads(node))

    def shape(self, name: str) -> bool:
        if name not in self._shapes:
            self._shapes[name] = False
            self._shapes[name] = self._shape(name)
        return self._shapes[name]

    def _shape(self, name):
        if name in self.inputs or name in self.constants:
            return True
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return False
        if node.op_type == "Constant":
            return True
        reads = [n for n in node.input if n]
        if node.op_type in _SHAPE_BY_SHAPES and len(reads) == len(node_reads(node)):
            return all(self.shape(n) for n in reads)
        if node.op_type in _SHAPE_BY_SETTINGS and node.input and node.input[0]:
            settings = [n for n in node.input[1:] if n]
            return self.shape(node.input[0]) and all(self.value(n) for n in settings)
        return self.value(name)


def _opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return max(versions, default=1)


class Folder:
    """Values of main-graph tensors that constants, deciding inputs and static
    shapes decide (None for the others)."""

    def __init__(self, model, values, shapes, opset):
        self.graph, self.shapes, self.opset = model.graph, shapes, opset
        self.values = {k: np.asarray(v) for k, v in values.items()}
        self.protos = {t.name: t for t in model.graph.initializer}
        self.producer = {out: node for node in model.graph.node for out in node.output}

    def value(self, name: str, depth: int = 0):
        if name in self.values:
            return self.values[name]
        found = None
        if name in self.protos:
            proto = self.protos[name]
            if int(np.prod(proto.dims)) <= _SMALL:
                found = numpy_helper.to_array(proto)
        elif name in self.producer and depth < 32:
            found = self._computed(self.producer[name], name, depth)
        self.values[name] = found
        return found

    def _static(self, name):
        shape = self.shapes.get(name)
        return None if shape is None or None in shape else shape

    def _computed(self, node, name, depth):
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return _constant(node)
        if node.op_type == "Shape":
            shape = self._static(node.input[0])
            if shape is None:
                return None
            rank = len(shape)
            start, end = attr(node, "start", 0), attr(node, "end", rank)
            return np.asarray(shape, np.int64)[slice(start, end)]
        if node.op_type == "Size":
            shape = self._static(node.input[0])
            return None if shape is None else np.asarray(int(np.prod(shape)), np.int64)
        if node.op_type == "Gather" and node.input[0] in self.producer:
            picked = self._known_dims(node)
            if picked is not None:
                return picked
        if node.op_type not in _FOLDED:
            return None
        operands = [self.value(n, depth + 1) if n else None for n in node.input]
        if any(v is None for v, n in zip(operands, node.input) if n):
            return None
        if sum(v.size for v in operands if v is not None) > _SMALL:
            return None
        if node.op_type == "ConstantOfShape" and np.prod(operands[0]) > _SMALL:
            return None
        results = _evaluate(node, operands, self.opset)
        if results is None:
            return None
        for out, result in zip(node.output, results):
            self.values[out] = np.asarray(result)
        return self.values[name]

    def _known_dims(self, gather):
        """``Gather(Shape(x), k)`` where the dims picked are known, the others not."""
        shape_node = self.producer[gather.input[0]]
        if shape_node.op_type != "Shape" or attr(gather, "axis", 0) != 0:
            return None
        shape = self.shapes.get(shape_node.input[0])
        indices = self.value(gather.input[1])
        if shape is None or indices is None or indices.dtype.kind not in "iu":
            return None
        rank = len(shape)
        start = attr(shape_node, "start", 0)
        dims = list(shape)[slice(start, attr(shape_node, "end", rank))]
        if not all(-len(dims) <= k < len(dims) for k in indices.reshape(-1)):
            return None
        picked = [dims[k] for k in indices.reshape(-1)]
        if None in picked:
            return None
        return np.asarray(picked, np.int64).reshape(indices.shape)


def _constant(node):
    if not node.attribute:
        return None
    a = node.attribute[0]
    value = helper.get_attribute_value(a)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if a.name in ("value_int", "value_ints"):
        return np.asarray(value, np.int64)
    if a.name in ("value_float", "value_floats"):
        return np.asarray(value, np.float32)
    return None


def _evaluate(node, operands, opset):
    """``node``'s outputs on ``operands`` by onnx's reference evaluator (None if it fails)."""
    from onnx.reference import ReferenceEvaluator

    feeds = {f"in{k}": v for k, v in enumerate(operands) if v is not None}
    probe = onnx.NodeProto()
    probe.CopyFrom(node)
    del probe.input[:], probe.output[:]
    probe.input.extend(f"in{k}" if v is not None else "" for k, v in enumerate(operands))
    probe.output.extend(f"out{k}" for k in range(len(node.output)))
    graph = helper.make_graph(
        [probe],
        "fold",
        [helper.make_tensor_value_info(k, elem_type(v.dtype), v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, 0, None) for o in probe.output],
    )
    folded = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        return ReferenceEvaluator(folded).run(None, feeds)
    except Exception:  # not decided here: the If stays
        return None


def _inline(graph: onnx.GraphProto, index: int, taken: bool) -> None:
    """Replace ``graph.node[index]`` (an If) by the nodes of the branch it takes.

    Names the branch defines that the rest of the model uses too are made
    unique (sibling subgraphs may reuse names; one graph may not); reads of
    outer names stay. The branch's outputs are copied to the If's outputs by
    Identity nodes; its initializers become Constant nodes (a main-graph float
    initializer would become a weight).
    """
    node = graph.node[index]
    branch = onnx.GraphProto()
    branch.CopyFrom(attr(node, "then_branch" if taken else "else_branch"))
    taken_names = _all_names_deep(graph, skip=node)
    renamed = {}
    for name in sorted(_defined_deep(branch)):
        if name in taken_names:
            renamed[name] = _unique(name, taken_names)
        else:
            taken_names.add(name)
    if renamed:
        _rename(branch, renamed)
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in branch.initializer]
    nodes.extend(branch.node)
    used = set()
    for new in nodes:
        # Names unique in the branch only: an adjoint If copies names too.
        new.name = _unique(new.name, used | taken_names) if new.name else ""
        used.add(new.name)
    nodes.extend(
        helper.make_node("Identity", [value.name], [out])
        for value, out in zip(branch.output, node.output)
    )
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend(kept[:index] + nodes + kept[index + 1 :])


def _always_true(body: onnx.GraphProto) -> bool:
    """Whether a Loop body's condition output is its condition input or a constant true."""
    out, given = body.output[0].name, body.input[1].name
    producer = {o: n for n in body.node for o in n.output}
    while out in producer and producer[out].op_type == "Identity":
        out = producer[out].input[0]
    if out == given:
        return True
    node = producer.get(out)
    value = _constant(node) if node is not None and node.op_type == "Constant" else None
    return value is not None and value.size == 1 and bool(value.reshape(-1)[0])


def _unroll(graph: onnx.GraphProto, index: int, count: int) -> None:
    """Replace ``graph.node[index]`` (a Loop) by ``count`` copies of its body.

    Each copy's names are made unique; the step number and the condition
    become constants; loop-carried values pass from copy to copy, scan
    outputs are stacked on a new first axis. Reads of outer names stay.
    """
    node = graph.node[index]
    body = attr(node, "body")
    n_carried = len(node.input) - 2
    taken = _all_names_deep(graph, skip=node)
    carried = list(node.input[2:])
    pieces: list[list[str]] = [[] for _ in body.output[1 + n_carried :]]
    nodes = []
    defined = sorted(_defined_deep(body) - {v.name for v in body.input})
    for step in range(count):
        renamed = {name: _unique(name, taken) for name in defined}
        step_name = _unique(f"{node.output[0]}_step", taken)
        keep_going = _unique(f"{node.output[0]}_true", taken)
        renamed[body.input[0].name] = step_name
        renamed[body.input[1].name] = keep_going
        renamed.update((v.name, c) for v, c in zip(body.input[2:], carried))
        copy = onnx.GraphProto()
        copy.CopyFrom(body)
        _rename(copy, renamed)
        nodes.append(_constant_node(step_name, np.array(step, np.int64)))
        nodes.append(_constant_node(keep_going, np.array(True)))
        nodes.extend(_constant_node(t.name, numpy_helper.to_array(t)) for t in copy.initializer)
        for new in copy.node:
            new.name = _unique(new.name, taken) if new.name else ""
            nodes.append(new)
        outputs = [o.name for o in copy.output]
        carried = outputs[1 : 1 + n_carried]
        for piece, name in zip(pieces, outputs[1 + n_carried :]):
            piece.append(name)
    nodes.extend(
        helper.make_node("Identity", [value], [out]) for value, out in zip(carried, node.output)
    )
    axis = _unique(f"{node.output[0]}_axis", taken)
    if pieces:
        nodes.append(_constant_node(axis, np.array([0], np.int64)))
    for piece, out in zip(pieces, node.output[n_carried:]):
        stacked = []
        for name in piece:
            stacked.append(_unique(f"{name}_stacked", taken))
            nodes.append(helper.make_node("Unsqueeze", [name, axis], [stacked[-1]]))
        nodes.append(helper.make_node("Concat", stacked, [out], axis=0))
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend(kept[:index] + nodes + kept[index + 1 :])


def _constant_node(name, array):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _all_names_deep(graph, skip=None) -> set[str]:
    names = _all_names(graph)
    for node in graph.node:
        if node is not skip:
            for sub in subgraphs(node):
                names |= _all_names_deep(sub)
    return names


def _defined_deep(graph) -> set[str]:
    """Names ``graph`` and its subgraphs define (not the ones they read)."""
    names = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    for node in graph.node:
        names.update(o for o in node.output if o)
        for sub in subgraphs(node):
            names |= _defined_deep(sub)
    return names


def _rename(graph, renamed) -> None:
    """Apply ``renamed`` to every name ``graph`` (and its subgraphs) defines or reads."""
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        value.name = renamed.get(value.name, value.name)
    for init in graph.initializer:
        init.name = renamed.get(init.name, init.name)
    for node in graph.node:
        for seq in (node.input, node.output):
            for k, name in enumerate(seq):
                if name in renamed:
                    seq[k] = renamed[name]
        for sub in subgraphs(node):
            _rename(sub, renamed)
