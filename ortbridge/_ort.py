"""Lazy access to onnxruntime: any build for sessions, the training build for its agent.

onnxruntime is imported on first use, not at ``import ortbridge``: the
package must import (and say what is missing) without it. Two distributions
provide the same ``onnxruntime`` module: onnxruntime-training 1.19.2 (with the
TrainingAgent and its gradient builder) and maintained onnxruntime (inference
only, run by the onnxruntime engine). Never both in one environment.
"""

from __future__ import annotations

import functools

from .exceptions import MissingDependencyError

_TRAINING_HINT = (
    "install onnxruntime-training 1.19.2: `pip install onnxruntime-training-cpu==1.19.2` "
    "(CPU) or `pip install onnxruntime-training==1.19.2` (CUDA 11.8), or the extras "
    "`ortbridge[cpu]` / `ortbridge[cuda]`; never beside another onnxruntime package"
)
_ANY_HINT = (
    "install one onnxruntime distribution: the extra `ortbridge[ort]` (maintained onnxruntime, "
    "CPU), `ortbridge[ort-gpu]` (onnxruntime-gpu, CUDA 12), or `ortbridge[cpu]` / "
    "`ortbridge[cuda]` (onnxruntime-training 1.19.2); never two in one environment"
)


@functools.cache
def runtime():
    """Return the installed ``onnxruntime`` module, whichever build it is."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise MissingDependencyError(f"onnxruntime is not installed: {_ANY_HINT}") from exc
    return ort


@functools.cache
def has_training() -> bool:
    """Whether the installed onnxruntime is the training build (has a TrainingAgent)."""
    try:
        ort = runtime()
    except MissingDependencyError:
        return False
    return hasattr(ort.capi._pybind_state, "TrainingAgent")


def onnxruntime():
    """Return the ``onnxruntime`` module, checking it is a training build."""
    ort = runtime()
    if not has_training():
        raise MissingDependencyError(
            f"onnxruntime {ort.__version__} is installed without training support "
            f"(no TrainingAgent): {_TRAINING_HINT}"
        )
    return ort


def capi():
    """Return ``onnxruntime.capi._pybind_state`` of any build."""
    return runtime().capi._pybind_state


def version() -> tuple[int, int]:
    """onnxruntime's (major, minor) version."""
    major, minor = runtime().__version__.split(".")[:2]
    return int(major), int(minor)
