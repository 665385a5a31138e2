"""Stage 1: the user's ONNX model made ready for an engine.

In: a path, bytes or ``onnx.ModelProto`` as a user holds it (any exporter,
opset 7 or later, weights in initializers or Constant nodes). Out: a
validated model with its summary (:func:`load_model`, :func:`summarize`), the
normalised graph every engine reads (:func:`normalize`: standard forms of
older exporters' nodes, sequences as tensors, activations with a gradient,
Constant-node weights lifted to initializers), and its train and eval
variants with the weights as graph inputs (:func:`make_variant`). Plain graph
code: no torch, and onnxruntime only to read which version is installed.

What a call alone can tell (ranks, If/Loop conditions) is decided by
:mod:`._call_ranks` and :mod:`._control_flow` at the first call.
"""

from ._batch_norm import batch_norm_nodes, values_per_channel
from ._exporter_forms import bfloat16_names
from ._load import load_model, summarize
from ._normalize import normalize
from ._variants import (
    EVAL,
    TRAIN,
    make_variant,
    predicting_model,
    weights_as_inputs,
    with_weights,
)

__all__ = [
    "EVAL",
    "TRAIN",
    "batch_norm_nodes",
    "bfloat16_names",
    "load_model",
    "make_variant",
    "normalize",
    "predicting_model",
    "summarize",
    "values_per_channel",
    "weights_as_inputs",
    "with_weights",
]
