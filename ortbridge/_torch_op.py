"""An ONNX layer as a torch operator, for ``torch.compile`` and ``torch.export``.

Eager calls go through the generated autograd Function (:mod:`._function`),
whose backward reads what its forward saved. Traced calls (``torch.compile``,
``torch.export``) go through ``torch.library`` operators, which torch sees as
opaque but typed nodes of its graph:

- ``ortbridge::onnx_layer(key, mode, tensors)``, the layer's outputs, where
  no gradient is wanted and where the graph is exported (an exported program
  or ONNX file holds it); its backward, ``onnx_layer_backward``, runs the
  layer's forward again, then the backward;
- ``ortbridge::onnx_layer_saving(key, mode, tensors, needs)``, where a
  compiled graph wants gradients: it runs the eager Function and keeps what
  that Function saved (its autograd graph) under a handle, an extra int64
  output; its backward, ``onnx_layer_saved_backward``, reads the handle: one
  forward per step, as eager. The kept state lives as long as the handle
  tensor (torch's saved tensors hold it), and a backward that finds it gone
  (a second one, ``retain_graph=True``) runs the forward again;
- a fake kernel gives the outputs' shapes and dtypes from ONNX shape
  inference on the call's shapes, symbolic dimensions kept symbolic (a
  dynamic batch compiles once);
- in train mode the new BatchNorm running statistics are outputs, which the
  module copies into its buffers: the operators mutate nothing they are given.

``key`` names the layer (its :class:`~._bridge.Bridge`) in a process-wide
table of weak references: the operators' arguments stay strings, bools and
tensors, which torch's graphs and exported programs hold.
"""

from __future__ import annotations

import itertools
import weakref

import onnx
import torch

from . import _function, _onnx_export, _prepare
from ._call_checks import torch_dtype
from ._prepare import _call_ranks
from ._prepare._load import tensor_spec
from .exceptions import OnnxInputError, OrtBridgeError

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COUNTER = itertools.count()
#: handle -> what a saving call's engine forward kept, until its backward
#: reads it or its handle tensor is freed.
_STATES: dict[int, _Context] = {}
_HANDLES = itertools.count(1)


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
    if torch.is_grad_enabled() and _saves(tensors):
        needs = [t.requires_grad for t in tensors]
        outputs = torch.ops.ortbridge.onnx_layer_saving(key, mode, tensors, needs)[:-1]
    else:
        outputs = torch.ops.ortbridge.onnx_layer(key, mode, tensors)
    n_stats = bridge.n_stat_outputs(mode)
    if n_stats:
        n_user = len(outputs) - n_stats
        with torch.no_grad():
            for pos, new in zip(bridge.stat_order, outputs[n_user:]):
                old = tensors[pos]
                old.copy_(torch.where(torch.isnan(new), old, new))
        outputs = outputs[:n_user]
    return outputs


def _saves(tensors) -> bool:
    """Whether a call takes the saving operator: gradients are wanted and the
    graph stays in this process (compiled, not exported or scripted)."""
    if torch.compiler.is_exporting() or torch.jit.is_tracing():
        return False
    return any(t.requires_grad for t in tensors)


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
    device = tensors[0].device if tensors else torch.device("cpu")
    graph = bridge.inference_graph(mode, device, tensors)
    outputs = graph.run(dict(zip(bridge.feed_names, bridge.run_feeds(mode, tensors))))
    return _unaliased(outputs, tensors)


def _unaliased(outputs, tensors):
    """``outputs``, those sharing an input's memory copied: an operator's
    outputs may not alias its inputs (an Identity graph hands one back)."""
    ptrs = {t.data_ptr() for t in tensors}
    return [o.clone() if o.data_ptr() in ptrs and o.numel() else o for o in outputs]


@torch.library.custom_op("ortbridge::onnx_layer_saving", mutates_args=())
def onnx_layer_saving(
    key: str, mode: str, tensors: list[torch.Tensor], needs: list[bool]
) -> list[torch.Tensor]:
    """As ``onnx_layer``, with a handle last: what the engine's forward saved
    for the gradients of the tensors ``needs`` marks."""
    bridge = _bridge(key)
    ctx, outputs = _engine_forward(bridge, mode, tensors, needs)
    outputs = _unaliased(outputs, tensors)
    if mode == _prepare.TRAIN:  # the running statistics the forward updated, on copies
        outputs += [ctx.volatile[pos] for pos in bridge.stat_order]
    handle = torch.tensor(next(_HANDLES))
    _STATES[int(handle)] = ctx
    weakref.finalize(handle, _STATES.pop, int(handle), None)
    return outputs + [handle]


@onnx_layer_saving.register_fake
def _onnx_layer_saving_fake(key, mode, tensors, needs):
    return _onnx_layer_fake(key, mode, tensors) + [torch.empty((), dtype=torch.int64)]


class _Context:
    """What the eager Function's forward and backward (:mod:`._function`) read
    and write of an autograd context, kept by the operators instead."""

    volatile = None

    def __init__(self, needs):
        self.needs_input_grad = (False, False, *needs)  # (bridge, mode, *tensors)

    def set_materialize_grads(self, value):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _engine_forward(bridge, mode, tensors, needs):
    """The engine's forward, as the eager Function runs it: its context and
    outputs. The running statistics are copies, which it updates."""
    volatile = bridge.running_stat_positions if mode == _prepare.TRAIN else ()
    tensors = [t.clone() if i in volatile else t for i, t in enumerate(tensors)]
    ctx = _Context(needs)
    with torch.no_grad():
        outputs = _function._forward(ctx, bridge, mode, *tensors)
    return ctx, list(outputs)


def _engine_backward(ctx, grads, needs):
    """The gradients of the tensors ``needs`` marks, from an engine forward's context."""
    with torch.no_grad():
        found = _function._backward(ctx, *grads)[2:]
    tensors = None
    out = []
    for i, need in enumerate(needs):
        if need:
            if found[i] is None:  # unreached from the outputs
                tensors = tensors or _function._inputs(ctx, ctx.saved_tensors)
                out.append(torch.zeros_like(tensors[i]))
            else:
                out.append(found[i])
    return out


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
    return _recomputed(_bridge(key), key, mode, tensors, grads, needs)


def _recomputed(bridge, key, mode, tensors, grads, needs):
    """The gradients by running the forward again, through the eager Function,
    on copies of the running statistics (the forward already gave their update)."""
    if mode == _prepare.TRAIN and bridge.draws_in_train_mode():
        raise OrtBridgeError(
            f"ONNX layer {key!r} draws Dropout masks in train mode, and this backward would "
            "run its forward again with new masks: an exported graph, or a second backward "
            "(retain_graph=True) of a compiled one, cannot give the masks back; call it in "
            "eval mode, or run the backward once"
        )
    ctx, _ = _engine_forward(bridge, mode, tensors, needs)
    return _engine_backward(ctx, grads, needs)


def _gradients_like(tensors, needs):
    """The backward operators' fake outputs: one gradient per tensor ``needs`` marks."""
    return [torch.empty_like(t) for t, need in zip(tensors, needs) if need]


@onnx_layer_backward.register_fake
def _onnx_layer_backward_fake(key, mode, tensors, grads, needs):
    return _gradients_like(tensors, needs)


def _save(ctx, key, mode, tensors, extra):
    ctx.key, ctx.mode = key, mode
    # The running statistics are updated in place after the call, and a
    # train-mode forward does not read them: left unsaved, stood in for by ones.
    volatile = _bridge(key).running_stat_positions if mode == _prepare.TRAIN else ()
    ctx.stand_ins = {
        i: dict(size=t.shape, dtype=t.dtype, device=t.device)
        for i, t in enumerate(tensors)
        if i in volatile
    }
    ctx.save_for_backward(*[t for i, t in enumerate(tensors) if i not in volatile], *extra)
    ctx.n_tensors = len(tensors)


def _saved(ctx):
    """The forward's tensors (stand-ins for the running statistics) and the extra saved ones."""
    saved = iter(ctx.saved_tensors)
    tensors = [
        torch.ones(**ctx.stand_ins[i]) if i in ctx.stand_ins else next(saved)
        for i in range(ctx.n_tensors)
    ]
    return tensors, list(saved)


def _setup_context(ctx, inputs, output):
    key, mode, tensors = inputs
    _save(ctx, key, mode, tensors, [])


def _backward(ctx, grads):
    tensors, _ = _saved(ctx)
    needs = [bool(need) for need in ctx.needs_input_grad[2]]
    found = iter(onnx_layer_backward(ctx.key, ctx.mode, tensors, list(grads), needs))
    return None, None, [next(found) if need else None for need in needs]


onnx_layer.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("ortbridge::onnx_layer_saved_backward", mutates_args=())
def onnx_layer_saved_backward(
    key: str,
    mode: str,
    handle: torch.Tensor,
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    needs: list[bool],
) -> list[torch.Tensor]:
    """Gradients from what ``onnx_layer_saving`` kept under ``handle``.

    ``outputs`` are not read: taking them keeps a compiled graph from
    reusing their memory, which the kept state shares, before this runs."""
    state = _STATES.pop(int(handle), None)
    if state is None:  # freed by an earlier backward: the forward again
        return _recomputed(_bridge(key), key, mode, tensors, grads, needs)
    return _engine_backward(state, grads, needs)


@onnx_layer_saved_backward.register_fake
def _onnx_layer_saved_backward_fake(key, mode, handle, tensors, outputs, grads, needs):
    return _gradients_like(tensors, needs)


def _saving_setup_context(ctx, inputs, output):
    key, mode, tensors, _ = inputs
    user = output[: len(output) - 1 - _bridge(key).n_stat_outputs(mode)]
    _save(ctx, key, mode, tensors, [*user, output[-1]])
    ctx.n_user = len(user)


def _saving_backward(ctx, grads):
    tensors, extra = _saved(ctx)
    outputs, handle = extra[: ctx.n_user], extra[ctx.n_user]
    needs = [bool(need) for need in ctx.needs_input_grad[2]]
    found = iter(
        onnx_layer_saved_backward(
            ctx.key, ctx.mode, handle, tensors, outputs, list(grads[: ctx.n_user]), needs
        )
    )
    return None, None, [next(found) if need else None for need in needs], None


onnx_layer_saving.register_autograd(_saving_backward, setup_context=_saving_setup_context)
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
