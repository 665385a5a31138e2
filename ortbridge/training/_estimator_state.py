"""The estimators' fitted state: the training module and its optimizer.

``fit`` builds them from the model (:meth:`_FittedState._initialize`): the
model with its loss as an :class:`ortbridge.OnnxModule`, whose parameters
are the weights, and a :class:`._sgd.SklearnSGD` whose state holds the
velocities, the coefficients (:func:`._losses.penalised_initializers`) in a
group of their own so that only they carry the elastic penalty. A warm start
keeps them and applies what ``set_params`` changed since.

onnxruntime sessions do not pickle: a pickle holds the parameters, the fitted
attributes, the weights and the velocities, and unpickling builds the module
and the optimizer again before putting them back. Both halves live here
because they agree on one list, :data:`_REBUILT`, of what ``_initialize`` makes.
"""

from __future__ import annotations

import torch
from sklearn.utils import check_random_state

from ..exceptions import OnnxModelError
from . import _losses
from ._sgd import SklearnSGD


class _FittedState:
    """Building, warm-starting and pickling the state of :class:`._estimators._BaseOnnxSGD`."""

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
        # The one-call epochs' caches (._estimator_in_graph), made again from the new module.
        self._engine = False  # built by the first epoch
        self._epoch_graphs = {}
        self._flat = None

    def _sync_hyperparameters(self):
        """Apply parameters changed by ``set_params`` between two fits (warm start)."""
        for group in self.optimizer_.param_groups:
            group["momentum"] = self.momentum
            group["nesterov"] = bool(self.nesterovs_momentum)
            group["l1_ratio"] = self.l1_ratio
            if any(p is q for p in group["params"] for q in self._penalised):
                group["alpha"] = self.alpha

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


#: Attributes ``_initialize`` makes, not restored from a pickle.
_REBUILT = ("module_", "optimizer_", "_penalised", "_penalised_names", "_predictor", "_engine",
            "_epoch_graphs", "_flat")  # fmt: skip


def _new_module(model, trainable, backend):
    from ..module import OnnxModule  # the core imports onnxruntime: only when fitting

    return OnnxModule(model, trainable=trainable, backend=backend)
