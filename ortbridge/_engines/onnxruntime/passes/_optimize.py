"""Exact rewrites that make onnx-ad's reverse model cheaper to run and to keep.

onnx-ad writes a general reverse model: the seed count is a trailing axis it
moves around every MatMul/Conv with ``Transpose`` nodes, each adjoint is
expanded to its full shape, and ReLU's mask is read from its input. With one
seed direction, all three have cheaper equal forms:

- a ``Transpose`` that moves only size-1 axes is ``Squeeze`` + ``Unsqueeze``
  (no data moved);
- an ``Expand`` whose input already has the target shape is an ``Identity``;
- a weight gradient written ``(X^T G)^T`` (a transpose of the weight-sized
  result) is ``G^T X`` (onnxruntime folds the small ``G^T`` into its
  MatMul); two Transposes that cancel are an ``Identity``;
- a batched MatMul's weight gradient written as per-batch products summed
  over the batch (a batch-times-weight-sized tensor) is one MatMul over the
  flattened batch;
- ``Greater(x, 0)`` beside ``Relu(x)`` is ``Greater(Relu(x), 0)``: the
  backward then reads the ReLU's output, which the next layer's weight
  gradient reads anyway, and the pre-activation need not be kept.

Shapes come from onnx's shape inference with data propagation, symbolic
dimensions compared by name; a rewrite applies only where they are known.
Shape arithmetic whose operands are all known (graphs built per input shape)
is folded to constants first (onnx-ad's own folding pass), which is what
lets inference see through, for instance, MaxPool's ScatterND backward.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _unique

from .._fold import fold_constants


def optimize_reverse(model: onnx.ModelProto) -> None:
    """Apply the rewrites to ``model`` in place."""
    folded = fold_constants(model)
    if folded is not model:
        model.CopyFrom(folded)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    _relu_masks_from_outputs(model)
    if opset < 13:  # Squeeze/Unsqueeze take their axes as inputs from opset 13
        return
    shapes = _shapes(model)
    if shapes is None:
        return
    graph = model.graph
    taken = _all_names(graph)
    rewritten = []
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "Transpose":
            replaced = _transpose_of_unit_axes(node, shapes, taken)
            if replaced:
                rewritten.extend(replaced)
                continue
        if node.domain in ("", "ai.onnx") and node.op_type == "Expand":
            src, out = shapes.get(node.input[0]), shapes.get(node.output[0])
            if src is not None and src == out and None not in src:
                rewritten.append(
                    helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name)
                )
                continue
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    _transposed_products(graph, shapes, taken)


def _perm(node) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _axes(node, constants) -> list[int] | None:
    if len(node.input) > 1 and node.input[1] in constants:
        return [int(a) for a in constants[node.input[1]].ravel()]
    return None


def _transposed_products(graph, shapes, taken) -> None:
    """``Transpose([1,0,2])`` of ``Unsqueeze(Squeeze(MatMul(Transpose(X), G), [0]), [2])``
    becomes ``Unsqueeze(MatMul(Transpose(Squeeze(G, [0])), X), [2])``; and
    ``Transpose(Transpose(x))`` whose permutations cancel becomes ``Identity(x)``."""
    producer = {o: n for n in graph.node for o in n.output}
    constants = {}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            constants[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    for i in graph.initializer:
        constants[i.name] = numpy_helper.to_array(i)
    rewritten = []
    for node in graph.node:
        replaced = _transposed_product(node, producer, constants, shapes, taken)
        if replaced is None:
            replaced = _summed_batch_product(node, producer, constants, shapes, taken)
        rewritten.extend(replaced or [node])
    del graph.node[:]
    graph.node.extend(rewritten)


def _transposed_product(node, producer, constants, shapes, taken):
    if node.op_type != "Transpose":
        return None
    inner = producer.get(node.input[0])
    perm = _perm(node)
    if inner is not None and inner.op_type == "Transpose" and perm and _perm(inner):
        if [_perm(inner)[p] for p in perm] == list(range(len(perm))):
            return [helper.make_node("Identity", [inner.input[0]], [node.output[0]], node.name)]
    if perm != [1, 0, 2] or inner is None or inner.op_type != "Unsqueeze":
        return None
    squeeze = producer.get(inner.input[0])
    if _axes(inner, constants) != [2] or squeeze is None or squeeze.op_type != "Squeeze":
        return None
    matmul = producer.get(squeeze.input[0])
    if _axes(squeeze, constants) != [0] or matmul is None or matmul.op_type != "MatMul":
        return None
    left = producer.get(matmul.input[0])
    g_shape, x_shape = shapes.get(matmul.input[1]), shapes.get(matmul.input[0])
    if left is None or left.op_type != "Transpose" or _perm(left) not in ([1, 0], None):
        return None
    if g_shape is None or len(g_shape) != 3 or g_shape[0] != 1 or len(x_shape or ()) != 2:
        return None
    names = [_unique(f"{node.output[0]}_{s}", taken) for s in ("g", "gt", "p", "ax0", "ax2")]
    g, gt, product, ax0, ax2 = names
    return [
        _const(ax0, [0]),
        helper.make_node("Squeeze", [matmul.input[1], ax0], [g]),
        helper.make_node("Transpose", [g], [gt], perm=[1, 0]),
        helper.make_node("MatMul", [gt, left.input[0]], [product]),
        _const(ax2, [2]),
        helper.make_node("Unsqueeze", [product, ax2], [node.output[0]], node.name),
    ]


def _summed_batch_product(node, producer, constants, shapes, taken):
    """``ReduceSum[0](Unsqueeze[3](Squeeze[0](MatMul(Transpose[0,2,1](X), G))))``,
    X (b, m, k) and G (1, b, m, n), is ``Reshape(MatMul(X'^T, G'), [1, k, n, 1])``
    with X' = X as (b*m, k) and G' = G as (b*m, n)."""
    if node.op_type != "ReduceSum" or _axes(node, constants) != [0]:
        return None
    if any(a.name == "keepdims" and a.i == 0 for a in node.attribute):
        return None
    unsqueeze = producer.get(node.input[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or _axes(unsqueeze, constants) != [3]:
        return None
    squeeze = producer.get(unsqueeze.input[0])
    if squeeze is None or squeeze.op_type != "Squeeze" or _axes(squeeze, constants) != [0]:
        return None
    matmul = producer.get(squeeze.input[0])
    if matmul is None or matmul.op_type != "MatMul":
        return None
    left = producer.get(matmul.input[0])
    if left is None or left.op_type != "Transpose" or _perm(left) != [0, 2, 1]:
        return None
    x_shape, g_shape = shapes.get(left.input[0]), shapes.get(matmul.input[1])
    if x_shape is None or g_shape is None or len(x_shape) != 3 or len(g_shape) != 4:
        return None
    k, n = x_shape[2], g_shape[3]
    if g_shape[0] != 1 or not isinstance(k, int) or not isinstance(n, int):
        return None
    base = node.output[0]
    nodes, p = flattened_product(left.input[0], matmul.input[1], k, n, base, taken)
    out_shape = _unique(f"{base}_shape", taken)
    return [
        *nodes,
        _const(out_shape, [1, k, n, 1]),
        helper.make_node("Reshape", [p, out_shape], [base], node.name),
    ]


def flattened_product(x, g, k, n, base, taken) -> tuple[list, str]:
    """Nodes computing ``X'^T G'``, X' = ``x`` as (-1, k) and G' = ``g`` as
    (-1, n): a sum over batches of per-batch products, as one product; and its name."""
    parts = ("xs", "gs", "xf", "gf", "xt", "p")
    xs, gs, xf, gf, xt, p = (_unique(f"{base}_{s}", taken) for s in parts)
    nodes = [
        _const(xs, [-1, k]),
        helper.make_node("Reshape", [x, xs], [xf]),
        _const(gs, [-1, n]),
        helper.make_node("Reshape", [g, gs], [gf]),
        helper.make_node("Transpose", [xf], [xt], perm=[1, 0]),
        helper.make_node("MatMul", [xt, gf], [p]),
    ]
    return nodes, p


def _shapes(model: onnx.ModelProto) -> dict[str, tuple] | None:
    inferred = _inferred(model)
    return None if inferred is None else _shapes_of(inferred)


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto | None:
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:
        return None


def _shapes_of(inferred: onnx.ModelProto) -> dict[str, tuple]:
    return _shapes_and_types(inferred)[0]


def _shapes_and_types(inferred: onnx.ModelProto) -> tuple[dict, dict]:
    """Each tensor's shape (ints; a symbol's name or None where unknown) and
    element type, as ``inferred``'s value infos and initializers give them."""
    shapes, types = {}, {}
    g = inferred.graph
    for field in (g.input, g.value_info, g.output):
        for vi in field:
            tt = vi.type.tensor_type
            if tt.elem_type:
                types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                dims = [d.dim_value for d in tt.shape.dim]
                if 0 in dims:  # a symbol or an unknown size reads as 0: look closer
                    dims = [
                        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                        for d in tt.shape.dim
                    ]
                shapes[vi.name] = tuple(dims)
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
        types[init.name] = init.data_type
    return shapes, types


def _transpose_of_unit_axes(node, shapes, taken):
    shape = shapes.get(node.input[0])
    if shape is None:
        return None
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if perm is None:
        perm = list(reversed(range(len(shape))))
    moved = [axis for axis in perm if shape[axis] != 1]
    if moved != sorted(moved) or any(d is None for d in (shape[a] for a in moved)):
        return None
    squeeze_axes = [a for a, d in enumerate(shape) if d == 1]
    unsqueeze_axes = [k for k, axis in enumerate(perm) if shape[axis] == 1]
    if not squeeze_axes:
        return [helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name)]
    nodes, current = [], node.input[0]
    out = node.output[0]  # onnx-ad's nodes have no names: the output's is unique
    s_axes, u_axes = _unique(f"{out}_sq", taken), _unique(f"{out}_unsq", taken)
    squeezed = _unique(f"{out}_squeezed", taken)
    nodes.append(_const(s_axes, squeeze_axes))
    nodes.append(helper.make_node("Squeeze", [current, s_axes], [squeezed]))
    nodes.append(_const(u_axes, unsqueeze_axes))
    nodes.append(helper.make_node("Unsqueeze", [squeezed, u_axes], [node.output[0]], node.name))
    return nodes


def reduce_axes(node, constants) -> list | None:
    """The axes ``node`` reduces, from its constant input or (before opset 18,
    ReduceSum's 13) its attribute; None where unknown or empty (every axis)."""
    if len(node.input) > 1 and node.input[1]:
        value = constants.get(node.input[1])
        return None if value is None else np.ravel(value).tolist() or None
    return next((list(a.ints) for a in node.attribute if a.name == "axes"), None) or None


def _const(name, values):
    """``Constant`` int64 ``values`` named ``name``: the node ``make_node`` and
    ``from_array`` write, built directly (half their time; the passes make
    hundreds a build)."""
    array = np.asarray(values, dtype="<i8")
    tensor = onnx.TensorProto(
        dims=array.shape, data_type=onnx.TensorProto.INT64, raw_data=array.tobytes()
    )
    node = onnx.NodeProto(op_type="Constant", output=[name])
    node.attribute.add(name="value", type=onnx.AttributeProto.TENSOR, t=tensor)
    return node


def _is_zero(name, constants) -> bool:
    value = constants.get(name)
    return value is not None and value.size == 1 and not value.any()


def _relu_masks_from_outputs(model: onnx.ModelProto) -> None:
    graph = model.graph
    relu_of = {}
    for node in graph.node:
        if node.op_type == "Relu" and node.domain in ("", "ai.onnx"):
            relu_of.setdefault(node.input[0], node.output[0])
    if not relu_of:
        return
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    for node in graph.node:
        if (
            node.op_type == "Greater"
            and node.input[0] in relu_of
            and _is_zero(node.input[1], constants)
        ):
            node.input[0] = relu_of[node.input[0]]


@dataclasses.dataclass
class Facts:
    """What a node rewrite of a graph with static shapes reads about the graph."""

    shapes: dict
    types: dict
    producer: dict
    readers: dict
    inits: dict
    taken: set


def facts(model: onnx.ModelProto) -> Facts | None:
    """The facts of ``model``'s main graph, None where shape inference fails."""
    inferred = _inferred(model)  # one inference pass gives shapes and types
    if inferred is None:
        return None
    shapes, types = _shapes_and_types(inferred)
    graph = model.graph
    producer, readers = _links(graph)
    inits = {i.name: i for i in graph.initializer}
    return Facts(shapes, types, producer, readers, inits, _all_names(graph))


def _links(graph: onnx.GraphProto) -> tuple[dict, dict]:
    """Each tensor's producing node, and how many node inputs read it."""
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return {o: n for n in graph.node for o in n.output}, readers


def extended(found: Facts, model: onnx.ModelProto, added: list) -> Facts | None:
    """``found`` for ``model`` after rewrites that kept every tensor's name and
    shape and added the nodes ``added``: their tensors' shapes and types from
    onnx's inference of those nodes alone, the other tensors they read
    declared as ``found`` has them; producers and readers as the graph now
    is; no entry for a tensor no node writes any more (a later rewrite may
    take its name for another). A whole inference costs about ten times that
    on a backward graph; None where the partial one fails."""
    graph = model.graph
    producer, readers = _links(graph)
    written = {o for n in added for o in n.output}
    shapes, types = {}, {}
    if written:
        inputs, seen = [], set()
        for node in added:
            for name in node.input:
                if name and name not in written and name not in seen:
                    seen.add(name)
                    elem = found.types.get(name, onnx.TensorProto.UNDEFINED)
                    shape = found.shapes.get(name)
                    inputs.append(helper.make_tensor_value_info(name, elem, shape))
        part = helper.make_graph(list(added), "added", inputs, [])
        partial = helper.make_model(part, opset_imports=list(model.opset_import))
        partial.ir_version = model.ir_version
        inferred = _inferred(partial)
        if inferred is None:
            return None
        shapes, types = _shapes_and_types(inferred)
    present = producer.keys() | {i.name for i in graph.input} | found.inits.keys()
    return Facts(
        {k: v for k, v in found.shapes.items() if k in present}
        | {k: v for k, v in shapes.items() if k in written},
        {k: v for k, v in found.types.items() if k in present}
        | {k: v for k, v in types.items() if k in written},
        producer,
        readers,
        found.inits,
        found.taken,
    )


def replace_nodes(graph: onnx.GraphProto, rewrite) -> None:
    """Each node of ``graph`` replaced by ``rewrite(node)``'s nodes, where not None."""
    rewritten = []
    for node in graph.node:
        rewritten.extend(rewrite(node) or [node])
    del graph.node[:]
    graph.node.extend(rewritten)
