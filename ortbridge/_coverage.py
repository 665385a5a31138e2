"""Op coverage of the onnxruntime engine: ONNX's node test cases, checked by finite differences.

Each case of ``onnx.backend.test.case.node`` (one node, or its function
expanded into several) becomes an :class:`~ortbridge.OnnxModule` with
``backend="onnxruntime"``: its float32/float64 graph inputs are inputs that
require grad, everything else (axes, pads, indices, shapes, masks, and the
float operands listed in :data:`FROZEN_OPERANDS`) an initializer, as an
exported model has them. The case is converted to float64 where onnxruntime
runs it that way (float32 otherwise, with looser tolerances). The module's
outputs are compared with onnxruntime inference of the same graph, and its
input gradients for a random cotangent with central finite differences of
that inference, on a fixed random subset of each input's elements.

Each case ends in one class:

``correct``
    outputs and every checked gradient element agree.
``wrong``
    an output or a gradient disagrees (see below for kinks): the engine is
    silently wrong there, the worst outcome.
``refused``
    the engine says it cannot differentiate a node
    (:class:`~ortbridge.exceptions.NotDifferentiableError`, naming it).
``no-gradient-path``
    nothing to differentiate: no float32/float64 input, or no float32/float64
    output.
``error``
    any other failure (onnxruntime's own errors, a crash of the process).
``skipped``
    the case cannot be checked here: onnxruntime does not run it at all
    (opset too new, kernel missing), its outputs are random, or it takes
    sequences or optionals, which an ``OnnxModule`` does not.

Finite differences: central, step 1e-6 (float64) or 1e-3 (float32) relative
to the element, with a tolerance that adds the rounding noise of the outputs
that moved. Points of non-differentiability (ReLU or Abs at 0, ties of Max,
Floor at an integer) are handled by accepting any value between the one-sided
derivatives where these differ. A disagreement where the function is not
differentiable (a kink, or a jump: a quarter of the step changes the
difference quotient) is checked again at inputs moved by 1-2%, and the case
is correct, with a note, only if everything agrees there; a disagreement
where the function is differentiable (a NaN gradient where the derivative is
0, say) is wrong at once. Output elements that are infinite or saturated (a
masked attention score) get a zero cotangent.

Two adaptations keep the reference honest. float64: the converted model
must give the float32 outputs, and each input, nudged by 1e-9, must move the
outputs linearly (onnxruntime computes some float64 kernels in float32, such
as GroupNormalization's); otherwise the case runs in float32. Versions: an IR
version newer than onnxruntime reads is lowered, and an opset newer than it
reads is converted down by onnx's version converter (noted on the case;
skipped where the converter refuses). Graphs asking for training behaviour
(a Dropout with ``training_mode`` true, a training BatchNormalization) run
the module in train mode, the others in eval mode.

:func:`run_case` checks one case in-process; :func:`run_isolated` runs many
in forked worker processes, so a case that kills its process (onnxruntime
can) costs that case only. ``benchmarks/op_coverage.py`` runs the whole suite
and writes the table; ``tests/test_op_coverage.py`` checks a subset.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import multiprocessing
import os
import re
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import wait

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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


# -- collecting the cases -----------------------------------------------------


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


# -- preparing a case ---------------------------------------------------------


class _Skip(Exception):
    pass


class _NoGradient(Exception):
    pass


class _Refused(Exception):
    pass


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


def _to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computing in float64 where its float32 tensors may be float64.

    Value types, tensor attributes and Cast targets change; an initializer
    changes only where every consumer's schema accepts double (Resize's
    scales stay float32).
    """
    converted = onnx.ModelProto()
    converted.CopyFrom(model)
    opsets = {o.domain or "": o.version for o in converted.opset_import}
    _graph_to_float64(converted.graph, opsets)
    return converted


def _graph_to_float64(graph: onnx.GraphProto, opsets: dict) -> None:
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        _type_to_float64(vi.type)
    keep32 = set()
    for node in graph.node:
        for pos, name in enumerate(node.input):
            if name and not _accepts_double(node, pos, opsets):
                keep32.add(name)
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in keep32:
            init.CopyFrom(_tensor_to_float64(init))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_tensor_to_float64(attr.t))
            elif attr.type == onnx.AttributeProto.GRAPH:
                _graph_to_float64(attr.g, opsets)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _graph_to_float64(g, opsets)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                if attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.DOUBLE
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name in ("value_float", "value_floats"):
                    scalar = attr.name == "value_float"
                    array = np.array(attr.f if scalar else list(attr.floats), dtype=np.float64)
                    attr.CopyFrom(
                        helper.make_attribute("value", numpy_helper.from_array(array, ""))
                    )


def _type_to_float64(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" and type_proto.tensor_type.elem_type == TensorProto.FLOAT:
        type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type_to_float64(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _type_to_float64(type_proto.optional_type.elem_type)


def _tensor_to_float64(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def _accepts_double(node: onnx.NodeProto, pos: int, opsets: dict) -> bool:
    try:
        schema = onnx.defs.get_schema(
            node.op_type, opsets.get(node.domain or "", 1), node.domain or ""
        )
    except Exception:
        return True
    if not schema.inputs:
        return True
    formal = schema.inputs[min(pos, len(schema.inputs) - 1)]
    allowed = {formal.type_str}
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = set(constraint.allowed_type_strs)
    return "tensor(double)" in allowed


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


# -- onnxruntime inference, the reference -------------------------------------


def _magnitude(array: np.ndarray) -> float:
    finite = np.abs(array[np.isfinite(array)])
    return float(finite.max()) if finite.size else 0.0


def _reference_session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _first_line(exc: BaseException, limit: int = 500) -> str:
    """The exception on one line; a long one keeps its head and its tail (the reason)."""
    text = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}").strip()
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


# -- checking one case --------------------------------------------------------


@dataclasses.dataclass
class _Tolerance:
    rtol: float
    atol: float
    step: float
    eps: float


_TOLERANCES = {
    "float64": _Tolerance(rtol=1e-4, atol=1e-6, step=1e-6, eps=float(np.finfo(np.float64).eps)),
    "float32": _Tolerance(rtol=1e-2, atol=5e-4, step=1e-3, eps=float(np.finfo(np.float32).eps)),
}

#: Output elements this large are saturated stand-ins for infinity (a masked
#: attention score): like infinite ones, they get a zero cotangent.
_SATURATED = 1e30


def run_case(case: NodeCase, *, samples: int = 16, backend: str = "onnxruntime") -> CaseResult:
    """Check one case through ``backend``'s engine; never raises (failures are classified)."""
    start = time.perf_counter()
    result = CaseResult(case.name, case.op_key, case.expanded, ERROR)
    try:
        _check(case, result, samples, backend)
    except _Skip as exc:
        result.status, result.detail = SKIPPED, str(exc)
    except _NoGradient as exc:
        result.status, result.detail = NO_GRADIENT, str(exc)
    except _Refused as exc:
        result.status, result.detail = REFUSED, str(exc)
    except Exception as exc:  # one case never stops the run
        result.status, result.detail = ERROR, _first_line(exc)
    result.seconds = round(time.perf_counter() - start, 4)
    for field in ("max_error", "grad_max"):
        value = getattr(result, field)
        if value is not None:
            setattr(result, field, float(f"{value:.4g}"))
    return result


def _load(model: onnx.ModelProto, result: CaseResult):
    """The reference session; ``model`` is adapted in place to what onnxruntime reads.

    onnx stamps its newest cases with an IR version and an opset onnxruntime
    may not read yet: the IR version (the file format) is lowered, and the
    model converted to onnxruntime's newest opset by onnx's version converter
    where it can (it refuses where the semantics differ). Both are noted.
    """
    notes = []
    for _ in range(3):
        try:
            session = _reference_session(model)
        except Exception as exc:
            text = str(exc)
            ir = re.search(r"max supported IR version: (\d+)", text)
            opset = re.search(r"support for domain ai\.onnx is till opset (\d+)", text)
            if ir and int(ir.group(1)) < model.ir_version:
                model.ir_version = int(ir.group(1))
                notes.append(f"IR version lowered to {model.ir_version}")
                continue
            if opset:
                target, current = int(opset.group(1)), _opset(model)
                try:
                    converted = onnx.version_converter.convert_version(model, target)
                except Exception as err:
                    raise _Skip(
                        f"onnxruntime reads ai.onnx opsets up to {target}, the case is opset "
                        f"{current} and onnx cannot convert it: {_first_line(err)}"
                    ) from None
                converted.ir_version = min(converted.ir_version, model.ir_version)
                model.CopyFrom(converted)
                notes.append(f"converted from opset {current} to {target}")
                continue
            raise _Skip(f"onnxruntime does not load the case: {_first_line(exc)}") from None
        for note in notes:
            _add_note(result, note)
        return session
    raise _Skip(f"onnxruntime does not load the case ({'; '.join(notes)})")


def _opset(model: onnx.ModelProto) -> int:
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [0])


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


def _check(case: NodeCase, result: CaseResult, samples: int, backend: str) -> None:
    model32, names, values32 = _split_inputs(case)
    if _random_dropout(model32):
        raise _Skip("random: a training-mode Dropout's mask (torch's generator here)")
    session32 = _load(model32, result)
    if not names:
        raise _NoGradient("no float32/float64 graph input")
    out_types = [o.type.tensor_type.elem_type for o in model32.graph.output]
    if not any(t in _TRAINED_TYPES for t in out_types):
        raise _NoGradient("no float32/float64 graph output")
    feeds32 = dict(zip(names, values32))
    try:
        first = session32.run(None, feeds32)
    except Exception as exc:
        raise _Skip(f"onnxruntime does not run the case: {_first_line(exc)}") from None
    if not all(_same(a, b) for a, b in zip(first, session32.run(None, feeds32))):
        raise _Skip("its outputs are random (two inference runs differ)")
    for name, got, want in zip([o.name for o in model32.graph.output], first, case.outputs):
        if isinstance(want, np.ndarray) and np.shape(got) != want.shape:
            raise _Skip(
                f"onnxruntime's output {name!r} has shape {np.shape(got)} where onnx expects "
                f"{want.shape}: no reference"
            )
        if (
            isinstance(want, np.ndarray)
            and want.dtype.kind == "f"
            and np.asarray(got).dtype.kind == "f"
            and not np.allclose(
                got, want, rtol=1e-3, atol=1e-4 * max(1.0, _magnitude(want)), equal_nan=True
            )
        ):
            # The installed runtime computes the case wrongly (onnxruntime 1.19.2's
            # ReverseSequence leaves a length-0 row unwritten): it is no reference.
            worst = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
            raise _Skip(
                f"onnxruntime's output {name!r} differs from onnx's expected one by up to "
                f"{worst:.3g}: no reference"
            )

    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    model, session, values, dtype = model32, session32, values32, "float32"
    if all(v.dtype == np.float64 for v in values32) and not _has_float32(model32):
        dtype = "float64"
    else:
        converted = _as_float64(model32, names, values32, first, rng)
        if converted is not None:
            model, session, values = converted
            dtype = "float64"
    result.dtype = dtype
    tol = _TOLERANCES[dtype]
    types = [o.type.tensor_type.elem_type for o in model.graph.output]
    seeded = [i for i, t in enumerate(types) if t in _TRAINED_TYPES]
    picks = [_pick(v.size, samples, rng) for v in values]
    cotangents = [rng.standard_normal(np.shape(first[i])) for i in seeded]
    try:
        layer = _module(model, backend)
        check = _verify(layer, session, names, values, seeded, cotangents, picks, tol, case.outputs)
    except Exception as exc:
        # The engine's float64 graphs may need kernels an older onnxruntime
        # lacks (its Cos or ReduceL2 in float64), or the engine may refuse
        # float64 (the training build's LSTM gradient): the float32 case is the case.
        refused = isinstance(exc, _Refused)
        if dtype != "float64" or model is model32:
            raise
        if not refused and "NOT_IMPLEMENTED" not in str(exc):
            raise
        model, session, values, dtype = model32, session32, values32, "float32"
        result.dtype, tol = dtype, _TOLERANCES[dtype]
        why = f"refused in float64 ({exc})" if refused else "needs kernels onnxruntime lacks"
        _add_note(result, f"the engine's float64 graph {why}: float32 checked")
        layer = _module(model, backend)
        check = _verify(layer, session, names, values, seeded, cotangents, picks, tol, case.outputs)
    result.checked, result.max_error = check.checked, check.max_error
    result.grad_max = check.grad_max
    if check.failure is None:
        if check.checked:
            result.status = CORRECT
        elif all(v.size == 0 for v in values):
            result.status = CORRECT
            _add_note(result, "zero-size inputs: outputs and gradient shapes checked")
        else:
            result.status = ERROR
            result.detail = "no gradient element could be checked (finite differences not finite)"
        return
    if not check.certain:
        # A disagreement at a kink or a discontinuity: check again at inputs moved off it.
        moved = [_perturb(v, rng) for v in values]
        again = _verify(layer, session, names, moved, seeded, cotangents, picks, tol, None)
        if again.failure is None and again.checked:
            result.status = CORRECT
            result.checked, result.max_error = again.checked, again.max_error
            result.grad_max = again.grad_max
            _add_note(
                result,
                f"at the test's inputs: {check.failure}; agrees at inputs moved by 1-2% "
                "(a point of non-differentiability)",
            )
            return
    result.status = WRONG
    result.detail = check.failure


def _add_note(result: CaseResult, text: str) -> None:
    result.note = f"{result.note}; {text}" if result.note else text


def _has_float32(model: onnx.ModelProto) -> bool:
    return any(
        vi.type.tensor_type.elem_type == TensorProto.FLOAT
        for vi in list(model.graph.input) + list(model.graph.output)
    )


def _as_float64(model32, names, values32, outputs32, rng):
    """The float64 model, session and values, or None where float64 cannot be trusted.

    onnxruntime may lack a float64 kernel (the model does not load), compute
    in float32 inside a float64 kernel (GroupNormalization's ``stash_type``),
    or the conversion may change what the graph computes: all three fall
    back to float32.
    """
    try:
        model64 = _to_float64(model32)
        session64 = _reference_session(model64)
        values64 = [v.astype(np.float64) for v in values32]
        base = session64.run(None, dict(zip(names, values64)))
    except Exception:
        return None
    if not all(_close(a, b, 1e-3, 1e-4) for a, b in zip(base, outputs32)):
        return None
    # Precision probe, input by input: outputs must move linearly under a 1e-9
    # relative nudge (a float32 computation moves by whole float32 steps or not at all).
    feeds = dict(zip(names, values64))
    for name, value in zip(names, values64):
        direction = rng.choice([-1.0, 1.0], value.shape) * (np.abs(value) + 1.0) * 1e-9
        with np.errstate(invalid="ignore", over="ignore"):
            nudged = [np.asarray(value + k * direction) for k in (1, 2)]
        try:
            runs = [session64.run(None, {**feeds, name: v}) for v in nudged]
        except Exception:
            return None
        moved = nonlinear = 0.0
        for b, r1, r2 in zip(base, *runs):
            b, r1, r2 = (np.asarray(a) for a in (b, r1, r2))
            if b.dtype != np.float64 or b.shape != r1.shape or b.shape != r2.shape:
                continue
            d1, d2 = _delta(r1, b), _delta(r2, b)
            ok = np.isfinite(d1) & np.isfinite(d2)
            moved += float(np.sum(np.abs(d1[ok])))
            nonlinear += float(np.sum(np.abs(d2[ok] - 2 * d1[ok])))
        if moved == 0.0 or nonlinear > 1e-3 * moved:
            return None
    return model64, session64, values64


def _delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b`` with equal entries (equal infinities included) giving 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(a == b, 0.0, a.astype(np.float64) - b.astype(np.float64))


def _module(model: onnx.ModelProto, backend: str):
    from .module import OnnxModule

    try:
        layer = OnnxModule(model, trainable=[], backend=backend)
    except _REFUSALS() as exc:
        raise _Refused(_first_line(exc, 600)) from None
    return layer.train(_training_mode(model))


def _REFUSALS():
    from .exceptions import MissingDependencyError, NotDifferentiableError

    return (NotDifferentiableError, MissingDependencyError)


@dataclasses.dataclass
class _Check:
    checked: int = 0
    max_error: float = 0.0
    grad_max: float = 0.0
    #: Largest absolute and relative (to the finite difference) disagreement.
    abs_error: float = 0.0
    rel_error: float = 0.0
    failure: str | None = None
    #: The failure is certain: in the outputs, or where the function is
    #: differentiable (else the point may be a kink or a discontinuity).
    certain: bool = False


def _verify(layer, session, names, values, seeded, cotangents, picks, tol, expected) -> _Check:
    """The module's outputs and gradients at ``values`` against onnxruntime inference."""
    import torch

    reference = session.run(None, dict(zip(names, values)))
    inputs = [torch.from_numpy(np.array(v, copy=True)).requires_grad_() for v in values]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = layer(*inputs)
    except _REFUSALS() as exc:
        raise _Refused(_first_line(exc, 600)) from None
    out = list(out) if isinstance(out, tuple) else [out]
    got = [o.detach().numpy() for o in out]
    for i, (g, want) in enumerate(zip(got, reference)):
        if _close(g, want, tol.rtol, tol.atol):
            continue
        # onnxruntime's kernel may differ from the spec where the engine does
        # not (a masked score as -inf or as float32's lowest): onnx's own
        # expected output decides then.
        if expected is not None and i < len(expected) and _close(g, expected[i], 1e-3, 1e-5):
            continue
        name = layer.output_names[i]
        return _Check(
            failure=f"output {name!r} differs from onnxruntime inference: {_diff(g, want)}",
            certain=True,
        )
    # Infinite or saturated outputs have no derivative: no cotangent there.
    weights = []
    for i, r in zip(seeded, cotangents):
        keep = _regular(reference[i]) & _regular(got[i])
        weights.append(np.where(keep, r, 0.0))
    pairs = [(out[i], w) for i, w in zip(seeded, weights) if out[i].requires_grad]
    grads = [None] * len(inputs)
    if pairs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(
                [t for t, _ in pairs],
                inputs,
                [torch.from_numpy(w).to(t.dtype) for t, w in pairs],
                allow_unused=True,
            )
    grads = [
        np.zeros(v.shape) if g is None else g.detach().numpy().astype(np.float64)
        for g, v in zip(grads, values)
    ]
    for name, g, v in zip(names, grads, values):
        if g.shape != v.shape:
            return _Check(
                failure=f"the gradient of {name!r} has shape {g.shape} instead of {v.shape}",
                certain=True,
            )
    return _finite_differences(
        session, names, values, seeded, weights, reference, picks, grads, tol
    )


def _regular(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.isfinite(a) & (np.abs(a) < _SATURATED)


def _finite_differences(session, names, values, seeded, weights, base, picks, grads, tol):
    """Central finite differences of ``sum(out_i * w_i)`` against the module's gradients."""
    check = _Check()
    feeds = dict(zip(names, values))

    def derivative(name, value, j, step):
        """Central, left and right differences and their rounding noise at element j."""
        flat = value.reshape(-1)
        x = flat[j]
        h = step * max(1.0, abs(float(x)))
        plus, minus = flat.copy(), flat.copy()
        plus[j] = x + h
        minus[j] = x - h
        d_plus, d_minus = float(plus[j]) - float(x), float(x) - float(minus[j])
        out_p = session.run(None, {**feeds, name: plus.reshape(value.shape)})
        out_m = session.run(None, {**feeds, name: minus.reshape(value.shape)})
        right = _directional(out_p, base, seeded, weights) / d_plus
        left = _directional(base, out_m, seeded, weights) / d_minus
        central = (right * d_plus + left * d_minus) / (d_plus + d_minus)
        noise = _rounding(out_p, out_m, base, seeded, weights, tol.eps) / min(d_plus, d_minus)
        return central, left, right, noise

    for name, value, pick, grad in zip(names, values, picks, grads):
        for j in pick:
            x = float(value.reshape(-1)[j])
            if not np.isfinite(x):
                continue
            central, left, right, noise = derivative(name, value, j, tol.step)
            if not (np.isfinite(right) and np.isfinite(left)):
                continue
            got = float(grad.reshape(-1)[j])
            allowed = tol.atol + tol.rtol * abs(central) + 4 * noise
            check.checked += 1
            check.grad_max = max(check.grad_max, abs(central))
            error = abs(got - central)
            check.abs_error = max(check.abs_error, error)
            check.rel_error = max(check.rel_error, error / max(abs(central), tol.atol))
            if error <= allowed:
                check.max_error = max(check.max_error, error / allowed)
                continue
            # A kink: left and right derivatives differ, any value between them is a subgradient.
            kink = abs(right - left) > allowed
            if kink and min(left, right) - allowed <= got <= max(left, right) + allowed:
                continue
            # Is the function differentiable here? Then a quarter of the step
            # gives the same derivative, and a disagreement is certain.
            quarter, left4, right4, noise4 = derivative(name, value, j, tol.step / 4)
            allowed4 = tol.atol + tol.rtol * abs(central) + 4 * (noise + noise4)
            smooth = not kink and abs(quarter - central) <= allowed4
            smooth = smooth and abs(right4 - left4) <= allowed4
            check.failure = (
                f"{name}[{j}] (x={x:.6g}): gradient {got:.8g}, finite differences "
                f"{central:.8g} (one-sided {left:.6g} / {right:.6g}; at a quarter of the step "
                f"{quarter:.6g}), tolerance {allowed:.3g}"
            )
            check.certain = smooth
            return check
    return check


def _directional(after, before, seeded, weights) -> float:
    """``sum_i w_i * (after_i - before_i)``, differences taken elementwise (no cancellation)."""
    total = 0.0
    for i, w in zip(seeded, weights):
        a, b = np.asarray(after[i]), np.asarray(before[i])
        if a.shape != b.shape:
            return math.nan
        d = _delta(a, b)
        with np.errstate(invalid="ignore"):
            total += float(np.sum(np.where(w != 0.0, d * w, 0.0)))
    return total


def _rounding(out_p, out_m, base, seeded, weights, eps) -> float:
    """Rounding noise of a loss difference: eps times the terms that changed."""
    total = 0.0
    for i, w in zip(seeded, weights):
        p = np.asarray(out_p[i], dtype=np.float64)
        m = np.asarray(out_m[i], dtype=np.float64)
        b = np.asarray(base[i], dtype=np.float64)
        if p.shape != m.shape or p.shape != b.shape:
            continue
        moved = ((p != b) | (m != b)) & (w != 0.0)
        if moved.any():
            with np.errstate(invalid="ignore", over="ignore"):
                terms = np.abs(w) * (np.abs(p) + np.abs(m) + np.abs(b))
            total += float(np.nansum(terms[moved]))
    return total * eps


def _pick(size: int, samples: int, rng) -> np.ndarray:
    if size <= samples:
        return np.arange(size)
    return np.sort(rng.choice(size, samples, replace=False))


def _perturb(value: np.ndarray, rng) -> np.ndarray:
    """``value`` moved by 1-2% (at least 0.005-0.01): well beyond any finite-difference step."""
    size = rng.uniform(0.5, 1.0, value.shape) * rng.choice([-1.0, 1.0], value.shape)
    noise = size * 2e-2 * (np.abs(value) + 0.5)
    with np.errstate(invalid="ignore"):
        moved = np.where(np.isfinite(value), value + noise, value)
    return moved.astype(value.dtype)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def _close(got, want, rtol: float, atol: float) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if got.dtype.kind not in "fc" or want.dtype.kind not in "fc":
        return bool(np.array_equal(got, want))
    got, want = got.astype(np.float64), want.astype(np.float64)
    # Saturated values of one sign are equal: -inf, float32's and float64's lowest.
    with np.errstate(invalid="ignore"):
        saturated = (np.abs(got) >= _SATURATED) & (np.abs(want) >= _SATURATED)
        saturated &= np.sign(got) == np.sign(want)
    got, want = np.where(saturated, 0.0, got), np.where(saturated, 0.0, want)
    regular = want[np.isfinite(want)]
    scale = np.max(np.abs(regular), initial=0.0)
    return bool(np.allclose(got, want, rtol=rtol, atol=atol * (1 + scale), equal_nan=True))


def _diff(got, want) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} instead of {want.shape}"
    if got.dtype.kind not in "fc":
        return f"{int(np.sum(got != want))} element(s) differ"
    err = _delta(got, want)
    where = int(np.nanargmax(np.abs(err))) if np.isfinite(err).any() else 0
    return (
        f"max abs difference {np.nanmax(np.abs(err)):.3g} (element {where}: "
        f"{got.reshape(-1)[where]:.6g} instead of {want.reshape(-1)[where]:.6g})"
    )


# -- many cases, in worker processes ------------------------------------------


def _worker(conn, cases: Sequence[NodeCase], samples: int, quiet: bool, backend: str) -> None:
    import gc

    import torch

    # What the fork inherited (the parent's onnxruntime sessions among it) is
    # never collected here: destroying an inherited session can kill the worker.
    gc.freeze()

    torch.set_num_threads(1)
    if quiet:  # onnxruntime logs its load failures on stderr, which the result records
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        faulthandler.disable()  # a crash is reported by its exit code
    while True:
        index = conn.recv()
        if index is None:
            return
        conn.send(run_case(cases[index], samples=samples, backend=backend).as_dict())


def run_isolated(
    cases: Sequence[NodeCase],
    *,
    workers: int = 2,
    samples: int = 16,
    timeout: float = 300.0,
    quiet: bool = False,
    progress: Callable[[int, int, CaseResult], None] | None = None,
    backend: str = "onnxruntime",
) -> list[CaseResult]:
    """Check ``cases`` in forked worker processes; a crash or a hang costs one case.

    Results come back in the order of ``cases``. ``progress(done, total,
    result)`` is called after each case; ``quiet`` silences the workers' stderr.
    """
    context = multiprocessing.get_context("fork")
    results: list[CaseResult | None] = [None] * len(cases)
    todo = list(range(len(cases)))[::-1]
    running: dict = {}  # connection -> [process, case index, start time]
    done = 0

    def start():
        parent, child = context.Pipe()
        process = context.Process(
            target=_worker, args=(child, cases, samples, quiet, backend), daemon=True
        )
        process.start()
        child.close()
        return parent, process

    def finish(index, result):
        nonlocal done
        results[index] = result
        done += 1
        if progress is not None:
            progress(done, len(cases), result)

    idle = [start() for _ in range(max(1, min(workers, len(cases))))]
    while todo or running:
        while idle and todo:
            conn, process = idle.pop()
            index = todo.pop()
            conn.send(index)
            running[conn] = [process, index, time.monotonic()]
        ready = wait(list(running) + [p.sentinel for p, _, _ in running.values()], timeout=1.0)
        for conn in list(running):
            process, index, began = running[conn]
            if conn in ready:
                try:
                    payload = conn.recv()
                except (EOFError, OSError):
                    payload = None
                if payload is not None:
                    del running[conn]
                    finish(index, CaseResult(**payload))
                    idle.append((conn, process))
                    continue
            crashed = not process.is_alive() or (conn in ready)
            late = time.monotonic() - began > timeout
            if crashed or late:
                del running[conn]
                if process.is_alive():
                    process.kill()
                process.join()
                conn.close()
                case = cases[index]
                if late and not crashed:
                    detail = f"timed out after {timeout:.0f} s"
                else:
                    detail = f"the process died (exit code {process.exitcode})"
                finish(
                    index,
                    CaseResult(
                        case.name,
                        case.op_key,
                        case.expanded,
                        ERROR,
                        detail=detail,
                        seconds=round(time.monotonic() - began, 2),
                    ),
                )
                if todo:
                    idle.append(start())
    for conn, process in idle:
        conn.send(None)
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    return results  # type: ignore[return-value]


# -- per op type ---------------------------------------------------------------


#: Op-type statuses of :func:`by_op_type`, best first.
TRAINS = "trains"
ZERO_GRADIENT = "zero-gradient"
PARTIAL = "partial"
STATUSES = (TRAINS, ZERO_GRADIENT, PARTIAL, WRONG, REFUSED, ERROR, NO_GRADIENT, SKIPPED)


def by_op_type(results: Iterable[CaseResult]) -> dict[str, dict]:
    """Counts per op type over the cases that test the op itself (not expanded functions).

    ``status``: ``trains`` when every case with a gradient path is correct
    (at least one, with a non-zero derivative somewhere; ``zero-gradient``
    when all are correct but the outputs never depend on the inputs where
    checked); ``wrong`` when any case is wrong; ``partial`` when some
    are correct and others refused or failing; else the class all its
    checked cases share (``refused``, ``error``), or ``no-gradient-path`` /
    ``skipped`` when no case could be checked. The ``expanded_*`` counts are
    the function-expanded variants, reported beside it.
    """
    table: dict[str, dict] = {}
    for r in results:
        row = table.setdefault(
            r.op_type,
            {"cases": 0, **{c: 0 for c in CLASSES}, "expanded_cases": 0, "expanded_correct": 0},
        )
        row.setdefault("grad_max", 0.0)
        if r.expanded:
            row["expanded_cases"] += 1
            row["expanded_correct"] += r.status == CORRECT
            row.setdefault("expanded_wrong", 0)
            row["expanded_wrong"] += r.status == WRONG
            continue
        row["cases"] += 1
        row[r.status] += 1
        if r.status == CORRECT and r.grad_max:
            row["grad_max"] = max(row["grad_max"], r.grad_max)
    for row in table.values():
        checked = row[CORRECT] + row[WRONG] + row[REFUSED] + row[ERROR]
        if row[WRONG]:
            status = WRONG
        elif checked and row[CORRECT] == checked:
            status = TRAINS if row["grad_max"] > 0 else ZERO_GRADIENT
        elif row[CORRECT]:
            status = PARTIAL
        elif row[REFUSED]:
            status = REFUSED
        elif row[ERROR]:
            status = ERROR
        elif row[NO_GRADIENT]:
            status = NO_GRADIENT
        else:
            status = SKIPPED
        row["status"] = status
        row.setdefault("expanded_wrong", 0)
    return dict(sorted(table.items()))


def summary(results: Sequence[CaseResult]) -> dict:
    """Case counts by class (direct and expanded cases) and op-type counts by status."""
    ops = by_op_type(results)
    direct = [r for r in results if not r.expanded]
    expanded = [r for r in results if r.expanded]
    return {
        "cases": {c: sum(r.status == c for r in direct) for c in CLASSES},
        "expanded_cases": {c: sum(r.status == c for r in expanded) for c in CLASSES},
        "op_types": {s: sum(row["status"] == s for row in ops.values()) for s in STATUSES},
        "op_types_trained": sorted(k for k, row in ops.items() if row["status"] == TRAINS),
    }


def rst_table(results: Sequence[CaseResult]) -> str:
    """The per-op-type table in reStructuredText (a simple table)."""
    ops = by_op_type(results)
    header = ["op type", "cases", "correct", "wrong", "refused", "error", "n/a", "status",
              "expanded"]  # fmt: skip
    rows = []
    for op, row in ops.items():
        expanded = (
            f"{row['expanded_correct']}/{row['expanded_cases']}" if row["expanded_cases"] else ""
        )
        if row["expanded_wrong"]:
            expanded += f" ({row['expanded_wrong']} wrong)"
        rows.append(
            [
                op,
                row["cases"],
                row[CORRECT],
                row[WRONG],
                row[REFUSED],
                row[ERROR],
                row[NO_GRADIENT] + row[SKIPPED],
                row["status"],
                expanded,
            ]
        )
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells[1:]]
    lines.append(rule)
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """Versions and machine the results were measured with."""
    import platform

    import onnxruntime
    import torch

    try:
        import onnx_ad

        ad_version = onnx_ad.__version__
    except ImportError:
        ad_version = None
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx_ad": ad_version,
    }


__all__ = [
    "CLASSES",
    "FROZEN_OPERANDS",
    "CaseResult",
    "NodeCase",
    "by_op_type",
    "node_cases",
    "rst_table",
    "run_case",
    "run_isolated",
    "summary",
]
