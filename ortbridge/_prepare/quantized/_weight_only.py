"""Weight-only int8 files: ``Mul(Cast(q), scale)`` read as ``DequantizeLinear(q, scale)``.

Some tools quantize the weights only, symmetrically: an int8 initializer is
cast to float and multiplied by a scale per tensor or per output channel
(shaped to broadcast, ``[C, 1, 1, 1]`` or ``[1, N]``); the activations stay
float. That is the ``DequantizeLinear`` of the integers with a zero point of
0, value for value (the same float32 product): :func:`weight_only_as_dequantize`
writes it so, and :mod:`._lift` trains and saves the weight as a QDQ file's.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._lookup import _all_names, _unique

_STANDARD = ("", "ai.onnx")
_INTEGERS = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})


def _found(model: onnx.ModelProto) -> dict[str, tuple]:
    """initializer -> (its Cast nodes, their Mul nodes, the scale's name, axis)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = {}
    for name, init in inits.items():
        if init.data_type not in _INTEGERS or name in outputs:
            continue
        casts = readers.get(name, [])
        if not casts or any(c.op_type != "Cast" or c.domain not in _STANDARD for c in casts):
            continue
        muls, scales = [], set()
        for cast in casts:
            users = readers.get(cast.output[0], [])
            if len(users) != 1 or users[0].op_type != "Mul" or cast.output[0] in outputs:
                break
            mul = users[0]
            other = [n for n in mul.input if n != cast.output[0]]
            if len(other) != 1 or other[0] not in inits:
                break
            scale = inits[other[0]]
            if helper.get_attribute_value(cast.attribute[0]) != scale.data_type:
                break
            muls.append(mul)
            scales.add(other[0])
        else:
            if len(scales) == 1:
                scale = inits[next(iter(scales))]
                axis = _axis(list(init.dims), list(scale.dims))
                if axis is not None and np.all(numpy_helper.to_array(scale) > 0):
                    found[name] = (casts, muls, scale.name, axis)
    return found


def _axis(dims: list[int], scale_dims: list[int]) -> int | None:
    """The axis of ``dims`` a broadcast scale varies along (-1: none), or None."""
    if len(scale_dims) > len(dims):
        return None
    offset = len(dims) - len(scale_dims)
    varying = [i for i, d in enumerate(scale_dims) if d != 1]
    if not varying:
        return -1
    if len(varying) > 1 or scale_dims[varying[0]] != dims[offset + varying[0]]:
        return None
    return offset + varying[0]


def has_weight_only(model: onnx.ModelProto) -> bool:
    return bool(_found(model))


def weight_only_as_dequantize(model: onnx.ModelProto) -> None:
    """Each weight-only int8 weight's ``Cast`` and ``Mul`` as one ``DequantizeLinear``, in place."""
    found = _found(model)
    if not found:
        return
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    taken = _all_names(graph)
    dropped, replaced = set(), {}
    for name, (casts, muls, scale_name, axis) in found.items():
        scale = numpy_helper.to_array(inits[scale_name])
        flat = scale.reshape(-1) if axis >= 0 else scale.reshape(())
        scale_flat = _unique(f"{name}_scale", taken)
        zero = _unique(f"{name}_zero_point", taken)
        integer = helper.tensor_dtype_to_np_dtype(inits[name].data_type)
        graph.initializer.extend(
            [
                numpy_helper.from_array(flat, scale_flat),
                numpy_helper.from_array(np.zeros(flat.shape, integer), zero),
            ]
        )
        dropped.update(id(c) for c in casts)
        for mul in muls:
            extra = {"axis": axis} if axis >= 0 else {}
            replaced[id(mul)] = helper.make_node(
                "DequantizeLinear", [name, scale_flat, zero], [mul.output[0]], mul.name, **extra
            )
    nodes = [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
