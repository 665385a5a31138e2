"""Train-mode BatchNormalization and Dropout as standard ops onnx-ad differentiates.

onnx-ad refuses both in train mode. ortbridge writes them out itself:

- BatchNormalization: batch statistics as reductions, and torch's running
  statistics update (unbiased variance) as extra graph outputs, in
  :func:`ortbridge._prepare._batch_norm.batch_norm_nodes` order.
- Dropout: the mask becomes a graph input, drawn by torch's generator at
  each forward (``torch.manual_seed`` reproduces a run) and already scaled by
  ``1 / (1 - ratio)``; the node becomes a ``Mul``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _infer, _unique
from ortbridge._prepare._onnx_utils import NodeBuilder
from ortbridge.exceptions import NotDifferentiableError


@dataclasses.dataclass
class DropoutMask:
    """A mask input the engine fills at each forward."""

    name: str
    ratio: float
    elem: int
    #: Shape: ints, names of symbolic dimensions, or None where unknown.
    shape: tuple | None


def lower_training_nodes(model: onnx.ModelProto, batch_norms) -> tuple[list[str], list]:
    """Rewrite ``model`` in place; returns (running-statistics outputs, dropout masks).

    ``model`` is the train-mode variant (Dropout with ``training_mode`` true,
    BatchNormalization in training form). ``batch_norms`` are the
    :class:`~ortbridge._prepare._batch_norm.BatchNormStats` whose running statistics are
    tracked; the other BatchNormalization nodes left (statistics computed by
    nodes) use batch statistics without updates; frozen ones were decomposed
    before.
    """
    graph = model.graph
    taken = _all_names(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    types, shapes = _infer(model, symbolic=True)
    by_output = {b.output: b for b in batch_norms}
    stats_for: dict[str, list[str]] = {}
    masks, new_nodes = [], []

    def fresh(base):
        return _unique(base, taken)

    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
        elif node.op_type == "BatchNormalization":
            # Untracked ones (statistics not initializers) use batch statistics
            # too, as the inference variant does; only their updates are dropped.
            bn = by_output.get(node.output[0])
            built, stats = _batch_norm(node, bn, types, shapes, opset, fresh)
            new_nodes.extend(built)
            if bn is not None:
                stats_for[bn.output] = stats
        elif node.op_type == "Dropout":
            built, mask = _dropout(node, consts, types, shapes, fresh)
            new_nodes.extend(built)
            if mask is not None:
                masks.append(mask)
                shape = None if mask.shape is None else list(mask.shape)
                graph.input.append(helper.make_tensor_value_info(mask.name, mask.elem, shape))
        else:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    outputs = []
    for bn in batch_norms:
        for name in stats_for[bn.output]:
            elem = types.get(bn.mean, TensorProto.FLOAT)
            graph.output.append(helper.make_tensor_value_info(name, elem, None))
            outputs.append(name)
    return outputs, masks


def _batch_norm(node, bn, types, shapes, opset, fresh):
    x, scale, bias, mean, var = node.input[:5]
    shape = shapes.get(x)
    if shape is None:
        raise NotDifferentiableError(
            f"node {node.name!r} (BatchNormalization, train mode): the rank of its input {x!r} "
            "is unknown; give the graph's inputs shapes (onnx.shape_inference) or use "
            "batch_norm='frozen'"
        )
    rank = len(shape)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    eps = float(attrs.get("epsilon", 1e-5))
    elem = types.get(x, TensorProto.FLOAT)
    b = NodeBuilder(elem, fresh, prefix=f"{node.name}_")
    axes = [0, *range(2, rank)]

    def reduce_mean(t, keepdims):
        if opset >= 18:
            axes_name = fresh(f"{node.name}_axes")
            b.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [axes_name],
                    value=numpy_helper.from_array(np.array(axes, dtype=np.int64)),
                )
            )
            return b.op("ReduceMean", t, axes_name, keepdims=keepdims)
        return b.op("ReduceMean", t, axes=axes, keepdims=keepdims)

    def as_channels(t):  # (C,) -> (1, C, 1, ...), broadcasting against x
        target = fresh(f"{node.name}_cshape")
        b.nodes.append(
            helper.make_node(
                "Constant",
                [],
                [target],
                value=numpy_helper.from_array(np.array([1, -1] + [1] * (rank - 2), np.int64)),
            )
        )
        return b.op("Reshape", t, target)

    def flat(t):
        target = fresh(f"{node.name}_flat")
        b.nodes.append(
            helper.make_node(
                "Constant", [], [target], value=numpy_helper.from_array(np.array([-1], np.int64))
            )
        )
        return b.op("Reshape", t, target)

    batch_mean = reduce_mean(x, 1)
    centred = b.op("Sub", x, batch_mean)
    batch_var = reduce_mean(b.op("Mul", centred, centred), 1)
    inv_std = b.op("Reciprocal", b.op("Sqrt", b.op("Add", batch_var, b.const(eps))))
    normed = b.op("Mul", centred, inv_std)
    b.op("Add", b.op("Mul", normed, as_channels(scale)), as_channels(bias), out=node.output[0])
    if bn is None:
        return b.nodes, []
    # Running statistics as torch updates them: momentum m of torch is
    # 1 - ONNX's momentum; torch keeps the unbiased batch variance.
    keep = bn.momentum
    mean_flat, var_flat = flat(batch_mean), flat(batch_var)
    count = b.op(
        "Div", b.op("Cast", b.op("Size", x), to=elem), b.op("Cast", b.op("Size", mean), to=elem)
    )
    unbiased = b.op("Div", b.op("Mul", var_flat, count), b.op("Sub", count, b.const(1.0)))
    new_mean = b.op(
        "Add", b.op("Mul", mean, b.const(keep)), b.op("Mul", mean_flat, b.const(1.0 - keep))
    )
    new_var = b.op(
        "Add", b.op("Mul", var, b.const(keep)), b.op("Mul", unbiased, b.const(1.0 - keep))
    )
    return b.nodes, [new_mean, new_var]


def _dropout(node, consts, types, shapes, fresh):
    x = node.input[0]
    ratio = 0.5
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in consts:
            raise NotDifferentiableError(
                f"node {node.name!r} (Dropout): its ratio {node.input[1]!r} is not a constant; "
                "the onnxruntime engine draws the mask in torch and needs it known"
            )
        ratio = float(consts[node.input[1]])
    training = True
    if len(node.input) > 2 and node.input[2] in consts:
        training = bool(consts[node.input[2]])
    elem = types.get(x, TensorProto.FLOAT)
    outputs = list(node.output) + [""] * (2 - len(node.output))
    built = []
    if not training or ratio == 0.0:
        built.append(helper.make_node("Identity", [x], [outputs[0]], name=node.name))
        if outputs[1]:
            built.append(
                helper.make_node(
                    "Cast",
                    [_ones_like(x, elem, fresh, built)],
                    [outputs[1]],
                    to=TensorProto.BOOL,
                )
            )
        return built, None
    mask = DropoutMask(fresh(f"{node.name}_mask"), ratio, elem, shapes.get(x))
    built.append(helper.make_node("Mul", [x, mask.name], [outputs[0]], name=node.name))
    if outputs[1]:
        built.append(helper.make_node("Cast", [mask.name], [outputs[1]], to=TensorProto.BOOL))
    return built, mask


def _ones_like(x, elem, fresh, built) -> str:
    shape, ones = fresh(f"{x}_shape"), fresh(f"{x}_ones")
    built.append(helper.make_node("Shape", [x], [shape]))
    value = numpy_helper.from_array(np.array([1], dtype=onnx.helper.tensor_dtype_to_np_dtype(elem)))
    built.append(helper.make_node("ConstantOfShape", [shape], [ones], value=value))
    return ones
