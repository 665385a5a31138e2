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
    ctx.set_materialize_grads(False)
    graph = bridge.gradient_graph(mode, ctx.needs_input_grad[2:], tensors[0].device)
    outputs, state = graph.forward(dict(zip(bridge.feed_names, tensors)))
    user = outputs[: graph.n_user_outputs]
    bridge.update_running_stats(tensors, outputs[graph.n_user_outputs :])
    ctx.bridge, ctx.graph, ctx.state, ctx.mode = bridge, graph, state, mode
    ctx.output_meta = [(o.shape, o.dtype, o.device) for o in user]
    ctx.mark_non_differentiable(*[o for o in user if not o.is_floating_point()])
    # Inputs are saved for a recomputation (second backward); running
    # statistics are updated in place right above, so they are kept unsaved.
    volatile = bridge.running_stat_positions
    ctx.volatile = {i: tensors[i] for i in volatile}
    kept = [t for i, t in enumerate(tensors) if i not in volatile]
    # Outputs the backward pass reads are saved so that torch's version
    # counter catches an in-place change (they share memory with onnxruntime).
    ctx.save_for_backward(*kept, *[user[i] for i in graph.save_for_backward])
    ctx.n_kept = len(kept)
    return tuple(user)


def _backward(ctx, *grad_outputs):
    saved = ctx.saved_tensors
    graph, state = ctx.graph, ctx.state
    if state is None:
        # The first backward consumed the state: run the forward again.
        it = iter(saved[: ctx.n_kept])
        n = len(ctx.bridge.feed_names)
        tensors = [ctx.volatile[i] if i in ctx.volatile else next(it) for i in range(n)]
        _, state = graph.forward(dict(zip(ctx.bridge.feed_names, tensors)))
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
    return (None, None, *[grads.get(name) for name in ctx.bridge.feed_names])
