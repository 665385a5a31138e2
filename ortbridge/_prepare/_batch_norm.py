"""BatchNormalization bookkeeping: running statistics as torch keeps them.

Which nodes' running statistics the bridge updates (:func:`batch_norm_nodes`),
how many values each averages per channel, the nodes turning onnxruntime's
running variance (biased) into torch's (unbiased), and an inference-mode
BatchNormalization as elementary ops for the eval variant.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..exceptions import OnnxModelError
from ._lookup import _all_names, _elem_type_of, _unique
from ._onnx_utils import np_dtype, set_input_shapes


@dataclasses.dataclass
class BatchNormStats:
    """A BatchNormalization node whose running statistics the bridge updates."""

    node_name: str
    output: str
    mean: str
    var: str
    momentum: float


def batch_norm_nodes(model: onnx.ModelProto) -> list[BatchNormStats]:
    """BatchNormalization nodes whose running statistics are float initializers."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        mean, var = node.input[3], node.input[4]
        if mean in inits and var in inits:
            found.append(
                BatchNormStats(
                    node.name, node.output[0], mean, var, float(attrs.get("momentum", 0.9))
                )
            )
    return found


def values_per_channel(
    model: onnx.ModelProto, batch_norms: list[BatchNormStats], shapes: dict[str, tuple]
) -> list[int | None]:
    """How many values each BatchNormalization averages per channel, for these input shapes.

    ``shapes``: the shape of each graph input. None where shape inference
    cannot tell the node's input shape.
    """
    sized = onnx.ModelProto()
    sized.CopyFrom(model)
    set_input_shapes(sized, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(sized)
    except Exception:  # noqa: BLE001 - an unknown count is checked after the run instead
        return [None] * len(batch_norms)
    known = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info]:
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            known[value.name] = [d.dim_value for d in dims]
    inputs = {n.name: n.input[0] for n in model.graph.node if n.op_type == "BatchNormalization"}
    counts = []
    for stats in batch_norms:
        shape = known.get(inputs.get(stats.node_name))
        ok = shape is not None and len(shape) >= 2 and shape[1] > 0
        counts.append(int(np.prod(shape)) // shape[1] if ok else None)
    return counts


def training_form(node: onnx.NodeProto, opset: int, taken: set[str]) -> list[str]:
    """Make ``node`` (BatchNormalization, one output) compute batch statistics; return the
    names of its new running mean and variance.

    From opset 14 the ``training_mode`` attribute asks for it, with three
    outputs; before, the five-output form does (onnxruntime's kernel then
    updates the running statistics as it does from opset 14).
    """
    keep = [a for a in node.attribute if a.name != "training_mode"]
    del node.attribute[:]
    node.attribute.extend(keep)
    del node.output[1:]
    suffixes = ("running_mean", "running_var")
    if opset >= 14:
        node.attribute.append(helper.make_attribute("training_mode", 1))
    else:
        suffixes += ("saved_mean", "saved_inv_std")
    node.output.extend(_unique(f"{node.output[0]}_{s}", taken) for s in suffixes)
    return list(node.output[1:3])


def unbiased_running_var(
    graph: onnx.GraphProto, x: str, new_var: str, batch_var: str, momentum: float, elem: int
) -> str:
    """Append nodes turning onnxruntime's running variance into torch's; return its name.

    onnxruntime updates the running variance with the biased batch variance
    ``v``, torch with the unbiased one, ``n / (n - 1)`` times larger (``n``
    values per channel): torch's value is ``new + (1 - momentum) * v / (n - 1)``.
    The old running variance is not read again: onnxruntime may have updated
    it in place.
    """
    taken = _all_names(graph)

    def new(suffix):
        return _unique(f"{new_var}_{suffix}", taken)

    rate, one = new("rate"), new("one")
    dtype = np_dtype(elem)
    graph.initializer.append(numpy_helper.from_array(np.array(1 - momentum, dtype=dtype), rate))
    graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=dtype), one))
    size, channels, count, count_f, count_m1 = (
        new("size"),
        new("c"),
        new("n"),
        new("nf"),
        new("n_1"),
    )
    share, step, out = new("share"), new("step"), new("unbiased")
    graph.node.extend(
        [
            helper.make_node("Size", [x], [size]),
            helper.make_node("Size", [new_var], [channels]),
            helper.make_node("Div", [size, channels], [count]),
            helper.make_node("Cast", [count], [count_f], to=elem),
            helper.make_node("Sub", [count_f, one], [count_m1]),
            helper.make_node("Div", [batch_var, count_m1], [share]),
            helper.make_node("Mul", [share, rate], [step]),
            helper.make_node("Add", [new_var, step], [out]),
        ]
    )
    return out


def batch_var_from_inv_std(graph: onnx.GraphProto, inv_std: str, epsilon: float, elem: int):
    """Biased batch variance from a saved ``1 / sqrt(var + epsilon)``."""
    taken = _all_names(graph)
    eps, square, inv, out = (_unique(f"{inv_std}_{s}", taken) for s in ("eps", "sq", "inv", "var"))
    graph.initializer.append(numpy_helper.from_array(np.array(epsilon, dtype=np_dtype(elem)), eps))
    graph.node.extend(
        [
            helper.make_node("Mul", [inv_std, inv_std], [square]),
            helper.make_node("Reciprocal", [square], [inv]),
            helper.make_node("Sub", [inv, eps], [out]),
        ]
    )
    return out


def _batch_var(graph: onnx.GraphProto, x: str, rank: int, opset: int) -> str:
    """Biased per-channel variance of ``x`` (channels on axis 1)."""
    taken = _all_names(graph)
    axes, mean, diff, square, out = (
        _unique(f"{x}_{s}", taken) for s in ("axes", "mean", "diff", "sq", "var")
    )
    reduce = [0, *range(2, rank)]
    # ReduceMean reads its axes from an input from opset 18, before from an attribute.
    if opset >= 18:
        graph.initializer.append(numpy_helper.from_array(np.array(reduce, dtype=np.int64), axes))
        axes_in, axes_attr = [axes], {}
    else:
        axes_in, axes_attr = [], {"axes": reduce}
    graph.node.extend(
        [
            helper.make_node("ReduceMean", [x, *axes_in], [mean], keepdims=1, **axes_attr),
            helper.make_node("Sub", [x, mean], [diff]),
            helper.make_node("Mul", [diff, diff], [square]),
            helper.make_node("ReduceMean", [square, *axes_in], [out], keepdims=0, **axes_attr),
        ]
    )
    return out


def _decompose_batch_norm(node, ranks, taken, graph) -> list[onnx.NodeProto]:
    """Inference-mode BatchNormalization as ops the gradient builder keeps as they are."""
    x, scale, bias, mean, var = node.input[:5]
    rank = ranks.get(x)
    if rank is None:
        raise OnnxModelError(
            f"node {node.name!r} (BatchNormalization): the rank of its input {x!r} is unknown; "
            "run onnx.shape_inference on the model or give the input a shape"
        )
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    eps = float(attrs.get("epsilon", 1e-5))
    prefix = _unique(f"{node.name or 'bn'}_frozen", taken)

    def new(suffix):
        return _unique(f"{prefix}_{suffix}", taken)

    eps_name, shape_name = new("eps"), new("shape")
    graph.initializer.append(numpy_helper.from_array(np.array(eps, dtype=np.float32), eps_name))
    graph.initializer.append(
        numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), dtype=np.int64), shape_name)
    )
    eps_like, var_eps, std, factor = new("eps_like"), new("var_eps"), new("std"), new("factor")
    shift, offset, factor_b, offset_b = (
        new("shift"),
        new("offset"),
        new("factor_b"),
        new("offset_b"),
    )
    scaled = new("scaled")
    return [
        helper.make_node("Cast", [eps_name], [eps_like], to=_elem_type_of(graph, var)),
        helper.make_node("Add", [var, eps_like], [var_eps]),
        helper.make_node("Sqrt", [var_eps], [std]),
        helper.make_node("Div", [scale, std], [factor]),
        helper.make_node("Mul", [mean, factor], [shift]),
        helper.make_node("Sub", [bias, shift], [offset]),
        helper.make_node("Reshape", [factor, shape_name], [factor_b]),
        helper.make_node("Reshape", [offset, shape_name], [offset_b]),
        helper.make_node("Mul", [x, factor_b], [scaled]),
        helper.make_node("Add", [scaled, offset_b], [node.output[0]], name=node.name),
    ]
