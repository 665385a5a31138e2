"""The two engines behind :class:`~ortbridge.OnnxModule`, and how ``backend`` picks one.

Each engine builds a gradient graph object with one interface the autograd
Function calls: ``forward(tensors) -> (outputs, residual tensors, token)``
and ``backward(output gradients, token, residuals, tensors, saved outputs)
-> gradients``, plus the bookkeeping attributes ``n_user_outputs``,
``non_differentiable``, ``full_shape``, ``save_outputs`` and ``grad_slots``.

- ``"training-agent"`` (:mod:`._training_agent`): onnxruntime-training
  1.19.2's gradient builder and TrainingAgent.
- ``"onnxruntime"`` (:mod:`._onnxruntime`): onnx-ad's reverse mode, split in
  two graphs, run by any onnxruntime.
- ``"auto"``: the training agent where the training build is installed and
  its builder differentiates the graph correctly; the onnxruntime engine
  otherwise.
"""

from __future__ import annotations

import onnx

from .. import _ort
from .._onnx_utils import attr
from ..exceptions import MissingDependencyError, OnnxInputError

TRAINING_AGENT = "training-agent"
ONNXRUNTIME = "onnxruntime"
AUTO = "auto"
BACKENDS = (AUTO, TRAINING_AGENT, ONNXRUNTIME)

# Node configurations the training build's gradient builder must never see:
# it crashes on them, gets them silently wrong, or writes a gradient graph
# with no CPU kernel. Under "auto" they go to the onnxruntime engine.
_BUILDER_AVOIDS = {
    "Loop": "crashes the gradient builder (SIGSEGV/abort)",
    "Scan": "has no gradient in the training build",
    "ConvTranspose": "its gradient has no CPU kernel in the training build",
    "Resize": "its gradient has no CPU kernel in the training build",
    "SplitToSequence": "makes the training build call weights unreachable",
    "GridSample": "has no gradient in the training build",
}


def builder_avoids(model: onnx.ModelProto) -> str | None:
    """Why the training build's builder must not differentiate ``model`` (None: it may)."""
    for node in model.graph.node:
        reason = _BUILDER_AVOIDS.get(node.op_type)
        if node.op_type in ("Conv", "AveragePool", "MaxPool") and str(
            attr(node, "auto_pad", "NOTSET")
        ).startswith("SAME"):
            reason = "auto_pad=SAME_* gets a wrong gradient from the training build"
        elif node.op_type in ("ScatterND", "ScatterElements") and attr(
            node, "reduction", "none"
        ) not in ("none",):
            reason = "a reduction gets a wrong gradient from the training build"
        elif node.op_type == "LSTM" and attr(node, "direction", "forward") == "bidirectional":
            reason = "a bidirectional LSTM's gradient has no CPU kernel in the training build"
        elif node.op_type == "AveragePool" and (
            any(attr(node, "pads", []) or [])
            or any(d != 1 for d in attr(node, "dilations", []) or [])
            or len(attr(node, "kernel_shape", []) or []) == 3
        ):
            reason = "pads, dilations or a 3-D window get a wrong gradient from the training build"
        elif node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
            reason = "its indices output gets a wrong gradient from the training build"
        if reason:
            return f"node {node.name!r} ({node.op_type}): {reason}"
    return None


def onnxruntime_engine_available() -> bool:
    try:
        _ort.runtime()
        from ._onnxruntime import onnx_ad

        onnx_ad()
    except MissingDependencyError:
        return False
    return True


def resolve(backend: str, model: onnx.ModelProto) -> tuple[str, str]:
    """The engine for ``backend`` and ``model``, and why it was chosen."""
    if backend not in BACKENDS:
        raise OnnxInputError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == TRAINING_AGENT:
        _ort.onnxruntime()  # names the extra to install when the build is missing
        return TRAINING_AGENT, "asked for"
    if backend == ONNXRUNTIME:
        _ort.runtime()
        from ._onnxruntime import onnx_ad

        onnx_ad()
        return ONNXRUNTIME, "asked for"
    if not _ort.has_training():
        _ort.runtime()
        return ONNXRUNTIME, "onnxruntime's training build is not installed"
    avoid = builder_avoids(model)
    if avoid and onnxruntime_engine_available():
        return ONNXRUNTIME, f"the training build cannot differentiate it: {avoid}"
    return TRAINING_AGENT, "onnxruntime's training build is installed"


def graph_class(engine: str):
    """The gradient-graph class of ``engine``."""
    if engine == TRAINING_AGENT:
        from ._training_agent import GradientGraph

        return GradientGraph
    from ._onnxruntime import OrtGradientGraph

    return OrtGradientGraph
