"""onnxruntime's gradient builder on a model whose output is a loss.

The graphs that train without torch (:mod:`._full_graph`, :mod:`._epoch_graph`)
start from the builder's graph: the forward nodes, then backward nodes that
write ``<weight>_grad`` for every trained weight. Unlike the TrainingAgent's
graph it has no YieldOp: one session runs it from inputs to gradients.
"""

from __future__ import annotations

import onnx

from .. import _ort
from .._gradient_rewrites import rewrite_gradient
from .._graph import weights_as_inputs
from ..exceptions import NotDifferentiableError


def gradient_model(model: onnx.ModelProto, loss: str, trainable: list[str], session_options):
    """The builder's graph of ``model`` (a copy) with ``trainable`` made inputs.

    ``model`` computes the scalar ``loss``. Returns ``(graph, float32 loss,
    data inputs)``: the graph takes the data inputs then the trainable
    weights, and outputs the loss as float32 (the builder seeds the backward
    with a float32 gradient: a float64 loss is cast, its gradient casts back
    and the weights' gradients stay float64), then ``<weight>_grad`` of each
    weight.
    """
    C = _ort.onnxruntime().capi._pybind_state
    forward = onnx.ModelProto()
    forward.CopyFrom(model)
    graph = forward.graph
    out = next(o for o in graph.output if o.name == loss)
    loss32 = loss
    if out.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        loss32 = f"{loss}/float32"
        graph.node.append(
            onnx.helper.make_node("Cast", [loss], [loss32], to=onnx.TensorProto.FLOAT)
        )
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(loss32, onnx.TensorProto.FLOAT, []))
    forward = weights_as_inputs(forward, trainable)
    data_inputs = [i.name for i in graph.input if i.name not in set(trainable)]
    try:
        optimized = C.get_optimized_model(
            forward.SerializeToString(), set(trainable), session_options
        )
        builder = C.GradientGraphBuilder(
            optimized, {loss32}, set(trainable), loss32, session_options
        )
        builder.build()
        built = onnx.load_from_string(builder.get_model())
    except Exception as exc:
        raise NotDifferentiableError(
            f"onnxruntime could not build the gradient of {loss!r} with respect to "
            f"{trainable}: {exc}"
        ) from exc
    rewrite_gradient(built, "cpu")
    return built, loss32, data_inputs
