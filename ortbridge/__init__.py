"""ortbridge: an ONNX graph inside a PyTorch model as a trainable layer.

>>> import ortbridge
>>> sorted(ortbridge.__all__)[:2]
['OnnxModule', 'OrtBridgeError']
"""

from __future__ import annotations

import importlib

from .exceptions import OrtBridgeError

__version__ = "0.1.0"

__all__ = [
    "OnnxModule",
    "OrtBridgeError",
    "add_loss_output",
    "get_train_initializer",
    "gradcheck",
    "lora",
]

# Public names resolved on first use: importing ortbridge stays cheap and
# works without onnxruntime-training (the error comes when it is needed).
_LAZY = {
    "OnnxModule": "ortbridge.module",
    "add_loss_output": "ortbridge.losses",
    "get_train_initializer": "ortbridge.losses",
    "gradcheck": "ortbridge._gradcheck",
    "lora": "ortbridge.adapters",
    "training": "ortbridge.training",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if name == "training" else getattr(module, name)
    raise AttributeError(f"module 'ortbridge' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
