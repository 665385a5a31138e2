"""A loss's gradient graph in standard ONNX operators: onnx-ad's reverse mode.

The gradient source for any onnxruntime, the maintained one included: the
same preparation the onnxruntime engine of :class:`~ortbridge.OnnxModule`
gives a graph (ortbridge's rewrites, refusal of what onnx-ad gets wrong,
ortbridge's corrections of its rules, the cheaper forms of the reverse
graph), then, unlike the engine, no split: one graph runs from the inputs
to the loss and the gradients, as the training build's builder writes it.

- The seed of the backward (the gradient of the loss) is a scalar
  initializer holding 1, which a caller may replace with its own scalar
  (the epoch graph feeds the batch's coefficient there).
- Train-mode Dropout: onnx-ad refuses it, so the node becomes a product
  with a mask (:mod:`ortbridge._engines.onnxruntime._train_ops`); the engine draws the
  mask in torch, here a ``RandomUniformLike`` in the graph draws it, seeded
  from torch's generator when the graph is built (``torch.manual_seed``
  reproduces a fit).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ortbridge._engines.onnxruntime import _train_ops
from ortbridge._engines.onnxruntime._reverse_prep import (
    declare_outputs,
    fix_seed_axis,
    not_differentiable,
    onnx_ad,
    prepare,
    refuse_known_wrong,
)
from ortbridge._engines.onnxruntime._rules import own_rules
from ortbridge._engines.onnxruntime.passes._optimize import optimize_reverse
from ortbridge._engines.onnxruntime.passes._simplify import reshape, simplify
from ortbridge._prepare._lookup import _all_names, _unique
from ortbridge._prepare._onnx_utils import np_dtype
from ortbridge.exceptions import OnnxModelError


def reverse_gradient(model: onnx.ModelProto, loss: str, trainable: list[str]):
    """The graph of ``model``'s scalar output ``loss`` and its gradients.

    ``model`` (not modified) has ``trainable`` as graph inputs and ``loss``
    as its only output. Returns ``(graph, seed)``: the graph takes the
    model's inputs and outputs ``loss`` then ``<weight>_grad`` of each
    trainable weight (the weight's shape); ``seed`` names its scalar seed
    initializer, of the loss's type.
    """
    ad = onnx_ad()
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _dropout_off_unless_training(m)
    _, masks = _train_ops.lower_training_nodes(m, [])
    mask_inputs = {mask.name: (_masked(m, mask.name), mask) for mask in masks}
    prepare(m)
    declare_outputs(m)
    refuse_known_wrong(m, trainable, [loss])
    n_inputs = len(m.graph.input)
    try:
        with own_rules():
            reverse = ad.reverse(m, inputs=list(trainable), outputs=[loss], layout="onnx")
    except Exception as exc:
        raise not_differentiable(exc, m) from exc
    seed_input = reverse.graph.input[n_inputs].name
    adjoints = [o.name for o in reverse.graph.output][1:]
    fix_seed_axis(reverse)
    optimize_reverse(reverse)
    graph = reverse.graph
    taken = _all_names(graph)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    elem = next(o.type.tensor_type.elem_type for o in graph.output if o.name == loss)
    # The seed: a scalar initializer, shaped (1,) as onnx-ad's seed input.
    seed = _unique(f"{loss}_grad", taken)
    head = reshape(seed, [1], seed_input, taken)
    graph.initializer.append(numpy_helper.from_array(np.array(1, np_dtype(elem)), seed))
    # The gradients under the names the update graphs read, in the weights' shapes.
    tail, outputs = [], [next(o for o in graph.output if o.name == loss)]
    for weight, adjoint in zip(trainable, adjoints):
        name = f"{weight}_grad"
        if name in taken:
            raise OnnxModelError(
                f"the model already uses the name {name!r}, which the gradient of {weight!r} "
                "needs: rename that tensor"
            )
        tail += reshape(adjoint, shapes[weight], name, taken)
        outputs.append(helper.make_tensor_value_info(name, _elem(graph, weight), shapes[weight]))
    nodes = head + _with_masks_drawn(list(graph.node), mask_inputs, taken) + tail
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [i for i in graph.input if i.name != seed_input and i.name not in mask_inputs]
    del graph.input[:]
    graph.input.extend(kept)
    del graph.output[:]
    graph.output.extend(outputs)
    simplify(reverse)
    return reverse, seed


def _elem(graph: onnx.GraphProto, name: str) -> int:
    return next(i.type.tensor_type.elem_type for i in graph.input if i.name == name)


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))


def _dropout_off_unless_training(model: onnx.ModelProto) -> None:
    """A Dropout without a ``training_mode`` input is off (ONNX's default): say so.

    :func:`._train_ops.lower_training_nodes` reads a missing input as train mode
    (it is given the train-mode variant); here the graph is taken as it is.
    """
    graph = model.graph
    off = None
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.input) > 2 and node.input[2]:
            continue
        if off is None:
            off = _unique("ortbridge_training_false", _all_names(graph))
            graph.initializer.append(numpy_helper.from_array(np.array(False), off))
        while len(node.input) < 3:
            node.input.append("")
        node.input[2] = off


def _masked(model: onnx.ModelProto, mask: str) -> str:
    """The tensor a lowered Dropout multiplies by ``mask`` (the mask's shape)."""
    for node in model.graph.node:
        if node.op_type == "Mul" and len(node.input) == 2 and node.input[1] == mask:
            return node.input[0]
    raise OnnxModelError(f"the Dropout mask {mask!r} multiplies no tensor")


def _with_masks_drawn(nodes: list, masks: dict, taken: set) -> list:
    """``nodes`` with each mask input drawn in the graph after its tensor is computed.

    A mask keeps a value with probability ``1 - ratio``, scaled by
    ``1 / (1 - ratio)`` as Dropout does.
    """
    if not masks:
        return nodes
    after: dict[str, list] = {}
    first = []
    produced = {out for node in nodes for out in node.output}
    for name, (x, mask) in masks.items():
        keep = 1.0 - mask.ratio
        dtype = np_dtype(mask.elem)
        seed = float(torch.randint(0, 2**24, ()).item())  # exact in a float attribute
        u, kept, cast, k, scale = (
            _unique(f"{name}/{part}", taken) for part in ("u", "kept", "cast", "k", "scale")
        )
        drawn = [
            helper.make_node("RandomUniformLike", [x], [u], dtype=mask.elem, seed=seed),
            _constant(k, np.array(keep, dtype)),
            helper.make_node("Less", [u, k], [kept]),
            helper.make_node("Cast", [kept], [cast], to=mask.elem),
            _constant(scale, np.array(1 / keep, dtype)),
            helper.make_node("Mul", [cast, scale], [name]),
        ]
        (after.setdefault(x, []) if x in produced else first).extend(drawn)
    ordered = list(first)
    for node in nodes:
        ordered.append(node)
        for out in node.output:
            ordered.extend(after.pop(out, []))
    return ordered
