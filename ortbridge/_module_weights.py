"""Where an :class:`~ortbridge.OnnxModule` keeps its weights.

Each float initializer becomes a parameter (trainable) or a buffer (frozen),
at the place its name gives in the module tree (``"fc.weight"``: submodule
``fc``, attribute ``weight``), a flat ``onnx_`` name where that cannot be.
The holders (``OnnxWeights``, in :mod:`ortbridge.module`, where pickles find
it) print the weights they hold with :func:`weights_repr`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ._prepare._onnx_utils import node_reads
from ._prepare._weights import gradient_cut
from .exceptions import NotDifferentiableError, OnnxInputError, OnnxTypeError


def attribute_path(module: nn.Module, name: str) -> tuple[str, ...]:
    """Where initializer ``name`` lives in the module tree (dots make submodules)."""
    parts = tuple(name.split("."))
    if all(p.isidentifier() or p.isdigit() for p in parts) and not _clashes(module, parts):
        return parts
    flat = "onnx_" + "".join(c if c.isalnum() else "_" for c in name)
    while hasattr(module, flat) or flat in module._parameters or flat in module._buffers:
        flat += "_"
    return (flat,)


def _clashes(module: nn.Module, parts) -> bool:
    owner = module
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part in owner._parameters or part in owner._buffers:
            return True
        child = owner._modules.get(part)
        if child is None:
            return hasattr(owner, part)
        if last:
            return True
        owner = child
    return False


def choose_trainable(trainable, summary, model=None) -> set[str]:
    """The initializers ``trainable`` selects (None: the weights a gradient reaches).

    A weight selected that no gradient reaches is refused, naming the node of
    ``model`` (the normalised graph) that cuts it: its ``.grad`` would stay
    None without a word. The default leaves such weights frozen.
    """
    floats = summary.float_initializers
    if trainable is None:
        return set(summary.default_trainable)
    if callable(trainable):
        chosen = {name for name, array in floats.items() if trainable(name, array)}
        _refuse_unreachable(chosen, summary, model)
        return chosen
    if isinstance(trainable, str):
        trainable = [trainable]
    try:
        names = list(trainable)
    except TypeError:
        raise OnnxTypeError(
            "trainable must be None, an iterable of initializer names or a callable "
            f"(name, array) -> bool, got {type(trainable).__name__}"
        ) from None
    unknown = [n for n in names if n not in floats]
    if unknown:
        raise OnnxInputError(
            f"unknown trainable initializer(s) {unknown}; the float initializers are "
            f"{sorted(floats)}"
        )
    _refuse_unreachable(set(names), summary, model)
    return set(names)


def _refuse_unreachable(chosen: set[str], summary, model) -> None:
    dead = [n for n in summary.float_initializers if n in chosen]
    dead = [n for n in dead if n not in summary.differentiable_initializers]
    if not dead:
        return
    name = dead[0]
    others = f" (nor do {', '.join(map(repr, dead[1:]))})" if dead[1:] else ""
    todo = "leave it out of trainable= (it then stays a frozen buffer)"
    found = gradient_cut(model, name) if model is not None else None
    if found is None:
        read = model is None or any(name in node_reads(node) for node in model.graph.node)
        where = "no graph output depends on it" if read else "no node reads it"
        raise NotDifferentiableError(
            f"trainable weight {name!r} gets no gradient{others}: {where}; {todo}",
            unreachable=name,
        )
    node, why = found
    if node.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
        todo += ", or train the float model it was quantized from"
    raise NotDifferentiableError(
        f"trainable weight {name!r} gets no gradient{others}: node {node.name!r} (op type "
        f"{node.op_type}) on its way to the outputs passes none on ({why}); {todo}",
        unreachable=name,
        node=node.name,
        op_type=node.op_type,
    )


def fetch(owner: nn.Module, attr: str) -> torch.Tensor:
    """Weight ``attr`` of ``owner``: a parameter, a buffer, or what a parametrization computes."""
    tensor = owner._parameters.get(attr)
    if tensor is None:
        tensor = owner._buffers.get(attr)
    return tensor if tensor is not None else getattr(owner, attr)


def weight_array(tensor: torch.Tensor) -> np.ndarray:
    """A weight's value as numpy holds it: bfloat16 (which numpy has no type
    for) as its float32 values, which the file's initializer rounds back."""
    value = tensor.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def weights_repr(module: nn.Module) -> str:
    """The parameters and buffers ``module`` holds itself, with their shapes."""
    shown = [f"{name}: {tuple(p.shape)}" for name, p in module._parameters.items() if p is not None]
    shown += [
        f"{name}: {tuple(b.shape)} frozen" for name, b in module._buffers.items() if b is not None
    ]
    return ", ".join(shown)
