"""ortbridge: an ONNX graph inside a PyTorch model as a trainable layer.

>>> import ortbridge
>>> sorted(ortbridge.__all__)[:3]
['GradcheckReport', 'OnnxModule', 'OrtBridgeError']
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from .exceptions import OrtBridgeError

__version__ = "0.1.0"

__all__ = [
    "OnnxModule",
    "GradcheckReport",
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
    "GradcheckReport": "ortbridge._gradcheck",
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


# Pickles name the module of each class they hold: an OnnxModule pickled
# before the package's modules moved names its summary's types by their old
# module. Those names import the module's new home, and only when asked for.
_MOVED = {"ortbridge._graph_load": "ortbridge._prepare._load"}


class _MovedModules:
    """Finds a moved module's old name (last on ``sys.meta_path``)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(name, _MovedModules)

    @staticmethod
    def create_module(spec):
        return importlib.import_module(_MOVED[spec.name])

    @staticmethod
    def exec_module(module):
        pass  # the new home ran when it was imported


if not any(finder is _MovedModules for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules)
