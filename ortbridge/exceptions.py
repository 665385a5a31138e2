"""Errors raised by ortbridge.

Every error derives from :class:`OrtBridgeError`; the subclasses also derive
from the built-in exception a caller would naturally catch.
"""

from __future__ import annotations


class OrtBridgeError(Exception):
    """Root of every error raised by ortbridge."""


class OnnxInputError(OrtBridgeError, ValueError):
    """A value given to an ONNX graph does not match what the graph declares."""


class OnnxTypeError(OrtBridgeError, TypeError):
    """An argument has the wrong Python or tensor type."""


class OnnxModelError(OrtBridgeError, ValueError):
    """The ONNX model is missing, corrupt or cannot be prepared for training."""


class NotDifferentiableError(OrtBridgeError, ValueError):
    """onnxruntime cannot build a gradient for a node of the graph.

    ``unreachable`` names the tensor no gradient reaches, when that is the
    cause; ``node`` and ``op_type`` the node refused, when one is;
    ``reason`` is the message without its ``hint`` (what else to try).
    """

    def __init__(
        self,
        message: str,
        unreachable: str | None = None,
        *,
        node: str | None = None,
        op_type: str | None = None,
        hint: str = "",
    ):
        super().__init__(message + hint)
        self.reason = message
        self.unreachable = unreachable
        self.node = node
        self.op_type = op_type


class MissingDependencyError(OrtBridgeError, ImportError):
    """A package ortbridge needs is not installed."""


class NotFittedError(OrtBridgeError, AttributeError):
    """An estimator was used before ``fit``.

    Also a ``sklearn.exceptions.NotFittedError`` when scikit-learn is installed
    (see :mod:`ortbridge.training`).
    """


class TrainingDivergedError(OrtBridgeError, FloatingPointError):
    """The training loss became NaN or infinite."""
