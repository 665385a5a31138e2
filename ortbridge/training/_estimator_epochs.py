"""The estimators' epochs: the learning rate, the batches and what ``fit`` reports.

Each epoch follows ``MLPRegressor``: the learning rate is set at its start
from ``t_``, the samples seen (:func:`._losses.learning_rate`), the rows are
shuffled, cut into batches of ``batch_size`` and the gradient of each batch
is divided by the sum of its sample weights (its rows without weights). The
batches then run one of two ways, to the same weights:
:mod:`._estimator_in_graph` in one onnxruntime call, or
:mod:`._estimator_by_batch` for the models the epoch graph cannot hold.
Afterwards come ``n_iter_``, ``t_``, ``loss_`` and ``train_losses_``.
"""

from __future__ import annotations

import numpy as np

from ..exceptions import OnnxInputError, TrainingDivergedError
from . import _losses


class _Epochs:
    """The training loop of :class:`._estimators._BaseOnnxSGD`."""

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
