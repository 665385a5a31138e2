"""Full-graph training: loss, backward and optimizer in one onnxruntime graph.

When the whole model is ONNX, torch has nothing left to do during training:
each step is one onnxruntime call on a graph holding the forward, the loss,
the gradients and the optimizer's update, with the weights and the
optimizer state kept in onnxruntime's buffers (:mod:`._graphs._step`).
The gradients come from either source of :mod:`._graphs._gradient`, so that the
trainer runs on the training build and on maintained onnxruntime alike.

onnxruntime's own training API (``onnxruntime.training.api``) needs two calls
a step (``Module.__call__`` then ``Optimizer.step``), copies every gradient
into an accumulation buffer, and its ``generate_artifacts`` writes an AdamW
that is not torch's; it is not used here.

This module holds the public class: its parameters, the training loop, the
predictions and the checkpoint methods. The checks of the model and the
data are in :mod:`._full_graph_checks`; the runners holding the state, its
snapshots for checkpoints and pickles, and the checkpoint files in
:mod:`._full_graph_state`.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np
import onnx
from numpy.typing import ArrayLike

from .._prepare import load_model, normalize, predicting_model, weights_as_inputs, with_weights
from .._prepare._onnx_utils import np_dtype
from .._runtime import _ort
from .._runtime._errors import plain
from .._runtime._limits import fit_to_runtime
from .._runtime._sessions import quiet_session_options, training_session
from ..exceptions import OnnxInputError, OnnxModelError, TrainingDivergedError
from ._full_graph_checks import _TrainerChecks
from ._full_graph_state import _TrainerState, read_checkpoint, write_checkpoint
from ._graphs._step import PingPongRunner
from ._graphs._update import check_learning_rate, optimizer_options

if TYPE_CHECKING:  # onnxruntime is imported when a session is made, not before
    import onnxruntime


class OrtFullGraphTrainer(_TrainerChecks, _TrainerState):
    """Trains a whole ONNX model inside onnxruntime: forward, loss, backward, update.

    Each training step is one onnxruntime call on one graph built from the
    model, its loss (:func:`ortbridge.add_loss_output`), its gradients and
    the optimizer's update; the weights and the optimizer state stay in
    onnxruntime's buffers between steps. Losses and optimizers follow torch:
    the same model, batches and hyperparameters give the same weights as
    ``torch.optim.AdamW`` or ``torch.optim.SGD`` on a ``reduction="mean"`` loss.

    ``fit`` continues from the current state: the first call starts from the
    model's initializers, later calls (and calls after
    :meth:`load_checkpoint`) go on training; :meth:`reset` starts over.

    Parameters
    ----------
    model : onnx.ModelProto, bytes or path
        A predicting model with one input; its output ``output_index`` is the
        prediction, batch on the first axis.
    loss : {"squared_error", "absolute_error", "elastic", "log_loss"}
        See :mod:`ortbridge.losses`.
    optimizer : {"adamw", "sgd"}
        torch's ``AdamW`` (betas 0.9/0.999, eps 1e-8, weight_decay 0.01) or
        ``SGD`` (no momentum) unless ``optimizer_params`` says otherwise.
    learning_rate : float
        The learning rate.
    batch_size : int
        Rows per step; the last batch of an epoch may be smaller.
    max_iter : int
        Epochs per call to ``fit``.
    shuffle : bool
        Draw a new order of the rows every epoch.
    random_state : int, optional
        Seed of the shuffling.
    trainable : list of str, optional
        Initializers to train; all floating-point ones by default
        (:func:`ortbridge.get_train_initializer`), the others stay frozen.
    optimizer_params : dict, optional
        Options of the optimizer, names as torch's: ``betas``, ``eps``,
        ``weight_decay`` for ``adamw``; ``momentum``, ``nesterov``,
        ``weight_decay`` for ``sgd``.
    penalty : dict, optional
        L1/L2 penalties per initializer, see :func:`ortbridge.add_loss_output`.
    output_index : int
        Which model output is the prediction.
    session_options : onnxruntime.SessionOptions, optional
        Options of the training and predicting sessions.
    backend : {"auto", "training-agent", "onnxruntime"}
        Where the gradients come from, named as :class:`ortbridge.OnnxModule`'s
        engines: onnxruntime-training's gradient builder (one graph for every
        batch shape), or onnx-ad's standard-op reverse graph, which
        maintained onnxruntime runs (one graph per batch shape: the last
        batch of an epoch gets its own). ``"auto"``: onnx-ad's graph, measured
        the faster of the two here; the builder where onnx-ad refuses the model
        and the training build is installed.
    verbose : bool or int
        Print one line per epoch to stdout, as scikit-learn's ``MLPRegressor``
        does: ``Iteration 3, loss = 0.01234567`` (the epoch's mean loss).

    Attributes
    ----------
    train_losses_ : list of float
        Mean training loss of each epoch (batch losses weighted by batch length).
    n_iter_ : int
        Epochs run so far.
    n_steps_ : int
        Training steps (onnxruntime calls) run so far.

    Examples
    --------
    >>> import numpy as np
    >>> from ortbridge.training import OrtFullGraphTrainer
    >>> from ortbridge.examples import linear_model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((64, 3)).astype(np.float32)
    >>> y = X @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    >>> trainer = OrtFullGraphTrainer(linear_model(3, 1), optimizer="sgd",
    ...                               learning_rate=0.1, max_iter=20, random_state=0)
    >>> trainer = trainer.fit(X, y)
    >>> trainer.train_losses_[-1] < 1e-3 < trainer.train_losses_[0]
    True
    >>> bool(np.abs(trainer.predict(X) - y).max() < 0.05)
    True
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        *,
        loss: str = "squared_error",
        optimizer: str = "adamw",
        learning_rate: float = 1e-3,
        batch_size: int = 32,
        max_iter: int = 10,
        shuffle: bool = True,
        random_state: int | None = None,
        trainable: list[str] | None = None,
        optimizer_params: dict | None = None,
        penalty: dict | None = None,
        output_index: int = 0,
        session_options: onnxruntime.SessionOptions | None = None,
        backend: str = "auto",
        verbose: bool | int = False,
    ) -> None:
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.max_iter = max_iter
        self.shuffle = shuffle
        self.random_state = random_state
        self.trainable = trainable
        self.optimizer_params = optimizer_params
        self.penalty = penalty
        self.output_index = output_index
        self.session_options = session_options
        self.backend = backend
        self.verbose = verbose
        self._onnx = None
        self._runners: dict[bool, PingPongRunner] = {}
        self._active: PingPongRunner | None = None
        self._predictor = None

    # -- public API ---------------------------------------------------------

    def fit(
        self, X: ArrayLike, y: ArrayLike, sample_weight: ArrayLike | None = None
    ) -> OrtFullGraphTrainer:
        """Train ``max_iter`` epochs on ``X``, ``y``, continuing from the current state.

        Parameters
        ----------
        X : array-like of shape (N, ...)
            Inputs, cast to the model input's element type.
        y : array-like
            Targets, shaped like the prediction (``(N,)`` is accepted for a
            ``(N, 1)`` prediction and the other way round).
        sample_weight : array-like of shape (N,), optional
            Per-row weights of the loss.

        Returns
        -------
        OrtFullGraphTrainer
            self.

        Raises
        ------
        TrainingDivergedError
            The loss became NaN or infinite.
        """
        learning_rate = check_learning_rate(self.learning_rate)
        self._prepare()
        X, y, sample_weight = self._check_data(X, y, sample_weight)
        n, batch = len(X), int(self.batch_size)
        if batch < 1:
            raise OnnxInputError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        columns = [X, y] + ([sample_weight] if sample_weight is not None else [])
        # The shapes of the first batch and of a shorter last one.
        starts = [0] + ([n - n % batch] if n % batch else [])
        shapes = [[c[start : start + batch].shape for c in columns] for start in starts]
        runner = self._runner(weighted=sample_weight is not None, shapes=shapes)
        if self._rng is None:
            self._rng = np.random.default_rng(self.random_state)
        runner.learning_rate.update_inplace(np.array(learning_rate, dtype=self._dtype))
        for _ in range(int(self.max_iter)):
            epoch = columns
            if self.shuffle:
                order = self._rng.permutation(n)
                epoch = [np.ascontiguousarray(c[order]) for c in columns]
            total = 0.0
            for start in range(0, n, batch):
                value = runner.step([c[start : start + batch] for c in epoch])
                if not math.isfinite(value):
                    raise TrainingDivergedError(
                        f"the training loss is {value} at epoch {self.n_iter_ + 1}, step "
                        f"{self.n_steps_ + 1}: lower learning_rate (now {self.learning_rate})"
                    )
                self.n_steps_ += 1
                total += value * min(batch, n - start)
            self.train_losses_.append(total / n)
            self.n_iter_ += 1
            if self.verbose:  # scikit-learn's MLP line, to stdout as it prints it
                print(f"Iteration {self.n_iter_}, loss = {total / n:.8f}", flush=True)
        return self

    def predict(self, X: ArrayLike) -> np.ndarray:
        """The model's prediction on ``X`` with the trained weights.

        Parameters
        ----------
        X : array-like of shape (N, ...)

        Returns
        -------
        numpy.ndarray
            Output ``output_index`` of the model.
        """
        runner = self._fitted_runner("predict")
        X = self._check_inputs(X)
        C = _ort.capi()
        if self._predictor is None:
            predicting = weights_as_inputs(
                predicting_model(load_model(self._onnx)), self._trainable
            )
            fit_to_runtime(predicting)
            so = self.session_options or quiet_session_options()
            self._predictor = training_session(predicting, so, "the predicting model")
        binding = C.SessionIOBinding(self._predictor._sess)
        for name in self._trainable:
            binding.bind_ortvalue_input(name, runner.sets[runner.current][name])
        binding.bind_input(self._input_name, runner.device, X.dtype, X.shape, X.ctypes.data)
        output = self._predictor.get_outputs()[self.output_index].name
        binding.bind_output(output, runner.device)
        try:
            self._predictor._sess.run_with_iobinding(binding, runner.run_options)
        except Exception as exc:
            raise OnnxModelError(
                f"onnxruntime failed to predict on input {self._input_name!r} of shape "
                f"{X.shape}: {plain(exc)}"
            ) from exc
        return binding.get_outputs()[0].numpy()

    def to_onnx(self) -> onnx.ModelProto:
        """The predicting model with the trained weights as initializers.

        Returns
        -------
        onnx.ModelProto
            The input model (normalised) with new initializer values, Dropout
            switched off; the IR version the installed onnxruntime loads.
        """
        weights = self.get_weights()
        return fit_to_runtime(predicting_model(with_weights(self._onnx, weights)))

    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the trained weights, name -> array."""
        runner = self._fitted_runner("get_weights")
        state = runner.read_state()
        return {name: state[name] for name in self._trainable}

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the weights, optimizer state, step count and shuffling state to ``path``.

        The file is a numpy ``.npz`` archive (no pickle); :meth:`load_checkpoint`
        in a trainer built with the same model and options continues the same
        trajectory.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write, the name as given (no suffix is added).
        """
        meta, arrays = self._snapshot("save_checkpoint")
        write_checkpoint(os.fspath(path), meta, arrays)

    def load_checkpoint(self, path: str | os.PathLike) -> OrtFullGraphTrainer:
        """Restore what :meth:`save_checkpoint` wrote; the next ``fit`` continues from it.

        Parameters
        ----------
        path : str or os.PathLike
            A file written by :meth:`save_checkpoint`.

        Returns
        -------
        OrtFullGraphTrainer
            self.
        """
        path = os.fspath(path)
        meta, arrays = read_checkpoint(path)
        return self._restore(meta, arrays, f"checkpoint {path!r}")

    def reset(self) -> OrtFullGraphTrainer:
        """Forget the training: the next ``fit`` starts from the model's initializers."""
        self._onnx = None
        self._runners.clear()
        self._active = None
        self._predictor = None
        return self

    # -- machinery ----------------------------------------------------------

    def _prepare(self) -> None:
        """Load and check the model once; set the initial state."""
        if self._onnx is not None:
            return
        model = normalize(load_model(self.model))
        floats, trainable, input_info, elem = self._check_model(model)
        self._options = optimizer_options(self.optimizer, self.optimizer_params)
        self._onnx = model
        self._trainable = trainable
        self._input_name = input_info.name
        self._input_dtype = np_dtype(input_info.type.tensor_type.elem_type)
        input_type = input_info.type.tensor_type
        self._input_shape = None
        if input_type.HasField("shape"):
            self._input_shape = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in input_type.shape.dim
            )
        self._dtype = np_dtype(elem)
        self._initial = {name: onnx.numpy_helper.to_array(floats[name]) for name in trainable}
        self._rng = None
        self._fitted = False
        self.train_losses_: list[float] = []
        self.n_iter_ = 0
        self.n_steps_ = 0
