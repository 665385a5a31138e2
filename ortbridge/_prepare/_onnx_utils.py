"""Small helpers shared by every module that builds ONNX graphs.

onnxruntime-training 1.19.2 loads IR version <= 10 and ai.onnx opset <= 21,
while recent onnx releases write newer IR versions by default: every graph
ortbridge builds goes through :func:`make_model` to pin both.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Highest IR version onnxruntime 1.19.2 loads.
IR_VERSION = 10
#: ai.onnx opset of the graphs ortbridge builds itself.
OPSET = 18

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


def make_model(graph: onnx.GraphProto, opset: int = OPSET, extra_opsets=None) -> onnx.ModelProto:
    """Wrap ``graph`` in a model whose IR version and opsets onnxruntime 1.19.2 accepts."""
    opsets = [helper.make_opsetid("", opset)]
    for domain, version in (extra_opsets or {}).items():
        opsets.append(helper.make_opsetid(domain, version))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="ortbridge")
    model.ir_version = IR_VERSION
    return model


def set_input_shapes(model: onnx.ModelProto, shapes: dict) -> None:
    """Declare the graph inputs named in ``shapes`` (name -> sizes) with those sizes, in place.

    A size given as a string declares a symbolic dimension of that name.
    """
    for value in model.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for size in shapes[value.name]:
                if isinstance(size, str):
                    dims.add().dim_param = size
                else:
                    dims.add().dim_value = size


def attr(node: onnx.NodeProto, name: str, default=None):
    """The value of attribute ``name`` of ``node`` (strings decoded), or ``default``."""
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def elem_type(dtype) -> int:
    """ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class NodeBuilder:
    """Nodes computing on tensors of one element type, collected in :attr:`nodes`.

    ``fresh(base)`` returns an unused tensor name; outputs are named
    ``fresh(prefix + op)``. Scalar constants are ``Constant`` nodes, one per
    value, not initializers: in a graph :class:`~ortbridge.OnnxModule` loads,
    a float initializer would become a weight.
    """

    def __init__(self, elem: int, fresh: Callable[[str], str], prefix: str = ""):
        self.elem, self.fresh, self.prefix = elem, fresh, prefix
        self.nodes: list[onnx.NodeProto] = []
        self._constants: dict[float, str] = {}

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        """Append one node; returns its (only) output."""
        out = out or self.fresh(f"{self.prefix}{op_type.lower()}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value: float) -> str:
        if value not in self._constants:
            array = np.array(value, dtype=np_dtype(self.elem))
            self._constants[value] = self.op("Constant", value=numpy_helper.from_array(array))
        return self._constants[value]

    def mask(self, comparison: str, x: str, bound: float) -> str:
        """1 where ``x <comparison> bound``, else 0; no gradient flows through it."""
        return self.op("Cast", self.op(comparison, x, self.const(bound)), to=self.elem)

    def replacing(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """The nodes, the last one taking over ``node``'s output and name."""
        self.nodes[-1].output[0] = node.output[0]
        self.nodes[-1].name = node.name
        return self.nodes


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies ``node`` holds in its attributes (an If's branches, a Loop's body)."""
    found = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            found.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            found.extend(a.graphs)
    return found


def all_graphs(graph: onnx.GraphProto):
    """``graph`` and every subgraph in it, outer ones first."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph body reads from its enclosing scopes."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    reads = set()
    for node in graph.node:
        for name in node_reads(node):
            if name not in defined:
                reads.add(name)
        defined.update(node.output)
    for out in graph.output:
        if out.name not in defined:
            reads.add(out.name)
    return reads


#: Default-domain ops whose attributes may hold a graph.
_WITH_BODIES = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The tensors ``node`` reads, including those its subgraphs read from outside."""
    names = [n for n in node.input if n]
    if node.op_type not in _WITH_BODIES and node.domain in ("", "ai.onnx"):
        return names  # no body: the attributes need no look (most nodes, every pass)
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            names.extend(sorted(subgraph_reads(attr.g)))
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for g in attr.graphs:
                names.extend(sorted(subgraph_reads(g)))
    return names


def ancestors(producer: dict, names, opaque=()) -> tuple[set[str], list[onnx.NodeProto]]:
    """The tensors ``names`` depend on (themselves included) and the nodes computing them.

    ``producer`` maps a tensor to its node. The walk reaches a node of an op
    type in ``opaque`` but not what it reads (a ``Shape`` reads no values).
    """
    seen, nodes, stack = set(), [], list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            nodes.append(node)
            if node.op_type not in opaque:
                stack.extend(node_reads(node))
    return seen, nodes


def drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Remove the initializers no node and no graph output reads (onnxruntime
    warns about each on stderr when it loads the graph)."""
    read = {o.name for o in graph.output}
    for node in graph.node:
        read.update(node_reads(node))
    kept = [i for i in graph.initializer if i.name in read]
    if len(kept) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def gradient_path(model: onnx.ModelProto, targets, outputs) -> list[onnx.NodeProto]:
    """Nodes between a tensor in ``targets`` and one of ``outputs``, in graph order."""
    nodes = list(model.graph.node)
    reached = set(targets)
    for node in nodes:
        if any(n in reached for n in node_reads(node)):
            reached.update(node.output)
    needed = set(outputs)
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            needed.update(node_reads(node))
    return [
        node
        for node in nodes
        if any(o in needed for o in node.output) and any(n in reached for n in node_reads(node))
    ]


def topological(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in an order where producers come first (exporters usually comply);
    among the nodes ready at a time, file order. Linear in the graph's size (a
    scan per round took 0.6 s of MobileViT's construction)."""
    produced = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    nodes = list(graph.node)
    unmet = []
    waiting: dict[str, list[int]] = {}
    ready: list[int] = []
    for index, node in enumerate(nodes):
        missing = {i for i in node.input if i not in produced}
        unmet.append(len(missing))
        for name in missing:
            waiting.setdefault(name, []).append(index)
        if not missing:
            ready.append(index)
    heapq.heapify(ready)
    ordered, done = [], set()
    while ready:
        index = heapq.heappop(ready)
        ordered.append(nodes[index])
        done.add(index)
        for name in nodes[index].output:
            for reader in waiting.pop(name, ()):
                unmet[reader] -= 1
                if unmet[reader] == 0:
                    heapq.heappush(ready, reader)
    # inputs from an outer scope or a cycle: the rest in file order
    ordered.extend(node for index, node in enumerate(nodes) if index not in done)
    return ordered
