"""QuantizeLinear/DequantizeLinear pairs differentiated as torch's fake quantization.

onnx-ad gives ``QuantizeLinear`` a zero derivative and follows no gradient
into an integer tensor: nothing before a pair gets one. torch's
``fake_quantize_per_tensor_affine`` / ``..._per_channel_affine`` pass the
gradient straight through where ``round(x / scale) + zero_point`` lies in
the integer type's range, and give zero outside it. A ``DynamicQuantizeLinear``
read by a ``DequantizeLinear`` (its range is the tensor's own: nothing is
clipped) passes it straight through everywhere.

:func:`fake_quantize_nodes` (the last rewrite before onnx-ad) writes each
pair as one node, ``FakeQuantize`` of a private domain, whose output keeps
the pair's declared type and shape; :func:`._rules.own_rules` gives it that
rule; :func:`quantize_pairs_restored` writes the pair back in the reverse
model before anything runs it, so onnxruntime computes the forward exactly
as the file does.

:func:`quantized_lstms_as_float` writes com.microsoft ``DynamicQuantizeLSTM``
(its int8 weights lifted to float under fake quantization, :mod:`._lift`) as
ONNX's LSTM of the dequantized weights, transposed to LSTM's layout. Its
kernel quantizes each step's input and hidden state on their own range
(nothing clipped): the gradient passes straight through them, as torch's
dynamic-quantization training leaves activations float. The forward of the
gradient graph therefore runs the float LSTM (its outputs differ from the
kernel's by those roundings); inference runs the file's kernel.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ortbridge._prepare._lookup import _all_names, _infer, _unique
from ortbridge._prepare.quantized._lift import (
    LSTM_WEIGHT_SLOTS,
    QDQ_DOMAINS,
    as_float_lstm,
    is_dynamic_lstm,
    lifted_lstm_weight,
)

DOMAIN = "ai.ortbridge.training"
OP = "FakeQuantize"
_STANDARD = ("", "ai.onnx")


def _is(node: onnx.NodeProto, op: str) -> bool:
    # QuantizeLinear/DequantizeLinear: ONNX's, or onnxruntime's contrib ones.
    domains = QDQ_DOMAINS if op != "DynamicQuantizeLinear" else _STANDARD
    return node.op_type == op and node.domain in domains


def _settings(node: onnx.NodeProto) -> tuple:
    zero = node.input[2] if len(node.input) > 2 else ""
    attrs = tuple(sorted((a.name, helper.get_attribute_value(a)) for a in node.attribute))
    return node.input[1], zero, attrs


def fake_quantize_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each ``DequantizeLinear`` reading a ``QuantizeLinear`` of the same scale,
    zero point and attributes as one ``FakeQuantize`` node; in place, returned.

    The ``QuantizeLinear`` goes where nothing else reads it.
    """
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    pairs = {}
    for node in graph.node:
        if not _is(node, "DequantizeLinear"):
            continue
        quantize = producer.get(node.input[0])
        if quantize is not None and _is(quantize, "QuantizeLinear"):
            if _settings(quantize) == _settings(node):
                pairs[id(node)] = quantize
        elif quantize is not None and _is(quantize, "DynamicQuantizeLinear"):
            if list(node.input) == list(quantize.output):
                pairs[id(node)] = quantize
    if not pairs:
        return model
    types, shapes = _infer(model)
    declared = {vi.name for vi in graph.value_info}
    nodes = []
    for node in graph.node:
        quantize = pairs.get(id(node))
        if quantize is None:
            nodes.append(node)
            continue
        if quantize.op_type == "DynamicQuantizeLinear":
            nodes.append(
                helper.make_node(
                    OP, [quantize.input[0]], [node.output[0]], node.name, domain=DOMAIN, dynamic=1
                )
            )
            _declare(graph, node.output[0], types, shapes, declared)
            continue
        scale, zero, _ = _settings(node)
        # The integers' type: onnx's inference (no zero point: uint8), or the
        # zero point's (onnx infers nothing for com.microsoft's contrib pair).
        held = types.get(quantize.output[0]) or (types.get(zero) if zero else TensorProto.UINT8)
        if held is None:
            nodes.append(node)
            continue
        fake = helper.make_node(
            OP,
            [quantize.input[0], scale, zero],
            [node.output[0]],
            node.name,
            domain=DOMAIN,
            to=held,
            axis=next((a.i for a in node.attribute if a.name == "axis"), 1),
            pair_domain=node.domain,  # written back as the file wrote it
        )
        fake.attribute.extend(a for a in quantize.attribute if a.name == "saturate")
        nodes.append(fake)
        _declare(graph, node.output[0], types, shapes, declared)
    read = {name for node in nodes for name in node.input} | {o.name for o in graph.output}
    kept = [
        n
        for n in nodes
        if not (
            (_is(n, "QuantizeLinear") or _is(n, "DynamicQuantizeLinear"))
            and not any(o in read for o in n.output)
        )
    ]
    del graph.node[:]
    graph.node.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    if any(q.domain == "com.microsoft" for q in pairs.values()):
        _declare_through(model)
    return model


def _declare_through(model: onnx.ModelProto) -> None:
    """Declare each ``FakeQuantize`` output as its input is (type and shape),
    where onnx could not: past a contrib pair onnx infers nothing, and a
    file's own declarations there may be of other sizes (the batch as a
    name). A chain of them is typed by declaring, inferring again, declaring
    (once per layer; for files with contrib pairs only: onnx types ONNX's
    pairs in the one inference :func:`fake_quantize_nodes` runs)."""
    graph = model.graph
    fakes = [n for n in graph.node if n.op_type == OP and n.domain == DOMAIN]
    for _ in range(len(fakes)):
        types, shapes = _infer(model)
        declared = {vi.name: vi for vi in graph.value_info}
        changed = False
        for node in fakes:
            x, out = node.input[0], node.output[0]
            dtype, shape = types.get(x) or types.get(out), shapes.get(x)
            if dtype is None or shape is None or shapes.get(out) == shape:
                continue
            if out in declared:
                graph.value_info.remove(declared[out])
            graph.value_info.append(helper.make_tensor_value_info(out, dtype, list(shape)))
            changed = True
        if not changed:
            return


def _declare(graph, out, types, shapes, declared) -> None:
    # onnx's shape inference cannot see through the private node.
    if out not in declared and out in types:
        graph.value_info.append(helper.make_tensor_value_info(out, types[out], shapes.get(out)))


def quantize_pairs_restored(model: onnx.ModelProto, source: onnx.ModelProto | None = None) -> None:
    """Every ``FakeQuantize`` node written back as the file's pair, in place.

    ``source`` (the graph handed to onnx-ad): its declarations of the pairs'
    outputs are copied (onnx types nothing past a contrib pair, and the
    forward graph's outputs need types).
    """
    graph = model.graph
    fakes = {n.output[0] for n in graph.node if n.op_type == OP and n.domain == DOMAIN}
    if not fakes:
        return
    if source is not None:
        known = {vi.name for vi in graph.value_info}
        graph.value_info.extend(
            vi for vi in source.graph.value_info if vi.name in fakes and vi.name not in known
        )
    nodes = []
    for node in graph.node:
        if node.op_type != OP or node.domain != DOMAIN:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("dynamic"):
            q, s, z = (f"{node.output[0]}__{part}" for part in ("quantized", "scale", "zero"))
            nodes.append(
                helper.make_node("DynamicQuantizeLinear", node.input, [q, s, z], f"{node.name}_q")
            )
            nodes.append(helper.make_node("DequantizeLinear", [q, s, z], node.output, node.name))
            continue
        x, scale, zero = node.input
        kept = {"axis": attrs["axis"]} if "axis" in attrs else {}
        domain = attrs.get("pair_domain", b"")
        domain = domain.decode() if isinstance(domain, bytes) else domain
        held = f"{node.output[0]}__quantized"
        q_attrs = dict(kept, **({"saturate": attrs["saturate"]} if "saturate" in attrs else {}))
        inputs = [scale, zero] if zero else [scale]
        nodes.append(
            helper.make_node(
                "QuantizeLinear", [x, *inputs], [held], f"{node.name}_q", domain=domain, **q_attrs
            )
        )
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [held, *inputs],
                [node.output[0]],
                node.name,
                domain=domain,
                **kept,
            )  # fmt: skip
        )
    del graph.node[:]
    graph.node.extend(nodes)
    kept_opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept_opsets)


def quantized_lstms_as_float(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each ``DynamicQuantizeLSTM`` as ONNX's ``LSTM`` of its dequantized
    weights; in place, returned. A weight its lifted ``QuantizeLinear`` gives
    is read by the ``DequantizeLinear`` of the same settings (the pair
    :func:`fake_quantize_nodes` makes one node); a node whose weights were
    not lifted is left (refused by name)."""
    graph = model.graph
    if not any(is_dynamic_lstm(n) for n in graph.node):
        return model
    producer = {out: node for node in graph.node for out in node.output}
    taken = _all_names(graph)
    nodes = []
    for node in graph.node:
        written: list[onnx.NodeProto] = []
        weights = [_dequantized(node, s, producer, taken, written) for s in LSTM_WEIGHT_SLOTS]
        if not is_dynamic_lstm(node) or None in weights:
            nodes.append(node)
            continue
        nodes.extend(written)
        nodes.extend(as_float_lstm(node, weights, taken, f"{node.name}_float"))
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _dequantized(node, slot, producer, taken, nodes) -> str | None:
    """The float weight a ``DynamicQuantizeLSTM`` reads at ``slot``, as the
    ``DequantizeLinear`` of each of its lifted ``QuantizeLinear`` nodes (one a
    direction, joined, for a scale per direction and channel); None for a
    weight not lifted."""
    found = lifted_lstm_weight(node, slot, producer) if is_dynamic_lstm(node) else None
    if found is None:
        return None
    name = node.input[slot]
    parts = []
    for quantize in found[1]:
        parts.append(_unique(f"{quantize.output[0]}_dequantized", taken))
        axis = {a.name: a.i for a in quantize.attribute if a.name == "axis"}
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [quantize.output[0], *quantize.input[1:]],
                [parts[-1]],
                _unique(f"{quantize.name}_dequantize", taken),
                domain=quantize.domain,
                **axis,
            )  # fmt: skip
        )
    if len(parts) == 1:
        return parts[0]
    out = _unique(f"{name}_dequantized", taken)
    nodes.append(helper.make_node("Concat", parts, [out], _unique(f"{name}_join", taken), axis=0))
    return out
