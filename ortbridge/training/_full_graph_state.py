"""The training state of :class:`._full_graph.OrtFullGraphTrainer`: runners, snapshots, files.

The weights and the optimizer state live in onnxruntime's buffers, held by
one :class:`._graphs._step.PingPongRunner` per variant of the training
graph (with or without sample weights); switching variants copies the state
once. A snapshot of it (JSON metadata, the state's arrays, the step counts
and the shuffling state) is what a checkpoint file holds, a numpy ``.npz``
archive with no pickle in it, and what a pickle of the trainer holds, since
onnxruntime sessions do not pickle.
"""

from __future__ import annotations

import functools
import json
import zipfile
from typing import TYPE_CHECKING

import numpy as np

from ..exceptions import NotFittedError, OnnxInputError
from ._graphs._step import (
    LABEL,
    SAMPLE_WEIGHT,
    PingPongRunner,
    build_training_graph,
    state_slots,
)

if TYPE_CHECKING:  # the trainer imports this module
    from ._full_graph import OrtFullGraphTrainer

_CHECKPOINT_FORMAT = "ortbridge.OrtFullGraphTrainer checkpoint"


class _TrainerState:
    """Where :class:`._full_graph.OrtFullGraphTrainer`'s state lives, and its snapshots."""

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


def write_checkpoint(path: str, meta: dict, arrays: dict) -> None:
    """Write a snapshot to ``path``, the name as given."""
    with open(path, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), **arrays)


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """The snapshot :func:`write_checkpoint` wrote to ``path``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {k: data[k] for k in data.files if k != "meta"}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise OnnxInputError(f"{path!r} is not a trainer checkpoint: {exc}") from exc
    if meta.get("format") != _CHECKPOINT_FORMAT:
        raise OnnxInputError(f"{path!r} is not an OrtFullGraphTrainer checkpoint")
    return meta, arrays
