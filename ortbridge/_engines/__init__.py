"""The two engines behind :class:`~ortbridge.OnnxModule`, and how ``backend`` picks one.

Each engine builds a gradient graph object with one interface the autograd
Function calls: ``forward(tensors) -> (outputs, residual tensors, token)``
and ``backward(output gradients, token, residuals, tensors, saved outputs)
-> gradients``, plus the bookkeeping attributes ``n_user_outputs``,
``non_differentiable``, ``full_shape``, ``save_outputs`` (the token, where
it has its own, says which outputs its backward reads) and ``grad_slots``.

- ``"training-agent"`` (:mod:`.training_agent._engine`): onnxruntime-training
  1.19.2's gradient builder and TrainingAgent.
- ``"onnxruntime"`` (:mod:`.onnxruntime._engine`): onnx-ad's reverse mode, split in
  two graphs, run by any onnxruntime.
- ``"auto"``: the onnxruntime engine; the training agent only for a graph
  the onnxruntime engine refuses, where the training build is installed and
  its builder differentiates the graph correctly. No graph is run twice to
  choose (a trial run would move running statistics and random draws).
"""

from __future__ import annotations

import onnx

from .._runtime import _ort
from ..exceptions import MissingDependencyError, OnnxInputError

TRAINING_AGENT = "training-agent"
ONNXRUNTIME = "onnxruntime"
AUTO = "auto"
BACKENDS = (AUTO, TRAINING_AGENT, ONNXRUNTIME)


def builder_avoids(model: onnx.ModelProto) -> str | None:
    """Why the training build's builder must not differentiate ``model`` (None: it may).

    The table of :mod:`.training_agent._limits`, after its rewrites.
    """
    from .training_agent import _limits

    found = _limits.first_limit(_limits.rewrite_for_builder(model))
    return None if found is None else _limits.describe(*found)


def onnxruntime_engine_available() -> bool:
    try:
        _ort.runtime()
        from .onnxruntime._reverse_prep import onnx_ad

        onnx_ad()
    except MissingDependencyError:
        return False
    return True


def installed() -> list[str]:
    """The engines this environment can run (the training agent first)."""
    found = [TRAINING_AGENT] if _ort.has_training() else []
    return found + ([ONNXRUNTIME] if onnxruntime_engine_available() else [])


def resolve(backend: str, model: onnx.ModelProto, prefer: str = ONNXRUNTIME) -> tuple[str, str]:
    """The engine for ``backend`` and ``model``, and why it was chosen.

    ``prefer``: the engine ``"auto"`` takes where both are installed and may
    differentiate the model (the other is then the fallback for what it refuses).
    """
    if backend not in BACKENDS:
        raise OnnxInputError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == TRAINING_AGENT:
        _ort.onnxruntime()  # names the extra to install when the build is missing
        return TRAINING_AGENT, "asked for"
    if backend == ONNXRUNTIME:
        _ort.runtime()
        from .onnxruntime._reverse_prep import onnx_ad

        onnx_ad()
        return ONNXRUNTIME, "asked for"
    if not _ort.has_training():
        _ort.runtime()
        return ONNXRUNTIME, "onnxruntime's training build is not installed"
    if not onnxruntime_engine_available():
        return TRAINING_AGENT, "onnx-ad is not installed: the training build's engine"
    if prefer == ONNXRUNTIME:
        return ONNXRUNTIME, "the default engine (the training agent is its fallback here)"
    avoid = builder_avoids(model)
    if avoid:
        return ONNXRUNTIME, f"the training build cannot differentiate it: {avoid}"
    return TRAINING_AGENT, "onnxruntime's training build is installed"


def fallback(engine: str, model: onnx.ModelProto) -> str | None:
    """The engine ``"auto"`` moves to after ``engine`` refuses ``model`` (None: none)."""
    if engine == ONNXRUNTIME:
        if _ort.has_training() and builder_avoids(model) is None:
            return TRAINING_AGENT
        return None
    return ONNXRUNTIME if onnxruntime_engine_available() else None


def graph_class(engine: str):
    """The gradient-graph class of ``engine``."""
    if engine == TRAINING_AGENT:
        from .training_agent._engine import GradientGraph

        return GradientGraph
    from .onnxruntime._engine import OrtGradientGraph

    return OrtGradientGraph


def gradient_graph(engine: str, model: onnx.ModelProto, *args, **kwargs):
    """The gradient graph of ``engine`` for ``model`` (arguments of its class).

    On the onnxruntime engine, a graph with main-graph ``If`` or ``Loop``
    nodes gets one gradient graph per branch a call takes (and per trip count
    of a loop it unrolls; :mod:`.onnxruntime._resolved`).
    """
    if engine == ONNXRUNTIME:
        from .._prepare._control_flow import main_control_flow

        if main_control_flow(model):
            from .onnxruntime._resolved import ResolvedGradientGraph

            return ResolvedGradientGraph(model, *args, **kwargs)
    return graph_class(engine)(model, *args, **kwargs)
