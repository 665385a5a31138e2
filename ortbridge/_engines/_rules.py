"""ortbridge's corrections to onnx-ad's reverse rules, in force only while ortbridge calls it.

onnx-ad keeps its rules in a table; :func:`own_rules` wraps some entries for
the duration of one ``reverse`` call and puts the originals back, so other
users of onnx-ad in the process see it unchanged. Each wrapper calls
onnx-ad's rule and corrects one case where its result is NaN and the true
derivative is zero (checked against finite differences on ONNX's node tests):

- ``Softmax``/``LogSoftmax`` of a row that is entirely masked (every input
  -inf) is NaN; exporters and the spec's Attention then mask that row's
  output (NaN-robust attention), so its derivative is 0, not NaN. Where
  every path from the output to the graph's outputs only carries a NaN on
  (arithmetic, layout, selection: :data:`_CARRIES_NAN`), nothing masks it,
  torch's own softmax backward is NaN there too, and the correction (an
  ``IsNaN`` and a ``Where`` over the whole output, 2.6% of a transformer
  layer's training step) is left out.
- ``Pow``'s exponent derivative ``y log(x)`` at ``x = 0`` is ``0 * -inf``;
  torch takes 0 there (``log`` of 1 where ``x`` is 0).
"""

from __future__ import annotations

import contextlib
import functools

import onnx

from .._onnx_utils import node_reads


@contextlib.contextmanager
def own_rules(model: onnx.ModelProto | None = None):
    """onnx-ad's reverse-rule table with ortbridge's wrappers in it, restored on exit.

    ``model``, the graph about to be differentiated, tells which softmax
    outputs no node can mask (without it every one is corrected).
    """
    from onnx_ad import rules

    table = rules.REVERSE
    saved = {op: table[op] for op in _WRAPPERS if op in table}
    unmasked = _unmasked_softmaxes(model) if model is not None else set()
    for op, original in saved.items():
        wrapper = _WRAPPERS[op]
        if op in ("Softmax", "LogSoftmax"):
            wrapper = functools.partial(wrapper, unmasked=unmasked)
        table[op] = lambda ctx, node, grads, w=wrapper, o=original: w(ctx, node, grads, o)
    try:
        yield
    finally:
        table.update(saved)


def _softmax(ctx, node, grads, original, unmasked=frozenset()):
    contributions = original(ctx, node, grads)
    if not contributions or contributions[0] is None or node.output[0] in unmasked:
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


#: Operators that carry a NaN in an input on to their outputs (or drop it with
#: the element it sits in): none of them can turn a NaN row into zeros.
_CARRIES_NAN = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Neg", "MatMul", "Gemm", "Einsum", "Exp", "Log",
        "Sqrt", "Pow", "Tanh", "Sigmoid", "Erf", "Gelu", "Relu", "Softmax", "LogSoftmax",
        "LayerNormalization", "ReduceSum", "ReduceMean", "Dropout", "Identity", "Reshape",
        "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
        "Gather", "Expand", "Tile",
    }
)  # fmt: skip


def _unmasked_softmaxes(model: onnx.ModelProto) -> set[str]:
    """Outputs of the main graph's softmaxes whose every reader, and theirs on to
    the graph's outputs, is in :data:`_CARRIES_NAN` (a node whose subgraph reads
    one is not)."""
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node_reads(node):
            readers.setdefault(name, []).append(node)
    found = set()
    for node in graph.node:
        if node.op_type not in ("Softmax", "LogSoftmax") or node.domain not in ("", "ai.onnx"):
            continue
        todo, seen, masked = [node.output[0]], set(), False
        while todo and not masked:
            name = todo.pop()
            for reader in readers.get(name, ()):
                if reader.domain not in ("", "ai.onnx") or reader.op_type not in _CARRIES_NAN:
                    masked = True
                    break
                for out in reader.output:
                    if out and out not in seen:
                        seen.add(out)
                        todo.append(out)
        if not masked:
            found.add(node.output[0])
    return found
