"""Lazy access to onnxruntime: any build for sessions, the training build for its agent.

onnxruntime is imported on first use, not at ``import ortbridge``: the
package must import (and say what is missing) without it. Two distributions
provide the same ``onnxruntime`` module: onnxruntime-training 1.19.2 (with the
TrainingAgent and its gradient builder) and maintained onnxruntime (inference
only, run by the onnxruntime engine). Never both in one environment.
"""

from __future__ import annotations

import functools
import importlib
import os

from ..exceptions import MissingDependencyError

_TRAINING_HINT = (
    "install onnxruntime-training 1.19.2: `pip install onnxruntime-training-cpu==1.19.2` "
    "(CPU) or `pip install onnxruntime-training==1.19.2` (built for CUDA 11.8), or the extras "
    "`ortbridge[cpu]` / `ortbridge[cuda]`; never beside another onnxruntime package"
)
_ANY_HINT = (
    "install one onnxruntime distribution: the extra `ortbridge[ort]` (maintained onnxruntime, "
    "CPU), `ortbridge[ort-gpu]` (onnxruntime-gpu 1.31.1, CUDA 13), or `ortbridge[cpu]` / "
    "`ortbridge[cuda]` (onnxruntime-training 1.19.2); never two in one environment"
)

#: The onnxruntime package whose CUDA provider loads beside a torch built for
#: each CUDA major version. From the wheels' metadata: onnxruntime-gpu 1.27.0
#: and later require CUDA 13's libraries (nvidia-cuda-runtime~=13.0), 1.21.0
#: to 1.26.0 CUDA 12's; onnxruntime-training 1.19.2 is built for CUDA 11.8.
_CUDA_PACKAGES = {
    "13": '`pip install "ortbridge[ort-gpu]"` (onnxruntime-gpu 1.31.1, built for CUDA 13)',
    "12": (
        "`pip install onnxruntime-gpu==1.26.0` (the last onnxruntime-gpu built for CUDA 12; "
        "the `ortbridge[ort-gpu]` extra's 1.31.1 needs CUDA 13)"
    ),
    "11": (
        '`pip install "ortbridge[cuda]"` (onnxruntime-training 1.19.2, built for CUDA 11.8, '
        "CPython <= 3.11)"
    ),
}


def cuda_hint() -> str:
    """Which onnxruntime package runs CUDA beside the installed torch, in a sentence."""
    import torch

    cuda = torch.version.cuda
    if cuda is None:
        kind = "a ROCm build" if getattr(torch.version, "hip", None) else "a CPU build"
        return (
            f"torch {torch.__version__} is {kind} (torch.version.cuda is None): to run on a GPU, "
            'install a CUDA build of torch first (CUDA 13, then `pip install "ortbridge[ort-gpu]"`)'
        )
    wanted = _CUDA_PACKAGES.get(cuda.split(".")[0])
    if wanted is None:
        return (
            f"torch {torch.__version__} is built for CUDA {cuda}, which no onnxruntime package "
            'matches: install a torch built for CUDA 13, then `pip install "ortbridge[ort-gpu]"`'
        )
    return (
        f"torch {torch.__version__} is built for CUDA {cuda}: {wanted}, after uninstalling any "
        "other onnxruntime package"
    )


def build() -> tuple[str, str | None]:
    """The installed onnxruntime's package and version (``"onnxruntime-gpu 1.31.1"``) and
    the CUDA version it is built for (None: a CPU build), as its wheel records them."""
    version = runtime().__version__
    try:
        info = importlib.import_module("onnxruntime.capi.build_and_package_info")
    except ImportError:  # a build from source may lack it
        return f"onnxruntime {version}", None
    package = getattr(info, "package_name", "onnxruntime")
    return f"{package} {version}", getattr(info, "cuda_version", None)


@functools.cache
def runtime():
    """Return the installed ``onnxruntime`` module, whichever build it is."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise MissingDependencyError(f"onnxruntime is not installed: {_ANY_HINT}") from exc
    _restore_torch_checkpoint()
    return ort


def _restore_torch_checkpoint() -> None:
    """Give ``torch.utils.checkpoint.checkpoint`` back to torch.

    onnxruntime-training's ``import onnxruntime`` imports ORTModule, which
    swaps torch's ``checkpoint`` for a wrapper that only acts when
    ``ORTMODULE_MEMORY_OPT_LEVEL=1`` and otherwise calls torch's; but
    ``torch.compile`` cannot trace the wrapper with ``use_reentrant=`` (a
    model with ONNX layers and checkpointing would not compile). Left as it
    is where that variable asks for ORTModule's layer-wise recompute.
    """
    if os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL", "0").strip() == "1":
        return
    import torch.utils.checkpoint as checkpointing

    # Its failed import (torch >= 2.10 lacks what it imports) may run twice: wrappers of wrappers.
    found = checkpointing.checkpoint
    while getattr(found, "__module__", "").startswith("onnxruntime.training"):
        code, cells = getattr(found, "__code__", None), getattr(found, "__closure__", None) or ()
        kept = dict(zip(code.co_freevars if code else (), (c.cell_contents for c in cells)))
        found = kept.get("original_checkpoint")
        if not callable(found):
            return
    checkpointing.checkpoint = found


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
