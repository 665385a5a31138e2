"""Losses, penalties and learning-rate schedules with scikit-learn's conventions.

Every loss is a sum over the rows of a batch, each row weighted by its sample
weight; the estimators divide the gradient by the sum of the weights of the
batch (the batch size without weights), as ``MLPRegressor`` does. Each loss
exists twice: as ONNX nodes appended to a model (:func:`append_loss`), so that
one onnxruntime forward gives the loss and one backward every gradient, and as
numpy functions (:func:`loss_value`, :func:`loss_gradient`), the reference the
tests compare the graphs with. Both stay in this module, a little over 400
lines, so that a loss's nodes and its reference are read and changed together.

With ``r = p - y`` the residual of a row (``p`` its prediction, a raw score
for ``log_loss``), the value and the gradient in ``p`` of a row are:

- ``squared_error``: ``r**2 / 2`` and ``r``;
- ``absolute_error``: ``|r|`` and ``sign(r)``;
- ``elastic``: ``l1_weight |r| + l2_weight r**2 / 2`` and
  ``l1_weight sign(r) + l2_weight r`` (both weights 0.5 by default);
- ``log_loss``: ``log(1 + exp(p)) - y p`` and ``sigmoid(p) - y`` (``y`` is 0 or 1).

The elastic penalty on the weights is
``alpha * (l1_ratio * |w|_1 + (1 - l1_ratio) / 2 * |w|_2**2)``, scikit-learn's
``SGDRegressor`` convention, which for ``l1_ratio=0`` is ``MLPRegressor``'s
``alpha / 2 * |w|_2**2``.

>>> import numpy as np
>>> p, y = np.array([[1.0], [3.0]]), np.array([[0.0], [1.0]])
>>> float(loss_value("squared_error", p, y))
2.5
>>> loss_gradient("absolute_error", p, y).ravel().tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .._prepare._loss_nodes import elementwise_loss
from .._prepare._onnx_utils import FLOAT_TYPES, make_model, np_dtype
from ..exceptions import OnnxInputError, OnnxModelError

#: Names of the losses the estimators accept.
LOSSES = ("squared_error", "absolute_error", "elastic", "log_loss")
#: Names of the learning-rate schedules the estimators accept.
SCHEDULES = ("constant", "invscaling", "optimal")
#: Operators whose weight input is penalised (the coefficients, not the biases).
PENALISED_INPUTS = {"MatMul": 1, "Gemm": 1, "Conv": 1, "ConvTranspose": 1}


def check_loss(loss: str) -> str:
    """Return ``loss`` if it is a known loss name, raise otherwise."""
    if loss not in LOSSES:
        raise OnnxInputError(f"loss={loss!r} is not supported: expected one of {LOSSES}")
    return loss


def _as_2d(name: str, value, n_rows: int | None = None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if arr.ndim != 2:
        raise OnnxInputError(f"{name} must have 1 or 2 dimensions, got shape {arr.shape}")
    if n_rows is not None and arr.shape[0] != n_rows:
        raise OnnxInputError(f"{name} has {arr.shape[0]} rows, expected {n_rows}")
    return arr


def _prepare(pred, target, sample_weight):
    p = _as_2d("prediction", pred)
    y = _as_2d("target", target, p.shape[0])
    if y.shape != p.shape:
        raise OnnxInputError(f"target has shape {y.shape}, prediction {p.shape}: expected equal")
    if sample_weight is None:
        w = np.ones((p.shape[0], 1), dtype=p.dtype)
    else:
        w = np.asarray(sample_weight, dtype=p.dtype).reshape(-1)
        if w.shape[0] != p.shape[0]:
            raise OnnxInputError(
                f"sample_weight has {w.shape[0]} values, expected one per row ({p.shape[0]})"
            )
        # (N, 1): one weight a row, never broadcast (N,) against (N, 1) into (N, N).
        w = w.reshape(-1, 1)
    return p, y, w


def loss_value(
    loss: str, pred, target, sample_weight=None, *, l1_weight: float = 0.5, l2_weight: float = 0.5
) -> float:
    """Numpy reference of a loss: the weighted sum over the rows.

    Parameters
    ----------
    loss : str
        One of :data:`LOSSES`.
    pred : array of shape (n,) or (n, k)
        Predictions (raw scores for ``log_loss``).
    target : array of the shape of ``pred``
        Targets (0 or 1 for ``log_loss``).
    sample_weight : array of shape (n,), optional
        One weight per row, 1 when omitted.
    l1_weight, l2_weight : float
        Mix of the ``elastic`` loss.

    Returns
    -------
    float

    Examples
    --------
    >>> float(loss_value("log_loss", [0.0], [1.0]))  # log(2)
    0.6931471805599453
    """
    check_loss(loss)
    p, y, w = _prepare(pred, target, sample_weight)
    r = p - y
    if loss == "squared_error":
        rows = 0.5 * r * r
    elif loss == "absolute_error":
        rows = np.abs(r)
    elif loss == "elastic":
        rows = l1_weight * np.abs(r) + l2_weight * 0.5 * r * r
    else:
        rows = np.logaddexp(0, p) - y * p
    return float((w * rows).sum())


def loss_gradient(
    loss: str, pred, target, sample_weight=None, *, l1_weight: float = 0.5, l2_weight: float = 0.5
) -> np.ndarray:
    """Numpy reference of the gradient of :func:`loss_value` in the prediction.

    Returns an array of shape ``(n, k)`` (``(n, 1)`` for a 1-D prediction).

    Examples
    --------
    >>> loss_gradient("squared_error", [2.0, 0.0], [1.0, 1.0], [1.0, 3.0]).ravel().tolist()
    [1.0, -3.0]
    """
    check_loss(loss)
    p, y, w = _prepare(pred, target, sample_weight)
    r = p - y
    if loss == "squared_error":
        rows = r
    elif loss == "absolute_error":
        rows = np.sign(r)
    elif loss == "elastic":
        rows = l1_weight * np.sign(r) + l2_weight * r
    else:
        rows = 1.0 / (1.0 + np.exp(-p)) - y
    return w * rows


def penalty_value(weights, alpha: float, l1_ratio: float) -> float:
    """Numpy reference of the elastic penalty summed over several weight arrays.

    Examples
    --------
    >>> penalty_value([np.array([1.0, -2.0])], alpha=0.5, l1_ratio=0.0)  # 0.5 / 2 * 5
    1.25
    """
    total = 0.0
    for w in weights:
        w = np.asarray(w)
        total += l1_ratio * np.abs(w).sum() + 0.5 * (1 - l1_ratio) * (w * w).sum()
    return float(alpha * total)


def penalty_gradient(weight, alpha: float, l1_ratio: float) -> np.ndarray:
    """Numpy reference of the gradient of :func:`penalty_value` for one weight array.

    Examples
    --------
    >>> penalty_gradient(np.array([1.0, -2.0]), alpha=1.0, l1_ratio=1.0).tolist()
    [1.0, -1.0]
    """
    w = np.asarray(weight)
    return alpha * (l1_ratio * np.sign(w) + (1 - l1_ratio) * w)


def optimal_t0(alpha: float) -> float:
    """Offset ``t0`` of the ``optimal`` schedule (Léon Bottou's heuristic).

    scikit-learn's ``SGDRegressor`` starts the schedule at
    ``typw / max(1, dloss(-typw, 1))`` with ``typw = sqrt(1 / sqrt(alpha))``;
    for the losses of this module the derivative term is never above 1, so the
    first learning rate is ``typw`` and ``t0 = 1 / (alpha * typw)``.
    """
    if not alpha > 0:
        raise OnnxInputError(
            f"learning_rate='optimal' needs alpha > 0 (it sets the schedule), got alpha={alpha}"
        )
    typw = np.sqrt(1.0 / np.sqrt(alpha))
    return float(1.0 / (alpha * typw))


def learning_rate(
    schedule: str, learning_rate_init: float, t: int, *, power_t: float = 0.5, alpha: float = 0.0
) -> float:
    """Learning rate after ``t`` samples were seen.

    ``constant``: ``learning_rate_init``; ``invscaling``:
    ``learning_rate_init / (t + 1) ** power_t`` (``MLPRegressor``);
    ``optimal``: ``1 / (alpha * (t0 + t))`` (``SGDRegressor``, see
    :func:`optimal_t0`; it ignores ``learning_rate_init``).

    Examples
    --------
    >>> learning_rate("invscaling", 0.1, 99, power_t=0.5)
    0.01
    """
    if schedule == "constant":
        return float(learning_rate_init)
    if schedule == "invscaling":
        return float(learning_rate_init / (t + 1) ** power_t)
    if schedule == "optimal":
        return float(1.0 / (alpha * (optimal_t0(alpha) + t)))
    raise OnnxInputError(
        f"learning_rate={schedule!r} is not supported: expected one of {SCHEDULES}"
    )


def sgd_update(weight, grad, velocity, *, lr: float, momentum: float = 0.0, nesterov: bool = False):
    """Numpy reference of scikit-learn's SGD update (``MLPRegressor``).

    ``grad`` is the gradient already divided by the batch size (or the sum of
    its sample weights). Returns ``(new_weight, new_velocity)``:
    ``v = momentum * v - lr * grad``, then ``w += v``, or with Nesterov
    ``w += momentum * v - lr * grad``.

    Examples
    --------
    >>> w, v = sgd_update(np.array([1.0]), np.array([2.0]), np.array([0.0]), lr=0.1, momentum=0.5)
    >>> w.tolist(), v.tolist()
    ([0.8], [-0.2])
    """
    v = momentum * velocity - lr * grad
    step = momentum * v - lr * grad if nesterov else v
    return weight + step, v


def penalised_initializers(model: onnx.ModelProto) -> set[str]:
    """Names of the initializers the elastic penalty applies to.

    As ``MLPRegressor`` penalises its coefficients but not its intercepts, the
    penalty applies to initializers used as the weight of a ``MatMul``,
    ``Gemm``, ``Conv`` or ``ConvTranspose`` node, not to the others (biases).
    """
    names = {init.name for init in model.graph.initializer}
    found = set()
    for node in model.graph.node:
        index = PENALISED_INPUTS.get(node.op_type)
        if index is not None and len(node.input) > index and node.input[index] in names:
            found.add(node.input[index])
    return found


def _loss_nodes(loss, pred, target, weight, output, dtype, prefix, l1_weight, l2_weight):
    """Nodes computing ``output = sum(weight * loss(pred, target))``.

    ``pred``, ``target`` are (n, k) and ``weight`` is (n, 1); the elementwise
    loss is :func:`ortbridge._prepare._loss_nodes.elementwise_loss`'s, squares halved.
    """
    nodes = []

    def node(op, inputs, base, **attrs):
        nodes.append(helper.make_node(op, inputs, [f"{prefix}{base}"], **attrs))
        return f"{prefix}{base}"

    def const(base, value):
        # A Constant node, not an initializer: OnnxModule would train a float
        # initializer.
        tensor = numpy_helper.from_array(np.array(value, dtype=dtype), f"{prefix}{base}")
        nodes.append(helper.make_node("Constant", [], [tensor.name], value=tensor))
        return tensor.name

    rows = elementwise_loss(
        loss, pred, target, node, const, halved=True, l1_weight=l1_weight, l2_weight=l2_weight
    )
    weighted = node("Mul", [rows, weight], "weighted")
    nodes.append(helper.make_node("ReduceSum", [weighted], [output], keepdims=0))
    return nodes


def _value_info_of(graph: onnx.GraphProto, name: str):
    for value in list(graph.output) + list(graph.value_info) + list(graph.input):
        if value.name == name:
            return value
    return None


def append_loss(
    model: onnx.ModelProto,
    loss: str,
    *,
    output: str | None = None,
    target_name: str = "ortbridge_target",
    weight_name: str = "ortbridge_sample_weight",
    loss_name: str = "ortbridge_loss",
    l1_weight: float = 0.5,
    l2_weight: float = 0.5,
) -> onnx.ModelProto:
    """Return a copy of ``model`` whose only output is the weighted summed loss.

    The new model takes the inputs of ``model``, then ``target_name`` of shape
    ``(n, k)`` and ``weight_name`` of shape ``(n, 1)``; ``k`` is the number of
    columns of the prediction, a 1-D prediction counting as one column. The
    loss is the scalar ``sum(weight * loss(prediction, target))``
    (see the table of this module).

    Parameters
    ----------
    model : onnx.ModelProto
        A model whose output ``output`` (the first one by default) is the
        prediction (the raw score for ``log_loss``).
    loss : str
        One of :data:`LOSSES`.
    output : str, optional
        Name of the prediction output.

    Examples
    --------
    >>> from onnx import TensorProto, helper
    >>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1])
    >>> graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
    ...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])])
    >>> with_loss = append_loss(make_model(graph), "squared_error")
    >>> [i.name for i in with_loss.graph.input], [o.name for o in with_loss.graph.output]
    (['x', 'ortbridge_target', 'ortbridge_sample_weight'], ['ortbridge_loss'])
    """
    check_loss(loss)
    if not isinstance(model, onnx.ModelProto):
        raise OnnxModelError(f"model must be an onnx.ModelProto, got {type(model).__name__}")
    graph = model.graph
    outputs = [o.name for o in graph.output]
    if not outputs:
        raise OnnxModelError("the model has no output: expected its prediction as an output")
    output = outputs[0] if output is None else output
    if output not in outputs:
        raise OnnxModelError(f"the model has no output {output!r}: its outputs are {outputs}")
    info = _value_info_of(graph, output)
    elem = info.type.tensor_type.elem_type
    if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
        raise OnnxModelError(
            f"output {output!r} has element type {onnx.TensorProto.DataType.Name(elem)}: "
            "expected float or double to append a loss"
        )
    dims = info.type.tensor_type.shape.dim
    n_cols = 1
    if len(dims) == 2:
        n_cols = dims[1].dim_value if dims[1].HasField("dim_value") else None
    elif len(dims) > 2:
        raise OnnxModelError(
            f"output {output!r} has {len(dims)} dimensions: expected (n,) or (n, k)"
        )
    used = {n for node in graph.node for n in list(node.input) + list(node.output)}
    used |= {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for new in (target_name, weight_name, loss_name):
        if new in used:
            raise OnnxModelError(f"the model already uses the name {new!r}: choose another one")
    prefix = f"{loss_name}__"
    dtype = np_dtype(elem)
    shape = numpy_helper.from_array(np.array([0, -1], dtype=np.int64), f"{prefix}shape")
    reshape = helper.make_node("Reshape", [output, shape.name], [f"{prefix}pred"])
    nodes = _loss_nodes(
        loss,
        f"{prefix}pred",
        target_name,
        weight_name,
        loss_name,
        dtype,
        prefix,
        l1_weight,
        l2_weight,
    )
    new = onnx.ModelProto()
    new.CopyFrom(model)
    del new.graph.output[:]
    new.graph.node.append(reshape)
    new.graph.node.extend(nodes)
    new.graph.initializer.append(shape)
    new.graph.input.extend(
        [
            helper.make_tensor_value_info(target_name, elem, ["ortbridge_n", n_cols]),
            helper.make_tensor_value_info(weight_name, elem, ["ortbridge_n", 1]),
        ]
    )
    new.graph.output.append(helper.make_tensor_value_info(loss_name, elem, []))
    return new


def loss_model(loss: str, elem: int = onnx.TensorProto.FLOAT, n_cols: int = 1, **kwargs):
    """A model ``(prediction, target, weight) -> loss``: :func:`append_loss` on an identity.

    Examples
    --------
    >>> [i.name for i in loss_model("log_loss").graph.input]
    ['prediction', 'ortbridge_target', 'ortbridge_sample_weight']
    """
    if elem not in FLOAT_TYPES:
        raise OnnxInputError(f"elem={elem} is not a float ONNX element type")
    pred = helper.make_tensor_value_info("prediction", elem, ["n", n_cols])
    out = helper.make_tensor_value_info("prediction_out", elem, ["n", n_cols])
    node = helper.make_node("Identity", ["prediction"], ["prediction_out"])
    graph = helper.make_graph([node], "loss", [pred], [out])
    return append_loss(make_model(graph), loss, **kwargs)
