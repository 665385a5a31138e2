"""scikit-learn estimators training an ONNX model with onnxruntime.

The model predicts (a regressor's prediction, a binary classifier's raw
score). Fitting appends a loss to its graph (:func:`._losses.append_loss`)
and wraps the result in :class:`ortbridge.OnnxModule`, whose parameters hold
the weights, with :class:`._sgd.SklearnSGD`, whose state holds the
velocities. An epoch then runs one of two ways, to the same weights:

- in one onnxruntime call (:mod:`._epoch_graph`): a ``Loop`` whose every
  step slices its batch, runs forward, loss, backward and update; the
  parameters and velocities are views of its flat state; the backward comes
  from either gradient source (:mod:`._gradient`), so that the estimators
  run on the training build and on maintained onnxruntime alike;
- batch by batch, for models with BatchNormalization (their running
  statistics are updated by the module's forward): the module's forward
  and backward, then ``SklearnSGD``'s update, one onnxruntime call each.

Conventions are ``MLPRegressor``'s: gradients averaged over the batch,
learning rate set at the start of each epoch, elastic penalty on the
coefficients (the weights of MatMul/Gemm/Conv nodes) divided by the batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

import numpy as np
import onnx
import torch
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.exceptions import NotFittedError as SklearnNotFittedError
from sklearn.utils import check_array, check_random_state

from .. import _engines, _graph, exceptions
from .._onnx_utils import np_dtype
from .._ort_limits import fit_to_runtime
from ..exceptions import OnnxInputError, OnnxModelError, TrainingDivergedError
from . import _losses
from ._epoch_graph import EpochGraph
from ._epoch_graph import Hyper as _Hyper
from ._epoch_graph import Rule as _Rule
from ._sessions import session_options, training_session
from ._sgd import SklearnSGD

try:
    from typing import Self
except ImportError:  # Python 3.10: torch depends on typing_extensions
    from typing_extensions import Self

__all__ = ["NotFittedError", "OnnxSGDClassifier", "OnnxSGDRegressor"]


class NotFittedError(exceptions.NotFittedError, SklearnNotFittedError):
    """An estimator was used before ``fit``; also scikit-learn's ``NotFittedError``."""


class _BaseOnnxSGD(BaseEstimator):
    """Mini-batch SGD on an ONNX model, scikit-learn's ``MLPRegressor`` conventions.

    Subclasses choose the loss, how ``y`` becomes the target and how the
    model's output becomes a prediction.
    """

    _losses_allowed: tuple[str, ...] = ()

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        *,
        loss: str,
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
        self.model = model
        self.loss = loss
        self.learning_rate = learning_rate
        self.learning_rate_init = learning_rate_init
        self.power_t = power_t
        self.momentum = momentum
        self.nesterovs_momentum = nesterovs_momentum
        self.alpha = alpha
        self.l1_ratio = l1_ratio
        self.batch_size = batch_size
        self.max_iter = max_iter
        self.shuffle = shuffle
        self.random_state = random_state
        self.warm_start = warm_start
        self.trainable = trainable
        self.backend = backend
        self.verbose = verbose

    # -- what subclasses define ---------------------------------------------

    def _target(self, y, dtype, first_call):
        """``y`` as a float array of shape (n, k)."""
        raise NotImplementedError

    # -- checks ---------------------------------------------------------------

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

    # -- initialisation ------------------------------------------------------

    def _load_model(self):
        model = _graph.load_model(self.model)
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

    def _initialize(self, n_outputs):
        """Build the training module and a fresh optimizer from ``self.model``."""
        model, _ = self._load_model()
        training = _losses.append_loss(model, self.loss)
        module = _new_module(training, self.trainable, self.backend)
        penalised = _losses.penalised_initializers(model)
        params = dict(module.named_onnx_parameters())
        if not params:
            raise OnnxModelError("the model has no trainable float initializer")
        coefs = [p for name, p in params.items() if name in penalised]
        others = [p for name, p in params.items() if name not in penalised]
        groups = [g for g in ({"params": coefs}, {"params": others, "alpha": 0.0}) if g["params"]]
        self.module_ = module
        self.optimizer_ = SklearnSGD(
            groups,
            lr=self.learning_rate_init,
            momentum=self.momentum,
            nesterov=bool(self.nesterovs_momentum),
            alpha=self.alpha,
            l1_ratio=self.l1_ratio,
        )
        self._penalised = coefs
        self._penalised_names = {name for name in params if name in penalised}
        self.n_outputs_ = n_outputs
        self.n_iter_ = 0
        self.t_ = 0
        self.train_losses_ = []
        self.learning_rate_ = float(self.learning_rate_init)
        self._random_state = check_random_state(self.random_state)
        self._predictor = None
        self._engine = False  # built by the first epoch
        self._epoch_graphs = {}
        self._flat = None

    # -- training --------------------------------------------------------------

    def _prepare(self, X, y, sample_weight, first_call):
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

    def _fit(self, X, y, sample_weight, epochs, incremental):
        self._check_params()
        first = not hasattr(self, "module_") or not (incremental or self.warm_start)
        X, target, weight = self._prepare(X, y, sample_weight, first)
        if first:
            self._initialize(target.shape[1])
        elif target.shape[1] != self.n_outputs_:
            raise OnnxInputError(
                f"y has {target.shape[1]} columns, the model was fitted with {self.n_outputs_}"
            )
        else:
            self._sync_hyperparameters()
        y = np.ascontiguousarray(target)
        w = np.ones((X.shape[0], 1), self._dtype_) if weight is None else weight.reshape(-1, 1)
        for _ in range(epochs):
            self._epoch(X, y, w, weight)
            if self.verbose:  # scikit-learn's MLP line, to stdout as it prints it
                print(f"Iteration {self.n_iter_}, loss = {self.loss_:.8f}", flush=True)
        return self

    def _sync_hyperparameters(self):
        """Apply parameters changed by ``set_params`` between two fits (warm start)."""
        for group in self.optimizer_.param_groups:
            group["momentum"] = self.momentum
            group["nesterov"] = bool(self.nesterovs_momentum)
            group["l1_ratio"] = self.l1_ratio
            if any(p is q for p in group["params"] for q in self._penalised):
                group["alpha"] = self.alpha

    def _epoch(self, X, y, w, weight):
        n = X.shape[0]
        batch = min(200, n) if self.batch_size == "auto" else min(int(self.batch_size), n)
        lr = _losses.learning_rate(
            self.learning_rate,
            self.learning_rate_init,
            self.t_,
            power_t=self.power_t,
            alpha=self.alpha,
        )
        self.learning_rate_ = lr
        if self.shuffle:
            order = self._random_state.permutation(n)
            X, y, w = X[order], y[order], w[order]
        starts = np.arange(0, n, batch)
        stops = np.minimum(starts + batch, n)
        if weight is None:
            sums = (stops - starts).astype(np.float64)
        else:
            sums = np.add.reduceat(w[:, 0].astype(np.float64), starts)
        if self._epoch_engine() is None:
            total = self._epoch_by_batch(X, y, w, starts, stops, sums, lr)
        else:
            total = self._epoch_in_graph(X, y, w, starts, stops, sums, lr)
        self._predictor = None
        self.n_iter_ += 1
        self.t_ += n
        self.loss_ = total / n
        self.train_losses_.append(self.loss_)

    def _diverged(self, value, start, stop, lr):
        return TrainingDivergedError(
            f"the training loss became {value} at epoch {self.n_iter_ + 1}, rows "
            f"{start}:{stop} (learning rate {lr:g}): lower learning_rate_init, scale "
            "X and y, or look for huge values in the data"
        )

    def _epoch_engine(self):
        """What runs epochs in onnxruntime, or None to run batch by batch.

        The model with its loss, ready for :class:`._epoch_graph.EpochGraph`;
        models with BatchNormalization go batch by batch through ``module_``,
        which keeps their running statistics, and so do models whose trained
        weights are not all of the loss's type (the epoch graph's state is one
        flat vector).
        """
        if self._engine is False:
            model = _graph.normalize(self.module_.to_onnx())
            loss_type = model.graph.output[0].type.tensor_type.elem_type
            trained = dict(self.module_.named_onnx_parameters())
            types = {init.data_type for init in model.graph.initializer if init.name in trained}
            if types != {loss_type} or any(
                node.op_type == "BatchNormalization" for node in model.graph.node
            ):
                self._engine = None
            else:
                model, _ = _graph.make_variant(model, _graph.TRAIN, False, for_gradient=True)
                self._engine = model
        return self._engine

    def _epoch_graph(self, rows):
        rule = _Rule(
            velocity=self.momentum != 0,
            nesterov=self.momentum != 0 and bool(self.nesterovs_momentum),
            l2=self.alpha != 0 and self.l1_ratio != 1,
            l1=self.alpha != 0 and self.l1_ratio != 0,
        )
        key = (rows, rule)
        graph = self._epoch_graphs.get(key)
        if graph is None:
            if len(self._epoch_graphs) >= 8:  # partial_fit on ever new sizes
                self._epoch_graphs.pop(next(iter(self._epoch_graphs)))
            module = self.module_
            graph = self._epoch_graphs[key] = EpochGraph(
                self._epoch_engine(),
                tuple(module.input_names),
                module.output_names[0],
                [name for name, _ in module.named_onnx_parameters()],
                self._penalised_names,
                rule,
                rows,
                _epoch_session_options(rows * self._n_weights()),
                self.backend,
            )
        return graph

    def _n_weights(self):
        return sum(t.numel() for t in self.module_.state_dict().values() if t.is_floating_point())

    def _epoch_in_graph(self, X, y, w, starts, stops, sums, lr):
        """The epoch as one onnxruntime call (two with a shorter last batch)."""
        params = [p for _, p in self.module_.named_onnx_parameters()]
        hyper = _Hyper(lr, self.momentum, self.alpha, self.l1_ratio)
        velocity = self.momentum != 0
        flat = self._flat_state(params, velocity)
        batch = int(stops[0] - starts[0])
        n_full = X.shape[0] // batch
        keep = sums > 0  # every row of the batch has weight 0: nothing to learn
        total = 0.0
        groups = [(batch, slice(0, n_full * batch), np.arange(n_full))]
        if n_full < len(starts):
            groups.append((int(stops[-1] - starts[-1]), slice(n_full * batch, None), [n_full]))
        state = [buffer.numpy() for buffer in flat]
        for rows, part, index in groups:
            index = np.asarray(index)[keep[index]]
            if not len(index):
                continue
            graph = self._epoch_graph(rows)
            data = [a[part].reshape(-1, rows, *a.shape[1:]) for a in (X, y, w)]
            batches = index - index[0] if rows != batch else index
            args = (data, batches, sums[index], hyper)
            new_state, values = graph.run(*args, state)
            finite = np.isfinite(values)
            if not finite.all():
                # Keep the weights of the last finite batch, then say where.
                bad = int(np.argmin(finite))
                if bad > 0:
                    state, _ = graph.run(*args, state, trips=bad)
                self._write_state(flat, state)
                start = int(starts[index[bad]])
                raise self._diverged(float(values[bad]), start, start + rows, lr)
            state = new_state
            # scikit-learn's loss_: the mean of each batch, weighted by its rows.
            total += float(np.sum(values.astype(np.float64) / sums[index] * rows))
        self._write_state(flat, state)
        return total

    def _flat_state(self, params, velocity):
        """The epoch graphs' state: flat buffers the parameters and velocities are views of.

        An epoch then reads the state without packing it and writes it back
        with one copy per buffer. Made again when a parameter or a velocity
        was replaced (``load_state_dict`` copies into them: it keeps them).
        """
        state = self.optimizer_.state
        flat = self._flat
        if flat is not None:
            views = flat[1] + (flat[3] if velocity else [])
            tensors = params + ([state[p].get("velocity") for p in params] if velocity else [])
            if len(flat[1]) == len(params) and all(
                t is not None and t.data_ptr() == v.data_ptr() and t.shape == v.shape
                for t, v in zip(tensors, views)
            ):
                return [flat[0], flat[2]] if velocity else [flat[0]]
        with torch.no_grad():
            weights, weight_views = _flat_views([p.detach() for p in params])
            for p, view in zip(params, weight_views):
                p.data = view
            velocities = [state[p].get("velocity") for p in params]
            velocities = [
                torch.zeros_like(p) if v is None else v for p, v in zip(params, velocities)
            ]
            vel, vel_views = _flat_views(velocities)
            for p, view in zip(params, vel_views):
                state[p]["velocity"] = view
        self._flat = (weights, weight_views, vel, vel_views)
        return [weights, vel] if velocity else [weights]

    @staticmethod
    def _write_state(flat, state):
        """Copy the state an epoch graph returned into the flat buffers."""
        for buffer, value in zip(flat, state):
            np.copyto(buffer.numpy(), value)

    def _epoch_by_batch(self, X, y, w, starts, stops, sums, lr):
        """The epoch batch by batch: ``module_`` forward and backward, then ``optimizer_``."""
        for group in self.optimizer_.param_groups:
            group["lr"] = lr
        X, y, w = (torch.from_numpy(np.ascontiguousarray(a)) for a in (X, y, w))
        module, optimizer = self.module_, self.optimizer_
        params = [p for group in optimizer.param_groups for p in group["params"]]
        penalty = self.alpha > 0 and bool(self._penalised)
        total = 0.0
        for start, stop, sw in zip(starts.tolist(), stops.tolist(), sums.tolist()):
            loss = module(X[start:stop], y[start:stop], w[start:stop])
            value = loss.item()
            if penalty:
                value += self._penalty_value()
            if not math.isfinite(value):
                raise self._diverged(value, start, stop, lr)
            if sw <= 0:
                continue  # every row of the batch has weight 0: nothing to learn
            for p in params:
                p.grad = None
            loss.backward()
            optimizer._step(1.0 / sw)
            # scikit-learn's loss_: the mean of the batch, weighted by its rows.
            total += value / sw * (stop - start)
        return total

    def _penalty_value(self):
        alpha, l1_ratio = self.alpha, self.l1_ratio
        with torch.no_grad():
            value = 0.0
            for p in self._penalised:
                if l1_ratio:
                    value += l1_ratio * p.abs().sum().item()
                if l1_ratio != 1:
                    value += 0.5 * (1 - l1_ratio) * (p * p).sum().item()
        return alpha * value

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
        return fit_to_runtime(_graph.predicting_model(_graph.with_weights(model, weights)))

    def _raw_predict(self, X):
        self._check_fitted()
        X = self._check_X(X, reset=False)
        if self._predictor is None:
            session = training_session(self.to_onnx(), session_options(), "the predicting model")
            self._predictor = (session, session.get_inputs()[0].name)
        session, name = self._predictor
        out = session.run(None, {name: X})[0]
        return out.reshape(X.shape[0], -1)

    # -- pickling ----------------------------------------------------------------

    def __getstate__(self):
        state = dict(super().__getstate__())  # may be self.__dict__ itself
        state.pop("_predictor", None)
        module = state.pop("module_", None)
        optimizer = state.pop("optimizer_", None)
        for name in ("_penalised", "_penalised_names", "_engine", "_epoch_graphs", "_flat"):
            state.pop(name, None)
        if module is not None:
            params = dict(module.named_onnx_parameters())
            state["_saved_weights"] = {n: p.detach().numpy().copy() for n, p in params.items()}
            state["_saved_velocities"] = {
                n: optimizer.state[p]["velocity"].numpy().copy()
                for n, p in params.items()
                if "velocity" in optimizer.state.get(p, {})
            }
        return state

    def __setstate__(self, state):
        weights = state.pop("_saved_weights", None)
        velocities = state.pop("_saved_velocities", {})
        # Pickled before these parameters existed.
        state.setdefault("backend", "auto")
        state.setdefault("verbose", False)
        super().__setstate__(state)
        self._predictor = None
        if weights is None:
            return
        # Rebuild the module and the optimizer, then restore the fitted state,
        # the weights and the velocities.
        saved = dict(self.__dict__)
        self._initialize(self.n_outputs_)
        for name, value in saved.items():
            if name not in _REBUILT:
                setattr(self, name, value)
        self._sync_hyperparameters()
        params = dict(self.module_.named_onnx_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(torch.from_numpy(value))
        for name, value in velocities.items():
            self.optimizer_.state[params[name]]["velocity"] = torch.from_numpy(value.copy())


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
    >>> from ortbridge._examples import linear_model
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
    >>> from ortbridge._examples import linear_model
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


#: Attributes ``_initialize`` makes, not restored from a pickle.
_REBUILT = ("module_", "optimizer_", "_penalised", "_penalised_names", "_predictor", "_engine",
            "_epoch_graphs", "_flat")  # fmt: skip


def _flat_views(tensors):
    """A flat tensor holding copies of ``tensors``, and views of it shaped as them."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    views, offset = [], 0
    for t in tensors:
        view = flat[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += t.numel()
    return flat, views


#: Multiply-adds of a step (about 3 per weight and row) under which one thread
#: is faster: waking a second one costs more than it saves. Measured: 2.3e5
#: (the scikit-learn benchmark) 6.9 ms an epoch on 1 thread, 8.0 on 2;
#: 3.9e7 (784-256-1, batch 64) 48 ms against 37.
_ONE_THREAD_WORK = 4e6


def _epoch_session_options(weights_times_rows):
    """Quiet sessions, not spinning; one thread for small steps, torch's count otherwise."""
    so = session_options()
    small = 3 * weights_times_rows < _ONE_THREAD_WORK
    so.intra_op_num_threads = 1 if small else torch.get_num_threads()
    so.inter_op_num_threads = 1
    return so


def _positive_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _static_dim(value: onnx.ValueInfoProto, axis: int) -> int | None:
    dims = value.type.tensor_type.shape.dim
    if len(dims) <= axis or not dims[axis].HasField("dim_value"):
        return None
    return dims[axis].dim_value


def _initializer_names(model):
    return {init.name for init in model.graph.initializer}


def _new_module(model, trainable, backend):
    from ..module import OnnxModule  # the core imports onnxruntime: only when fitting

    return OnnxModule(model, trainable=trainable, backend=backend)
