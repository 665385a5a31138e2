"""A Scan body's outputs without copies: each value returned once, no Identity before it.

After the rewrites before this one a backward Scan's body returns some
values twice: an adjoint onnx-ad returns, and the same steps stacked in the
other order for a weight's sum (:mod:`._sums`). Each goes out through
an ``Identity`` that onnxruntime keeps (a body output's name), and every
step runs it and copies the value. Here a repeated output goes (its readers
take the first one's steps, reversed by one ``Slice`` per run where the two
were stacked in opposite orders), and an output that is an ``Identity`` of
a value computed in the body gives that value its name.

Measured on the benchmarks' LSTM (2-core CPU): each backward body 72 -> 48
nodes, 10 -> 6 outputs (two of the four repeats are identical stacks, two
the others' steps reversed, one Slice each after the loop); step 0.98x in
both environments (A/B in one process, 2-core AMD EPYC).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ortbridge._prepare._lookup import _unique
from ortbridge._prepare._onnx_utils import subgraph_reads

from .._optimize import _const
from .._simplify import _live
from ._sums import _GRAPHS, _STD, _body, _ints, _rebuilt, _set_body, rewrite_scans


def scan_outputs_without_copies(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main-graph Scans in place (opset 10 or later: Slice's steps)."""
    rewrite_scans(model, _without_copies, 10)


def _source(name, producer) -> str:
    """The value ``name`` is, through Identities."""
    node = producer.get(name)
    while node is not None and node.op_type == "Identity" and node.domain in _STD:
        name = node.input[0]
        node = producer.get(name)
    return name


def _without_copies(scan, seen, outer, taken) -> list | None:
    body = _body(scan)
    n_scan_in = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
    n_states = len(scan.input) - n_scan_in
    n_scan_out = len(body.output) - n_states
    if n_states < 0 or n_scan_out < 0 or len(scan.output) > len(body.output):
        return None
    out_axes = _ints(scan, "scan_output_axes", n_scan_out)
    out_dirs = _ints(scan, "scan_output_directions", n_scan_out)
    scan_outputs = list(scan.output) + [""] * (len(body.output) - len(scan.output))
    producer = {o: n for n in body.node for o in n.output}
    after, first, repeats = [], {}, set()
    for j in range(n_scan_out):
        k = n_states + j
        value = _source(body.output[k].name, producer)
        j0 = first.setdefault((value, out_axes[j]), j)
        if j0 == j:
            continue
        repeats.add(j)
        if not scan_outputs[k]:
            continue
        k0 = n_states + j0
        if not scan_outputs[k0]:
            scan_outputs[k0] = _unique(f"{body.output[k0].name}_steps", taken)
        if out_dirs[j] == out_dirs[j0]:
            after.append(helper.make_node("Identity", [scan_outputs[k0]], [scan_outputs[k]]))
        else:  # the same steps in the other order
            after += _reversed(scan_outputs[k0], out_axes[j], scan_outputs[k], taken)
    renamed = _named_outputs(body, skip={n_states + j for j in repeats})
    if not repeats and not renamed:
        return None
    keep = [k for k in range(len(body.output)) if k - n_states not in repeats]
    outputs = [body.output[k] for k in keep]
    _set_body(body, _live(list(body.node), {o.name for o in outputs}), outputs=outputs)
    kept_scan = [j for j in range(n_scan_out) if j not in repeats]
    new_outputs = [scan_outputs[k] for k in keep]
    while new_outputs and not new_outputs[-1]:  # unread trailing outputs stay unnamed
        new_outputs.pop()
    new = _rebuilt(
        scan,
        list(scan.input),
        new_outputs,
        scan_output_axes=[out_axes[j] for j in kept_scan],
        scan_output_directions=[out_dirs[j] for j in kept_scan],
    )
    return [new, *after]


def _reversed(source, axis, out, taken) -> list:
    names = [_unique(f"{out}/{part}", taken) for part in ("starts", "ends", "axes", "steps")]
    bounds = ([-1], [np.iinfo(np.int64).min], [axis], [-1])
    return [
        *(_const(name, value) for name, value in zip(names, bounds)),
        helper.make_node("Slice", [source, *names], [out]),
    ]


def _bypass_identities(body, kept: set) -> None:
    """Readers of an ``Identity`` (whose output is not in ``kept``) read its input."""
    source = {}
    for node in body.node:
        if node.op_type == "Identity" and node.domain in _STD and node.output[0] not in kept:
            source[node.output[0]] = source.get(node.input[0], node.input[0])
    if not source:
        return
    nodes = [n for n in body.node if not (n.op_type == "Identity" and n.output[0] in source)]
    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = source.get(name, name)
    del body.node[:]
    body.node.extend(nodes)


def _named_outputs(body, skip) -> bool:
    """Each body output (but those in ``skip``) that is an ``Identity`` of a value the
    body computes and returns nowhere else: that value renamed to it."""
    returned = [o.name for k, o in enumerate(body.output) if k not in skip]
    nested = set()
    for node in body.node:
        if any(a.type in _GRAPHS for a in node.attribute):
            for a in node.attribute:
                for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                    nested |= subgraph_reads(g)
    inputs = {i.name for i in body.input}
    _bypass_identities(body, set(returned) | nested)
    producer = {o: n for n in body.node for o in n.output}
    renames = {}
    for name in returned:
        node = producer.get(name)
        if node is None or node.op_type != "Identity" or node.domain not in _STD:
            continue
        value = node.input[0]
        if value in inputs or value not in producer or value in nested:
            continue
        if value in returned or value in renames:
            continue
        renames[value] = (name, node)
    if not renames:
        return False
    dropped = {id(node) for _, node in renames.values()}
    nodes = [n for n in body.node if id(n) not in dropped]
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name][0]
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name][0]
    del body.node[:]
    body.node.extend(nodes)
    kept = [vi for vi in body.value_info if vi.name not in renames]
    del body.value_info[:]
    body.value_info.extend(kept)
    return True
