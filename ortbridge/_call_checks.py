"""Checking a call of an :class:`~ortbridge.OnnxModule` against its graph.

Arguments are bound to the graph's inputs by position or by name; each input
must have the dtype, shape and device the graph expects, symbolic dimensions
two inputs share one size, and each weight the dtype and shape of its
initializer. Errors name what was received and what to do.
"""

from __future__ import annotations

import numpy as np
import torch

from ._prepare._exporter_forms import UNKNOWN_DIM_NAMES
from .exceptions import OnnxInputError, OnnxTypeError, OrtBridgeError

#: torch dtypes of the float initializers, by numpy dtype string.
TORCH_DTYPES = {
    np.dtype(np.float32).str: torch.float32,
    np.dtype(np.float64).str: torch.float64,
    np.dtype(np.float16).str: torch.float16,
}


def torch_dtype(spec) -> torch.dtype:
    """The torch dtype of graph input ``spec``."""
    try:
        return torch.from_numpy(np.empty(0, dtype=spec.dtype)).dtype
    except TypeError as exc:
        raise OnnxTypeError(f"input {spec.name!r} has a type torch does not support") from exc


def shared_dims(specs) -> dict[str, list[tuple[int, int]]]:
    """Symbolic dimensions two inputs share, with their places: one size each at a call.

    ``?`` (paddle2onnx's name for any unknown axis) ties nothing together.
    """
    where: dict[str, list] = {}
    for i, spec in enumerate(specs):
        for axis, dim in enumerate(spec.shape or ()):
            if isinstance(dim, str) and dim not in UNKNOWN_DIM_NAMES:
                where.setdefault(dim, []).append((i, axis))
    return {d: places for d, places in where.items() if len(places) > 1}


def bind(specs, graph_name: str, args, kwargs) -> list[torch.Tensor]:
    """The call's arguments in graph-input order (``specs``), given by position or by name."""
    if not kwargs and len(args) == len(specs) and all(a is not None for a in args):
        return list(args)
    names = [s.name for s in specs]
    if len(args) > len(specs):
        raise OnnxInputError(
            f"graph {graph_name!r} takes {len(specs)} input(s) {names}, "
            f"got {len(args)} positional argument(s)"
        )
    bound = list(args) + [None] * (len(specs) - len(args))
    for key, value in kwargs.items():
        if key not in names:
            raise OnnxInputError(f"unknown input {key!r}; the graph's inputs are {names}")
        pos = names.index(key)
        if bound[pos] is not None:
            raise OnnxInputError(f"input {key!r} given twice")
        bound[pos] = value
    missing = [n for n, v in zip(names, bound) if v is None]
    if missing:
        raise OnnxInputError(
            f"missing input(s) {missing}: the graph takes {len(specs)} input(s) {names}"
        )
    return bound


def check_input(spec, expected, tensor, device) -> torch.Tensor:
    """``tensor`` for graph input ``spec`` (dtype ``expected``), contiguous, autocast if on."""
    if not isinstance(tensor, torch.Tensor):
        raise OnnxTypeError(
            f"input {spec.name!r} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.dtype != expected:
        if tensor.is_floating_point() and expected.is_floating_point and _autocasting(tensor):
            tensor = tensor.to(expected)
        else:
            raise OnnxTypeError(f"input {spec.name!r} must be {expected}, got {tensor.dtype}")
    if spec.shape is not None:
        if tensor.dim() != len(spec.shape) or any(
            isinstance(d, int) and d > 0 and d != s for d, s in zip(spec.shape, tensor.shape)
        ):
            raise OnnxInputError(
                f"input {spec.name!r} must have shape {shape_str(spec.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
    if tensor.device != device:
        raise OnnxInputError(
            f"input {spec.name!r} is on {tensor.device} but the module is on {device}: "
            f"move one of them (module.to(device) or tensor.to(device))"
        )
    return tensor.contiguous()


def check_shared_dims(specs, shared: dict, inputs) -> None:
    """Each symbolic dimension of :func:`shared_dims` has one size across ``inputs``."""
    for dim, places in shared.items():
        sizes = {(i, axis): inputs[i].shape[axis] for i, axis in places}
        if len(set(sizes.values())) > 1:
            shown = ", ".join(
                f"{specs[i].name!r} axis {axis} is {size}" for (i, axis), size in sizes.items()
            )
            raise OnnxInputError(f"dimension {dim!r} must have one size across the inputs: {shown}")


def check_weights(names, dtypes, shapes, weights) -> None:
    """Each weight has its initializer's dtype (where torch has it) and shape."""
    if [w.dtype for w in weights] == dtypes and [
        w.shape for w in weights
    ] == shapes:  # the usual case, in two tests
        return
    for name, expected, shape, tensor in zip(names, dtypes, shapes, weights):
        if expected is not None and tensor.dtype != expected:
            raise OrtBridgeError(
                f"weight {name!r} is {tensor.dtype} but the ONNX graph computes in "
                f"{expected}: .double()/.half() cannot change an ONNX graph's types; "
                "convert the ONNX model itself, or use torch.autocast for inputs"
            )
        if tuple(tensor.shape) != tuple(shape):
            raise OnnxInputError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, but the ONNX graph's "
                f"initializer {name!r} has shape {tuple(shape)}: a weight may change its "
                "values, not its shape"
            )


def _autocasting(tensor: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(tensor.device.type)


def shape_str(shape) -> str:
    """A graph shape as text, ``?`` for an unknown dimension."""
    return "(" + ", ".join(str(d) if d is not None else "?" for d in shape) + ")"
