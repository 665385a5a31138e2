"""A case's graph in float64, where onnxruntime computes it in float64 and the same way.

Finite differences in float64 check gradients far more tightly than in
float32: :func:`_as_float64` converts the graph (:func:`_to_float64`) and
keeps the conversion only where its outputs agree with the float32 graph and
move linearly under a tiny nudge.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._compare import _close, _delta
from ._reference import _reference_session


def _to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computing in float64 where its float32 tensors may be float64.

    Value types, tensor attributes and Cast targets change; an initializer
    changes only where every consumer's schema accepts double (Resize's
    scales stay float32).
    """
    converted = onnx.ModelProto()
    converted.CopyFrom(model)
    opsets = {o.domain or "": o.version for o in converted.opset_import}
    _graph_to_float64(converted.graph, opsets)
    return converted


def _graph_to_float64(graph: onnx.GraphProto, opsets: dict) -> None:
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        _type_to_float64(vi.type)
    keep32 = set()
    for node in graph.node:
        for pos, name in enumerate(node.input):
            if name and not _accepts_double(node, pos, opsets):
                keep32.add(name)
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in keep32:
            init.CopyFrom(_tensor_to_float64(init))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_tensor_to_float64(attr.t))
            elif attr.type == onnx.AttributeProto.GRAPH:
                _graph_to_float64(attr.g, opsets)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _graph_to_float64(g, opsets)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                if attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.DOUBLE
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name in ("value_float", "value_floats"):
                    scalar = attr.name == "value_float"
                    array = np.array(attr.f if scalar else list(attr.floats), dtype=np.float64)
                    attr.CopyFrom(
                        helper.make_attribute("value", numpy_helper.from_array(array, ""))
                    )


def _type_to_float64(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" and type_proto.tensor_type.elem_type == TensorProto.FLOAT:
        type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type_to_float64(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _type_to_float64(type_proto.optional_type.elem_type)


def _tensor_to_float64(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def _accepts_double(node: onnx.NodeProto, pos: int, opsets: dict) -> bool:
    try:
        schema = onnx.defs.get_schema(
            node.op_type, opsets.get(node.domain or "", 1), node.domain or ""
        )
    except Exception:
        return True
    if not schema.inputs:
        return True
    formal = schema.inputs[min(pos, len(schema.inputs) - 1)]
    allowed = {formal.type_str}
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = set(constraint.allowed_type_strs)
    return "tensor(double)" in allowed


def _has_float32(model: onnx.ModelProto) -> bool:
    return any(
        vi.type.tensor_type.elem_type == TensorProto.FLOAT
        for vi in list(model.graph.input) + list(model.graph.output)
    )


def _as_float64(model32, names, values32, outputs32, rng):
    """The float64 model, session and values, or None where float64 cannot be trusted.

    onnxruntime may lack a float64 kernel (the model does not load), compute
    in float32 inside a float64 kernel (GroupNormalization's ``stash_type``),
    or the conversion may change what the graph computes: all three fall
    back to float32.
    """
    try:
        model64 = _to_float64(model32)
        session64 = _reference_session(model64)
        values64 = [v.astype(np.float64) for v in values32]
        base = session64.run(None, dict(zip(names, values64)))
    except Exception:
        return None
    if not all(_close(a, b, 1e-3, 1e-4) for a, b in zip(base, outputs32)):
        return None
    # Precision probe, input by input: outputs must move linearly under a 1e-9
    # relative nudge (a float32 computation moves by whole float32 steps or not at all).
    feeds = dict(zip(names, values64))
    for name, value in zip(names, values64):
        direction = rng.choice([-1.0, 1.0], value.shape) * (np.abs(value) + 1.0) * 1e-9
        with np.errstate(invalid="ignore", over="ignore"):
            nudged = [np.asarray(value + k * direction) for k in (1, 2)]
        try:
            runs = [session64.run(None, {**feeds, name: v}) for v in nudged]
        except Exception:
            return None
        moved = nonlinear = 0.0
        for b, r1, r2 in zip(base, *runs):
            b, r1, r2 = (np.asarray(a) for a in (b, r1, r2))
            if b.dtype != np.float64 or b.shape != r1.shape or b.shape != r2.shape:
                continue
            d1, d2 = _delta(r1, b), _delta(r2, b)
            ok = np.isfinite(d1) & np.isfinite(d2)
            moved += float(np.sum(np.abs(d1[ok])))
            nonlinear += float(np.sum(np.abs(d2[ok] - 2 * d1[ok])))
        if moved == 0.0 or nonlinear > 1e-3 * moved:
            return None
    return model64, session64, values64
