"""A sum of pieces placed into zeros, covering every slice once, as one Concat.

onnx-ad's adjoint of ``Gather(x, k, axis=0)`` with a constant scalar ``k`` is
``ScatterND(zeros, [k], update)``; where a tensor is split by several such
Gathers (torch's ``unbind``/``select`` of q, k and v out of one in-projection),
the adjoints are summed: ``m`` scatters into ``m`` zero tensors and an
``m``-way Sum, each over the whole tensor. Where the indices are ``0..n-1``,
each once, over an axis of size ``n``, that sum is the updates concatenated
in index order: one copy, no zeros, no additions (exact).

The adjoint of a ``Slice`` is a zero ``Pad`` of its gradient; a tensor cut
into pieces along one axis (an LSTM's weights and biases into its four
gates, the gates' pre-activations) gets a Sum of Pads. Where the pieces
tile that axis, each once, the sum is their Concat too (an LSTM's backward:
128 Pads and 32 Sums less).

Half-precision scatters that add (:func:`half_scatters_in_float`, whatever
the shapes): onnx-ad writes an embedding table's gradient as a ``ScatterND``
with ``reduction="add"``, which onnxruntime's CPU provider has no float16 or
bfloat16 kernel for ("MLFloat16 data type is not supported with ScatterND
opset 16 when reduction is 'add'", 1.19 to 1.31): a float16 file's backward
failed there. The scatter runs on float32 copies of its data and updates
and its sum is cast back; adding in float32 rounds less than float16 would
(CUDA, which has the kernel, pays two casts).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ortbridge._prepare._lookup import _all_names, _infer, _unique
from ortbridge._prepare._onnx_utils import attr

from ._optimize import _const, facts
from ._pool_grad import _zeros
from ._simplify import _constants


def concat_scatter_sums(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main graph in place (graphs with static shapes)."""
    if not any(n.op_type in ("ScatterND", "Pad") for n in model.graph.node):
        return
    found = facts(model)
    if found is None:
        return
    constants = _constants(model.graph)
    concats, dropped = {}, set()
    for node in model.graph.node:
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx"):
            continue
        slices = _slices(node, found, constants)
        if slices is not None:
            dropped.update(id(found.producer[name]) for name in node.input)
            concats[id(node)] = _concat(node, sorted(slices), found.taken)
            continue
        tiles = _tiles(node, found, constants)
        if tiles is not None:
            axis, pieces = tiles
            dropped.update(id(found.producer[name]) for name in node.input)
            concats[id(node)] = [
                helper.make_node("Concat", pieces, [node.output[0]], node.name, axis=axis)
            ]
    if not concats:
        return
    kept = []
    for n in model.graph.node:
        if id(n) not in dropped:
            kept.extend(concats.get(id(n), [n]))
    # The zero tensors the scatters wrote into go too, where nothing else reads them.
    read = {name for n in kept for name in n.input}
    kept = [n for n in kept if n.op_type != "ConstantOfShape" or n.output[0] in read]
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _concat(node, slices, taken) -> list:
    nodes, parts = [], []
    for _, update, lacks_axis in slices:
        if lacks_axis:
            axis, part = _unique(f"{update}_axis0", taken), _unique(f"{update}_slice", taken)
            nodes.append(_const(axis, [0]))
            nodes.append(helper.make_node("Unsqueeze", [update, axis], [part]))
            update = part
        parts.append(update)
    nodes.append(helper.make_node("Concat", parts, [node.output[0]], node.name, axis=0))
    return nodes


def _slices(node, found, constants) -> list[tuple[int, str, bool]] | None:
    """(index, update, update lacks the axis) of each scatter ``node`` sums.

    None unless they tile axis 0 exactly, each slice once.
    """
    out_shape = found.shapes.get(node.output[0])
    if not out_shape or any(not isinstance(d, int) for d in out_shape):
        return None
    slices = []
    for name in node.input:
        scatter = found.producer.get(name)
        if scatter is None or scatter.op_type != "ScatterND" or found.readers.get(name) != 1:
            return None
        if found.shapes.get(name) != out_shape:
            return None
        if not _zeros(scatter.input[0], found.producer, found.inits):
            return None
        # Indices [k] take an update of the slice's shape, [[k]] one with a
        # leading axis of 1.
        index = constants.get(scatter.input[1])
        if index is None or index.shape not in ((1,), (1, 1)):
            return None
        update = scatter.input[2]
        if found.shapes.get(update) != (1,) * (index.ndim - 1) + tuple(out_shape[1:]):
            return None
        slices.append((int(index.ravel()[0]) % out_shape[0], update, index.ndim == 1))
    if sorted(k for k, _, _ in slices) != list(range(out_shape[0])):
        return None
    return slices


def _tiles(node, found, constants) -> tuple[int, list[str]] | None:
    """(axis, pieces in order) where ``node`` sums zero Pads of pieces that tile
    one axis of its output, each once; None otherwise."""
    out_shape = found.shapes.get(node.output[0])
    if not out_shape or any(not isinstance(d, int) for d in out_shape) or len(node.input) < 2:
        return None
    rank, placed, axes = len(out_shape), [], set()
    for name in node.input:
        pad = found.producer.get(name)
        if pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx"):
            return None
        if found.readers.get(name) != 1 or found.shapes.get(name) != out_shape:
            return None
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        if mode != b"constant" or len(pad.input) > 3 or len(pad.input) < 2:
            return None  # an ``axes`` input (opset 18) is not read here
        if len(pad.input) == 3 and pad.input[2]:
            value = constants.get(pad.input[2])
            if value is None or value.size != 1 or float(value.ravel()[0]) != 0.0:
                return None
        pads = constants.get(pad.input[1])
        if pads is None or pads.shape != (2 * rank,) or (pads < 0).any():
            return None
        padded = [a for a in range(rank) if pads[a] or pads[rank + a]]
        if len(padded) != 1:
            return None
        axes.add(padded[0])
        placed.append((int(pads[padded[0]]), int(pads[rank + padded[0]]), pad.input[0]))
    if len(axes) != 1:
        return None
    (axis,) = axes
    placed.sort()
    start = 0
    for begin, end, _ in placed:
        if begin != start:
            return None
        start = out_shape[axis] - end
    if start != out_shape[axis]:
        return None
    return axis, [piece for _, _, piece in placed]


_HALF = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
_SCATTERS = frozenset({"ScatterND", "ScatterElements"})


def half_scatters_in_float(model: onnx.ModelProto) -> None:
    """Each float16/bfloat16 scatter with a reduction run in float32, in place."""
    graph = model.graph
    # Keyed by id, the nodes held: protobuf makes a new wrapper for a node no
    # one holds, whose id another node's may then take.
    candidates = {
        id(n): n
        for n in graph.node
        if n.op_type in _SCATTERS
        and n.domain in ("", "ai.onnx")
        and attr(n, "reduction", "none") != "none"
    }
    if not candidates:
        return
    types, _ = _infer(model)
    taken = _all_names(graph)
    nodes = []
    for node in graph.node:
        elem = types.get(node.input[0]) if id(node) in candidates else None
        if elem not in _HALF:
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        data, updates, result = (
            _unique(f"{base}/{s}_float", taken) for s in ("data", "updates", "sum")
        )
        nodes.append(helper.make_node("Cast", [node.input[0]], [data], data, to=TensorProto.FLOAT))
        nodes.append(
            helper.make_node("Cast", [node.input[2]], [updates], updates, to=TensorProto.FLOAT)
        )
        scatter = onnx.NodeProto()
        scatter.CopyFrom(node)
        scatter.input[0], scatter.input[2] = data, updates
        scatter.output[0] = result
        nodes.append(scatter)
        nodes.append(
            helper.make_node("Cast", [result], [node.output[0]], f"{base}/cast_back", to=elem)
        )
    del graph.node[:]
    graph.node.extend(nodes)
