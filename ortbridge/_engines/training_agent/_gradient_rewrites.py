"""Rewrites of the gradient graphs onnxruntime's builder writes.

Applied to every gradient graph before its session is created:

- **tanh GELU, a wrong gradient** (every device). The builder differentiates
  ``Gelu(approximate="tanh")`` (opset 20) with ``GeluGrad``, the gradient of
  the exact, erf-based GELU: weight gradients off by up to 1e-3 against
  torch. Its ``GeluGrad`` becomes the tanh form's own gradient: onnxruntime's
  ``FastGeluGrad`` on CUDA, standard ops on the CPU (where ``FastGeluGrad``
  takes 72 ms on 2M values, torch's forward and backward 8.5 ms).
- **ReLU, a slow kernel** (CPU only). onnxruntime's CPU ``ReluGrad``
  (``dX = X > 0 ? dY : 0``) runs about four times slower than ``Greater`` +
  ``Cast`` + ``Mul`` computing the same thing: 92 against 23 us on a 64x256
  tensor, a sixth of an MLP's backward pass. The products agree exactly
  except where ``dY`` is infinite or NaN at an inactive unit, where the
  product gives NaN and ``ReluGrad`` 0: a gradient already not finite
  upstream. The CUDA kernel is one fused launch and stays.

Both also lift onnxruntime's float-only CPU kernels: float64 networks with
these activations train on the CPU. For the same reason, in float64 graphs
on the CPU, the ``QuickGelu`` and ``QuickGeluGrad`` nodes the builder makes
out of SiLU (``x * sigmoid(x)``) go back to standard ops.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from ortbridge._prepare._lookup import _all_names, _elem_types, _unique
from ortbridge._prepare._onnx_utils import NodeBuilder
from ortbridge.exceptions import OnnxModelError

_MS = "com.microsoft"
_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def rewrite_gradient(model: onnx.ModelProto, device_type: str) -> dict[str, int]:
    """Apply the rewrites for ``device_type`` to ``model`` in place; counts per rewrite."""
    graph = model.graph
    done = {"tanh_gelu": 0, "relu": 0, "quick_gelu": 0}
    targets = dict.fromkeys(_tanh_gelu_grads(graph), "tanh_gelu")
    if device_type == "cpu":
        for i, n in enumerate(graph.node):
            if n.domain == _MS and n.op_type == "ReluGrad":
                targets[i] = "relu"
            elif n.domain == _MS and n.op_type in ("QuickGelu", "QuickGeluGrad"):
                targets[i] = "quick_gelu"
    if not targets:
        return done
    types, taken = _elem_types(model), _all_names(graph)
    nodes = []
    for i, node in enumerate(graph.node):
        kind = targets.get(i)
        if kind is None:
            nodes.append(node)
            continue
        # the activation's input: QuickGelu's only one, a gradient node's second
        x = node.input[0] if node.op_type == "QuickGelu" else node.input[1]
        elem = types.get(x)
        if kind == "tanh_gelu" and (device_type != "cpu" or elem not in _TYPES):
            nodes.append(
                helper.make_node(
                    "FastGeluGrad", list(node.input), list(node.output), name=node.name, domain=_MS
                )
            )
        elif elem in _REWRITTEN_TYPES[kind]:
            b = NodeBuilder(elem, lambda base: _unique(base, taken), prefix=f"{x}_")
            _REWRITES[kind](b, node, x)
            nodes += b.replacing(node)
        else:  # untyped, or a type onnxruntime's kernel handles
            nodes.append(node)
            continue
        done[kind] += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return done


def _tanh_gelu_grads(graph: onnx.GraphProto) -> set[int]:
    """Positions of the ``GeluGrad`` nodes that differentiate a tanh-approximate Gelu."""
    tanh_out, exact_out = {}, {}
    for node in graph.node:
        if node.op_type == "Gelu" and node.domain in ("", "ai.onnx"):
            approximate = next(
                (helper.get_attribute_value(a) for a in node.attribute if a.name == "approximate"),
                b"none",
            )
            (tanh_out if approximate == b"tanh" else exact_out)[node.output[0]] = node.input[0]
    if not tanh_out:
        return set()
    tanh_in, exact_in = set(tanh_out.values()), set(exact_out.values())
    found = set()
    for i, node in enumerate(graph.node):
        if node.op_type != "GeluGrad" or node.domain != _MS or node.input[1] not in tanh_in:
            continue
        if node.input[1] in exact_in:
            # One tensor feeds both GELU forms: the builder names the incoming
            # gradient after the output it belongs to.
            grad = node.input[0]
            source = grad[: -len("_grad")] if grad.endswith("_grad") else None
            if source in exact_out:
                continue
            if source not in tanh_out:
                raise OnnxModelError(
                    f"tensor {node.input[1]!r} feeds both an exact and a tanh-approximate "
                    f"Gelu, and gradient node {node.name!r} cannot be matched to either"
                )
        found.add(i)
    return found


def _relu_grad(b: NodeBuilder, node, x: str) -> None:
    b.op("Mul", node.input[0], b.mask("Greater", x, 0.0))


def _quick_gelu(b: NodeBuilder, node, x: str) -> None:
    # QuickGelu(x) = x s, s = sigmoid(alpha x); d/dx = s (1 + alpha x (1 - s)).
    alpha = next(
        (helper.get_attribute_value(a) for a in node.attribute if a.name == "alpha"), 1.702
    )
    scaled = b.op("Mul", x, b.const(alpha))
    s = b.op("Sigmoid", scaled)
    if node.op_type == "QuickGelu":
        b.op("Mul", x, s)
        return
    rest = b.op("Sub", b.const(1.0), s)
    slope = b.op("Mul", s, b.op("Add", b.op("Mul", scaled, rest), b.const(1.0)))
    b.op("Mul", node.input[0], slope)


def _tanh_gelu_grad(b: NodeBuilder, node, x: str) -> None:
    # y = x/2 (1 + tanh(u)), u = c (x + k x^3):
    # dy/dx = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 k x^2), t = tanh(u).
    x2 = b.op("Mul", x, x)
    inner = b.op("Mul", x, b.op("Add", b.op("Mul", x2, b.const(_GELU_K)), b.const(1.0)))
    t = b.op("Tanh", b.op("Mul", inner, b.const(_GELU_C)))
    left = b.op("Mul", b.op("Add", t, b.const(1.0)), b.const(0.5))
    sech2 = b.op("Sub", b.const(1.0), b.op("Mul", t, t))
    poly = b.op("Add", b.op("Mul", x2, b.const(3 * _GELU_K)), b.const(1.0))
    right = b.op("Mul", b.op("Mul", b.op("Mul", x, sech2), poly), b.const(0.5 * _GELU_C))
    b.op("Mul", node.input[0], b.op("Add", left, right))


_REWRITES = {"relu": _relu_grad, "quick_gelu": _quick_gelu, "tanh_gelu": _tanh_gelu_grad}
# Element types each rewrite takes; other types keep onnxruntime's node (a
# tanh GELU of another type has got FastGeluGrad before this test).
_REWRITTEN_TYPES = {
    "relu": _TYPES,
    "quick_gelu": (onnx.TensorProto.DOUBLE,),
    "tanh_gelu": _TYPES,
}
