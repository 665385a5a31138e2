"""The ``torch.autograd.Function`` subclass generated for each ONNX graph.

``forward`` runs the engine's forward and keeps what its backward needs:
residual tensors in ``save_for_backward`` (onnxruntime engine) or the
TrainingAgent's execution state (training-agent engine, consumed by the
first backward; a second one, ``retain_graph=True``, runs the forward again).

Under ``create_graph=True`` the backward itself is differentiable on the
onnxruntime engine: it runs the whole reverse model (inputs and output
gradients in, gradients out) through another generated Function, whose own
backward is the reverse of the reverse model.
"""

from __future__ import annotations

import ast
import hashlib
import re

import onnx
import torch

from .exceptions import NotDifferentiableError, OrtBridgeError

#: Graph names exporters give every model (torch's dynamo and TorchScript
#: exporters): naming a Function after them tells models apart no better.
GENERIC_GRAPH_NAMES = frozenset({"", "main_graph", "torch_jit", "torch-jit-export", "onnx_graph"})


def function_name(model: onnx.ModelProto) -> str:
    """What a model's Function is named after: its graph, else the model it came from.

    The graph's name, unless an exporter gives it to every model; then the
    torch class the dynamo exporter recorded in the nodes' metadata
    (``MyNet``); else ``OnnxModule_`` and a hash of the graph's structure,
    the same from run to run.
    """
    name = model.graph.name
    if name not in GENERIC_GRAPH_NAMES:
        return name
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == "pkg.torch.onnx.class_hierarchy":
                try:
                    root = str(ast.literal_eval(prop.value)[0])
                except (ValueError, SyntaxError, IndexError, TypeError):
                    continue
                if not root.startswith("aten."):  # an operator, not the exported module
                    return root.rsplit(".", 1)[-1]
    digest = hashlib.sha1()
    for node in model.graph.node:
        digest.update(f"{node.op_type}({','.join(node.input)})->{','.join(node.output)};".encode())
    return f"OnnxModule_{digest.hexdigest()[:8]}"


def make_function(name: str, graph_name: str | None = None) -> type[torch.autograd.Function]:
    """A new autograd Function class named ``<Name>Function`` after ``name``.

    ``graph_name``: the graph the docstring names, when it is not ``name``.
    """
    ident = re.sub(r"\W", "_", name, flags=re.ASCII).strip("_") or "onnx_graph"
    if ident[0].isdigit():
        ident = f"Onnx_{ident}"
    class_name = f"{ident[0].upper()}{ident[1:]}Function"
    graph_name = name if graph_name is None else graph_name
    return type(
        class_name,
        (torch.autograd.Function,),
        {
            "__doc__": f"Forward and backward of ONNX graph {graph_name!r} in onnxruntime.",
            "__module__": __name__,
            "__qualname__": class_name,
            "forward": staticmethod(_forward),
            "backward": staticmethod(_backward),
        },
    )


def _forward(ctx, bridge, mode, *tensors):
    # Runs on every training step: the common case (one float output, no
    # running statistics) takes no detours, since in a step with cold caches
    # each Python line costs several times its tight-loop price.
    ctx.set_materialize_grads(False)
    graph = bridge.gradient_graph(mode, ctx.needs_input_grad[2:], tensors[0].device, tensors)
    feeds = bridge.run_feeds(mode, tensors)
    try:
        outputs, residuals, token = graph.forward(feeds)
    except NotDifferentiableError as exc:
        # The graphs for this call's shapes were refused while being built,
        # before anything ran: ``auto`` may build the other engine's instead.
        graph = bridge.after_refusal(exc, mode, ctx.needs_input_grad[2:], tensors)
        outputs, residuals, token = graph.forward(feeds)
    n_user = graph.n_user_outputs
    if len(outputs) > n_user:
        bridge.update_running_stats(tensors, outputs[n_user:])
        outputs = outputs[:n_user]
    ctx.bridge, ctx.graph, ctx.token, ctx.mode = bridge, graph, token, mode
    ctx.output_meta = [(o.shape, o.dtype, o.device) for o in outputs]
    integers = [o for o in outputs if not o.is_floating_point()]
    if integers:
        ctx.mark_non_differentiable(*integers)
    # Running statistics are updated in place right above: kept unsaved.
    volatile = bridge.running_stat_positions
    if volatile:
        ctx.volatile = {i: tensors[i] for i in volatile}
        kept = [t for i, t in enumerate(tensors) if i not in volatile]
    else:
        ctx.volatile, kept = None, tensors
    # Outputs the backward pass reads are saved so that torch's version
    # counter catches an in-place change.
    # The graphs built for one input shape may read other outputs (and give
    # other gradients) than the first one built: the token (the graph that
    # ran) says which, where it can.
    ctx.save_outputs = getattr(token, "save_outputs", graph.save_outputs)
    ctx.grad_slots = getattr(token, "grad_slots", graph.grad_slots)
    ctx.save_for_backward(*kept, *[outputs[i] for i in ctx.save_outputs], *residuals)
    ctx.n_kept, ctx.n_saved_outputs = len(kept), len(ctx.save_outputs)
    return tuple(outputs)


def _backward(ctx, *grad_outputs):
    saved = ctx.saved_tensors
    graph = ctx.graph
    # The onnxruntime engine reads output gradients by output position (None
    # where an output has none); the training agent takes the differentiable ones.
    positional = graph.saves_tensors
    feeds = []
    for idx, grad in enumerate(grad_outputs[: graph.n_user_outputs]):
        if idx in graph.non_differentiable:
            if positional:
                feeds.append(None)
            continue
        if grad is None:
            shape, dtype, device = ctx.output_meta[idx]
            grad = torch.zeros(shape if idx in graph.full_shape else (), dtype=dtype, device=device)
        feeds.append(grad.contiguous())
    slots = ctx.grad_slots
    if feeds and all(f is None or f.numel() == 0 for f in feeds):
        # Empty outputs (a batch of zero rows): a vector-Jacobian product over
        # no elements is zero. onnxruntime's kernels may refuse empty shapes.
        tensors = _inputs(ctx, saved)
        grads = [torch.zeros_like(tensors[slot]) for slot in slots]
    elif torch.is_grad_enabled():
        grads, slots = _differentiable_backward(ctx, graph, feeds, saved)
    elif positional:
        n_kept, n_out = ctx.n_kept, ctx.n_saved_outputs
        saved_outputs = dict(zip(ctx.save_outputs, saved[n_kept : n_kept + n_out]))
        grads = graph.backward(
            feeds, ctx.token, saved[n_kept + n_out :], _inputs(ctx, saved), saved_outputs
        )
    else:
        token, ctx.token = ctx.token, None  # the state holds every activation: freed here
        # A state consumed by an earlier backward (retain_graph) is rebuilt from
        # the inputs and the saved residuals (the Dropout seed: the same masks).
        residuals = saved[ctx.n_kept + ctx.n_saved_outputs :]
        grads = graph.backward(
            feeds, token, residuals, None if token is not None else _inputs(ctx, saved)
        )
    # (bridge, mode, *tensors): one slot per argument of forward.
    result = [None] * (2 + len(ctx.bridge.feed_names))
    for slot, grad in zip(slots, grads):
        result[2 + slot] = grad
    if ctx.bridge.zero_slots:  # reached through Round and the like only: zeros, as torch
        tensors = _inputs(ctx, saved)
        for slot in ctx.bridge.zero_slots:
            if ctx.needs_input_grad[2 + slot] and result[2 + slot] is None:
                result[2 + slot] = torch.zeros_like(tensors[slot])
    return tuple(result)


def _inputs(ctx, saved) -> list[torch.Tensor]:
    """The forward's tensors: the saved ones, and the running statistics kept unsaved."""
    tensors = list(saved[: ctx.n_kept])
    for i in sorted(ctx.volatile or ()):
        tensors.insert(i, ctx.volatile[i])
    return tensors


def _differentiable_backward(ctx, graph, feeds, saved):
    """The backward as a differentiable function of the inputs (``create_graph=True``):
    the gradients, and the slots of the graph built for these shapes they fill."""
    if not graph.saves_tensors:
        raise OrtBridgeError(
            "double backward (create_graph=True) through an ONNX layer is not supported by "
            "the training-agent engine: its gradient graph is not differentiable and the "
            "second-order term would be lost; build the module with backend='onnxruntime' "
            "(the default, backend='auto', does so unless that engine refused the graph)"
        )
    tensors = _inputs(ctx, saved)
    reverse_bridge, order = ctx.bridge.reverse_bridge(graph, tensors)
    # The Dropout masks lead the residuals, after the inputs and saved outputs.
    masks = saved[ctx.n_kept + ctx.n_saved_outputs :][: len(ctx.token.masks)]
    values = dict(zip(ctx.bridge.feed_names, tensors))
    values.update(zip(ctx.token.mask_names, masks))
    seeds = [feeds[i].unsqueeze(-1) for i in ctx.token.seed_index]
    args = [values[name] for name in order[: len(order) - len(seeds)]] + seeds
    grads = reverse_bridge.function_apply(*args)
    return [g.squeeze(-1) for g in grads], graph.static_built(tensors).grad_slots
