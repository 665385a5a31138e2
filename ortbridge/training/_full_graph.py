"""Full-graph training: loss, backward and optimizer in one onnxruntime graph.

When the whole model is ONNX, torch has nothing left to do during training:
each step is one onnxruntime call on a graph holding the forward, the loss,
the gradients and the optimizer's update, with the weights and the
optimizer state kept in onnxruntime's buffers (:mod:`._training_graph`).
The gradients come from either source of :mod:`._gradient`, so that the
trainer runs on the training build and on maintained onnxruntime alike.

onnxruntime's own training API (``onnxruntime.training.api``) needs two calls
a step (``Module.__call__`` then ``Optimizer.step``), copies every gradient
into an accumulation buffer, and its ``generate_artifacts`` writes an AdamW
that is not torch's; it is not used here.
"""

from __future__ import annotations

import functools
import json
import math
import os
import zipfile
from typing import TYPE_CHECKING

import numpy as np
import onnx
from numpy.typing import ArrayLike

from .. import _ort
from .._graph import load_model, normalize, predicting_model, weights_as_inputs, with_weights
from .._onnx_utils import FLOAT_TYPES, np_dtype
from .._ort_errors import plain
from .._ort_limits import fit_to_runtime
from ..exceptions import (
    NotFittedError,
    OnnxInputError,
    OnnxModelError,
    TrainingDivergedError,
)
from ._sessions import session_options as default_session_options
from ._sessions import training_session
from ._training_graph import (
    LABEL,
    SAMPLE_WEIGHT,
    PingPongRunner,
    build_training_graph,
    state_slots,
)
from ._update_graph import check_learning_rate, optimizer_options

if TYPE_CHECKING:  # onnxruntime is imported when a session is made, not before
    import onnxruntime

_CHECKPOINT_FORMAT = "ortbridge.OrtFullGraphTrainer checkpoint"


class OrtFullGraphTrainer:
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
    >>> from ortbridge._examples import linear_model
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
            so = self.session_options or default_session_options()
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
        with open(os.fspath(path), "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)

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
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                arrays = {k: data[k] for k in data.files if k != "meta"}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise OnnxInputError(f"{path!r} is not a trainer checkpoint: {exc}") from exc
        if meta.get("format") != _CHECKPOINT_FORMAT:
            raise OnnxInputError(f"{path!r} is not an OrtFullGraphTrainer checkpoint")
        return self._restore(meta, arrays, f"checkpoint {path!r}")

    def __getstate__(self):
        # onnxruntime sessions do not pickle: keep the parameters and the
        # training state, the sessions are rebuilt on first use.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        for name in ("train_losses_", "n_iter_", "n_steps_"):
            state.pop(name, None)
        fitted = self._onnx is not None and self._fitted and self._active is not None
        state["_snapshot"] = self._snapshot("pickle") if fitted else None
        return state

    def __setstate__(self, state):
        snapshot = state.pop("_snapshot")
        self.__init__(**state)
        if snapshot is not None:
            self._restore(*snapshot, "the pickled trainer")

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
        self._options = optimizer_options(self.optimizer, self.optimizer_params)
        self._onnx = model
        self._trainable = trainable
        self._input_name = inputs[0].name
        self._input_dtype = np_dtype(inputs[0].type.tensor_type.elem_type)
        input_type = inputs[0].type.tensor_type
        self._input_shape = None
        if input_type.HasField("shape"):
            self._input_shape = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in input_type.shape.dim
            )
        self._dtype = np_dtype(types.pop())
        self._initial = {name: onnx.numpy_helper.to_array(floats[name]) for name in trainable}
        self._rng = None
        self._fitted = False
        self.train_losses_: list[float] = []
        self.n_iter_ = 0
        self.n_steps_ = 0

    def _runner(self, weighted: bool, shapes: list = ()) -> PingPongRunner:
        """The runner of the graph variant with or without sample weights.

        Switching variants copies the state once from the other variant.
        ``shapes``: the batch shapes of the coming fit, whose graphs are built
        before anything changes (a model that cannot be trained fails here).
        """
        runner = self._runners.get(weighted)
        if runner is None:
            build = functools.partial(
                build_training_graph,
                self._onnx,
                self._trainable,
                loss=self.loss,
                optimizer=self.optimizer,
                options=self._options,
                weighted=weighted,
                output_index=self.output_index,
                penalty=self.penalty,
                session_options=self.session_options,
                backend=self.backend,
            )
            slots = state_slots(
                self._onnx, self._trainable, self._dtype, self.optimizer, self._options
            )
            if self._active is not None:
                initial = self._active.read_state()
            else:
                initial = {
                    s.input: self._initial[s.input] if s.kind == "weight" else np.zeros(s.shape)
                    for s in slots
                }
            data = [self._input_name, LABEL] + ([SAMPLE_WEIGHT] if weighted else [])
            runner = PingPongRunner(
                slots,
                self._dtype,
                data,
                lambda shapes: build(shapes=shapes),
                initial,
                self.session_options,
            )
            runner.prepare(shapes)
            self._runners[weighted] = runner
        else:
            runner.prepare(shapes)
            if self._active is not None and self._active is not runner:
                runner.write_state(self._active.read_state())
        self._active = runner
        self._fitted = True
        return runner

    def _snapshot(self, what: str) -> tuple[dict, dict]:
        """The training state: JSON-able metadata and the state arrays."""
        runner = self._fitted_runner(what)
        state = runner.read_state()
        meta = {
            "format": _CHECKPOINT_FORMAT,
            "version": 1,
            "optimizer": self.optimizer,
            "loss": self.loss,
            "slots": [s.input for s in runner.slots],
            "train_losses": self.train_losses_,
            "n_iter": self.n_iter_,
            "n_steps": self.n_steps_,
            "rng": self._rng.bit_generator.state if self._rng is not None else None,
        }
        arrays = {f"state_{k}": state[s.input] for k, s in enumerate(runner.slots)}
        return meta, arrays

    def _restore(self, meta: dict, arrays: dict, where: str) -> OrtFullGraphTrainer:
        self._prepare()
        runner = self._active or self._runner(weighted=False)
        expected = [s.input for s in runner.slots]
        if meta["slots"] != expected or meta["optimizer"] != self.optimizer:
            raise OnnxInputError(
                f"{where} holds optimizer {meta['optimizer']!r} state {meta['slots']}, "
                f"this trainer needs optimizer {self.optimizer!r} state {expected}: build "
                "the trainer with the options of the saved one"
            )
        runner.write_state({name: arrays[f"state_{k}"] for k, name in enumerate(expected)})
        self.train_losses_ = list(meta["train_losses"])
        self.n_iter_, self.n_steps_ = meta["n_iter"], meta["n_steps"]
        self._rng = None
        if meta["rng"] is not None:
            self._rng = np.random.default_rng()
            self._rng.bit_generator.state = meta["rng"]
        self._fitted = True
        return self

    def _fitted_runner(self, what: str) -> PingPongRunner:
        if self._onnx is None or not self._fitted or self._active is None:
            raise NotFittedError(
                f"this OrtFullGraphTrainer is not fitted: call fit or load_checkpoint before {what}"
            )
        return self._active

    def _check_inputs(self, X) -> np.ndarray:
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
