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

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._graph import _all_names, _elem_types, _unique
from .exceptions import OnnxModelError

_MS = "com.microsoft"
_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def rewrite_gradient(model: onnx.ModelProto, device_type: str) -> dict[str, int]:
    """Apply the rewrites for ``device_type`` to ``model`` in place; counts per rewrite."""
    graph = model.graph
    done = {"tanh_gelu": 0, "relu": 0, "quick_gelu": 0}
    tanh_gelu = _tanh_gelu_grads(graph)
    relu, quick = set(), set()
    if device_type == "cpu":
        for i, n in enumerate(graph.node):
            if n.domain == _MS and n.op_type == "ReluGrad":
                relu.add(i)
            elif n.domain == _MS and n.op_type in ("QuickGelu", "QuickGeluGrad"):
                quick.add(i)
    if not tanh_gelu and not relu and not quick:
        return done
    builder = _Builder(model)
    nodes = []
    for i, node in enumerate(graph.node):
        # the activation's input: the only input of QuickGelu, else the second
        x = node.input[0] if node.op_type == "QuickGelu" else node.input[-1]
        elem = builder.types.get(x) if i in relu or i in tanh_gelu or i in quick else None
        if i in tanh_gelu and (device_type != "cpu" or elem not in _TYPES):
            nodes.append(
                helper.make_node(
                    "FastGeluGrad", list(node.input), list(node.output), name=node.name, domain=_MS
                )
            )
            done["tanh_gelu"] += 1
        elif i in tanh_gelu:
            nodes += builder.tanh_gelu_grad(node, elem)
            done["tanh_gelu"] += 1
        elif i in relu and elem in _TYPES:
            nodes += builder.relu_grad(node, elem)
            done["relu"] += 1
        elif i in quick and elem == onnx.TensorProto.DOUBLE:
            nodes += builder.quick_gelu(node, elem)
            done["quick_gelu"] += 1
        else:
            nodes.append(node)
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
            source = node.input[0][: -len("_grad")]
            if source in exact_out:
                continue
            if source not in tanh_out:
                raise OnnxModelError(
                    f"tensor {node.input[1]!r} feeds both an exact and a tanh-approximate "
                    f"Gelu, and gradient node {node.name!r} cannot be matched to either"
                )
        found.add(i)
    return found


class _Builder:
    """Makes replacement nodes with fresh names and shared scalar constants."""

    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.types = _elem_types(model)
        self.taken = _all_names(model.graph)
        self.constants: dict[tuple[int, float], str] = {}

    def name(self, base: str) -> str:
        return _unique(base, self.taken)

    def constant(self, value: float, elem: int) -> str:
        key = (elem, value)
        if key not in self.constants:
            name = self.name(f"ortbridge_const_{len(self.constants)}")
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            self.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype), name))
            self.constants[key] = name
        return self.constants[key]

    def relu_grad(self, node, elem) -> list[onnx.NodeProto]:
        d_y, x = node.input[0], node.input[1]
        active, mask = self.name(f"{x}_active"), self.name(f"{x}_active_mask")
        return [
            helper.make_node("Greater", [x, self.constant(0.0, elem)], [active]),
            helper.make_node("Cast", [active], [mask], to=elem),
            helper.make_node("Mul", [d_y, mask], [node.output[0]], name=node.name),
        ]

    def quick_gelu(self, node, elem) -> list[onnx.NodeProto]:
        # QuickGelu(x) = x s, s = sigmoid(alpha x); d/dx = s (1 + alpha x (1 - s)).
        alpha = next(
            (helper.get_attribute_value(a) for a in node.attribute if a.name == "alpha"), 1.702
        )
        x = node.input[0] if node.op_type == "QuickGelu" else node.input[1]
        scaled, s = self.name(f"{x}_qg_ax"), self.name(f"{x}_qg_s")
        nodes = [
            helper.make_node("Mul", [x, self.constant(alpha, elem)], [scaled]),
            helper.make_node("Sigmoid", [scaled], [s]),
        ]
        if node.op_type == "QuickGelu":
            return [*nodes, helper.make_node("Mul", [x, s], list(node.output), name=node.name)]
        n = {k: self.name(f"{x}_qg_{k}") for k in ("rest", "t", "u", "d")}
        return [
            *nodes,
            helper.make_node("Sub", [self.constant(1.0, elem), s], [n["rest"]]),
            helper.make_node("Mul", [scaled, n["rest"]], [n["t"]]),
            helper.make_node("Add", [n["t"], self.constant(1.0, elem)], [n["u"]]),
            helper.make_node("Mul", [s, n["u"]], [n["d"]]),
            helper.make_node("Mul", [node.input[0], n["d"]], list(node.output), name=node.name),
        ]

    def tanh_gelu_grad(self, node, elem) -> list[onnx.NodeProto]:
        # y = x/2 (1 + tanh(u)), u = c (x + k x^3):
        # dy/dx = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 k x^2), t = tanh(u).
        d_y, x = node.input[0], node.input[1]
        const = lambda v: self.constant(v, elem)  # noqa: E731
        n = {
            k: self.name(f"{x}_gelu_{k}")
            for k in "x2 a b inner u t tp left t2 s p q r rr d sum".split()
        }
        return [
            helper.make_node("Mul", [x, x], [n["x2"]]),
            helper.make_node("Mul", [n["x2"], const(_GELU_K)], [n["a"]]),
            helper.make_node("Add", [n["a"], const(1.0)], [n["b"]]),
            helper.make_node("Mul", [x, n["b"]], [n["inner"]]),
            helper.make_node("Mul", [n["inner"], const(_GELU_C)], [n["u"]]),
            helper.make_node("Tanh", [n["u"]], [n["t"]]),
            helper.make_node("Add", [n["t"], const(1.0)], [n["tp"]]),
            helper.make_node("Mul", [n["tp"], const(0.5)], [n["left"]]),
            helper.make_node("Mul", [n["t"], n["t"]], [n["t2"]]),
            helper.make_node("Sub", [const(1.0), n["t2"]], [n["s"]]),
            helper.make_node("Mul", [n["x2"], const(3 * _GELU_K)], [n["p"]]),
            helper.make_node("Add", [n["p"], const(1.0)], [n["q"]]),
            helper.make_node("Mul", [x, n["s"]], [n["r"]]),
            helper.make_node("Mul", [n["r"], n["q"]], [n["rr"]]),
            helper.make_node("Mul", [n["rr"], const(0.5 * _GELU_C)], [n["d"]]),
            helper.make_node("Add", [n["left"], n["d"]], [n["sum"]]),
            helper.make_node("Mul", [d_y, n["sum"]], [node.output[0]], name=node.name),
        ]
