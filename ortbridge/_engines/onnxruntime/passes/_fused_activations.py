"""Activations spelled out in standard ops, as one ``com.microsoft`` kernel each.

Exporters below opset 20 write ``nn.GELU()`` as
``0.5 * x * (1 + Erf(x / sqrt(2)))`` (TorchScript: ``Div``, ``Erf``, ``Add``,
``Mul``, ``Mul``), and ``nn.SiLU()`` as ``x * Sigmoid(x)``. Differentiated
node by node, the backward reads the intermediates, each the size of the
activation (four for a GELU, two for a SiLU), where torch keeps the input
only; the forward runs a kernel per node. onnxruntime's contrib kernels
(float, in every build, CPU and CUDA) compute each in one: ``Gelu`` (the
exact form) and ``QuickGelu`` (``x * Sigmoid(alpha * x)``, a SiLU with
``alpha = 1``). onnx-ad's rule for ``Gelu`` (by op type; the contrib op has no
``approximate``) and ortbridge's for ``QuickGelu``
(:mod:`.._rules`) give the derivative from the input alone, so the forward saves
``x`` only.

Matched where each intermediate has one reader and is no graph output, the
constants are sqrt(2) (or its inverse as a ``Mul``), 1 and 0.5 to float32
precision, and ``x`` is float32.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper, numpy_helper

_MS = "com.microsoft"
_TOLERANCE = 1e-6


def fused_activations(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s spelled-out GELUs and SiLUs in place; how many were fused."""
    graph = model.graph
    if not any(n.op_type in ("Erf", "Sigmoid") for n in graph.node):
        return 0
    constants = {i.name: i for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def only_reader(name):
        """The one node reading ``name``, which no graph output is; else None."""
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    types, shapes = _float_types(model)
    replaced: dict[int, onnx.NodeProto | None] = {}  # id(node) -> its replacement or None
    for anchor in graph.node:
        if anchor.domain:
            continue
        if anchor.op_type == "Erf":
            match = _match_gelu(anchor, producer, only_reader, constants)
            op, attrs = "Gelu", {}
        elif anchor.op_type == "Sigmoid":
            match = _match_silu(anchor, only_reader)
            op, attrs = "QuickGelu", {"alpha": 1.0}
        else:
            continue
        if match is None or types.get(match[0]) != onnx.TensorProto.FLOAT:
            continue
        x, nodes = match
        if any(id(n) in replaced for n in nodes):
            continue
        last = nodes[-1]
        name = f"{last.name or last.output[0]}/{op.lower()}"
        fused = helper.make_node(op, [x], [last.output[0]], name=name, domain=_MS, **attrs)
        for n in nodes:
            replaced[id(n)] = None
        replaced[id(last)] = fused
        # onnx's shape inference does not know the contrib ops: what they
        # return is declared (x's type and shape).
        declared = onnx.ValueInfoProto()
        if x in shapes:
            declared.CopyFrom(shapes[x])
        declared.name = last.output[0]
        declared.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        graph.value_info.append(declared)
    if not replaced:
        return 0
    kept = []
    for node in graph.node:
        if id(node) not in replaced:
            kept.append(node)
        elif replaced[id(node)] is not None:
            kept.append(replaced[id(node)])
    del graph.node[:]
    graph.node.extend(kept)
    if not any(o.domain == _MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS, 1))
    return sum(1 for n in replaced.values() if n is not None)


def _match_silu(sigmoid, only_reader):
    """``(x, nodes)`` of ``x * Sigmoid(x)`` around ``sigmoid``; or None."""
    x, s = sigmoid.input[0], sigmoid.output[0]
    product = only_reader(s)
    if product is None or product.op_type != "Mul" or product.domain:
        return None
    return (x, [sigmoid, product]) if sorted(product.input) == sorted([x, s]) else None


def _match_gelu(erf, producer, only_reader, constants):
    """``(x, nodes)`` of the GELU around ``erf``, nodes in graph order of use; or None."""

    def other(node, name):
        if len(node.input) != 2 or node.domain:
            return None
        a, b = node.input
        return b if a == name else a if b == name else None

    def is_value(name, value):
        tensor = constants.get(name)
        if tensor is None:
            return False
        array = numpy_helper.to_array(tensor)
        return array.size == 1 and abs(float(array.ravel()[0]) - value) <= _TOLERANCE * value

    scaled = producer.get(erf.input[0])
    if scaled is None or scaled.domain or only_reader(scaled.output[0]) is not erf:
        return None
    if scaled.op_type == "Div" and is_value(scaled.input[1], math.sqrt(2)):
        x = scaled.input[0]
    elif scaled.op_type == "Mul":
        x = next((i for i in scaled.input if is_value(other(scaled, i), math.sqrt(0.5))), None)
        if x is None:
            return None
    else:
        return None
    plus = only_reader(erf.output[0])
    if plus is None or plus.op_type != "Add" or not is_value(other(plus, erf.output[0]), 1.0):
        return None
    second = only_reader(plus.output[0])
    if second is None or second.op_type != "Mul":
        return None
    factor = other(second, plus.output[0])
    if factor == x:  # x * (1 + erf), then * 0.5
        last = only_reader(second.output[0])
        if last is None or last.op_type != "Mul":
            return None
        if not is_value(other(last, second.output[0]), 0.5):
            return None
        return x, [scaled, erf, plus, second, last]
    half = producer.get(factor)  # (0.5 * x) * (1 + erf)
    if half is None or half.op_type != "Mul" or only_reader(factor) is not second:
        return None
    if other(half, x) is None or not is_value(other(half, x), 0.5):
        return None
    return x, [half, scaled, erf, plus, second]


def _float_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    """Element types and value infos of the graph's tensors, from onnx's shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return {}, {}
    g = inferred.graph
    types = {i.name: i.data_type for i in g.initializer}
    infos = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
        infos[vi.name] = vi
    return types, infos


def declare_fused_outputs(source: onnx.ModelProto, target: onnx.ModelProto) -> None:
    """Copy ``source``'s declarations of its com.microsoft nodes' outputs (the
    fused activations', and those of a fused node left as it is) into
    ``target`` (onnx-ad's reverse model leaves them out, and onnx's shape
    inference cannot give them)."""
    outputs = {out for n in target.graph.node if n.domain == _MS for out in n.output if out}
    if not outputs:
        return
    known = {vi.name for vi in target.graph.value_info}
    for vi in source.graph.value_info:
        if vi.name in outputs and vi.name not in known:
            target.graph.value_info.append(vi)
