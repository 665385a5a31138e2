"""The cases and how each ends: ONNX's node test cases, prepared for an ``OnnxModule``.

:func:`node_cases` collects them; :func:`_split_inputs` turns a case's
constant inputs into initializers, as an exported model has them. The
classes a case ends in, :class:`CaseResult`, and the exceptions that end a
check early in one of them live here too.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

CORRECT = "correct"
WRONG = "wrong"
REFUSED = "refused"
NO_GRADIENT = "no-gradient-path"
ERROR = "error"
SKIPPED = "skipped"
CLASSES = (CORRECT, WRONG, REFUSED, NO_GRADIENT, ERROR, SKIPPED)

#: Float operands that are settings rather than data: they stay initializers
#: (exported models hold them as constants), keyed by op type, then input
#: positions. Everything else that is float32/float64 is differentiated.
FROZEN_OPERANDS = {
    "Resize": {1, 2},  # roi, scales
    "Upsample": {1},  # scales
    "Pad": {2},  # constant_value
    "Dropout": {1},  # ratio
    "Range": {0, 1, 2},  # start, limit, delta: the output's length depends on them
    "RoiAlign": {1},  # rois: boxes, as torchvision's roi_align treats them
    "OneHot": {0, 1},  # indices and depth, whatever their type
    "CastLike": {1},  # target_type: only its type is read
    "NegativeLogLikelihoodLoss": {2},  # class weights
    "SoftmaxCrossEntropyLoss": {2},  # class weights
}

_TRAINED_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE}
_NP_TRAINED = (np.float32, np.float64)


@dataclasses.dataclass
class NodeCase:
    """One test case of ONNX's node suite."""

    name: str
    op_type: str
    domain: str
    expanded: bool
    model: onnx.ModelProto
    inputs: list
    outputs: list

    @property
    def op_key(self) -> str:
        """The op type, prefixed by its domain outside ai.onnx."""
        if self.domain in ("", "ai.onnx"):
            return self.op_type
        return f"{self.domain}.{self.op_type}"


@dataclasses.dataclass
class CaseResult:
    """How one case went: its class, details and numbers."""

    name: str
    op_type: str
    expanded: bool
    status: str
    detail: str = ""
    dtype: str | None = None
    checked: int = 0
    max_error: float | None = None
    #: Largest finite-difference derivative checked: 0 when the outputs do not
    #: depend on the inputs where checked (a correct gradient with nothing to train).
    grad_max: float | None = None
    note: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def node_cases(op_types: Iterable[str] | None = None, *, expanded: bool = True) -> list[NodeCase]:
    """ONNX's node test cases, optionally only those of ``op_types`` (keys as :attr:`op_key`).

    Collecting imports every case module of onnx (about 12 s on 2 cores):
    do it once per process.
    """
    from onnx.backend.test.case import node as node_suite

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnx's generators overflow casts on purpose
        collected = node_suite.collect_testcases()
    by_name = node_suite._existing_names  # base case name -> the node it tests
    wanted = None if op_types is None else set(op_types)
    cases = []
    for case in collected:
        base = re.sub(r"_expanded(_ver\d+)?$", "", case.name)
        node = by_name.get(base)
        if node is None:
            continue
        is_expanded = base != case.name
        if is_expanded and not expanded:
            continue
        found = NodeCase(
            case.name, node.op_type, node.domain, is_expanded, case.model, *map(list, _data(case))
        )
        if wanted is None or found.op_key in wanted:
            cases.append(found)
    return cases


def _data(case):
    inputs, outputs = case.data_sets[0]
    return inputs, outputs


class _Skip(Exception):
    pass


class _NoGradient(Exception):
    pass


class _Refused(Exception):
    pass


def _REFUSALS():
    from ..exceptions import MissingDependencyError, NotDifferentiableError

    return (NotDifferentiableError, MissingDependencyError)


def _add_note(result: CaseResult, text: str) -> None:
    result.note = f"{result.note}; {text}" if result.note else text


def _first_line(exc: BaseException, limit: int = 500) -> str:
    """The exception on one line; a long one keeps its head and its tail (the reason)."""
    text = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}").strip()
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


def _frozen_names(case: NodeCase) -> set[str]:
    """Graph inputs feeding a slot of :data:`FROZEN_OPERANDS`."""
    slots = FROZEN_OPERANDS.get(case.op_type, ())
    if not slots or case.domain not in ("", "ai.onnx"):
        return set()
    # Expanded cases keep the node's inputs as graph inputs, in the same order;
    # the graph inputs are the node's present inputs.
    from onnx.backend.test.case import node as node_suite

    base = re.sub(r"_expanded(_ver\d+)?$", "", case.name)
    node = node_suite._existing_names.get(base)
    if node is None:
        return set()
    return {name for pos, name in enumerate(node.input) if name and pos in slots}


def _as_initializer(value, name: str) -> onnx.TensorProto:
    if isinstance(value, onnx.TensorProto):
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value)
        tensor.name = name
        return tensor
    return numpy_helper.from_array(np.asarray(value), name)


def _split_inputs(case: NodeCase) -> tuple[onnx.ModelProto, list[str], list[np.ndarray]]:
    """The case's model with constants as initializers; the trained inputs and their values."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    graph = model.graph
    for vi in list(graph.input) + list(graph.output):
        if vi.type.WhichOneof("value") != "tensor_type":
            raise _Skip(
                f"graph {'input' if vi in graph.input else 'output'} {vi.name!r} is a "
                f"{vi.type.WhichOneof('value')}: an OnnxModule takes and returns tensors only"
            )
    frozen = _frozen_names(case)
    names, values, keep = [], [], []
    for vi, value in zip(list(graph.input), case.inputs):
        if isinstance(value, onnx.TensorProto) and value.data_type in _TRAINED_TYPES:
            value = numpy_helper.to_array(value)
        is_float = isinstance(value, np.ndarray) and value.dtype.type in _NP_TRAINED
        if is_float and vi.name not in frozen:
            names.append(vi.name)
            values.append(value)
            keep.append(vi)
        else:
            graph.initializer.append(_as_initializer(value, vi.name))
    del graph.input[:]
    graph.input.extend(keep)
    return model, names, values


def _training_mode(model: onnx.ModelProto) -> bool:
    """Whether the graph asks for training behaviour (Dropout or BatchNormalization)."""
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            value = constants.get(node.input[2])
            if value is None or bool(np.asarray(value).item()):
                return True
        if node.op_type == "BatchNormalization":
            if any(a.name == "training_mode" and a.i for a in node.attribute):
                return True
    return False


def _random_dropout(model: onnx.ModelProto) -> bool:
    """Whether a Dropout draws a mask (training mode, ratio not zero).

    The onnxruntime engine draws it with torch's generator, onnxruntime's
    inference with its own: outputs cannot be compared. The test suite checks
    those gradients against the mask drawn (``test_modes``).
    """
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Dropout" or not _training_mode(model):
            continue
        ratio = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else 0.5
        if ratio is None or float(np.asarray(ratio)) != 0.0:
            return True
    return False
