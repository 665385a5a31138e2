"""Dynamically quantized files: ``MatMulInteger`` / ``ConvInteger`` read as float ops between pairs.

onnxruntime's ``quantize_dynamic`` keeps int8 weights and quantizes each
activation at run time (``DynamicQuantizeLinear``: a uint8 scale and zero
point from the tensor's range); the integer product is cast to float and
multiplied by ``activation_scale * weight_scale``. :func:`dynamic_as_pairs`
writes each ``*Integer`` node, its ``Cast`` and that ``Mul`` as the float op
of the ``DequantizeLinear`` of both operands (the activation's reading the
``DynamicQuantizeLinear``'s scale and zero point): the same product, summed
in float32 rather than in int32 (an output differs by float rounding). Then
:mod:`._lift` trains the weights under fake quantization; the activations'
dynamic pairs pass the gradient straight through (their range is the
tensor's own: nothing is clipped). The lift keeps the ``*Integer`` nodes,
each reading its weight's ``QuantizeLinear``, so inference runs the file's
kernels; the engine's gradient graph reads them in float
(:func:`integer_products_as_pairs`), as it reads ``DynamicQuantizeLSTM``.
A ``MatMulInteger`` weight scaled per
column (``quantize_dynamic(..., per_channel=True)``) is read per axis. A saved
file keeps the integer nodes.
onnxruntime's optimiser fuses them into com.microsoft ``DynamicQuantizeMatMul``
and ``MatMulIntegerToFloat``, read the same way; on a file the transformer
optimizer fused first, ``quantize_dynamic`` writes com.microsoft
``QAttention`` and ``QEmbedLayerNormalization``, read as ``Attention`` and
``EmbedLayerNormalization`` of their operands' ``DequantizeLinear`` (the
fused-op decompositions then differentiate those).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from .._lookup import _all_names, _unique
from ._qoperators import dequantize_linear

_STANDARD = ("", "ai.onnx")
_FLOAT_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}


def _matches(model: onnx.ModelProto):
    """(integer node, its Cast, its Mul, the activation's DynamicQuantizeLinear,
    the weight scale's name) for each node written exactly."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for node in graph.node:
        if node.op_type not in _FLOAT_OPS or node.domain not in _STANDARD:
            continue
        dynamic = producer.get(node.input[0])
        if dynamic is None or dynamic.op_type != "DynamicQuantizeLinear":
            continue
        source = _weight_source(node.input[1], producer, inits)
        if source is None:
            continue
        lifted = isinstance(source, onnx.NodeProto)  # (its settings may be graph inputs)
        if not lifted and len(node.input) > 3 and node.input[3] not in inits:
            continue
        # onnx's older quantizer adds the bias in int32 first: the float bias
        # divided by the product's scale, floored (read here as the float bias)
        add = _only_reader(readers, node.output[0], "Add")
        bias = rounded_bias(add, node.output[0], producer, inits) if add is not None else ""
        if bias is None:
            continue
        cast = _only_reader(readers, (add or node).output[0], "Cast")
        mul = _only_reader(readers, cast.output[0], "Mul") if cast is not None else None
        if mul is None:
            continue
        scales = producer.get(next((i for i in mul.input if i != cast.output[0]), ""))
        if scales is None or scales.op_type != "Mul" or dynamic.output[1] not in scales.input:
            continue
        weight_scale = next((i for i in scales.input if i != dynamic.output[1]), "")
        axis = _weight_axis(node, inits, weight_scale, source)
        if axis is not False:
            yield node, cast, mul, dynamic, weight_scale, axis, add, bias


def rounded_bias(add, product: str, producer, inits) -> str | None:
    """The float bias initializer an integer ``Add`` adds to ``product`` as
    ``Cast(Floor(bias / scale))`` (reshaped or not); None for another form."""
    other = next((i for i in add.input if i != product), "")
    node = producer.get(other)
    if node is not None and node.op_type == "Reshape":
        node = producer.get(node.input[0])
    chain = []
    for op in ("Cast", "Floor", "Div"):
        if node is None or node.op_type != op:
            return None
        chain.append(node)
        node = producer.get(node.input[0])
    bias = chain[-1].input[0]
    if bias in inits and len(inits[bias].dims) != 1:
        return None
    return bias  # (an input of the engine's graphs, where the weights are fed)


def _weight_source(name: str, producer, inits) -> str | onnx.NodeProto | None:
    """An integer product's weight: its integers' initializer, or (lifted,
    :mod:`._lift`) the ``QuantizeLinear`` rounding the float weight (an
    initializer, or an input of the engine's graphs)."""
    if name in inits:
        return name
    quantize = producer.get(name)
    return quantize if quantize is not None and quantize.op_type == "QuantizeLinear" else None


def _weight_axis(node: onnx.NodeProto, inits, weight_scale: str, source):
    """None: one scale a weight (``quantize_dynamic``'s default); the weight's
    last axis: a ``MatMulInteger`` scaled per column (its ``per_channel=True``),
    the zero point alike; False: any other form (left as it is)."""
    if isinstance(source, onnx.NodeProto):  # lifted: its QuantizeLinear's axis
        return next((a.i for a in source.attribute if a.name == "axis"), None)
    scale = inits.get(weight_scale)
    if scale is None:
        return False
    size = int(numpy_helper.to_array(scale).size)
    if size == 1:
        return None
    weight = inits[source]
    zero = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    columns = list(weight.dims[-1:])
    if node.op_type != "MatMulInteger" or list(scale.dims) != columns or zero is None:
        return False
    return len(weight.dims) - 1 if list(zero.dims) == columns else False


def _only_reader(readers, name, op_type):
    users = readers.get(name, [])
    if len(users) == 1 and users[0].op_type == op_type and users[0].domain in _STANDARD:
        return users[0]
    return None


#: onnxruntime's fusions of the same (what its optimiser saves, optimum's O2+):
#: op type -> positions of (A, B, A's scale or None: A is float, quantized
#: inside, B's scale, A's zero point, B's zero point, bias).
_FUSED = {
    "DynamicQuantizeMatMul": (0, 1, None, 2, None, 3, 4),
    "MatMulIntegerToFloat": (0, 1, 2, 3, 4, 5, 6),
}


#: Quantized fused nodes: op type -> (float op, [(data, scale, zero point)
#: positions of each quantized operand], the float op's inputs: an int is
#: the node's input there, a str "q<k>" the k-th operand dequantized).
_QUANTIZED_FUSIONS = {
    "QAttention": (
        "Attention", [(0, 3, 6), (1, 4, 7)], ["q0", "q1", 2, 5, 8],
    ),
    "QEmbedLayerNormalization": (
        "EmbedLayerNormalization",
        [(2, 8, 13), (3, 9, 14), (4, 10, 15), (5, 11, 16), (6, 12, 17)],
        [0, 1, "q0", "q1", "q2", "q3", "q4", 7],
    ),
}  # fmt: skip


def _quantized_fusions(model: onnx.ModelProto):
    for node in model.graph.node:
        if node.domain == "com.microsoft" and node.op_type in _QUANTIZED_FUSIONS:
            yield node


def _fused(model: onnx.ModelProto):
    inits = {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        slots = _FUSED.get(node.op_type) if node.domain == "com.microsoft" else None
        if slots is None:
            continue
        b, b_scale, b_zero = (_at(node, slots[i]) for i in (1, 3, 5))
        if b in inits and b_scale in inits and (not b_zero or b_zero in inits):
            yield node, slots


def _at(node, pos):
    return node.input[pos] if pos is not None and len(node.input) > pos else ""


def integer_products(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str, int | None]]:
    """(node, its weight's scale, axis) of each ``*Integer`` node read as a product."""
    return [(node, scale, axis) for node, _, _, _, scale, axis, _, _ in _matches(model)]


def has_dynamic(model: onnx.ModelProto) -> bool:
    return any(
        next(found(model), None) is not None for found in (_matches, _fused, _quantized_fusions)
    )


def _rewrite_each(model: onnx.ModelProto, found: list, write) -> None:
    """Each node of ``found`` (or ``(node, ...)``) replaced by what
    ``write(item, inits, taken)`` returns, in place."""
    if not found:
        return
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    taken = _all_names(graph)
    replaced = {}
    for item in found:
        node = item[0] if isinstance(item, tuple) else item
        replaced[node.output[0]] = write(item, inits, taken)
    rewritten = []
    for node in graph.node:
        rewritten.extend(replaced.get(node.output[0], [node]) if node.output else [node])
    del graph.node[:]
    graph.node.extend(rewritten)


def quantized_fusions_as_pairs(model: onnx.ModelProto) -> None:
    """com.microsoft ``QAttention`` and ``QEmbedLayerNormalization`` as their
    float fused op of ``DequantizeLinear`` operands (a weight scaled per
    column: per axis 1), in place; the node's outputs keep their names."""
    _rewrite_each(model, list(_quantized_fusions(model)), _quantized_fusion)


def _quantized_fusion(node, inits, taken) -> list[onnx.NodeProto]:
    float_op, operands, inputs = _QUANTIZED_FUSIONS[node.op_type]
    base = node.name or node.output[0]
    nodes, dequantized = [], []
    for slots in operands:
        data, scale, zero = (_at(node, p) for p in slots)
        dequantized.append(_unique(f"{base}/{data}/dequantized", taken))
        nodes.append(dequantize_linear(data, scale, zero, dequantized[-1], inits))
    args = [dequantized[int(i[1:])] if isinstance(i, str) else _at(node, i) for i in inputs]
    while args and not args[-1]:
        args.pop()
    fused = helper.make_node(float_op, args, list(node.output), base, domain=node.domain)
    fused.attribute.extend(node.attribute)
    return [*nodes, fused]


def fused_as_pairs(model: onnx.ModelProto) -> None:
    """com.microsoft ``DynamicQuantizeMatMul`` (A quantized inside, as
    ``DynamicQuantizeLinear`` quantizes it) and ``MatMulIntegerToFloat`` as
    ``MatMul`` of ``DequantizeLinear`` operands, plus the bias; the quantized
    fused nodes as :func:`quantized_fusions_as_pairs` writes them."""
    quantized_fusions_as_pairs(model)
    _rewrite_each(model, list(_fused(model)), _fused_product)


def _fused_product(found, inits, taken) -> list[onnx.NodeProto]:
    node, slots = found
    a, b, a_scale, b_scale, a_zero, b_zero, bias = (_at(node, p) for p in slots)
    base = node.name or node.output[0]
    fresh = lambda stem: _unique(f"{base}/{stem}", taken)  # noqa: E731
    nodes = []
    if slots[2] is None:  # quantized here, as DynamicQuantizeLinear does
        q, a_scale, a_zero = fresh("a_quantized"), fresh("a_scale"), fresh("a_zero_point")
        nodes.append(helper.make_node("DynamicQuantizeLinear", [a], [q, a_scale, a_zero], q))
        a = q
    a_f, b_f = fresh("a_dequantized"), fresh("b_dequantized")
    nodes.append(dequantize_linear(a, a_scale, a_zero, a_f, inits))
    nodes.append(dequantize_linear(b, b_scale, b_zero, b_f, inits))
    product = fresh("product") if bias else node.output[0]
    nodes.append(helper.make_node("MatMul", [a_f, b_f], [product], base))
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], fresh("bias")))
    return nodes


def dynamic_as_pairs(model: onnx.ModelProto) -> None:
    """Each matched ``*Integer`` node (and onnxruntime's fusions of them) as
    its float op between pairs, in place."""
    fused_as_pairs(model)
    integer_products_as_pairs(model)


def integer_products_as_pairs(model: onnx.ModelProto) -> None:
    """Each matched ``*Integer`` node, its integer bias add, Cast and rescale
    as the float op between pairs, in place: where the weight is lifted
    (read through a ``QuantizeLinear``), the engine's gradient graph."""
    found = list(_matches(model))
    if not found:
        return
    graph = model.graph
    taken = _all_names(graph)
    dropped, replaced = set(), {}
    for node, cast, mul, dynamic, weight_scale, axis, add, bias in found:
        base = node.name or node.output[0]
        a, w = _unique(f"{base}/a_dequantized", taken), _unique(f"{base}/w_dequantized", taken)
        a_inputs = [node.input[0], dynamic.output[1]] + (
            [node.input[2]] if len(node.input) > 2 and node.input[2] else []
        )
        w_inputs = [node.input[1], weight_scale] + (
            [node.input[3]] if len(node.input) > 3 and node.input[3] else []
        )
        attrs = {a_.name: helper.get_attribute_value(a_) for a_ in node.attribute}
        float_op = _FLOAT_OPS[node.op_type]
        out = mul.output[0]
        replaced[id(node)] = [
            helper.make_node("DequantizeLinear", a_inputs, [a], a),
            helper.make_node(
                "DequantizeLinear", w_inputs, [w], w, **({} if axis is None else {"axis": axis})
            ),
        ]
        if bias and float_op == "Conv":  # the float bias itself (its rounding: a tiny step)
            replaced[id(node)].append(helper.make_node("Conv", [a, w, bias], [out], base, **attrs))
        elif bias:
            product = _unique(f"{base}/product", taken)
            replaced[id(node)] += [
                helper.make_node(float_op, [a, w], [product], base, **attrs),
                helper.make_node("Add", [product, bias], [out], _unique(f"{base}/bias", taken)),
            ]
        else:
            replaced[id(node)].append(helper.make_node(float_op, [a, w], [out], base, **attrs))
        dropped.update({id(cast), id(mul)} | ({id(add)} if add is not None else set()))
    nodes = []
    for n in graph.node:
        if id(n) in dropped:
            continue
        nodes.extend(replaced.get(id(n), [n]))
    del graph.node[:]
    graph.node.extend(nodes)
