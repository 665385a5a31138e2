"""A prepared graph's train and eval variants, and its weights as graph inputs.

Plain graph code, no torch and no onnxruntime. :func:`make_variant` writes
the graph one mode runs (Dropout's training flag, BatchNormalization's batch
statistics in train mode, with their running averages as extra outputs);
:func:`weights_as_inputs` and :func:`with_weights` move weights between
initializers and graph inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..exceptions import OnnxModelError
from ._batch_norm import (
    _batch_var,
    _decompose_batch_norm,
    batch_norm_nodes,
    training_form,
    unbiased_running_var,
)
from ._lookup import _all_names, _elem_type_of, _infer, _unique
from ._normalize import normalize
from ._onnx_utils import np_dtype
from ._weights import write_constants
from .quantized import requantized

TRAIN = "train"
EVAL = "eval"


def make_variant(
    model: onnx.ModelProto, mode: str, frozen_batch_norm: bool, for_gradient: bool
) -> tuple[onnx.ModelProto, list[str]]:
    """The graph as it computes in ``mode`` (``"train"`` or ``"eval"``).

    Returns the model and the names of the extra outputs it gains (new
    running mean and variance of each BatchNormalization updated in train
    mode, in :func:`batch_norm_nodes` order; only when ``for_gradient`` is
    false: the gradient graph gets them from its own training-mode kernel).

    - Dropout: active in train mode (``training_mode`` forced true), an
      Identity in eval mode.
    - BatchNormalization: batch statistics in train mode; running statistics
      (as elementary ops, since the gradient builder turns an inference-mode
      BatchNormalization into a training-mode one) in eval mode or when
      ``frozen_batch_norm``.
    """
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    graph = variant.graph
    taken = _all_names(graph)
    ranks = _ranks(variant)
    opset = next((o.version for o in variant.opset_import if o.domain in ("", "ai.onnx")), 1)
    # Only these nodes' new running statistics are outputs (untracked ones,
    # statistics computed by nodes, still use batch statistics).
    tracked = {b.output for b in batch_norm_nodes(variant)}
    true_name = None
    new_nodes, extra_outputs, batch_norms = [], [], []
    consumed = {name for node in graph.node for name in node.input}
    consumed |= {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            if mode == EVAL:
                if len(node.output) > 1 and node.output[1] in consumed:
                    # The mask is used: keep the node, switched off.
                    _set_dropout_training(node, graph, taken, False)
                    new_nodes.append(node)
                else:
                    new_nodes.append(
                        helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name)
                    )
                continue
            if true_name is None:
                true_name = _set_dropout_training(node, graph, taken, True)
            else:
                _set_dropout_input(node, 2, true_name)
            new_nodes.append(node)
        elif node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            if mode == EVAL or frozen_batch_norm:
                new_nodes.extend(_decompose_batch_norm(node, ranks, taken, graph))
            elif not for_gradient:
                # Inference session in train mode: the training kernel
                # computes batch statistics and the new running statistics.
                outs = training_form(node, opset, taken)
                new_nodes.append(node)
                if node.output[0] in tracked:
                    batch_norms.append((node, outs))
            else:
                new_nodes.append(node)
        else:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for node, (mean, var) in batch_norms:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        elem = _elem_type_of(graph, node.input[4])
        momentum = float(attrs.get("momentum", 0.9))
        x = node.input[0]
        if x not in ranks:
            raise OnnxModelError(
                f"node {node.name!r} (BatchNormalization): the rank of its input {x!r} is "
                "unknown; run onnx.shape_inference on the model or give the input a shape"
            )
        batch_var = _batch_var(graph, x, ranks[x], opset)
        extra_outputs.append(mean)
        extra_outputs.append(unbiased_running_var(graph, x, var, batch_var, momentum, elem))
    for name in extra_outputs:
        graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return variant, extra_outputs


def predicting_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as it predicts: Dropout off, BatchNormalization on running statistics.

    A graph exported in train mode runs Dropout and batch statistics in any
    onnxruntime session; predictions must not. A model with neither node is
    returned as it is.
    """
    ops = {node.op_type for node in model.graph.node}
    if not ops & {"Dropout", "BatchNormalization"}:
        return model
    variant, _ = make_variant(normalize(model), EVAL, False, for_gradient=False)
    return variant


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    return {name: len(shape) for name, shape in _infer(model)[1].items()}


def _set_dropout_input(node, pos, name):
    while len(node.input) <= pos:
        node.input.append("")
    node.input[pos] = name


def _set_dropout_training(node, graph, taken, value: bool) -> str:
    name = _unique("ortbridge_training_true" if value else "ortbridge_training_false", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(value), name))
    _set_dropout_input(node, 2, name)
    return name


def weights_as_inputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Move the initializers ``names`` to graph inputs (in that order, after the user inputs)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    moved = set(names)
    keep = [init for init in graph.initializer if init.name not in moved]
    # Models of IR version < 4 also list their initializers as inputs.
    inputs = [i for i in graph.input if i.name not in moved]
    del graph.input[:]
    graph.input.extend(inputs)
    for name in names:
        init = inits[name]
        graph.input.append(helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return model


def with_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``weights`` hold new values.

    A weight the file holds in a ``Constant`` node is written back there; one
    it holds quantized is quantized again (:func:`.quantized.requantized`).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    write_constants(out, weights)
    weights = {**weights, **requantized(model, weights)}
    for init in out.graph.initializer:
        if init.name in weights:
            value = np.ascontiguousarray(weights[init.name]).astype(np_dtype(init.data_type))
            if value.size == int(np.prod(init.dims)):  # the file's shape (a scalar stays one)
                value = value.reshape(list(init.dims))
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return out
