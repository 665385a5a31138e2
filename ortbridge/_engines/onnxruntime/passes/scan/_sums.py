"""Sums a backward ``Scan`` accumulates step by step, taken once after it.

onnx-ad's reverse of a ``Scan`` (the RNN lowering: LSTM, GRU, RNN) carries
the gradient of each weight the body reads as a loop state: every step adds
``X_t^T G_t`` (a per-step operand, transposed, times a per-step adjoint),
moved through the seed axis by Transposes, to it. The sum over steps of
those products is one product of the steps' operands stacked,
``[X_1; ...; X_T]^T [G_1; ...; G_T]``: the body returns ``G_t`` as a scan
output (``X_t`` is often a scan input already), and the product, its views
and the initial state's Add run once after the loop. A bias's gradient (the
step's adjoint summed over the batch, a ``ReduceSum``) is the stacked steps'
``ReduceSum``, the same way. On a two-layer bidirectional LSTM each backward
step lost 4 products, their Transposes and Adds and 4 carried 64x64 states:
the training step took 0.86x its time (2 cores, both onnxruntime versions).

Exact up to the order of the sums.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _unique
from ortbridge._prepare._onnx_utils import node_reads

from .._optimize import _const, _inferred, _perm, flattened_product
from .._simplify import _live, _static, reshape

#: Nodes the sum passes through unchanged in form: linear and the same at
#: every step (their other operands constant).
_LINEAR = frozenset({"Identity", "Transpose", "Reshape", "Expand", "Squeeze", "Unsqueeze"})
_STD = ("", "ai.onnx")
_GRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def hoisted_scan_sums(model: onnx.ModelProto) -> None:
    """Rewrite ``model``'s main-graph Scans in place (static shapes)."""
    opset = _opset(model)
    # Scan-8 leads with sequence lengths.
    rewrite_scans(model, lambda scan, seen, _, taken: _hoist(scan, seen, opset, taken), 9)


def rewrite_scans(model: onnx.ModelProto, rewrite, min_opset: int) -> None:
    """Each main-graph Scan replaced by ``rewrite(scan, its body with inferred
    shapes, the main graph's shapes, the names taken)``'s nodes, where not None."""
    if not any(n.op_type == "Scan" and n.domain in _STD for n in model.graph.node):
        return
    if _opset(model) < min_opset:
        return
    inferred = _inferred(model)
    if inferred is None:
        return
    taken = _names(model.graph)
    outer = _shapes(inferred.graph)  # what bodies read from outside
    rewritten = []
    for node, seen in zip(model.graph.node, inferred.graph.node):
        if node.op_type == "Scan" and node.domain in _STD:
            rewritten.extend(rewrite(node, _body(seen), outer, taken) or [node])
        else:
            rewritten.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rewritten)


def _opset(model) -> int:
    return max((o.version for o in model.opset_import if o.domain in _STD), default=1)


def _body(node) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == "body")


def _loop_inputs(scan) -> tuple[onnx.GraphProto, int, int] | None:
    """A Scan's body, its number of states and of scan inputs; None where the
    body's inputs do not match the node's."""
    body = _body(scan)
    n_scan_in = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
    n_states = len(scan.input) - n_scan_in
    if n_states < 0 or len(body.input) != len(scan.input):
        return None
    return body, n_states, n_scan_in


def _rebuilt(scan, inputs, outputs, **replaced) -> onnx.NodeProto:
    """``scan`` with these inputs and outputs, the attributes in ``replaced``
    given anew (an empty list left out: it has no type, and means the default)."""
    new = helper.make_node("Scan", inputs, outputs, scan.name, domain=scan.domain)
    new.attribute.extend(a for a in scan.attribute if a.name not in replaced)
    for name, value in replaced.items():
        if value or isinstance(value, int):
            new.attribute.append(helper.make_attribute(name, value))
    return new


def _set_body(body, nodes, inputs=None, outputs=None) -> None:
    """``body``'s nodes (and inputs, outputs where given) replaced; the value
    infos of names it no longer defines go."""
    for field, values in (("input", inputs), ("output", outputs), ("node", nodes)):
        if values is not None:
            del getattr(body, field)[:]
            getattr(body, field).extend(values)
    defined = {n for node in body.node for n in node.output} | {i.name for i in body.input}
    defined |= {i.name for i in body.initializer}
    kept = [vi for vi in body.value_info if vi.name in defined]
    del body.value_info[:]
    body.value_info.extend(kept)


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every name in ``graph`` and the graphs inside it (one namespace in ONNX)."""
    names = _all_names(graph)
    for node in graph.node:
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names |= _names(g)
    return names


def _types(graph: onnx.GraphProto) -> dict:
    found = {i.name: i.data_type for i in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.tensor_type.elem_type:
            found[vi.name] = vi.type.tensor_type.elem_type
    return found


def _shapes(graph: onnx.GraphProto) -> dict:
    found = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            found[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    for init in graph.initializer:
        found[init.name] = tuple(init.dims)
    return found


def _ints(node, name, n) -> list[int]:
    for a in node.attribute:
        if a.name == name:
            return list(a.ints)
    return [0] * n


class _Body:
    """What the rewrite reads of one Scan body."""

    def __init__(self, body: onnx.GraphProto, seen: onnx.GraphProto, opset: int):
        self.graph = body
        self.opset = opset
        self.shapes = _shapes(seen)
        self.types = _types(seen)
        self.producer = {o: n for n in body.node for o in n.output}
        self.readers: dict[str, int] = {}
        for node in body.node:
            for name in node_reads(node):
                self.readers[name] = self.readers.get(name, 0) + 1
        for out in body.output:
            self.readers[out.name] = self.readers.get(out.name, 0) + 1
        self.constants = {i.name: i for i in body.initializer}
        for node in body.node:
            if node.op_type == "Constant" and node.domain in _STD:
                self.constants[node.output[0]] = node
        self.inputs = [i.name for i in body.input]


def _hoist(scan, seen, opset, taken) -> list | None:
    """The Scan and the nodes after it, where some state sums step products; None otherwise."""
    body = _body(scan)
    n_scan_in = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
    n_states = len(scan.input) - n_scan_in
    n_scan_out = len(body.output) - n_states
    if n_states <= 0 or len(body.input) != len(scan.input) or len(scan.output) > len(body.output):
        return None
    facts = _Body(body, seen, opset)
    in_axes = _ints(scan, "scan_input_axes", n_scan_in)
    in_dirs = _ints(scan, "scan_input_directions", n_scan_in)
    found = []
    for i in range(n_states):
        sums = _summed_products(i, n_states, facts, in_axes, in_dirs)
        if sums is not None and i < len(scan.output) and scan.output[i]:
            found.append((i, sums))
    if not found:
        return None
    out_axes = _ints(scan, "scan_output_axes", n_scan_out)
    out_dirs = _ints(scan, "scan_output_directions", n_scan_out)
    after, new_outputs = [], {}  # body value -> (its steps stacked, their direction)
    returned = {o.name for o in body.output}
    for i, (chain, term_node, term, sources, direction) in found:
        stacked = []
        for kind, name in sources:
            if kind == "scan_in":
                stacked.append(scan.input[n_states + name])
                continue
            if (name, direction) not in new_outputs:
                value = name
                if value in returned or any(v == value for v, _, _ in new_outputs.values()):
                    # a body output names one value once
                    value = _unique(f"{name}_step", taken)
                    body.node.append(helper.make_node("Identity", [name], [value]))
                outer = _unique(f"{name}_steps", taken)
                new_outputs[name, direction] = (value, outer, facts.types.get(name, 0))
            stacked.append(new_outputs[name, direction][1])
        after.extend(_after(scan, i, chain, term_node, term, stacked, facts, taken))
    dropped = {i for i, _ in found}
    keep = [i for i in range(n_states) if i not in dropped]
    scan_inputs = [scan.input[i] for i in keep] + list(scan.input[n_states:])
    scan_outputs = [scan.output[i] for i in keep] + list(scan.output[n_states:])
    body_inputs = [body.input[i] for i in keep] + list(body.input[n_states:])
    body_outputs = [body.output[i] for i in keep] + list(body.output[n_states:])
    # Scan outputs past the ones the node names: padded so that ours line up.
    scan_outputs += [""] * (len(body_outputs) - len(scan_outputs))
    for (_, direction), (name, outer, elem) in new_outputs.items():
        body_outputs.append(helper.make_tensor_value_info(name, elem, None))
        scan_outputs.append(outer)
        out_axes.append(0)
        out_dirs.append(direction)
    live = _live(list(body.node), {o.name for o in body_outputs})
    _set_body(body, live, body_inputs, body_outputs)
    new = _rebuilt(
        scan, scan_inputs, scan_outputs, scan_output_axes=out_axes, scan_output_directions=out_dirs
    )
    return [new, *after]


def _summed_products(i, n_states, facts, in_axes, in_dirs):
    """For state ``i`` updated as ``S + views(term)`` and read nowhere else, the
    term ``MatMul(Transpose(X), G)`` or ``ReduceSum(V)``: (the views, the term's
    node, what :func:`_after` reads of it, its operands' sources, the
    direction the stacked steps take); None otherwise.

    A source is ``("scan_in", k)`` (the k-th scan input, stacked along axis 0)
    or ``("value", name)`` (a body value, stacked as a new scan output).
    """
    body = facts.graph
    state_in, state_out = body.input[i].name, body.output[i].name
    if facts.readers.get(state_in) != 1:
        return None
    node = facts.producer.get(state_out)
    while node is not None and node.op_type == "Identity" and node.domain in _STD:
        if facts.readers.get(node.output[0]) != 1:
            return None
        node = facts.producer.get(node.input[0])
    if node is None or node.op_type != "Add" or node.domain not in _STD:
        return None
    if facts.readers.get(node.output[0]) != 1 or state_in not in node.input:
        return None
    step = node.input[1] if node.input[0] == state_in else node.input[0]
    shapes = facts.shapes
    if not _static(shapes.get(step)) or shapes.get(step) != shapes.get(state_in):
        return None
    chain = []  # the views, last first
    node = facts.producer.get(step)
    while node is not None and node.op_type in _LINEAR and node.domain in _STD:
        if facts.readers.get(node.output[0]) != 1 or not _constant_operands(node, facts):
            return None
        chain.append(node)
        node = facts.producer.get(node.input[0])
    if node is None or node.domain not in _STD or facts.readers.get(node.output[0]) != 1:
        return None
    if node.op_type == "MatMul":
        term = _product_term(node, facts)
    elif node.op_type == "ReduceSum":
        term = _reduced_term(node, facts)
    else:
        return None
    if term is None:
        return None
    sources = [_source(name, facts, n_states, in_axes, in_dirs) for name in term[1]]
    if None in sources:
        return None
    directions = {d for kind, _, d in sources if kind == "scan_in"}
    if len(directions) > 1:  # stacked in opposite orders: the steps would not pair up
        return None
    direction = directions.pop() if directions else 0
    return chain[::-1], node, term[0], [src[:2] for src in sources], direction


def _product_term(node, facts):
    """``MatMul(Transpose(X), G)``, X (n, k), G (1.., n, m): ("product", [X, G], (k, m))."""
    left = facts.producer.get(node.input[0])
    if left is None or left.op_type != "Transpose" or left.domain not in _STD:
        return None
    shapes = facts.shapes
    x, g, out = (shapes.get(n) for n in (left.input[0], node.input[1], node.output[0]))
    if not all(_static(s) for s in (x, g, out)) or len(x) != 2 or len(g) < 2:
        return None
    if _perm(left) not in (None, [1, 0]) or any(d != 1 for d in g[:-2]) or g[-2] != x[0]:
        return None
    return ("product", x[1], g[-1]), [left.input[0], node.input[1]]


def _reduced_term(node, facts):
    """``ReduceSum(V, axes)`` over constant axes: ("reduced", [V], axes)."""
    shape = facts.shapes.get(node.input[0])
    if not _static(shape) or not _static(facts.shapes.get(node.output[0])):
        return None
    if len(node.input) > 1 and node.input[1]:
        axes = facts.constants.get(node.input[1])
        if axes is None:
            return None
        axes = [int(a) for a in numpy_helper.to_array(_tensor(axes)).ravel()]
    else:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), [])
    if not axes:
        if next((a.i for a in node.attribute if a.name == "noop_with_empty_axes"), 0):
            return None  # a copy, not a sum
        axes = list(range(len(shape)))
    return ("reduced", sorted(a % len(shape) for a in axes)), [node.input[0]]


def _tensor(source) -> onnx.TensorProto:
    """The value of a body constant (an initializer or a Constant node)."""
    if isinstance(source, onnx.TensorProto):
        return source
    return next(a.t for a in source.attribute if a.name == "value")


def _constant_operands(node, facts) -> bool:
    """Whether ``node``'s operands past the first are constants (the same at every step)."""
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    ):
        return False
    produced = set(facts.producer) | set(facts.inputs)
    return all(not n or n in facts.constants or n not in produced for n in node.input[1:])


def _source(name, facts, n_states, in_axes, in_dirs):
    """How ``name``'s steps can be stacked, with the direction that pairs them."""
    if name in facts.inputs:
        k = facts.inputs.index(name) - n_states
        if k < 0 or in_axes[k] != 0:  # a state, or steps along another axis
            return None
        return "scan_in", k, in_dirs[k]
    if name not in facts.producer:  # read from outside: the same at every step
        return None
    return "value", name, None


def _after(scan, i, chain, term_node, term, stacked, facts, taken) -> list:
    """Nodes after the Scan giving its i-th output: initial state + views(sum of terms)."""
    base = scan.output[i]
    if term[0] == "product":  # the sum of X_t^T G_t: the stacked steps' product
        nodes, summed = flattened_product(*stacked, term[1], term[2], base, taken)
    else:  # the sum of ReduceSum(V_t): a ReduceSum of the stacked steps
        summed = _unique(f"{base}_reduced", taken)
        axes = [0] + [a + 1 for a in term[1]]
        if facts.opset >= 13:
            axes_name = _unique(f"{base}_axes", taken)
            nodes = [
                _const(axes_name, axes),
                helper.make_node("ReduceSum", [stacked[0], axes_name], [summed], keepdims=1),
            ]
        else:
            nodes = [helper.make_node("ReduceSum", stacked, [summed], axes=axes, keepdims=1)]
    current = _unique(f"{base}_summed", taken)
    nodes += reshape(summed, facts.shapes[term_node.output[0]], current, taken)
    renamed = {}
    for view in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(view)
        copy.name = _unique(f"{view.name or view.op_type}_summed", taken)
        for k, operand in enumerate(copy.input[1:], 1):
            if operand in facts.constants:
                if operand not in renamed:
                    renamed[operand] = _unique(f"{operand}_outer", taken)
                    nodes.append(_outer_constant(facts.constants[operand], renamed[operand]))
                copy.input[k] = renamed[operand]
        copy.input[0] = current
        current = _unique(f"{base}_{view.op_type.lower()}", taken)
        copy.output[0] = current
        nodes.append(copy)
    nodes.append(helper.make_node("Add", [scan.input[i], current], [base]))
    return nodes


def _outer_constant(source, name) -> onnx.NodeProto:
    """A body constant (initializer or Constant node) as a Constant node named ``name``."""
    if isinstance(source, onnx.TensorProto):
        value = onnx.TensorProto()
        value.CopyFrom(source)
        value.name = ""
        return helper.make_node("Constant", [], [name], value=value)
    copy = onnx.NodeProto()
    copy.CopyFrom(source)
    copy.output[0] = name
    copy.name = ""
    return copy
