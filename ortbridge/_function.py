"""The ``torch.autograd.Function`` subclass generated for each ONNX graph.

``forward`` runs onnxruntime's TrainingAgent up to the graph's ``YieldOp`` and
keeps the execution state; ``backward`` resumes that state once and frees it.
A second backward over the same graph (``retain_graph=True``) recomputes the
forward from the saved inputs first.
"""

from __future__ import annotations

import re

import torch


def make_function(graph_name: str) -> type[torch.autograd.Function]:
    """A new autograd Function class named after ``graph_name``."""
    ident = re.sub(r"\W", "_", graph_name).strip("_") or "onnx_graph"
    name = f"{ident[0].upper()}{ident[1:]}Function"
    return type(
        name,
        (torch.autograd.Function,),
        {
            "__doc__": f"Forward and backward of ONNX graph {graph_name!r} in onnxruntime.",
            "__module__": __name__,
            "__qualname__": name,
            "forward": staticmethod(_forward),
            "backward": staticmethod(_backward),
        },
    )


def _forward(ctx, bridge, mode, *tensors):
    # Runs on every training step: the common case (one float output, no
    # running statistics) takes no detours, since in a step with cold caches
    # each Python line costs several times its tight-loop price.
    ctx.set_materialize_grads(False)
    graph = bridge.gradient_graph(mode, ctx.needs_input_grad[2:], tensors[0].device)
    outputs, state = graph.forward(tensors)
    n_user = graph.n_user_outputs
    if len(outputs) > n_user:
        bridge.update_running_stats(tensors, outputs[n_user:])
        outputs = outputs[:n_user]
    ctx.bridge, ctx.graph, ctx.state = bridge, graph, state
    ctx.output_meta = [(o.shape, o.dtype, o.device) for o in outputs]
    integers = [o for o in outputs if not o.is_floating_point()]
    if integers:
        ctx.mark_non_differentiable(*integers)
    # Inputs are saved for a recomputation (second backward); running
    # statistics are updated in place right above, so they are kept unsaved.
    volatile = bridge.running_stat_positions
    if volatile:
        ctx.volatile = {i: tensors[i] for i in volatile}
        kept = [t for i, t in enumerate(tensors) if i not in volatile]
    else:
        ctx.volatile, kept = None, tensors
    # Outputs the backward pass reads are saved so that torch's version
    # counter catches an in-place change (they share memory with onnxruntime).
    ctx.save_for_backward(*kept, *[outputs[i] for i in graph.save_for_backward])
    ctx.n_kept = len(kept)
    return tuple(outputs)


def _backward(ctx, *grad_outputs):
    saved = ctx.saved_tensors
    graph, state = ctx.graph, ctx.state
    if state is None:
        # The first backward consumed the state: run the forward again.
        tensors = list(saved[: ctx.n_kept])
        for i in sorted(ctx.volatile or ()):
            tensors.insert(i, ctx.volatile[i])
        _, state = graph.forward(tensors)
    ctx.state = None  # the state holds every activation: free it with this backward
    feeds = []
    for idx, grad in enumerate(grad_outputs[: graph.n_user_outputs]):
        if idx in graph.non_differentiable:
            continue
        if grad is None:
            shape, dtype, device = ctx.output_meta[idx]
            grad = torch.zeros(shape if idx in graph.full_shape else (), dtype=dtype, device=device)
        feeds.append(grad.contiguous())
    grads = graph.backward(feeds, state)
    del state
    # (bridge, mode, *tensors): one slot per argument of forward.
    result = [None] * (2 + len(ctx.bridge.feed_names))
    for slot, grad in zip(graph.grad_slots, grads):
        result[2 + slot] = grad
    return tuple(result)
