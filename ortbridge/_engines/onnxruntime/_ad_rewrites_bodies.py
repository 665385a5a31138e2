"""Control flow prepared for onnx-ad: part of :func:`._ad_rewrites.prepare_for_reverse`.

onnx-ad differentiates ``If``, ``Loop`` and ``Scan`` by their bodies, and
onnxruntime must then load what it writes. :func:`rewrite_bodies` makes a
constant-condition ``If`` the branch it takes, unnames the other ``If``
nodes, and in subgraph bodies rewrites ``CastLike`` and ``Slice`` with
computed bounds, scope by scope (outer constants are visible inside).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._lookup import Names, _all_names, _unique
from ortbridge._prepare._onnx_utils import (
    FLOAT_TYPES,
    NodeBuilder,
    all_graphs,
    attr,
    elem_type,
    subgraphs,
)

from ._ad_rewrites_conv import copy_node, ints


def _opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return max(versions, default=1)


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # onnx-ad then meets the unknown shapes, and names them
        return model


def rewrite_bodies(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its control flow prepared for onnx-ad (and onnxruntime).

    - An ``If`` whose condition is a constant becomes the branch it takes:
      onnxruntime's ConstantFolding kills the process inlining some of them
      (dynamo's EmbeddingBag mode dispatch, and the graphs onnx-ad makes of it).
    - Other ``If`` nodes lose their name: onnx-ad's adjoint ``If`` copies it,
      and onnxruntime refuses two nodes of one name.
    - In subgraph bodies, ``CastLike`` and Slices with computed bounds (the
      main graph's are :func:`._ad_rewrites._rewrite`'s).
    """
    if not any(subgraphs(node) for node in model.graph.node):
        return model
    model = _inferred(model)
    types, shapes, taken = {}, {}, Names()
    for graph in all_graphs(model.graph):
        for value in list(graph.input) + list(graph.output) + list(graph.value_info):
            tensor = value.type.tensor_type
            if value.type.HasField("tensor_type") and tensor.elem_type:
                types[value.name] = tensor.elem_type
            if value.type.HasField("tensor_type") and tensor.HasField("shape"):
                shapes[value.name] = [d.dim_value or None for d in tensor.shape.dim]
        for init in graph.initializer:
            types[init.name], shapes[init.name] = init.data_type, list(init.dims)
        taken |= _all_names(graph) | {value.name for value in graph.input}
    _Bodies(types, shapes, lambda base: _unique(base, taken), _opset(model)).graph(
        model.graph, _Scope(model.graph, None), main=True
    )
    return model


class _Scope:
    """Constant values visible in one graph, read lazily (outer scopes included)."""

    def __init__(self, graph: onnx.GraphProto, outer: _Scope | None):
        self.outer = outer
        self.protos = {t.name: t for t in graph.initializer}
        self.values: dict[str, np.ndarray] = {}
        self.producers: dict[str, onnx.NodeProto] = {}

    def get(self, name: str):
        if name in self.values:
            return self.values[name]
        if name in self.protos:
            self.values[name] = numpy_helper.to_array(self.protos[name])
            return self.values[name]
        return self.outer.get(name) if self.outer is not None else None

    def add(self, node: onnx.NodeProto) -> None:
        for out in node.output:
            self.producers[out] = node
        if node.op_type == "Constant" and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            if isinstance(value, onnx.TensorProto):
                self.values[node.output[0]] = numpy_helper.to_array(value)
            elif node.attribute[0].name in ("value_int", "value_ints"):
                self.values[node.output[0]] = np.asarray(value, np.int64)
            elif node.attribute[0].name in ("value_float", "value_floats"):
                self.values[node.output[0]] = np.asarray(value, np.float32)


#: Ops whose results on a few constant scalars decide an If (none makes a large tensor).
_FOLDED = frozenset(
    {
        "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not",
        "Cast", "CastLike", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Add", "Sub", "Mul",
        "Neg", "Abs", "Min", "Max", "Gather", "Concat", "Slice", "Size",
    }
)  # fmt: skip


class _Bodies:
    """The rewrites of :func:`rewrite_bodies`, graph by graph, outer scopes first."""

    _SMALL = 64  # elements: a condition is computed from a few scalars

    def __init__(self, types, shapes, fresh, opset):
        self.types, self.shapes, self.fresh, self.opset = types, shapes, fresh, opset

    def graph(self, graph: onnx.GraphProto, scope: _Scope, main: bool) -> None:
        """Rewrite ``graph``'s nodes (and its subgraphs') in place."""
        nodes = []
        for node in graph.node:
            for new in self.node(node, scope, main):
                scope.add(new)
                nodes.append(new)
        del graph.node[:]
        graph.node.extend(nodes)

    def node(self, node, scope, main) -> list[onnx.NodeProto]:
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            condition = self.value(node.input[0], scope)
            if condition is not None and condition.size == 1:
                return self.inline(node, bool(condition.reshape(-1)[0]), scope, main)
            node.name = ""  # onnx-ad's adjoint If copies the name: two nodes would have it
        for sub in subgraphs(node):
            self.graph(sub, _Scope(sub, scope), main=False)
        if main or node.domain not in ("", "ai.onnx"):
            return [node]
        if node.op_type == "CastLike" and self.types.get(node.input[1]):
            to = self.types[node.input[1]]
            return [helper.make_node("Cast", node.input[:1], node.output, node.name, to=to)]
        if node.op_type == "Slice":
            b = NodeBuilder(TensorProto.INT64, self.fresh, f"{node.output[0]}_")
            new = _computed_slice(node, b, self.types, self.shapes, scope.get)
            if new is not None:
                return new
        return [node]

    def inline(self, node, taken: bool, scope, main) -> list[onnx.NodeProto]:
        """The nodes of the branch an If takes, its outputs renamed to the If's.

        They lose their names, unique only in the branch.
        """
        branch = onnx.GraphProto()
        branch.CopyFrom(attr(node, "then_branch" if taken else "else_branch"))
        self.graph(branch, _Scope(branch, scope), main)
        nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in branch.initializer]
        nodes.extend(branch.node)
        for inlined in nodes:
            inlined.name = ""
        nodes.extend(
            helper.make_node("Identity", [value.name], [out])
            for value, out in zip(branch.output, node.output)
        )
        return nodes

    def value(self, name, scope, depth=0):
        """The value of ``name`` where a few constant scalars decide it, else None."""
        known = scope.get(name)
        if known is not None or depth > 8:
            return known
        producer, level = None, scope
        while level is not None and producer is None:
            producer, level = level.producers.get(name), level.outer
        if producer is None or producer.op_type not in _FOLDED or producer.domain:
            return None
        operands = [self.value(n, scope, depth + 1) if n else None for n in producer.input]
        if any(v is None for v, n in zip(operands, producer.input) if n):
            return None
        if sum(v.size for v in operands if v is not None) > self._SMALL:
            return None
        from onnx.reference import ReferenceEvaluator

        feeds = {f"in{k}": v for k, v in enumerate(operands) if v is not None}
        inputs = [f"in{k}" if n else "" for k, n in enumerate(producer.input)]
        probe = copy_node(producer, inputs)
        del probe.output[:]
        probe.output.extend(f"out{k}" for k in range(len(producer.output)))
        graph = helper.make_graph(
            [probe],
            "probe",
            [
                helper.make_tensor_value_info(k, elem_type(v.dtype), v.shape)
                for k, v in feeds.items()
            ],
            [helper.make_tensor_value_info(o, 0, None) for o in probe.output],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        try:
            results = ReferenceEvaluator(model).run(None, feeds)
        except Exception:
            return None
        for out, result in zip(producer.output, results):
            scope.values[out] = np.asarray(result)
        return scope.values[name]


def _computed_slice(node, b, types, shapes, constant):
    """A Slice with bounds computed at run time as Gathers of Ranges (steps of 1).

    ``constant(name)``: the value of a constant, else None.
    """
    x, starts, ends, axes, steps = list(node.input) + [""] * (5 - len(node.input))
    if types.get(x) not in FLOAT_TYPES or not ends:
        return None
    if constant(starts) is not None and constant(ends) is not None:
        return None  # onnx-ad's own rule
    if steps and not (constant(steps) is not None and np.all(constant(steps) == 1)):
        return None
    count, dims = shapes.get(starts), shapes.get(x)
    count = count[0] if count and len(count) == 1 else None
    if axes:
        if constant(axes) is None:
            return None
        axes, padded = [int(a) for a in constant(axes).reshape(-1)], False
    elif count or dims:
        # Bounds of an unknown length k <= rank are the leading axes': the others are whole.
        axes, padded = list(range(count or len(dims))), not count
    else:
        return None

    def scalar(value):
        return b.op("Constant", value=numpy_helper.from_array(np.array(value, np.int64)))

    starts = b.op("Cast", starts, to=TensorProto.INT64)
    ends = b.op("Cast", ends, to=TensorProto.INT64)
    if padded:
        n, cut = len(axes), ints(b, [len(axes)])
        whole = ints(b, [0] * n), ints(b, [np.iinfo(np.int64).max] * n)
        starts, ends = (
            b.op("Slice", b.op("Concat", given, rest, axis=0), ints(b, [0]), cut)
            for given, rest in zip((starts, ends), whole)
        )
    zero, one, shape = scalar(0), scalar(1), b.op("Shape", x)
    for k, axis in enumerate(axes):
        extent = b.op("Gather", shape, scalar(axis))

        def bound(bounds, k=k, extent=extent):
            value = b.op("Gather", bounds, scalar(k))
            wrapped = b.op("Where", b.op("Less", value, zero), b.op("Add", value, extent), value)
            return b.op("Min", b.op("Max", wrapped, zero), extent)

        indices = b.op("Range", bound(starts), bound(ends), one)
        x = b.op("Gather", x, indices, axis=axis)
    return b.replacing(node)
