"""Activations without a registered gradient, rewritten into ops that have one.

torch exports ``nn.ELU``, ``CELU``, ``SELU``, ``Softplus``, ``Mish``,
``Hardsigmoid``, ``Hardswish`` and ``PReLU`` as single ONNX ops for which
onnxruntime-training 1.19.2 registers no gradient: a graph using them could
not train. Each becomes standard ops whose gradients exist. The pieces of a
piecewise function are selected by masks (``Greater`` then ``Cast``, which
carry no gradient), so the gradient at a join is the one torch picks: at
``x = 0`` the negative side for ELU, CELU, SELU and PReLU. Values that would
overflow are never computed (``exp`` sees ``min(x, 0)``, softplus is
``max(x, 0) + log(1 + exp(-|x|))``), so no NaN enters the backward pass.

``LeakyRelu`` is rewritten the same way in float64 graphs only, where
onnxruntime has no CPU kernel for it.

One difference remains, at measure-zero points: at exactly ``x = +-3``
torch's ``hardswish`` backward takes the inner slope, the rewrite the outer
one (as torch's own ``hardsigmoid`` does).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from ._onnx_utils import NodeBuilder

_SELU_ALPHA = 1.67326319217681884765625  # ONNX's defaults (float32 values)
_SELU_GAMMA = 1.05070102214813232421875

#: Op types rewritten here (ai.onnx domain).
OPS = frozenset({"Elu", "Celu", "Selu", "Softplus", "Mish", "HardSigmoid", "HardSwish", "PRelu"})
#: Op types rewritten in float64 graphs only: onnxruntime's CPU kernel is float only.
FLOAT64_OPS = frozenset({"LeakyRelu"})
ALL_OPS = OPS | FLOAT64_OPS


def rewrites(op_type: str, elem: int) -> bool:
    """Whether :func:`decompose` rewrites an ai.onnx ``op_type`` node on ``elem`` tensors."""
    return op_type in OPS or (op_type in FLOAT64_OPS and elem == onnx.TensorProto.DOUBLE)


def decompose(node: onnx.NodeProto, elem: int, fresh: Callable[[str], str]) -> list[onnx.NodeProto]:
    """Standard-op nodes computing ``node`` (see :func:`rewrites`) on tensors of type ``elem``.

    ``fresh(base)`` returns an unused tensor name. The last node writes
    ``node``'s output and keeps its name.
    """
    b = _Nodes(elem, fresh, prefix=f"{node.output[0]}_")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x = node.input[0]
    kind = node.op_type
    if kind == "Elu":
        b.elu(x, attrs.get("alpha", 1.0), 1.0)
    elif kind == "Celu":
        alpha = attrs.get("alpha", 1.0)
        b.elu(x, alpha, 1.0 / alpha)
    elif kind == "Selu":
        elu = b.elu(x, attrs.get("alpha", _SELU_ALPHA), 1.0)
        b.op("Mul", elu, b.const(attrs.get("gamma", _SELU_GAMMA)))
    elif kind == "Softplus":
        b.softplus(x)
    elif kind == "Mish":
        b.op("Mul", x, b.op("Tanh", b.softplus(x)))
    elif kind == "HardSigmoid":
        b.hard_sigmoid(x, attrs.get("alpha", 0.2), attrs.get("beta", 0.5))
    elif kind == "HardSwish":
        b.op("Mul", x, b.hard_sigmoid(x, 1.0 / 6.0, 0.5))
    elif kind == "PRelu":
        positive, inactive = b.split(x)
        b.op("Add", positive, b.op("Mul", inactive, node.input[1]))
    elif kind == "LeakyRelu":
        positive, inactive = b.split(x)
        b.op("Add", positive, b.op("Mul", inactive, b.const(attrs.get("alpha", 0.01))))
    else:
        raise ValueError(f"no decomposition for {kind}")
    return b.replacing(node)


class _Nodes(NodeBuilder):
    """The pieces the activations are made of."""

    def split(self, x: str) -> tuple[str, str]:
        """``(max(x, 0), min(x, 0))``; at 0 the gradient goes to the second."""
        above = self.mask("Greater", x, 0.0)
        below = self.op("Sub", self.const(1.0), above)
        return self.op("Mul", x, above), self.op("Mul", x, below)

    def elu(self, x: str, alpha: float, inner: float) -> str:
        """``max(x, 0) + alpha (exp(inner min(x, 0)) - 1)``."""
        positive, negative = self.split(x)
        if inner != 1.0:
            negative = self.op("Mul", negative, self.const(inner))
        curve = self.op("Sub", self.op("Exp", negative), self.const(1.0))
        return self.op("Add", positive, self.op("Mul", curve, self.const(alpha)))

    def softplus(self, x: str) -> str:
        """``max(x, 0) + log(1 + exp(-|x|))``: no overflow for large ``x``."""
        positive, negative = self.split(x)
        minus_abs = self.op("Sub", negative, positive)
        tail = self.op("Log", self.op("Add", self.op("Exp", minus_abs), self.const(1.0)))
        return self.op("Add", positive, tail)

    def hard_sigmoid(self, x: str, alpha: float, beta: float) -> str:
        """``min(max(alpha x + beta, 0), 1)``, slope ``alpha`` strictly inside."""
        z = self.op("Add", self.op("Mul", x, self.const(alpha)), self.const(beta))
        inside = self.op("Mul", self.mask("Greater", z, 0.0), self.mask("Less", z, 1.0))
        saturated = self.mask("GreaterOrEqual", z, 1.0)
        return self.op("Add", self.op("Mul", z, inside), saturated)
