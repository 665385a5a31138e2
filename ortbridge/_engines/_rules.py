"""ortbridge's corrections to onnx-ad's reverse rules, in force only while ortbridge calls it.

onnx-ad keeps its rules in a table; :func:`own_rules` wraps some entries for
the duration of one ``reverse`` call and puts the originals back, so other
users of onnx-ad in the process see it unchanged. Each wrapper calls
onnx-ad's rule and corrects one case where its result is NaN and the true
derivative is zero (checked against finite differences on ONNX's node tests):

- ``Softmax``/``LogSoftmax`` of a row that is entirely masked (every input
  -inf) is NaN; exporters and the spec's Attention then mask that row's
  output (NaN-robust attention), so its derivative is 0, not NaN.
- ``Pow``'s exponent derivative ``y log(x)`` at ``x = 0`` is ``0 * -inf``;
  torch takes 0 there (``log`` of 1 where ``x`` is 0).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def own_rules():
    """onnx-ad's reverse-rule table with ortbridge's wrappers in it, restored on exit."""
    from onnx_ad import rules

    table = rules.REVERSE
    saved = {op: table[op] for op in _WRAPPERS if op in table}
    for op, original in saved.items():
        wrapper = _WRAPPERS[op]
        table[op] = lambda ctx, node, grads, w=wrapper, o=original: w(ctx, node, grads, o)
    try:
        yield
    finally:
        table.update(saved)


def _softmax(ctx, node, grads, original):
    contributions = original(ctx, node, grads)
    if not contributions or contributions[0] is None:
        return contributions
    b = ctx.b
    y = b.op("Unsqueeze", [node.output[0], b.ints([-1])], stem="softmax_y")  # seed axis
    nan = b.op("IsNaN", [y], stem="softmax_masked_row")
    zero = ctx.constant(0.0, ctx.dtype(node.output[0]))
    return [b.op("Where", [nan, zero, contributions[0]], stem="softmax_adjoint")]


def _pow(ctx, node, grads, original):
    base, exponent = node.input[0], node.input[1]
    if grads[0] is None or not ctx.asked_for(exponent) or ctx.dtype(exponent) != ctx.dtype(base):
        return original(ctx, node, grads)
    # onnx-ad's rule for the base; its exponent term is replaced (the split
    # keeps only the nodes an adjoint needs).
    contributions = list(original(ctx, node, grads))
    b = ctx.b
    dtype = ctx.dtype(node.output[0], base)
    is_zero = b.op("Equal", [base, ctx.constant(0.0, dtype)], stem="pow_base_zero")
    safe = b.op("Where", [is_zero, ctx.constant(1.0, dtype), base], stem="pow_safe_base")
    d_exponent = b.op("Mul", [node.output[0], b.op("Log", [safe])], stem="pow_d_exponent")
    product = b.op("Mul", [grads[0], ctx.lift(d_exponent)])
    contributions[1] = ctx.unbroadcast(product, ctx.rank(node.output[0]), exponent)
    return contributions[:2]


_WRAPPERS = {"Softmax": _softmax, "LogSoftmax": _softmax, "Pow": _pow}
