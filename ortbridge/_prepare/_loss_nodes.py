"""The ONNX nodes of a loss on each element of a prediction, under either convention.

Two writers append losses to graphs: :func:`ortbridge.add_loss_output`
(torch's conventions: ``MSELoss``, ``L1Loss``, ``BCEWithLogitsLoss``) and the
estimators' :func:`ortbridge.training._losses.append_loss` (scikit-learn's:
squares halved, ``r**2 / 2``). They differ in that factor and in how rows
are reduced, which each keeps; the elementwise loss is written here once.

With ``r = p - y``, the elementwise loss is

- ``squared_error``: ``s r**2``,
- ``absolute_error``: ``|r|``,
- ``elastic``: ``l1_weight |r| + s l2_weight r**2``,
- ``log_loss``: ``log(1 + exp(p)) - y p`` on the raw score ``p``,

with ``s = 1/2`` when ``halved`` (scikit-learn) and 1 otherwise (torch).
Only operators both onnxruntimes differentiate are used (onnxruntime 1.19.2
has no gradient for ``Softplus``).
"""

from __future__ import annotations

from collections.abc import Callable

#: ``node(op_type, inputs, base_name, **attributes) -> output name``.
NodeFn = Callable[..., str]
#: ``const(base_name, value) -> name`` of a scalar of the loss's type.
ConstFn = Callable[[str, float], str]


def elementwise_loss(
    loss: str,
    pred: str,
    target: str,
    node: NodeFn,
    const: ConstFn,
    *,
    halved: bool,
    l1_weight: float = 0.5,
    l2_weight: float = 0.5,
) -> str:
    """Append the nodes of ``loss`` on each element; return the name of the result.

    ``node`` and ``const`` append a node or a constant the caller's way (an
    initializer, or a Constant node where a float initializer would be
    taken for a weight to train).
    """
    if loss == "log_loss":
        # log(1 + exp(p)) - y p written as (1/2 - y) p + |p|/2 + log(1 + exp(-|p|)):
        # stable for large |p|, and its derivative at p == 0 is exactly 1/2 - y
        # (Abs' gradient is 0 there), which relu(p) + ... would not give.
        half = const("half", 0.5)
        absolute = node("Abs", [pred], "abs")
        exp = node("Exp", [node("Neg", [absolute], "neg")], "exp")
        soft = node("Log", [node("Add", [exp, const("one", 1.0)], "one_plus_exp")], "log")
        linear = node("Mul", [node("Sub", [half, target], "half_minus_y"), pred], "linear")
        half_abs = node("Mul", [absolute, half], "half_abs")
        return node("Add", [node("Add", [linear, half_abs], "sum"), soft], "elementwise")
    residual = node("Sub", [pred, target], "residual")
    scale = 0.5 if halved else 1.0
    terms = []
    if loss in ("squared_error", "elastic"):
        square = node("Mul", [residual, residual], "square")
        coef = scale if loss == "squared_error" else scale * l2_weight
        terms.append(square if coef == 1 else node("Mul", [square, const("l2", coef)], "l2_part"))
    if loss in ("absolute_error", "elastic"):
        absolute = node("Abs", [residual], "abs")
        if loss == "elastic":
            absolute = node("Mul", [absolute, const("l1", l1_weight)], "l1_part")
        terms.append(absolute)
    if not terms:
        raise ValueError(f"unknown loss {loss!r}")  # callers check names first
    return terms[0] if len(terms) == 1 else node("Add", terms, "elementwise")
