"""The estimator that :class:`._estimators.OnnxSGDRegressor` and ``OnnxSGDClassifier`` share.

:class:`_BaseOnnxSGD` puts the mixins of the other ``_estimator_*`` modules
together over scikit-learn's ``BaseEstimator``, stores the parameters and
gives ``fit``, ``partial_fit``, ``to_onnx`` and the raw predictions, from a
session of ``to_onnx``'s model made at the first prediction after an epoch.
The public classes say their loss, how ``y`` becomes the target and how the
model's output becomes a prediction.
"""

from __future__ import annotations

import os

import onnx
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator

from .. import _prepare
from .._runtime._limits import fit_to_runtime
from .._runtime._sessions import quiet_session_options, training_session
from ._estimator_by_batch import _EpochsByBatch
from ._estimator_checks import _Checks
from ._estimator_epochs import _Epochs
from ._estimator_in_graph import _EpochsInGraph
from ._estimator_state import _FittedState

try:
    from typing import Self
except ImportError:  # Python 3.10: torch depends on typing_extensions
    from typing_extensions import Self


class _BaseOnnxSGD(_Checks, _FittedState, _Epochs, _EpochsInGraph, _EpochsByBatch, BaseEstimator):
    """Mini-batch SGD on an ONNX model, scikit-learn's ``MLPRegressor`` conventions.

    Subclasses choose the loss, how ``y`` becomes the target and how the
    model's output becomes a prediction.
    """

    _losses_allowed: tuple[str, ...] = ()

    def __init__(self, model: str | os.PathLike | bytes | onnx.ModelProto, **params) -> None:
        # Stored as given: the public classes spell the parameters out in their
        # own __init__, which is where scikit-learn's get_params reads them.
        self.model = model
        for name, value in params.items():
            setattr(self, name, value)

    # -- what subclasses define ---------------------------------------------

    def _target(self, y, dtype, first_call):
        """``y`` as a float array of shape (n, k)."""
        raise NotImplementedError

    # -- training ----------------------------------------------------------------

    def fit(self, X: ArrayLike, y: ArrayLike, sample_weight: ArrayLike | None = None) -> Self:
        """Train for ``max_iter`` epochs (resuming the previous fit when ``warm_start``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
        sample_weight : array-like of shape (n_samples,), optional
            One weight per row; a batch's gradient is divided by the sum of
            its weights.

        Returns
        -------
        self
        """
        return self._fit(X, y, sample_weight, int(self.max_iter), incremental=False)

    def partial_fit(
        self, X: ArrayLike, y: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> Self:
        """One epoch on ``(X, y)``, resuming the previous state if there is one."""
        return self._fit(X, y, sample_weight, 1, incremental=True)

    # -- inference --------------------------------------------------------------

    def to_onnx(self) -> onnx.ModelProto:
        """The model given at construction with the trained weights.

        Its onnxruntime predictions are :meth:`predict`'s (the raw score for a
        classifier); its IR version is one the installed onnxruntime loads.
        """
        self._check_fitted()
        model, _ = self._load_model()
        # Every weight, trained or not (BatchNormalization's running statistics too).
        trained = self.module_.to_onnx().graph.initializer
        weights = {init.name: onnx.numpy_helper.to_array(init) for init in trained}
        # Dropout off and BatchNormalization on its running statistics, even
        # for a model exported in train mode.
        return fit_to_runtime(_prepare.predicting_model(_prepare.with_weights(model, weights)))

    def _raw_predict(self, X):
        self._check_fitted()
        X = self._check_X(X, reset=False)
        if self._predictor is None:
            session = training_session(
                self.to_onnx(), quiet_session_options(), "the predicting model"
            )
            self._predictor = (session, session.get_inputs()[0].name)
        session, name = self._predictor
        out = session.run(None, {name: X})[0]
        return out.reshape(X.shape[0], -1)
