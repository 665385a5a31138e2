"""A backward graph of opset 13 to 17 raised to opset 18, where that is exact.

The cheaper form of a convolution's input gradient (``Col2Im``,
:mod:`._conv_grad`) exists from opset 18, and TorchScript exports at opset
17: ResNet's backward then ran onnxruntime's ``ConvTranspose``, the slowest
of its convolution kernels with workers that spin. The backward graph is
ortbridge's own, so its opset may be raised where every node means the same
at 18: its op's schema is unchanged between the two opsets, opset 18 only
added optional inputs or attributes to it, or it is a reduction whose
``axes`` attribute becomes the input opset 18 reads them from.
"""

from __future__ import annotations

import functools

import onnx
from onnx import defs

from ortbridge._prepare._lookup import _all_names, _unique

from ._optimize import _const

_TARGET = 18

#: Reductions whose ``axes`` moved from an attribute to an input at opset 18.
_REDUCTIONS = frozenset(
    {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
     "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
)  # fmt: skip


#: Ops whose opset-18 schema only adds optional inputs or attributes whose
#: defaults keep the earlier meaning (Pad's ``axes``, Resize's ``antialias``,
#: the scatters' max/min reductions, LpPool's ``ceil_mode``).
_EXTENDED = frozenset({"Pad", "Resize", "ScatterND", "ScatterElements", "LpPool"})


def raise_to_opset18(model: onnx.ModelProto) -> bool:
    """Raise ``model``'s default-domain opset to 18 in place where exact; True if raised."""
    entry = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if entry is None or not 13 <= entry.version < _TARGET:
        return False
    graph = model.graph
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):  # fmt: skip
            return False  # a body's nodes would need the same check
        if node.op_type in _REDUCTIONS or node.op_type in _EXTENDED:
            continue
        if node.op_type == "Split" and len(node.input) > 1 and node.input[1]:
            continue  # sizes given: what opset 18 reads (else num_outputs)
        if not _unchanged(node.op_type, entry.version):
            return False
    taken = _all_names(graph)
    rewritten = []
    for node in graph.node:
        if node.op_type in _REDUCTIONS and not node.domain:
            axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
            if axes is not None:
                name = _unique(f"{node.output[0]}/axes", taken)
                rewritten.append(_const(name, axes))
                kept = [a for a in node.attribute if a.name != "axes"]
                del node.attribute[:]
                node.attribute.extend(kept)
                node.input.append(name)
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    entry.version = _TARGET
    model.ir_version = max(model.ir_version, 8)  # opset 18 needs IR 8
    return True


@functools.cache  # a schema lookup per node cost 3 ms of a 1,000-node backward
def _unchanged(op_type: str, version: int) -> bool:
    """Whether ``op_type`` has the same schema at ``version`` and at opset 18."""
    try:
        now = defs.get_schema(op_type, version, "").since_version
        then = defs.get_schema(op_type, _TARGET, "").since_version
    except defs.SchemaError:
        return False
    return now == then
