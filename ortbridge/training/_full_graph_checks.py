"""Checks of what :class:`._full_graph.OrtFullGraphTrainer` is given: its model and data.

They run before onnxruntime sees either, whose own errors would name graph
nodes. The model must take one input, have no BatchNormalization (the graph
could not update its running statistics), and the weights to train must be
float32 or float64 initializers of one type. ``X`` must have the input's
shape, ``y`` the prediction's (``(N,)`` and ``(N, 1)`` stand for one
another) and ``sample_weight`` one value a row.
"""

from __future__ import annotations

import numpy as np
import onnx

from .._prepare._onnx_utils import FLOAT_TYPES
from ..exceptions import OnnxInputError, OnnxModelError


class _TrainerChecks:
    """The checks of :class:`._full_graph.OrtFullGraphTrainer`."""

    def _check_model(self, model: onnx.ModelProto):
        """``model``'s float initializers, those to train, its input and their element type."""
        floats = {
            init.name: init for init in model.graph.initializer if init.data_type in FLOAT_TYPES
        }
        trainable = list(floats) if self.trainable is None else list(self.trainable)
        unknown = [name for name in trainable if name not in floats]
        if unknown or not trainable:
            raise OnnxInputError(
                f"trainable={self.trainable!r}: {unknown or 'nothing'} is not a floating-point "
                f"initializer of the model; expected some of {list(floats)}"
            )
        batch_norms = [n.name for n in model.graph.node if n.op_type == "BatchNormalization"]
        if batch_norms:
            # Trained in train mode they use batch statistics, and the graph has
            # no way to update the running ones.
            raise OnnxModelError(
                f"OrtFullGraphTrainer cannot train BatchNormalization nodes {batch_norms}: "
                "their running statistics would never be updated; train the model with "
                "ortbridge.OnnxModule, which tracks them"
            )
        types = {floats[name].data_type for name in trainable}
        inits = {init.name for init in model.graph.initializer}
        inputs = [i for i in model.graph.input if i.name not in inits]
        if len(inputs) != 1:
            raise OnnxModelError(
                f"OrtFullGraphTrainer trains models with one input, this one has "
                f"{[i.name for i in inputs]}"
            )
        if len(types) != 1 or not types <= {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}:
            names = [onnx.TensorProto.DataType.Name(t) for t in sorted(types)]
            raise OnnxModelError(
                f"OrtFullGraphTrainer trains float32 or float64 weights of one type, the "
                f"trainable initializers are {names}"
            )
        return floats, trainable, inputs[0], types.pop()

    def _check_inputs(self, X) -> np.ndarray:
        """``X`` in the input's element type, checked against its shape."""
        X = np.ascontiguousarray(X, dtype=self._input_dtype)
        expected = self._input_shape
        if X.ndim == 0 or (
            expected is not None
            and (
                len(expected) != X.ndim
                or any(e is not None and e != d for e, d in zip(expected[1:], X.shape[1:]))
            )
        ):
            shown = "?" if expected is None else tuple("N" if e is None else e for e in expected)
            raise OnnxInputError(
                f"input {self._input_name!r}: expected shape {shown}, got {X.shape}"
            )
        return X

    def _check_data(self, X, y, sample_weight):
        """``X``; ``y`` shaped as the prediction; ``sample_weight`` as ``(N,)``."""
        X = self._check_inputs(X)
        n = len(X)
        output = self._onnx.graph.output[self.output_index]
        rank = len(output.type.tensor_type.shape.dim)
        y = np.asarray(y, dtype=self._dtype)
        if y.ndim == rank - 1 and rank == 2:
            y = y.reshape(-1, 1)
        elif y.ndim == rank + 1 and y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        dims = output.type.tensor_type.shape.dim
        sizes = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        if (
            len(y) != n
            or (rank and y.ndim != rank)
            or any(s is not None and s != got for s, got in zip(sizes[1:], y.shape[1:]))
        ):
            shown = tuple(["N"] + ["?" if s is None else s for s in sizes[1:]]) if rank else ()
            raise OnnxInputError(
                f"y: expected {n} rows shaped like output {output.name!r} {shown}, "
                f"got shape {y.shape}"
            )
        y = np.ascontiguousarray(y)
        if sample_weight is not None:
            sample_weight = np.asarray(sample_weight, dtype=self._dtype)
            if sample_weight.size != n or sample_weight.ndim > 2:
                raise OnnxInputError(
                    f"sample_weight: expected shape ({n},), got {sample_weight.shape}"
                )
            # (N, 1) weights become (N,): multiplied with the (N,) per-row losses.
            sample_weight = np.ascontiguousarray(sample_weight.reshape(n))
        return X, y, sample_weight
