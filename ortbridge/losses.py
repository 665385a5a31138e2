"""Losses appended to an ONNX graph, with torch's conventions.

:func:`add_loss_output` turns a predicting model into one whose first output
is a scalar training loss, so that onnxruntime can compute the loss, its
gradient and (see :class:`ortbridge.training.OrtFullGraphTrainer`) the weight
update in one graph. With ``p`` the prediction of a row, ``y`` its target and
``r = p - y``, the loss of a row is the mean over its elements of

- ``squared_error``: ``r**2`` (torch's ``MSELoss``),
- ``absolute_error``: ``|r|`` (torch's ``L1Loss``),
- ``elastic``: ``l1_weight * |r| + l2_weight * r**2``,
- ``log_loss``: binary cross-entropy on the raw score ``p``,
  ``log(1 + exp(p)) - y * p`` (torch's ``BCEWithLogitsLoss``).

The loss of a batch is the mean over its rows of ``sample_weight * row_loss``
(torch's ``weight`` argument convention: the mean, not the weighted average),
plus ``l1 * sum(|w|) + l2 * sum(w**2)`` for each penalised initializer ``w``.
Without weights and penalties it is exactly torch's ``reduction="mean"``.

>>> import numpy as np, onnxruntime
>>> from ortbridge import add_loss_output
>>> from ortbridge.examples import linear_model
>>> model = add_loss_output(linear_model(3, 1), "squared_error")
>>> [o.name for o in model.graph.output]
['loss', 'y']
>>> sess = onnxruntime.InferenceSession(model.SerializeToString())
>>> x, label = np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32)
>>> loss, y = sess.run(None, {"x": x, "label": label})
>>> bool(np.isclose(loss, (y**2).mean()))
True
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._prepare._load import load_model
from ._prepare._lookup import _all_names
from ._prepare._loss_nodes import elementwise_loss
from ._prepare._onnx_utils import FLOAT_TYPES, np_dtype
from ._runtime._limits import fit_to_runtime
from .exceptions import OnnxInputError, OnnxModelError

__all__ = ["LOSSES", "add_loss_output", "get_train_initializer"]

#: Names of the losses :func:`add_loss_output` accepts.
LOSSES = ("squared_error", "absolute_error", "elastic", "log_loss")


def get_train_initializer(model) -> dict[str, np.ndarray]:
    """Floating-point initializers of ``model``, the weights one may train.

    Integer initializers (shapes, axes, indices) are left out.

    Parameters
    ----------
    model : onnx.ModelProto, bytes or path
        The model.

    Returns
    -------
    dict of str to numpy.ndarray
        Initializer name to a copy of its value, in graph order.

    Examples
    --------
    >>> from ortbridge import get_train_initializer
    >>> from ortbridge.examples import linear_model
    >>> {k: v.shape for k, v in get_train_initializer(linear_model(3, 2)).items()}
    {'weight': (2, 3), 'bias': (2,)}
    """
    model = load_model(model)
    return {
        init.name: numpy_helper.to_array(init).copy()
        for init in model.graph.initializer
        if init.data_type in FLOAT_TYPES
    }


def add_loss_output(
    model,
    loss: str = "squared_error",
    *,
    weight_name: str | None = None,
    penalty: dict | None = None,
    output_index: int = 0,
    l1_weight: float = 0.5,
    l2_weight: float = 0.5,
    label_name: str = "label",
    loss_name: str = "loss",
) -> onnx.ModelProto:
    """Return a copy of ``model`` whose first output is a scalar training loss.

    The new model takes one more input, ``label_name``, shaped and typed like
    the predicted output, and with ``weight_name`` one more, the per-row
    sample weights of shape ``(N,)``. Its outputs are the loss followed by the
    original outputs. See the module docstring for the formulas.

    Parameters
    ----------
    model : onnx.ModelProto, bytes or path
        A predicting model; its output ``output_index`` is the prediction
        (a raw score for ``log_loss``) with the batch on its first axis.
    loss : {"squared_error", "absolute_error", "elastic", "log_loss"}
        The loss, with torch's conventions (batch mean).
    weight_name : str, optional
        Name of a new input of shape ``(N,)`` holding per-row sample weights.
        The per-row losses are reduced to shape ``(N,)`` before the weights
        multiply them, so no ``(N, 1) x (N,)`` broadcast can happen.
    penalty : dict, optional
        ``{initializer_name: {"l1": a, "l2": b}}`` adds
        ``a * sum(|w|) + b * sum(w**2)`` for each listed initializer.
    output_index : int
        Which output is the prediction.
    l1_weight, l2_weight : float
        Weights of the absolute and squared parts of ``elastic``.
    label_name, loss_name : str
        Names of the new target input and loss output.

    Returns
    -------
    onnx.ModelProto
        The new model, its IR version lowered to what the installed
        onnxruntime loads.

    Raises
    ------
    OnnxInputError
        Unknown loss, penalty on a missing or non-float initializer, a name
        already used in the graph, a bad ``output_index``.
    OnnxModelError
        The prediction is not a float tensor of known rank, or the model's
        opset is newer than the installed onnxruntime runs.

    Examples
    --------
    >>> from ortbridge import add_loss_output
    >>> from ortbridge.examples import linear_model
    >>> model = add_loss_output(
    ...     linear_model(3, 1), "elastic", weight_name="w", penalty={"weight": {"l2": 0.1}}
    ... )
    >>> [i.name for i in model.graph.input]
    ['x', 'label', 'w']
    """
    if loss not in LOSSES:
        raise OnnxInputError(f"loss={loss!r} is not supported: expected one of {LOSSES}")
    model = load_model(model)
    graph = model.graph
    opset = _ai_onnx_opset(model)
    n_outputs = len(graph.output)
    if not -n_outputs <= output_index < n_outputs:
        raise OnnxInputError(
            f"output_index={output_index} is out of range: the model has {n_outputs} output(s) "
            f"{[o.name for o in graph.output]}"
        )
    prediction = graph.output[output_index]
    elem, shape = _float_output(model, prediction)
    dtype = np_dtype(elem)

    taken = _all_names(graph)
    for what, name in (("label_name", label_name), ("weight_name", weight_name)):
        if name is not None and name in taken:
            raise OnnxInputError(f"{what}={name!r} is already a name in the graph: choose another")
    if loss_name in taken or loss_name in (label_name, weight_name):
        raise OnnxInputError(f"loss_name={loss_name!r} is already a name in the graph")
    taken.update({label_name, loss_name} | ({weight_name} if weight_name else set()))

    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def fresh(base):
        name, k = f"{loss_name}/{base}", 0
        while name in taken:
            k += 1
            name = f"{loss_name}/{base}_{k}"
        taken.add(name)
        return name

    def const(base, value):
        name = fresh(base)
        inits.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def node(op, inputs, base, **attrs):
        out = fresh(base)
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    # Elementwise loss (torch's: squares not halved).
    pred = prediction.name
    elementwise = elementwise_loss(
        loss, pred, label_name, node, const, halved=False, l1_weight=l1_weight, l2_weight=l2_weight
    )
    # Per-row loss of shape (N,), then the batch mean.
    rank = len(shape)
    if rank == 0:
        raise OnnxModelError(f"output {pred!r} is a scalar: a prediction needs a batch axis")
    per_row = elementwise
    if rank > 1:
        per_row = fresh("per_row")
        nodes.extend(
            _reduce("ReduceMean", elementwise, per_row, list(range(1, rank)), opset, inits, fresh)
        )
    if weight_name is not None:
        per_row = node("Mul", [per_row, weight_name], "weighted")
    total = fresh("mean")
    nodes.extend(_reduce("ReduceMean", per_row, total, None, opset, inits, fresh))
    for init_name, coefs in (penalty or {}).items():
        total = _add_penalty(graph, elem, init_name, coefs, total, node, const)
    nodes.append(helper.make_node("Identity", [total], [loss_name], name=fresh("output")))

    label_info = helper.make_tensor_value_info(label_name, elem, list(shape))
    _copy_dims(prediction, label_info)
    new_inputs = [label_info]
    if weight_name is not None:
        batch = shape[0]
        new_inputs.append(helper.make_tensor_value_info(weight_name, elem, [batch]))
        _copy_dims(prediction, new_inputs[-1], rank=1)
    first_init = _first_initializer_input(graph)
    for k, info in enumerate(new_inputs):
        graph.input.insert(first_init + k, info)
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    outputs = list(graph.output)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(loss_name, elem, []))
    graph.output.extend(outputs)
    return model  # its IR version already fitted by _ai_onnx_opset


def _ai_onnx_opset(model: onnx.ModelProto) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            fit_to_runtime(model)  # refuses an opset the installed onnxruntime cannot run
            return opset.version
    raise OnnxModelError("the model imports no ai.onnx opset")


def _float_output(model, output) -> tuple[int, tuple]:
    tensor_type = output.type.tensor_type
    if not tensor_type.HasField("shape"):
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # keep the original error message below
            inferred = model
        for out in inferred.graph.output:
            if out.name == output.name:
                tensor_type = out.type.tensor_type
    if tensor_type.elem_type not in FLOAT_TYPES:
        raise OnnxModelError(
            f"output {output.name!r} has element type "
            f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}: a loss needs a "
            "floating-point prediction"
        )
    if not tensor_type.HasField("shape"):
        raise OnnxModelError(
            f"the rank of output {output.name!r} is unknown: give the output a shape "
            "(onnx.shape_inference.infer_shapes could not find it)"
        )
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in tensor_type.shape.dim
    )
    return tensor_type.elem_type, dims


def _copy_dims(source, target, rank=None) -> None:
    """Copy the dims (values and symbolic names) of ``source`` onto ``target``."""
    src = source.type.tensor_type.shape.dim
    dst = target.type.tensor_type.shape.dim
    for k in range(len(dst) if rank is None else rank):
        dst[k].CopyFrom(src[k])


def _reduce(op, data, out, axes, opset, inits, fresh) -> list[onnx.NodeProto]:
    """``op`` over ``axes`` (all when None) with keepdims=0, for any opset."""
    since = {"ReduceMean": 18, "ReduceSum": 13}[op]
    if axes is None:
        return [helper.make_node(op, [data], [out], keepdims=0, name=out)]
    if opset >= since:
        axes_name = fresh("axes")
        inits.append(numpy_helper.from_array(np.array(axes, dtype=np.int64), axes_name))
        return [helper.make_node(op, [data, axes_name], [out], keepdims=0, name=out)]
    return [helper.make_node(op, [data], [out], keepdims=0, axes=axes, name=out)]


def _add_penalty(graph, elem, init_name, coefs, total, node, const) -> str:
    inits = {init.name: init for init in graph.initializer}
    if init_name not in inits or inits[init_name].data_type not in FLOAT_TYPES:
        floats = [name for name, init in inits.items() if init.data_type in FLOAT_TYPES]
        raise OnnxInputError(
            f"penalty names {init_name!r}, which is not a floating-point initializer of the "
            f"model; expected one of {floats}"
        )
    if not isinstance(coefs, dict) or not set(coefs) <= {"l1", "l2"}:
        raise OnnxInputError(
            f"penalty[{init_name!r}] must be a dict with keys 'l1' and/or 'l2', got {coefs!r}"
        )
    if inits[init_name].data_type != elem:
        raise OnnxInputError(
            f"penalty on {init_name!r}: its element type "
            f"{onnx.TensorProto.DataType.Name(inits[init_name].data_type)} differs from the "
            f"prediction's {onnx.TensorProto.DataType.Name(elem)}"
        )
    for key, op in (("l1", "Abs"), ("l2", "Square")):
        coef = coefs.get(key)
        if not coef:
            continue
        if op == "Abs":
            part = node("Abs", [init_name], f"{key}_abs")
        else:
            part = node("Mul", [init_name, init_name], f"{key}_square")
        summed = node("ReduceSum", [part], f"{key}_sum", keepdims=0)
        scaled = node("Mul", [summed, const(f"{key}_coef", coef)], f"{key}_penalty")
        total = node("Add", [total, scaled], f"with_{key}")
    return total


def _first_initializer_input(graph: onnx.GraphProto) -> int:
    """Position after the last user input (old models list initializers as inputs)."""
    inits = {init.name for init in graph.initializer}
    positions = [k for k, i in enumerate(graph.input) if i.name not in inits]
    return positions[-1] + 1 if positions else 0
