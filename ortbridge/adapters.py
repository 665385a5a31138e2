"""Low-rank adapters (LoRA) on the weights of an ONNX graph.

The ONNX weights of an :class:`~ortbridge.OnnxModule` are ordinary
``nn.Parameter``\\ s on its submodules, so torch's parametrizations apply to
them as to any layer's (:func:`torch.nn.utils.parametrize.register_parametrization`):
the graph reads the parametrized value, ``to_onnx()`` and ``save()`` write
it merged into the initializer, ``state_dict`` holds the original and the
adapter's parameters as torch's does. :func:`ortbridge.lora` puts a
:class:`~ortbridge.adapters.LowRank` update on every product weight (what a
MatMul, Gemm or Conv reads as its weight) in one call;
:func:`save_adapters` writes the updates apart, in onnxruntime's adapter
format (``.onnx_adapter``), beside a base file that takes them (multi-LoRA
serving: one base, an adapter per task).

>>> import torch
>>> from ortbridge.adapters import LowRank
>>> update = LowRank((4, 3), rank=2)
>>> weight = torch.ones(4, 3)
>>> bool((update(weight) == weight).all())  # B starts at zero: no change at first
True
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import os

import onnx
import torch
from torch import nn
from torch.nn.utils import parametrize

from ._prepare._weights import product_weights
from ._prepare.quantized import lift_quantized_weights

__all__ = ["LowRank", "lora", "save_adapters"]


class LowRank(nn.Module):
    """``W + scale * (B @ A)``, the product reshaped to ``W``'s shape (LoRA).

    ``A`` is ``(rank, prod(shape[1:]))``, ``B`` is ``(shape[0], rank)``: a
    Conv's weight ``(out, in, kh, kw)`` gets ``B @ A`` of ``(out, in*kh*kw)``.
    ``A`` starts as nn.Linear's weight does, ``B`` at zero, so the update
    starts at zero. ``scale`` is LoRA's ``alpha / rank``.
    """

    def __init__(self, shape, rank: int, scale: float = 1.0, dtype=None, device=None):
        super().__init__()
        if len(shape) < 2 or rank < 1:
            raise ValueError(f"a low-rank update needs a weight of 2 or more axes and rank >= 1, "
                             f"got shape {tuple(shape)} and rank {rank}")  # fmt: skip
        columns = math.prod(shape[1:])
        self.A = nn.Parameter(torch.empty(rank, columns, dtype=dtype, device=device))
        self.B = nn.Parameter(torch.zeros(shape[0], rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.B @ self.A).reshape(weight.shape) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.A.shape[0]}, scale={self.scale}"


def lora(
    module: nn.Module,
    rank: int = 8,
    alpha: float | None = None,
    names: str | list[str] | None = None,
    freeze: bool = True,
    beside_quantized: bool = False,
) -> list[nn.Parameter]:
    """Put a :class:`~ortbridge.adapters.LowRank` update on the product weights of ``module``.

    Parameters
    ----------
    module
        An :class:`~ortbridge.OnnxModule`, or a module holding some.
    rank
        The rank of each update.
    alpha
        LoRA's scale numerator: the update is ``alpha / rank * B @ A``
        (default: ``rank``, a scale of 1).
    names
        Glob patterns (``fnmatch``) of the ONNX initializer names to adapt,
        for instance ``"*attn*"``; default: every weight a MatMul, Gemm or
        Conv (or onnxruntime's FusedMatMul and Attention: its packed
        query-key-value weight, one update for the three) reads as its
        weight (2 or more axes, not a bias). A 4-bit ``MatMulNBits``
        (matched by its packed weight's name) gets its update beside it, a
        float branch ``scale * (x @ A) @ B`` in the graph: its integers take
        no merged update; ``save()`` writes the branch with them (QLoRA).
    freeze
        Freeze every ONNX weight of the module (``requires_grad=False``), so
        that only the adapters train.
    beside_quantized
        A quantized file's products (a ``MatMul`` or ``Gemm`` reading an
        integer weight through a ``DequantizeLinear``) get their update
        beside them too, as 4-bit ones do (QLoRA): the file's integers stay
        as they are and ``save()`` writes the float branches with them.
        Default: the update merges into the weight under the file's fake
        quantization, and ``save()`` rounds the merged weight to its integers.

    Returns
    -------
    list of nn.Parameter
        The adapters' parameters, for the optimizer.
    """
    from . import _adapter_format
    from .module import OnnxModule

    patterns = [names] if isinstance(names, str) else names
    scale = (rank if alpha is None else alpha) / rank
    adapters: list[nn.Parameter] = []
    layers = [m for m in module.modules() if isinstance(m, OnnxModule)]
    if not layers:
        raise TypeError(f"lora() adapts OnnxModule weights; {type(module).__name__} holds none")
    # What each layer adapts, found before anything changes: a call that
    # matches nothing leaves the module as it was.
    planned = []
    for layer in layers:
        side = _adapter_format.branch_products(layer._original, patterns, beside_quantized)
        beside = {weight for _, weight in side}
        merged = [n for n in _float_products(layer, patterns) if n not in beside]
        planned.append((layer, merged, bool(side)))
    if not any(names or four_bit for _, names, four_bit in planned):
        raise ValueError(
            f"no product weight matched {patterns}: see OnnxModule.named_onnx_parameters()"
            if patterns
            else "no MatMul, Gemm or Conv reads a weight of the module's graphs"
        )
    for layer, names, four_bit in planned:
        beside = _side_adapters(layer, patterns, rank, scale, beside_quantized) if four_bit else []
        if freeze:
            for name, param in layer.named_onnx_parameters():
                param.requires_grad_(name in beside)
        adapters.extend(layer.onnx_weight(name) for name in beside)
        for name in names:
            path = layer._onnx_names[name]
            owner = layer._owner(path)
            weight = getattr(owner, path[-1])
            update = LowRank(weight.shape, rank, scale, dtype=weight.dtype, device=weight.device)
            parametrize.register_parametrization(owner, path[-1], update)
            getattr(owner.parametrizations, path[-1]).original.requires_grad_(False)
            adapters.extend([update.A, update.B])
    return adapters


def _float_products(layer, patterns) -> list[str]:
    """The float product weights of ``layer`` an update merges into (matching
    ``patterns``; not a branch beside a 4-bit product, not yet adapted)."""
    from . import _adapter_format

    branches = _adapter_format.side_adapters(layer._original)
    found = []
    for name in sorted(product_weights(_lifted(layer._original))):
        if name in branches or name not in layer._onnx_names:
            continue
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        path = layer._onnx_names[name]
        owner = layer._owner(path)
        if parametrize.is_parametrized(owner, path[-1]):
            continue
        weight = getattr(owner, path[-1])
        if weight.dim() >= 2 and weight.is_floating_point():
            found.append(name)
    return found


def _side_adapters(layer, patterns, rank: int, scale: float, quantized: bool) -> list[str]:
    """Low-rank branches beside the layer's 4-bit products (MatMulNBits), whose
    packed integers no update can be merged into, and with ``quantized`` its
    int8 ones (:func:`._adapter_format.branch_products`): the layer is rebuilt on its
    file with the branches in it (their ``A`` and ``B`` trainable float
    weights, ``save()`` writing them as they are; hooks registered on the
    layer before are dropped). The adapters' names."""
    from . import _adapter_format

    model = layer.to_onnx()
    products = _adapter_format.branch_products(model, patterns, quantized)
    added = _adapter_format.with_side_adapters(model, products, rank, scale)
    trainable = {name for name, _ in layer.named_onnx_parameters()} | set(added)
    held = next(itertools.chain(layer.parameters(), layer.buffers()), None)
    device = held.device if held is not None else torch.device("cpu")
    training = layer.training
    rebuilt = type(layer)(
        model,
        trainable=trainable,
        providers=layer._providers,
        session_options=layer._session_options,
        batch_norm=layer._batch_norm,
        backend=layer._backend,
        dtype=layer._master_dtype,
    )
    # The same object (a parent module holds it), rebuilt: caches and hooks go.
    layer.__dict__.clear()
    layer.__dict__.update(rebuilt.__dict__)
    layer.to(device).train(training)
    return added


def _lifted(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its quantized weights as the float weights the module trains
    (the update then goes on the float weight, under the file's fake
    quantization, and is saved merged and rounded to the file's integers)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    lift_quantized_weights(copy)
    return copy


def save_adapters(
    layer: nn.Module, model_path: str | os.PathLike, adapter_path: str | os.PathLike
) -> None:
    """Write an :class:`~ortbridge.OnnxModule`'s LoRA updates as onnxruntime adapters.

    ``adapter_path`` (``.onnx_adapter``, onnxruntime's adapter format): each
    update's ``A`` and ``scale * B``, named ``<initializer>.lora_A`` and
    ``.lora_B``. ``model_path``: the layer's file with those names as graph
    inputs (symbolic rank) and each adapted weight read as ``W + B @ A``; the
    inputs default to zeros, so without an adapter it runs the weights
    before fine-tuning. onnxruntime applies an adapter with
    ``RunOptions.add_active_adapter(onnxruntime.LoraAdapter())`` after
    ``Load(adapter_path)``; onnxruntime-genai loads the same files.
    ``layer.save()`` still writes the merged file. Branches beside 4-bit
    products (QLoRA) go out the same way: the base file reads their ``A``
    (in, rank) and ``B`` (rank, out) as inputs defaulting to zeros, the
    adapter file holds ``A`` and ``scale * B``. Needs maintained
    onnxruntime (>= 1.20) for the adapter file.
    """
    from . import _adapter_format

    params = _adapter_format.adapter_parameters(layer)
    model = _adapter_format.base_model(layer)
    # The adapter first: where onnxruntime cannot write one, nothing is written.
    _adapter_format.write_adapter(params, adapter_path)
    onnx.save(model, os.fspath(model_path))
