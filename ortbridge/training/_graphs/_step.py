"""One training step as one onnxruntime call: the graph, and the runner of its state.

:func:`build_training_graph` appends the loss (:func:`ortbridge.add_loss_output`)
to the model, takes its gradients from a gradient source (:mod:`._gradient`)
and appends the optimizer update (:mod:`._update`), so that one
``run_with_iobinding`` call runs a whole training step.

:class:`PingPongRunner` keeps the weights and the optimizer state in two
sets of onnxruntime buffers bound once: a step reads one set and writes the
other, the next step the other way round. No tensor is copied between steps
and the optimizer needs no second call. The state does not depend on the
batch's shape, the graph may: onnx-ad's graph is built per batch shape
(the last batch of an epoch is often shorter), every one bound to the same
two sets.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from ortbridge._prepare._onnx_utils import np_dtype
from ortbridge._runtime import _ort
from ortbridge._runtime._errors import plain
from ortbridge._runtime._limits import fit_to_runtime
from ortbridge._runtime._sessions import quiet_session_options, training_session
from ortbridge.exceptions import OnnxModelError
from ortbridge.losses import add_loss_output

from ._gradient import ONNX_AD, gradient_model
from ._update import LEARNING_RATE, StateSlot, append_update, declare_slots

LABEL = "ortbridge/label"
SAMPLE_WEIGHT = "ortbridge/sample_weight"
LOSS = "ortbridge/loss"
#: Graphs built for batch shapes kept per runner (``partial_fit`` on ever new sizes).
MAX_SHAPES = 8
#: Batch inputs of fewer bytes are copied into buffers bound once, not bound by address
#: at every step: binding costs 3-4 us on onnxruntime 1.31 (2.5 on 1.19), copying 2 KB
#: a fraction of that, 16 KB about as much.
STAGE_BELOW = 16 * 1024


@dataclasses.dataclass
class TrainingGraph:
    """The training graph and what is needed to feed it."""

    model: onnx.ModelProto
    data_inputs: list[str]
    slots: list[StateSlot]
    dtype: np.dtype
    loss: str
    loss_dtype: np.dtype
    #: The gradient source that wrote it (:mod:`._gradient`), and why.
    source: str
    reason: str
    #: Built for the batch shapes it was given, which are the only ones it runs.
    static: bool


def build_training_graph(
    model: onnx.ModelProto,
    trainable: list[str],
    *,
    loss: str,
    optimizer: str,
    options: dict,
    weighted: bool,
    output_index: int = 0,
    penalty: dict | None = None,
    session_options=None,
    backend: str = "auto",
    shapes: dict | None = None,
) -> TrainingGraph:
    """Forward, loss, gradients and update of ``trainable`` as one ONNX graph.

    Inputs: the model's input, the label, the sample weights (if
    ``weighted``), the learning rate, then every state slot; outputs: the
    loss, then the next value of every slot. ``shapes`` (data input name ->
    shape): the batch shapes a graph of onnx-ad's may be built for.
    """
    with_loss = add_loss_output(
        model,
        loss,
        weight_name=SAMPLE_WEIGHT if weighted else None,
        penalty=penalty,
        output_index=output_index,
        label_name=LABEL,
        loss_name=LOSS,
    )
    elem = with_loss.graph.output[0].type.tensor_type.elem_type
    gradient = gradient_model(
        with_loss,
        LOSS,
        trainable,
        session_options or quiet_session_options(),
        backend,
        static=shapes,
        prefer=ONNX_AD,  # measured faster for this graph (see _gradient)
    )
    graph_model = gradient.model
    graph = graph_model.graph
    del graph.output[1:]  # the gradients feed the update, they are not returned
    slots = append_update(
        graph, _weight_shapes(model, trainable), np_dtype(elem), optimizer, options
    )
    declare_slots(graph, slots, elem)
    # add_loss_output wrote IR 10 (what every runtime loads): the model's own
    # IR version where the installed onnxruntime loads it.
    graph_model.ir_version = max(graph_model.ir_version, model.ir_version)
    fit_to_runtime(graph_model)
    return TrainingGraph(
        graph_model,
        gradient.data_inputs,
        slots,
        np_dtype(elem),
        gradient.loss,
        np_dtype(gradient.loss_elem),
        gradient.source,
        gradient.reason,
        gradient.static,
    )


def state_slots(model: onnx.ModelProto, trainable, dtype, optimizer, options) -> list[StateSlot]:
    """The state slots :func:`build_training_graph` gives the graph, without building it."""
    return append_update(
        onnx.GraphProto(), _weight_shapes(model, trainable), dtype, optimizer, options
    )


def _staging_buffers(training: TrainingGraph, data_inputs: list[str]) -> list:
    """(position, buffer) for the small data inputs of a graph built for static shapes."""
    if not training.static:
        return []
    inputs = {i.name: i.type.tensor_type for i in training.model.graph.input}
    staged = []
    for pos, name in enumerate(data_inputs):
        shape = tuple(d.dim_value for d in inputs[name].shape.dim)
        buffer = np.zeros(shape, np_dtype(inputs[name].elem_type))
        if buffer.nbytes < STAGE_BELOW:
            staged.append((pos, buffer))
    return staged


def _weight_shapes(model: onnx.ModelProto, trainable) -> dict[str, tuple]:
    shapes = {init.name: tuple(init.dims) for init in model.graph.initializer}
    return {name: shapes[name] for name in trainable}


@dataclasses.dataclass
class _Bound:
    """A training graph's session, its two bindings and its loss buffer."""

    training: TrainingGraph
    session: object
    bindings: list
    loss: object
    #: (position, buffer bound in both bindings) of the data inputs copied at each step,
    #: and the positions of those bound by address.
    staged: list
    unstaged: list


class PingPongRunner:
    """Runs training graphs with their state in two sets of bound buffers.

    ``build(shapes)`` returns the :class:`TrainingGraph` for a batch of
    those shapes (data input name -> shape). ``bindings[k]`` reads state
    set ``k`` and writes set ``1 - k``; after a step the current set flips.
    The learning rate has one buffer, bound in every graph.
    """

    def __init__(self, slots, dtype, data_inputs, build, initial: dict, session_options=None):
        C = _ort.capi()
        self.slots, self.dtype, self.data_inputs = slots, np.dtype(dtype), list(data_inputs)
        self._build, self._session_options = build, session_options
        self.device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        self.sets = [{s.input: self._buffer(s.shape) for s in slots} for _ in range(2)]
        self.learning_rate = self._buffer(())
        self.current = 0
        self.run_options = C.RunOptions()
        self._graphs: dict = {}  # batch shapes (None: any) -> _Bound
        self._last: _Bound | None = None
        # The one onnxruntime call of a step (an attribute: tests count it).
        self.run = self._run
        self.write_state(initial)

    def _buffer(self, shape, dtype=None):
        return _ort.capi().OrtValue.ortvalue_from_shape_and_type(
            list(shape), dtype or self.dtype, self.device
        )

    @property
    def training(self) -> TrainingGraph | None:
        """The graph of the last step (or of :meth:`prepare`)."""
        return None if self._last is None else self._last.training

    @property
    def bindings(self) -> list:
        return self._last.bindings

    @property
    def loss(self):
        return self._last.loss

    def prepare(self, batches: list) -> None:
        """Build the graphs for batches of these shapes (a model it cannot train fails here).

        ``batches``: the shapes of each data input, for each batch shape to come.
        """
        built = [self._graph(tuple(shapes)) for shapes in batches]
        if built:
            self._last = built[0]

    def _graph(self, key: tuple) -> _Bound:
        bound = self._graphs.get(None) or self._graphs.get(key)
        if bound is None:
            training = self._build(dict(zip(self.data_inputs, key)))
            bound = self._bind(training)
            if training.static and len(self._graphs) >= MAX_SHAPES:
                self._graphs.pop(next(k for k in self._graphs if self._graphs[k] is not self._last))
            self._graphs[key if training.static else None] = bound
        return bound

    def _bind(self, training: TrainingGraph) -> _Bound:
        C = _ort.capi()
        session = training_session(
            training.model,
            self._session_options or quiet_session_options(),
            "the training graph",
            reverse=training.source == ONNX_AD,
        )
        loss = self._buffer((), training.loss_dtype)
        staged = _staging_buffers(training, self.data_inputs)
        bindings = []
        for k in range(2):
            binding = C.SessionIOBinding(session._sess)
            for slot in training.slots:
                binding.bind_ortvalue_input(slot.input, self.sets[k][slot.input])
                binding.bind_ortvalue_output(slot.output, self.sets[1 - k][slot.input])
            binding.bind_ortvalue_input(LEARNING_RATE, self.learning_rate)
            binding.bind_ortvalue_output(training.loss, loss)
            for pos, buffer in staged:
                name = self.data_inputs[pos]
                binding.bind_input(
                    name, self.device, buffer.dtype, buffer.shape, buffer.ctypes.data
                )
            bindings.append(binding)
        unstaged = sorted(set(range(len(self.data_inputs))) - {pos for pos, _ in staged})
        return _Bound(training, session, bindings, loss, staged, unstaged)

    def _run(self, session, binding) -> None:
        session._sess.run_with_iobinding(binding, self.run_options)

    def write_state(self, values: dict) -> None:
        """Copy ``values`` (slot input name -> array) into the current set."""
        for name, value in values.items():
            target = self.sets[self.current][name]
            target.update_inplace(
                np.ascontiguousarray(value, dtype=self.dtype).reshape(target.shape())
            )

    def read_state(self) -> dict:
        """Copies of the current state, slot input name -> array."""
        return {name: value.numpy() for name, value in self.sets[self.current].items()}

    def step(self, arrays: list[np.ndarray]) -> float:
        """One training step on a batch (contiguous arrays, in ``data_inputs`` order)."""
        bound = self._last
        if bound is None or bound.training.static:
            bound = self._last = self._graph(tuple(a.shape for a in arrays))
        binding = bound.bindings[self.current]
        for pos, buffer in bound.staged:
            np.copyto(buffer, arrays[pos])
        for pos in bound.unstaged:
            # Bound by address: the batch is not copied.
            array = arrays[pos]
            binding.bind_input(
                self.data_inputs[pos], self.device, array.dtype, array.shape, array.ctypes.data
            )
        try:
            self.run(bound.session, binding)
        except Exception as exc:
            raise OnnxModelError(
                f"onnxruntime failed to run a training step on a batch of shapes "
                f"{[a.shape for a in arrays]}: {plain(exc)}"
            ) from exc
        self.current = 1 - self.current
        return float(bound.loss.numpy())
