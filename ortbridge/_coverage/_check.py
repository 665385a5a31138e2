"""Checking one case in-process: :func:`run_case`, which classifies every failure."""

from __future__ import annotations

import time
import zlib

import numpy as np
import onnx

from ._cases import (
    _REFUSALS,
    _TRAINED_TYPES,
    CORRECT,
    ERROR,
    NO_GRADIENT,
    REFUSED,
    SKIPPED,
    WRONG,
    CaseResult,
    NodeCase,
    _add_note,
    _first_line,
    _NoGradient,
    _random_dropout,
    _Refused,
    _Skip,
    _split_inputs,
    _training_mode,
)
from ._compare import _TOLERANCES, _perturb, _pick, _same, _verify
from ._float64 import _as_float64, _has_float32
from ._reference import _load


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


def _magnitude(array: np.ndarray) -> float:
    finite = np.abs(array[np.isfinite(array)])
    return float(finite.max()) if finite.size else 0.0


def _module(model: onnx.ModelProto, backend: str):
    from ..module import OnnxModule

    try:
        layer = OnnxModule(model, trainable=[], backend=backend)
    except _REFUSALS() as exc:
        raise _Refused(_first_line(exc, 600)) from None
    return layer.train(_training_mode(model))
