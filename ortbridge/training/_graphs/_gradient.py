"""The gradient graph of a model whose output is a loss, from one of two sources.

The graphs that train without torch (:mod:`.._full_graph`, :mod:`._epoch`)
start from one graph that runs from the inputs to the loss and the
gradients ``<weight>_grad`` of every trained weight, in one session. Two
sources write it, named as :class:`~ortbridge.OnnxModule`'s engines:

- ``"training-agent"``: onnxruntime-training's ``GradientGraphBuilder`` (its
  forward and backward nodes, without the TrainingAgent's YieldOp); the
  graph holds training-only kernels, so only the training build runs it.
- ``"onnxruntime"``: onnx-ad's standard-op reverse graph
  (:mod:`._reverse_gradient`), which any onnxruntime runs.

``"auto"`` picks as ``OnnxModule`` does, but with its own preference, measured per
kind of graph where the training build is installed (``benchmarks/README.rst``,
2-core CPU):

- the estimators' epoch graph prefers the builder: an epoch runs as fast on
  either graph (3.3-3.5 ms on ``bench_sklearn.py``'s MLP), but onnx-ad's two
  graphs (full and last batch) take about 0.1 s longer to build, 0.35x
  against 0.45x scikit-learn's fit time;
- the full graph prefers onnx-ad: built for the batch's shape, its step took
  0.94-0.98x the builder's (``bench_training_paths.py``), 0.65x against 0.74x
  scikit-learn's time on ``bench_sklearn.py``.

The builder is chosen only where it differentiates the model correctly
(:func:`ortbridge._engines.builder_avoids`); without the training build
onnx-ad's graph is the only source. A model the preferred source refuses
goes to the other.
"""

from __future__ import annotations

import dataclasses
import functools

import onnx

from ortbridge import _engines
from ortbridge._engines.training_agent._gradient_rewrites import rewrite_gradient
from ortbridge._prepare._onnx_utils import set_input_shapes
from ortbridge._prepare._variants import weights_as_inputs
from ortbridge._runtime import _errors, _ort
from ortbridge.exceptions import NotDifferentiableError, OnnxModelError

BUILDER = _engines.TRAINING_AGENT
ONNX_AD = _engines.ONNXRUNTIME


@dataclasses.dataclass
class LossGradient:
    """A graph computing a loss and its gradients, and how to feed it."""

    #: Inputs: ``data_inputs``, then the trained weights; outputs: ``loss``,
    #: then ``<weight>_grad`` of each weight.
    model: onnx.ModelProto
    loss: str
    data_inputs: list[str]
    #: A scalar initializer holding the backward's seed (1), of type
    #: ``seed_elem``; None where the graph has none to replace.
    seed: str | None
    seed_elem: int
    #: Which source wrote it, and why it was chosen.
    source: str
    reason: str
    #: Built for the input shapes it was given (it runs on those only).
    static: bool = False

    @property
    def loss_elem(self) -> int:
        return self.model.graph.output[0].type.tensor_type.elem_type


def resolve(backend: str, model: onnx.ModelProto, prefer: str = BUILDER) -> tuple[str, str]:
    """The gradient source for ``backend`` and ``model``, and why it was chosen.

    ``prefer``: what ``"auto"`` takes where both sources may differentiate
    the model (the builder's graph then only where it is correct).
    """
    source, reason = _engines.resolve(backend, model, prefer)
    if backend == _engines.AUTO and prefer == ONNX_AD and source == ONNX_AD and _ort.has_training():
        return ONNX_AD, "measured faster than the training build's builder for this graph"
    return source, reason


def gradient_model(
    model: onnx.ModelProto,
    loss: str,
    trainable: list[str],
    session_options,
    backend: str = _engines.AUTO,
    static: dict | None = None,
    prefer: str = BUILDER,
) -> LossGradient:
    """The gradient graph of ``model`` (not modified) with ``trainable`` made inputs.

    ``model`` computes the scalar ``loss``. The builder's graph outputs the
    loss as float32 (its backward is seeded with a float32 gradient: a
    float64 loss is cast, its gradient casts back and the weights' gradients
    stay float64); onnx-ad's keeps the loss's type.

    ``static`` (input name -> shape): onnx-ad's graph is built for these
    shapes. With unknown sizes it computes its broadcasting and reduction
    axes at run time (an MLP's step measured 2.2x slower) and cannot
    differentiate Conv or Slice at all; the builder's graph, which
    onnxruntime folds itself, stays shape-generic. ``prefer``: see :func:`resolve`.
    """
    source, reason = resolve(backend, model, prefer)
    forward = _copy(model)
    graph = forward.graph
    out = next(o for o in graph.output if o.name == loss)
    del graph.output[:]
    graph.output.append(out)
    forward = weights_as_inputs(forward, trainable)
    data_inputs = [i.name for i in graph.input if i.name not in set(trainable)]
    build = {BUILDER: _from_builder, ONNX_AD: functools.partial(_from_onnx_ad, static=static)}
    try:
        return build[source](forward, loss, trainable, session_options, data_inputs, reason)
    except NotDifferentiableError as exc:
        other = ONNX_AD if source == BUILDER else BUILDER
        if backend != _engines.AUTO or not _available(other):
            raise
        try:
            why = f"the {source} source refused the model: {exc}"
            return build[other](forward, loss, trainable, session_options, data_inputs, why)
        except NotDifferentiableError:
            raise exc from None


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _available(source: str) -> bool:
    if source == BUILDER:
        return _ort.has_training()
    return _engines.onnxruntime_engine_available()


def _from_onnx_ad(forward, loss, trainable, session_options, data_inputs, reason, static):
    from ._reverse_gradient import reverse_gradient  # imports onnx-ad

    forward = _copy(forward)  # unchanged for the other source if this one refuses
    set_input_shapes(forward, static or {})
    if static:
        try:  # a batch the model cannot take: say so, not what onnx-ad makes of it
            onnx.shape_inference.infer_shapes(forward, strict_mode=True)
        except onnx.shape_inference.InferenceError as exc:
            shapes = {name: tuple(shape) for name, shape in static.items()}
            raise OnnxModelError(f"the model cannot run a batch of shapes {shapes}: {exc}") from exc
    built, seed = reverse_gradient(forward, loss, trainable)
    elem = built.graph.output[0].type.tensor_type.elem_type
    return LossGradient(built, loss, data_inputs, seed, elem, ONNX_AD, reason, bool(static))


def _from_builder(forward, loss, trainable, session_options, data_inputs, reason):
    from ortbridge._engines.training_agent import _limits

    C = _ort.onnxruntime().capi._pybind_state
    # What the builder gets wrong or crashes on is rewritten or refused first,
    # as the training agent does; the copy is unchanged for the other source.
    forward = _copy(_limits.rewrite_for_builder(forward))
    _limits.refuse_limits(forward, trainable)
    graph = forward.graph
    loss32 = loss
    if graph.output[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        loss32 = f"{loss}/float32"
        graph.node.append(
            onnx.helper.make_node("Cast", [loss], [loss32], to=onnx.TensorProto.FLOAT)
        )
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(loss32, onnx.TensorProto.FLOAT, []))
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
        doing = f"build the gradient of {loss!r} with respect to {trainable}"
        raise _errors.translate(exc, doing, forward, refuse=BUILDER) from exc
    rewrite_gradient(built, "cpu")
    # The builder seeds the backward with a constant it names after the loss.
    seed = f"{loss32}_grad"
    if seed not in {init.name for init in built.graph.initializer}:
        seed = None
    return LossGradient(built, loss32, data_inputs, seed, onnx.TensorProto.FLOAT, BUILDER, reason)
