"""Faster equivalents of slow onnxruntime CPU kernels in gradient graphs.

onnxruntime's CPU ``ReluGrad`` (``dX = X > 0 ? dY : 0``) runs about four
times slower than ``Greater`` + ``Cast`` + ``Mul`` computing the same thing:
92 against 23 us on a 64x256 tensor, a sixth of an MLP's backward pass and
3 of the 13 ms of a small CNN's. The rewrite is for the CPU only: the CUDA
kernel is a single fused launch.

The products agree exactly except where ``dY`` is infinite or NaN at an
inactive unit (``X <= 0``), where the product gives NaN and ``ReluGrad`` 0:
a gradient that is already not finite upstream.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._graph import _all_names, _elem_types, _unique

_MS = "com.microsoft"
_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def speed_up_cpu_gradient(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s slow CPU gradient nodes in place; returns how many."""
    graph = model.graph
    targets = {i for i, n in enumerate(graph.node) if n.op_type == "ReluGrad" and n.domain == _MS}
    if not targets:
        return 0
    types = _elem_types(model)
    taken = _all_names(graph)
    zeros: dict[int, str] = {}
    rewritten, nodes = 0, []
    for i, node in enumerate(graph.node):
        elem = types.get(node.input[1]) if i in targets else None
        if elem not in _TYPES:  # untyped, or a type Greater lacks on the CPU
            nodes.append(node)
            continue
        if elem not in zeros:
            zero = _unique("ortbridge_zero", taken)
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            graph.initializer.append(numpy_helper.from_array(np.zeros((), dtype), zero))
            zeros[elem] = zero
        d_y, x = node.input[0], node.input[1]
        active = _unique(f"{x}_active", taken)
        mask = _unique(f"{x}_active_mask", taken)
        nodes += [
            helper.make_node("Greater", [x, zeros[elem]], [active]),
            helper.make_node("Cast", [active], [mask], to=elem),
            helper.make_node("Mul", [d_y, mask], [node.output[0]], name=node.name),
        ]
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten
