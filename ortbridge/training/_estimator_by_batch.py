"""An estimator's epoch batch by batch: ``module_``'s forward and backward, then the update.

The way for the models the one-call epoch (:mod:`._estimator_in_graph`)
cannot hold: those with BatchNormalization, whose running statistics only
the module's forward updates, and those whose trained weights are not all of
the loss's type (the epoch graph's state is one flat vector). Each batch is
three onnxruntime calls: forward, backward and :class:`._sgd.SklearnSGD`'s
update.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class _EpochsByBatch:
    """Batch-by-batch epochs of :class:`._estimators._BaseOnnxSGD`."""

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
