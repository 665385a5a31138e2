"""scikit-learn estimators training an ONNX model with onnxruntime.

The model predicts (a regressor's prediction, a binary classifier's raw
score). Fitting appends a loss to its graph (:func:`._losses.append_loss`)
and wraps the result in :class:`ortbridge.OnnxModule`, whose parameters hold
the weights, with :class:`._sgd.SklearnSGD`, whose state holds the
velocities (:mod:`._estimator_state`, which also pickles them). An epoch
(:mod:`._estimator_epochs`) then runs one of two ways, to the same weights:

- in one onnxruntime call (:mod:`._estimator_in_graph`, on
  :mod:`._graphs._epoch`): a ``Loop`` whose every step slices its batch, runs
  forward, loss, backward and update; the parameters and velocities are
  views of its flat state; the backward comes from either gradient source
  (:mod:`._graphs._gradient`), so that the estimators run on the training build and
  on maintained onnxruntime alike;
- batch by batch (:mod:`._estimator_by_batch`), for models with
  BatchNormalization (their running statistics are updated by the module's
  forward): the module's forward and backward, then ``SklearnSGD``'s
  update, one onnxruntime call each.

Conventions are ``MLPRegressor``'s: gradients averaged over the batch,
learning rate set at the start of each epoch, elastic penalty on the
coefficients (the weights of MatMul/Gemm/Conv nodes) divided by the batch.
Parameters, model and data are checked in scikit-learn's words
(:mod:`._estimator_checks`). Those modules are mixins of one concern each,
put together in :mod:`._estimator_base`; this one holds the public classes,
which pickles name, and what is theirs: the parameters, the loss, how ``y``
becomes the target and the output a prediction.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np
import onnx
from numpy.typing import ArrayLike
from sklearn.base import ClassifierMixin, RegressorMixin
from sklearn.utils import check_array

from ..exceptions import OnnxInputError
from ._estimator_base import _BaseOnnxSGD
from ._estimator_checks import NotFittedError

try:
    from typing import Self
except ImportError:  # Python 3.10: torch depends on typing_extensions
    from typing_extensions import Self

__all__ = ["NotFittedError", "OnnxSGDClassifier", "OnnxSGDRegressor"]


class OnnxSGDRegressor(RegressorMixin, _BaseOnnxSGD):
    """Train an ONNX regression model with SGD run by onnxruntime.

    The parameters follow scikit-learn's ``MLPRegressor`` (and ``SGDRegressor``
    for ``alpha``/``l1_ratio``/``learning_rate="optimal"``); the update is
    ``MLPRegressor``'s, so that starting from an ``MLPRegressor`` converted to
    ONNX, an epoch gives the weights ``MLPRegressor.partial_fit`` gives.

    Parameters
    ----------
    model : onnx.ModelProto, bytes or path
        The model; its first output is the prediction, shape (n,) or (n, k).
    loss : {"squared_error", "absolute_error", "elastic"}
        ``squared_error`` is half the squared error, averaged over a batch.
    learning_rate : {"constant", "invscaling", "optimal"}
        Schedule, evaluated at the start of each epoch from ``t_``, the
        number of samples seen: ``learning_rate_init``,
        ``learning_rate_init / (t_ + 1) ** power_t``, or
        ``1 / (alpha * (t0 + t_))``.
    learning_rate_init, power_t : float
    momentum : float in [0, 1]
    nesterovs_momentum : bool
    alpha : float
        Strength of the elastic penalty on the coefficients (weights of
        MatMul, Gemm and Conv nodes; biases are not penalised).
    l1_ratio : float in [0, 1]
        Its L1 share: ``alpha * (l1_ratio |w|_1 + (1 - l1_ratio) / 2 |w|^2)``.
    batch_size : int or "auto"
    max_iter : int
        Epochs run by ``fit``.
    shuffle : bool
    random_state : int, RandomState or None
    warm_start : bool
        ``fit`` resumes from the previous fit (weights and velocities).
    trainable : None, iterable of str or callable
        Initializers to train, as :class:`ortbridge.OnnxModule`'s ``trainable``.
    backend : {"auto", "training-agent", "onnxruntime"}
        Where the gradients come from, named as :class:`ortbridge.OnnxModule`'s
        engines: onnxruntime-training's gradient builder, or onnx-ad's
        standard-op reverse graph, which maintained onnxruntime runs.
        ``"auto"``: the builder where the training build is installed and
        differentiates the model correctly (measured the faster here:
        ``benchmarks/README.rst``), onnx-ad's graph otherwise.
    verbose : bool or int
        Print one line per epoch to stdout, as ``MLPRegressor`` does:
        ``Iteration 3, loss = 0.01234567``.

    Attributes
    ----------
    train_losses_ : list of float
        Loss of each epoch (mean over rows, penalty included).
    loss_ : float
    n_iter_ : int
        Epochs run since the weights were last initialised from ``model``.
    t_ : int
        Samples seen since then.
    learning_rate_ : float
    module_ : ortbridge.OnnxModule
        The model with its loss; its parameters are the trained weights.

    Examples
    --------
    >>> import numpy as np
    >>> from ortbridge.examples import linear_model
    >>> from ortbridge.training import OnnxSGDRegressor
    >>> X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> y = X @ np.array([1.0, -2.0, 0.5], dtype=np.float32)
    >>> reg = OnnxSGDRegressor(linear_model(3, 1), learning_rate_init=0.05, max_iter=30,
    ...                        batch_size=8, random_state=0).fit(X, y)
    >>> reg.score(X, y) > 0.99
    True
    """

    _losses_allowed = ("squared_error", "absolute_error", "elastic")

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        *,
        loss: str = "squared_error",
        learning_rate: str = "constant",
        learning_rate_init: float = 0.001,
        power_t: float = 0.5,
        momentum: float = 0.9,
        nesterovs_momentum: bool = True,
        alpha: float = 0.0,
        l1_ratio: float = 0.0,
        batch_size: int | str = 32,
        max_iter: int = 200,
        shuffle: bool = True,
        random_state: int | np.random.RandomState | None = None,
        warm_start: bool = False,
        trainable: None | Iterable[str] | Callable[[str, np.ndarray], bool] = None,
        backend: str = "auto",
        verbose: bool | int = False,
    ) -> None:
        super().__init__(
            model,
            loss=loss,
            learning_rate=learning_rate,
            learning_rate_init=learning_rate_init,
            power_t=power_t,
            momentum=momentum,
            nesterovs_momentum=nesterovs_momentum,
            alpha=alpha,
            l1_ratio=l1_ratio,
            batch_size=batch_size,
            max_iter=max_iter,
            shuffle=shuffle,
            random_state=random_state,
            warm_start=warm_start,
            trainable=trainable,
            backend=backend,
            verbose=verbose,
        )

    def _target(self, y, dtype, first_call):
        y = check_array(y, dtype=dtype, ensure_2d=False, order="C")
        self._y_1d = y.ndim == 1 if first_call else self._y_1d
        return y.reshape(y.shape[0], -1)

    def predict(self, X: ArrayLike) -> np.ndarray:
        """Predictions of the trained model, shape (n,) for one output."""
        out = self._raw_predict(X)
        return out.ravel() if out.shape[1] == 1 and self._y_1d else out


class OnnxSGDClassifier(ClassifierMixin, _BaseOnnxSGD):
    """Train an ONNX binary classifier (it outputs a raw score) with onnxruntime.

    Same parameters as :class:`OnnxSGDRegressor`, with ``loss="log_loss"``:
    the logistic loss of the raw score ``s``, ``log(1 + exp(s)) - y s``. The
    second class of ``classes_`` is the positive one.

    Examples
    --------
    >>> import numpy as np
    >>> from ortbridge.examples import linear_model
    >>> from ortbridge.training import OnnxSGDClassifier
    >>> X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> y = np.where(X[:, 0] - X[:, 1] > 0, "yes", "no")
    >>> clf = OnnxSGDClassifier(linear_model(3, 1), learning_rate_init=0.1, max_iter=20,
    ...                         batch_size=8, random_state=0).fit(X, y)
    >>> clf.score(X, y) > 0.95, clf.predict_proba(X[:2]).shape
    (True, (2, 2))
    """

    _losses_allowed = ("log_loss",)

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        *,
        loss: str = "log_loss",
        learning_rate: str = "constant",
        learning_rate_init: float = 0.001,
        power_t: float = 0.5,
        momentum: float = 0.9,
        nesterovs_momentum: bool = True,
        alpha: float = 0.0,
        l1_ratio: float = 0.0,
        batch_size: int | str = 32,
        max_iter: int = 200,
        shuffle: bool = True,
        random_state: int | np.random.RandomState | None = None,
        warm_start: bool = False,
        trainable: None | Iterable[str] | Callable[[str, np.ndarray], bool] = None,
        backend: str = "auto",
        verbose: bool | int = False,
    ) -> None:
        super().__init__(
            model,
            loss=loss,
            learning_rate=learning_rate,
            learning_rate_init=learning_rate_init,
            power_t=power_t,
            momentum=momentum,
            nesterovs_momentum=nesterovs_momentum,
            alpha=alpha,
            l1_ratio=l1_ratio,
            batch_size=batch_size,
            max_iter=max_iter,
            shuffle=shuffle,
            random_state=random_state,
            warm_start=warm_start,
            trainable=trainable,
            backend=backend,
            verbose=verbose,
        )

    def partial_fit(
        self,
        X: ArrayLike,
        y: ArrayLike,
        sample_weight: ArrayLike | None = None,
        classes: ArrayLike | None = None,
    ) -> Self:
        """One epoch on ``(X, y)``; ``classes`` (both labels) is needed on the first call
        when ``y`` may not hold both."""
        if classes is not None and not hasattr(self, "classes_"):
            self._classes_given = np.unique(classes)
        return super().partial_fit(X, y, sample_weight)

    def _target(self, y, dtype, first_call):
        y = np.asarray(y)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.ravel()
        if y.ndim != 1:
            raise OnnxInputError(
                f"y must be 1-D, got shape {y.shape}: {type(self).__name__} is binary"
            )
        if first_call:
            given = self.__dict__.pop("_classes_given", None)
            classes = given if given is not None else np.unique(y)
            if len(classes) != 2:
                raise OnnxInputError(
                    f"{type(self).__name__} is a binary classifier: y holds "
                    f"{len(classes)} class(es) {list(classes)[:5]}, expected 2"
                )
            self.classes_ = classes
        unknown = ~np.isin(y, self.classes_)
        if unknown.any():
            raise OnnxInputError(
                f"y holds labels {list(np.unique(y[unknown]))[:5]} unseen in classes_ "
                f"{list(self.classes_)}"
            )
        return (y == self.classes_[1]).astype(dtype).reshape(-1, 1)

    def decision_function(self, X: ArrayLike) -> np.ndarray:
        """Raw scores, shape (n,); positive means ``classes_[1]``."""
        return self._raw_predict(X)[:, 0]

    def predict_proba(self, X: ArrayLike) -> np.ndarray:
        """Probabilities of ``classes_``, shape (n, 2)."""
        score = self.decision_function(X).astype(np.float64)
        positive = 1.0 / (1.0 + np.exp(-score))
        return np.column_stack([1.0 - positive, positive])

    def predict(self, X: ArrayLike) -> np.ndarray:
        """Labels from ``classes_``."""
        return self.classes_[(self.decision_function(X) > 0).astype(int)]
