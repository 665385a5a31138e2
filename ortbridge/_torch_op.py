"""An ONNX layer as a torch operator, for ``torch.compile`` and ``torch.export``.

Eager calls go through the generated autograd Function (:mod:`._function`),
whose backward reads what its forward saved. Traced calls (``torch.compile``,
``torch.export``) go through one ``torch.library`` operator,
``ortbridge::onnx_layer(key, mode, tensors)``, which torch sees as an opaque
but typed node of its graph:

- a fake kernel gives the outputs' shapes and dtypes from ONNX shape
  inference on the call's shapes, symbolic dimensions kept symbolic (a
  dynamic batch compiles once);
- its backward is a second operator, ``ortbridge::onnx_layer_backward``,
  which runs the engine's gradient graph on the saved inputs: the forward
  again, then the backward (the residuals of an opaque forward cannot be
  sized before it runs);
- in train mode the new BatchNorm running statistics are outputs, which the
  module copies into its buffers: the operator itself mutates nothing.

``key`` names the layer (its :class:`~._bridge.Bridge`) in a process-wide
table of weak references: the operator's arguments stay a string, a string
and tensors, which torch's graphs and exported programs hold.
"""

from __future__ import annotations

import itertools
import weakref

import onnx
import torch

from . import _onnx_export, _prepare
from ._call_checks import torch_dtype
from ._prepare import _call_ranks
from ._prepare._load import tensor_spec
from .exceptions import OnnxInputError, OrtBridgeError

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register(bridge, name: str) -> str:
    """A new key for ``bridge`` in the operator's table of layers."""
    key = f"{name}:{next(_COUNTER)}"
    _LAYERS[key] = bridge
    return key


def call(key: str, bridge, mode: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layer's outputs through the operator; in train mode its running
    statistics copied into their buffers (``tensors``), as torch's BatchNorm
    does in a traced graph. A statistic that came out NaN (a batch of zero
    rows) leaves its buffer as it was."""
    if torch.jit.is_tracing():  # maybe the TorchScript ONNX exporter's trace
        _onnx_export.register_symbolic()
    outputs = torch.ops.ortbridge.onnx_layer(key, mode, tensors)
    n_stats = 2 * len(bridge.batch_norms) if mode == _prepare.TRAIN else 0
    if n_stats:
        n_user = len(outputs) - n_stats
        with torch.no_grad():
            positions = [pos for pair in bridge.stat_positions for pos in pair]
            for pos, new in zip(positions, outputs[n_user:]):
                old = tensors[pos]
                old.copy_(torch.where(torch.isnan(new), old, new))
        outputs = outputs[:n_user]
    return outputs


def _bridge(key: str):
    bridge = _LAYERS.get(key)
    if bridge is None:
        raise OrtBridgeError(
            f"ONNX layer {key!r} no longer exists in this process: a compiled or exported "
            "graph calls the OnnxModule it was traced with; keep that module alive, or trace again"
        )
    return bridge


@torch.library.custom_op("ortbridge::onnx_layer", mutates_args=())
def onnx_layer(key: str, mode: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layer's outputs (and in train mode its new running statistics)."""
    bridge = _bridge(key)
    if mode == _prepare.TRAIN and bridge.draws_in_train_mode():
        raise OrtBridgeError(
            f"ONNX layer {key!r} draws Dropout masks in train mode: a traced (compiled or "
            "exported) call cannot yet give its backward the same masks; call it in eval "
            "mode, or outside torch.compile"
        )
    device = tensors[0].device if tensors else torch.device("cpu")
    graph = bridge.inference_graph(mode, device, tensors)
    outputs = graph.run(dict(zip(bridge.feed_names, bridge.run_feeds(mode, tensors))))
    # An operator's outputs may not alias its inputs (an Identity graph hands one back).
    ptrs = {t.data_ptr() for t in tensors}
    return [o.clone() if o.data_ptr() in ptrs and o.numel() else o for o in outputs]


@onnx_layer.register_fake
def _onnx_layer_fake(key, mode, tensors):
    bridge = _bridge(key)
    n_in = len(bridge.input_names)
    dims = []
    names = {}
    for t in tensors[:n_in]:
        row = []
        for d in t.shape:
            if isinstance(d, int):
                row.append(d)
            else:
                name = f"ortbridge_sym_{len(names)}"
                name = next((n for n, s in names.items() if s is d), name)
                names[name] = d
                row.append(name)
        dims.append(tuple(row))
    inferred = bridge.output_dims(mode, tuple(dims))
    ctx = None
    device = tensors[0].device if tensors else torch.device("cpu")
    out = []
    for shape, dtype in inferred:
        sizes = []
        for d in shape:
            if isinstance(d, int):
                sizes.append(d)
            elif d in names:
                sizes.append(names[d])
            else:
                ctx = ctx or torch.library.get_ctx()
                sizes.append(ctx.new_dynamic_size())
        out.append(torch.empty(sizes, dtype=dtype, device=device))
    return out


@torch.library.custom_op("ortbridge::onnx_layer_backward", mutates_args=())
def onnx_layer_backward(
    key: str,
    mode: str,
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    needs: list[bool],
) -> list[torch.Tensor]:
    """Gradients of the tensors ``needs`` marks, for output gradients ``grads``."""
    bridge = _bridge(key)
    # The forward again, through the eager autograd Function, on copies of the
    # running statistics (the operator's forward already gave their update).
    volatile = bridge.running_stat_positions
    with torch.enable_grad():
        leaves = [
            t.detach().clone() if i in volatile else t.detach().requires_grad_(need)
            for i, (t, need) in enumerate(zip(tensors, needs))
        ]
        outputs = bridge.function_apply(*leaves, mode=mode)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [leaves[i] for i, need in enumerate(needs) if need]
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )
    return [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, found)]


@onnx_layer_backward.register_fake
def _onnx_layer_backward_fake(key, mode, tensors, grads, needs):
    return [torch.empty_like(t) for t, need in zip(tensors, needs) if need]


def _setup_context(ctx, inputs, output):
    key, mode, tensors = inputs
    ctx.key, ctx.mode = key, mode
    # The running statistics are updated in place after the call, and a
    # train-mode forward does not read them: left unsaved, stood in for by ones.
    volatile = _bridge(key).running_stat_positions if mode == _prepare.TRAIN else ()
    ctx.stand_ins = {
        i: dict(size=t.shape, dtype=t.dtype, device=t.device)
        for i, t in enumerate(tensors)
        if i in volatile
    }
    ctx.save_for_backward(*[t for i, t in enumerate(tensors) if i not in volatile])


def _backward(ctx, grads):
    saved = iter(ctx.saved_tensors)
    n = len(ctx.needs_input_grad[2])
    tensors = [
        torch.ones(**ctx.stand_ins[i]) if i in ctx.stand_ins else next(saved) for i in range(n)
    ]
    needs = [bool(need) for need in ctx.needs_input_grad[2]]
    found = iter(onnx_layer_backward(ctx.key, ctx.mode, tensors, list(grads), needs))
    return None, None, [next(found) if need else None for need in needs]


onnx_layer.register_autograd(_backward, setup_context=_setup_context)
_onnx_export.install()


def output_dims(model: onnx.ModelProto, dims: dict[str, tuple]) -> list[tuple[tuple, torch.dtype]]:
    """Each output's sizes (int, a dimension's name, or None) and dtype, by shape inference.

    ``dims``: input name -> sizes, each an int or the name of a symbolic size.
    """
    try:
        outputs = _call_ranks.inferred_outputs(model, dims)
    except Exception as exc:  # noqa: BLE001
        raise OnnxInputError(
            f"the output shapes of graph {model.graph.name!r} cannot be inferred for inputs "
            f"{dims}, which torch.compile and torch.export need: {exc}"
        ) from exc
    out = []
    for spec in map(tensor_spec, outputs):
        if spec.shape is None:
            raise OnnxInputError(
                f"the rank of output {spec.name!r} of graph {model.graph.name!r} cannot be "
                "inferred, which torch.compile and torch.export need"
            )
        # bfloat16 has no numpy dtype to go through.
        bf16 = spec.elem_type == onnx.TensorProto.BFLOAT16
        out.append((spec.shape, torch.bfloat16 if bf16 else torch_dtype(spec)))
    return out
