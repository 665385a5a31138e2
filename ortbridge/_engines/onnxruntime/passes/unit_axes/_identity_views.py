"""Views that keep their input's shape, dropped from a backward graph.

The passes before this one move the seed axis out and collapse chains of
views, and some views end up reshaping a tensor to the shape it has: a
weight's adjoint viewed to the weight's shape it already has, a gradient
"squeezed" of an axis the twin no longer carries. onnxruntime removes an
``Identity`` but runs such a ``Reshape``, ``Squeeze`` or ``Unsqueeze``, and
at batch 1-8 each node's dispatch is most of what it costs (about a
microsecond; ResNet's backward at batch 2 had 36).

A reader of such a view reads its input instead. A view that writes a graph
output is dropped too where its input is a tensor a node of the graph
writes and nothing else returns: that node writes the output's name. Exact:
the same elements in the same shape. Static shapes only.
"""

from __future__ import annotations

import onnx

from ortbridge._prepare._onnx_utils import node_reads, subgraph_reads, subgraphs

from .._simplify import _VIEWS


def drop_identity_views(model: onnx.ModelProto, shapes: dict) -> int:
    """Drop ``model``'s views whose output has their input's known shape, in
    place; how many were dropped."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    given = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    produced = {o for n in graph.node for o in n.output if o}
    # Names a loop body reads from outside keep their names (and their views).
    inner = {r for n in graph.node for body in subgraphs(n) for r in subgraph_reads(body)}
    same = {}  # view output -> the tensor it views
    for node in graph.node:
        if node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        if node.output[0] in inner:
            continue
        before, after = shapes.get(node.input[0]), shapes.get(node.output[0])
        if before is None or after is None or None in before or tuple(before) != tuple(after):
            continue
        same[node.output[0]] = node.input[0]

    def source(name):
        while name in same:
            name = same[name]
        return name

    # A graph output that is such a view: its source's node writes it instead,
    # where that source is written by a node, returned by no output, and
    # viewed into one output only.
    renamed, claimed = {}, set()
    for out in [o for o in same if o in outputs]:
        src = source(out)
        if src in given or src not in produced or src in outputs or src in claimed or src in inner:
            del same[out]
            continue
        claimed.add(src)
        renamed[src] = out
    if not same:
        return 0
    # The dropped views' shape and axes operands, where a Constant node wrote
    # them, go with the views once nothing else reads them.
    operands = {
        name for n in graph.node if n.output and n.output[0] in same for name in n.input[1:]
    }
    kept = []
    for node in graph.node:
        if node.output and node.output[0] in same:
            continue
        for i, name in enumerate(node.input):
            if name:
                name = source(name)
                node.input[i] = renamed.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renamed.get(name, name)
        kept.append(node)
    read = {r for n in kept for r in node_reads(n)} | outputs
    kept = [
        n
        for n in kept
        if not (n.op_type == "Constant" and n.output[0] in operands and n.output[0] not in read)
    ]
    del graph.node[:]
    graph.node.extend(kept)
    gone = set(same) | set(renamed)
    infos = [vi for vi in graph.value_info if vi.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return len(same)
