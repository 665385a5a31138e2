"""Checks of the estimators' parameters, model and data, in scikit-learn's words.

Everything a user gives an estimator is checked before onnxruntime sees it,
whose own errors would name graph nodes: the constructor's parameters at each
``fit``, the model's single float input, ``X``'s and ``y``'s widths against
the model's input and prediction, ``sample_weight``. The messages are
scikit-learn's where it has one (``X has 3 features, but OnnxSGDRegressor is
expecting 4 features as input``), so that a user of both reads one wording.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from sklearn.exceptions import NotFittedError as SklearnNotFittedError
from sklearn.utils import check_array

from .. import _engines, _prepare, exceptions
from .._prepare._onnx_utils import np_dtype
from ..exceptions import OnnxInputError, OnnxModelError
from . import _losses


class NotFittedError(exceptions.NotFittedError, SklearnNotFittedError):
    """An estimator was used before ``fit``; also scikit-learn's ``NotFittedError``."""


class _Checks:
    """The checks of :class:`._estimators._BaseOnnxSGD`, on its parameters and data."""

    def _check_params(self):
        if self.backend not in _engines.BACKENDS:
            raise OnnxInputError(
                f"backend must be one of {list(_engines.BACKENDS)}, got {self.backend!r}"
            )
        if self.loss not in self._losses_allowed:
            raise OnnxInputError(
                f"loss={self.loss!r} is not supported by {type(self).__name__}: "
                f"expected one of {self._losses_allowed}"
            )
        if self.learning_rate not in _losses.SCHEDULES:
            raise OnnxInputError(
                f"learning_rate={self.learning_rate!r} is not supported: "
                f"expected one of {_losses.SCHEDULES}"
            )
        checks = [
            ("learning_rate_init", self.learning_rate_init, 0, None, False),
            ("momentum", self.momentum, 0, 1, True),
            ("alpha", self.alpha, 0, None, True),
            ("l1_ratio", self.l1_ratio, 0, 1, True),
            ("power_t", self.power_t, None, None, True),
        ]
        for name, value, low, high, low_ok in checks:
            ok = isinstance(value, (int, float, np.number)) and math.isfinite(value)
            ok = ok and (low is None or value > low or (low_ok and value == low))
            ok = ok and (high is None or value <= high)
            if not ok:
                bounds = f"{'>=' if low_ok else '>'} {low}" if low is not None else "finite"
                bounds += f" and <= {high}" if high is not None else ""
                raise OnnxInputError(f"{name} must be a number {bounds}, got {value!r}")
        if self.learning_rate == "optimal":
            _losses.optimal_t0(self.alpha)
        if not (self.batch_size == "auto" or _positive_int(self.batch_size)):
            raise OnnxInputError(
                f"batch_size must be a positive integer or 'auto', got {self.batch_size!r}"
            )
        if not _positive_int(self.max_iter):
            raise OnnxInputError(f"max_iter must be a positive integer, got {self.max_iter!r}")

    def _check_X(self, X, reset):
        X = check_array(X, dtype=self._dtype_, order="C")
        if reset:
            self.n_features_in_ = X.shape[1]
        elif X.shape[1] != self.n_features_in_:
            raise OnnxInputError(
                f"X has {X.shape[1]} features, but {type(self).__name__} was fitted "
                f"with {self.n_features_in_}"
            )
        return X

    def _check_widths(self, model, X, target):
        """X's features and y's columns against the model's input and prediction."""
        name = type(self).__name__
        x_info = next(i for i in model.graph.input if i.name not in _initializer_names(model))
        features = _static_dim(x_info, 1)
        if features is not None and X.shape[1] != features:
            raise OnnxInputError(
                f"X has {X.shape[1]} features, but {name} is expecting {features} features "
                f"as input (the model's input {x_info.name!r})"
            )
        prediction = model.graph.output[0]
        columns = _static_dim(prediction, 1)
        if columns is not None and target.shape[1] != columns:
            raise OnnxInputError(
                f"y has {target.shape[1]} target column(s), but {name} is expecting "
                f"{columns} (the model's output {prediction.name!r})"
            )

    def _check_fitted(self):
        if not hasattr(self, "module_"):
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet: call 'fit' or "
                "'partial_fit' before using it"
            )

    def _load_model(self):
        """``self.model``, checked to take one float input, and that input's dtype."""
        model = _prepare.load_model(self.model)
        inputs = [i for i in model.graph.input if i.name not in _initializer_names(model)]
        if len(inputs) != 1:
            raise OnnxModelError(
                f"the model takes {len(inputs)} inputs {[i.name for i in inputs]}: "
                f"{type(self).__name__} expects one, the features X"
            )
        elem = inputs[0].type.tensor_type.elem_type
        if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
            raise OnnxModelError(
                f"input {inputs[0].name!r} has type {onnx.TensorProto.DataType.Name(elem)}: "
                "expected float or double features"
            )
        return model, np_dtype(elem)

    def _prepare(self, X, y, sample_weight, first_call):
        """``X``, ``y`` as the target and the weights, checked; the model read on the first call."""
        if first_call:
            model, self._dtype_ = self._load_model()
        X = self._check_X(X, reset=first_call)
        target = self._target(y, self._dtype_, first_call)
        if target.shape[0] != X.shape[0]:
            raise OnnxInputError(f"X has {X.shape[0]} rows but y has {target.shape[0]}")
        if first_call:  # before onnxruntime sees them, in scikit-learn's words
            self._check_widths(model, X, target)
        if sample_weight is None:
            weight = None
        else:
            weight = np.asarray(sample_weight, dtype=self._dtype_).reshape(-1)
            if weight.shape[0] != X.shape[0]:
                raise OnnxInputError(
                    f"sample_weight has {weight.shape[0]} values, expected one per row "
                    f"of X ({X.shape[0]})"
                )
            if not np.all(np.isfinite(weight)) or (weight < 0).any():
                raise OnnxInputError("sample_weight must hold finite values >= 0")
        return X, target, weight


def _positive_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _static_dim(value: onnx.ValueInfoProto, axis: int) -> int | None:
    dims = value.type.tensor_type.shape.dim
    if len(dims) <= axis or not dims[axis].HasField("dim_value"):
        return None
    return dims[axis].dim_value


def _initializer_names(model):
    return {init.name for init in model.graph.initializer}
