"""Training without a torch optimizer: weight updates, losses and estimators
run by onnxruntime.

Everything here runs on onnxruntime-training 1.19.2 and on maintained
onnxruntime alike: the gradients come from the training build's gradient
builder where it is installed, from onnx-ad's standard-op reverse graph
otherwise (the ``backend`` argument of each trainer).
"""

from __future__ import annotations

import importlib

__all__ = [
    "OnnxSGDClassifier",
    "OnnxSGDRegressor",
    "OrtFullGraphTrainer",
    "OrtSGD",
]

_LAZY = {
    "OrtSGD": "ortbridge.training._sgd",
    "OnnxSGDRegressor": "ortbridge.training._estimators",
    "OnnxSGDClassifier": "ortbridge.training._estimators",
    "OrtFullGraphTrainer": "ortbridge.training._full_graph",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ortbridge.training' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
