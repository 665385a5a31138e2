"""Lazy access to onnxruntime-training.

onnxruntime is imported on first use, not at ``import ortbridge``: the
package must import (and say what is missing) without it.
"""

from __future__ import annotations

import functools

from .exceptions import MissingDependencyError

_INSTALL_HINT = (
    "install onnxruntime-training 1.19.2: `pip install onnxruntime-training-cpu==1.19.2` "
    "(CPU) or `pip install onnxruntime-training==1.19.2` (CUDA 11.8), or the extras "
    "`ortbridge[cpu]` / `ortbridge[cuda]`; never beside another onnxruntime package"
)


@functools.cache
def onnxruntime():
    """Return the ``onnxruntime`` module, checking it is a training build."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise MissingDependencyError(f"onnxruntime is not installed: {_INSTALL_HINT}") from exc
    capi = ort.capi._pybind_state
    if not hasattr(capi, "TrainingAgent"):
        raise MissingDependencyError(
            f"onnxruntime {ort.__version__} is installed without training support "
            f"(no TrainingAgent): {_INSTALL_HINT}"
        )
    return ort


def capi():
    """Return ``onnxruntime.capi._pybind_state`` of the training build."""
    return onnxruntime().capi._pybind_state
