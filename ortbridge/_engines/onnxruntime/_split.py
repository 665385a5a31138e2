"""Splitting a reverse-mode model into a forward graph and a backward graph.

onnx-ad's reverse model computes the primal outputs and the adjoints in one
graph, a function of ``(inputs, seeds)``. Training needs two: the forward
runs when torch calls the layer and must not wait for the seeds (the output
gradients), the backward runs later. Plain graph code, no onnxruntime.

- Forward: the ancestors of the primal outputs. It also returns the
  *residuals*: tensors it produces that the backward reads.
- Backward: every other ancestor of the adjoints, including seed-independent
  work the forward does not need (recomputed there from inputs and residuals
  rather than saved: torch's trade too).
- Graph inputs the backward reads are fed to it directly, never saved twice.
- A view (``Reshape``, ``Squeeze``...) of a forward tensor is taken in the
  backward, the tensor viewed returned: onnxruntime would copy the view out.
- An adjoint that depends on no seed is zero (no gradient reaches it).
- Small vectors the backward reads (an eval BatchNorm's per-channel factors)
  cross as one tensor, concatenated in the forward and split in the
  backward: each tensor handed to torch and back costs about 1 us a
  crossing, more than two nodes over a few hundred numbers.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx.numpy_helper
from onnx import helper

from ortbridge._prepare._lookup import _all_names, _unique
from ortbridge._prepare._onnx_utils import node_reads

from .passes._simplify import _RANDOM, _VIEWS


@dataclasses.dataclass
class Split:
    """The two halves of a reverse model."""

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    #: Tensors the forward returns after the primal outputs for the backward.
    residuals: list[str]
    #: Graph inputs of the reverse model that the backward reads.
    backward_inputs: list[str]
    #: Adjoint outputs that no seed reaches (zero gradients, not computed).
    zero_adjoints: list[str]
    #: The adjoints the backward returns, in order, as the reverse model names them.
    live_adjoints: list[str]


def _ancestors(targets, producer, nodes) -> set[int]:
    """Indices of the nodes ``targets`` depend on."""
    seen, stack = set(), [t for t in targets if t in producer]
    while stack:
        idx = producer[stack.pop()]
        if idx in seen:
            continue
        seen.add(idx)
        stack.extend(n for n in node_reads(nodes[idx]) if n in producer)
    return seen


def split(
    reverse: onnx.ModelProto,
    primal_outputs: list[str],
    seeds: list[str],
    adjoints: list[str],
) -> Split:
    """Split ``reverse`` into forward and backward models.

    ``primal_outputs``: outputs the forward returns (user outputs and any
    extra primal outputs such as running statistics); ``seeds``: the seed
    inputs; ``adjoints``: the adjoint outputs the backward returns.
    """
    graph = reverse.graph
    _forward_identities(graph, set(primal_outputs) | set(adjoints))
    nodes = list(graph.node)
    producer = {}
    for idx, node in enumerate(nodes):
        for out in node.output:
            if out:
                producer[out] = idx
    # Which tensors depend on a seed (forward closure, in topological order).
    seeded = set(seeds)
    for node in nodes:
        if any(n in seeded for n in node_reads(node)):
            seeded.update(o for o in node.output if o)
    forward_idx = _ancestors(primal_outputs, producer, nodes)
    bad = [nodes[i].name or nodes[i].op_type for i in forward_idx if nodes[i].output[0] in seeded]
    if bad:
        raise ValueError(f"forward nodes depend on a seed: {bad[:5]}")
    zero = [a for a in adjoints if a not in seeded or _is_zeros(a, producer, nodes)]
    live = [a for a in adjoints if a not in zero]
    forward_out = set()
    for i in forward_idx:
        forward_out.update(o for o in nodes[i].output if o)
    # The shape of a forward tensor is a few integers: computed in the forward
    # and saved, rather than the tensor saved for its shape.
    available = forward_out | {i.name for i in graph.input if i.name not in seeded}
    needed = _ancestors(live, producer, nodes)
    for idx in needed - forward_idx:
        node = nodes[idx]
        if node.op_type in ("Shape", "Size") and node.input[0] in available:
            forward_idx.add(idx)
            forward_out.update(node.output)
    backward_idx = needed - forward_idx

    inits = {i.name: i for i in graph.initializer}
    graph_inputs = [i.name for i in graph.input]
    seed_set = set(seeds)
    backward_reads = _reads(nodes, backward_idx, live)
    # A copy of graph inputs (a weight's Transpose, the zero-interleaved and
    # padded input a ConvTranspose becomes) is redone in the backward rather
    # than saved: torch keeps the input, not a copy.
    redo = _copies_of_inputs(nodes, forward_idx, graph, seed_set, set(inits))
    wanted = [producer[n] for n in backward_reads if n in forward_out and producer[n] in redo]
    if wanted:
        backward_idx |= _ancestors([o for i in wanted for o in nodes[i].output], producer, nodes)
        backward_reads = _reads(nodes, backward_idx, live)
    # A residual that is a view of another forward tensor (a Reshape's output)
    # would be copied to be returned (onnxruntime gives a graph output its own
    # buffer): the viewed tensor is returned and the view taken in the backward.
    while True:
        views = [
            producer[n]
            for n in backward_reads
            if n in forward_out and n not in primal_outputs and nodes[producer[n]].op_type in _VIEWS
        ]
        if not views:
            break
        backward_idx.update(views)
        backward_reads = _reads(nodes, backward_idx, live)
        # Their constant operands (a Reshape's shape) are taken along, not saved.
        backward_idx.update(
            producer[n]
            for n in backward_reads
            if n in forward_out and nodes[producer[n]].op_type == "Constant"
        )
        backward_reads = _reads(nodes, backward_idx, live)
    residuals = [n for n in backward_reads if n in forward_out]
    backward_inputs = [n for n in graph_inputs if n in backward_reads and n not in seed_set]

    types = _value_infos(reverse)

    def info(name):
        if name in types:
            return types[name]
        return helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)

    def model(node_idx, inputs, outputs):
        body = [nodes[i] for i in sorted(node_idx)]
        reads = set(outputs)
        for node in body:
            reads.update(node_reads(node))
        # Outputs of contrib ops (the fused activations) keep their declared
        # shapes: onnx's inference cannot give them, nor what reads them.
        contrib = [
            types[o]
            for node in body
            if node.domain not in ("", "ai.onnx")
            for o in node.output
            if o in types
        ]
        g = helper.make_graph(
            body,
            graph.name,
            [info(n) for n in inputs],
            [info(n) for n in outputs],
            initializer=[inits[n] for n in inits if n in reads],
            value_info=contrib,
        )
        m = helper.make_model(g, opset_imports=list(reverse.opset_import))
        m.ir_version = reverse.ir_version
        m.functions.extend(reverse.functions)
        return m

    forward_inputs = [n for n in graph_inputs if n not in seed_set]
    # Residuals that are primal outputs are returned once, as outputs.
    extra = [r for r in residuals if r not in primal_outputs]
    opset = next((o.version for o in reverse.opset_import if o.domain in ("", "ai.onnx")), 0)
    # Split reads its sizes from an input from opset 13 (ortbridge raises files to it).
    packed = _small_vectors(extra, types) if opset >= 13 else []
    if packed:
        name = _unique("packed_residuals", _all_names(graph))
        nodes.append(helper.make_node("Concat", packed, [name], axis=0))
        forward_idx.add(len(nodes) - 1)
        sizes = [types[n].type.tensor_type.shape.dim[0].dim_value for n in packed]
        split_sizes = _unique("packed_sizes", _all_names(graph) | {name})
        unpack = [
            helper.make_node("Constant", [], [split_sizes], value_ints=sizes),
            helper.make_node("Split", [name, split_sizes], list(packed), axis=0),
        ]
        nodes.extend(unpack)
        backward_idx.update(range(len(nodes) - len(unpack), len(nodes)))
        dtype = types[packed[0]].type.tensor_type.elem_type
        types[name] = helper.make_tensor_value_info(name, dtype, [sum(sizes)])
        residuals = [name] + [r for r in residuals if r not in packed]
        extra = [name] + [r for r in extra if r not in packed]
    fw = model(forward_idx, forward_inputs, list(primal_outputs) + extra)
    bw = model(backward_idx, backward_inputs + residuals + list(seeds), live)
    if packed:  # the unpacking first: the nodes read it in that order
        made = {o for n in unpack for o in n.output}
        order = sorted(bw.graph.node, key=lambda n: not made.intersection(n.output))
        del bw.graph.node[:]
        bw.graph.node.extend(order)
    _drop_seed_axis(bw, list(seeds))
    return Split(fw, bw, residuals, backward_inputs, zero, live)


#: Residuals of one dimension and at most this many elements are packed.
_SMALL_VECTOR = 4096


def _small_vectors(extra: list[str], types: dict) -> list[str]:
    """The residuals that cross as one tensor: vectors of a statically known,
    small size, of the element type most of them have (none unless two)."""
    found: dict[int, list[str]] = {}
    for name in extra:
        vi = types.get(name)
        dims = vi.type.tensor_type.shape.dim if vi is not None else ()
        if len(dims) != 1 or not dims[0].HasField("dim_value"):
            continue
        if 0 < dims[0].dim_value <= _SMALL_VECTOR:
            found.setdefault(vi.type.tensor_type.elem_type, []).append(name)
    best = max(found.values(), key=len, default=[])
    return best if len(best) > 1 else []


def _drop_seed_axis(model: onnx.ModelProto, seeds: list[str]) -> None:
    """The backward takes output gradients and returns gradients without the
    trailing seed axis (size 1): the axis is added and removed inside the
    graph (views for onnxruntime), not by a torch call per tensor each step."""
    graph = model.graph
    taken = _all_names(graph)

    def fresh(stem):
        return _unique(stem, taken)

    axis = fresh("seed_axis")
    head = [helper.make_node("Constant", [], [axis], value_ints=[-1])]
    for vi in graph.input:
        if vi.name in seeds:
            outer = fresh(f"{vi.name}_value")
            head.append(helper.make_node("Unsqueeze", [outer, axis], [vi.name]))
            vi.name = outer
            _drop_last_dim(vi)
    tail = []
    for vi in graph.output:
        inner = vi.name
        vi.name = fresh(f"{inner}_value")
        tail.append(helper.make_node("Squeeze", [inner, axis], [vi.name]))
        _drop_last_dim(vi)
    nodes = head + list(graph.node) + tail
    del graph.node[:]
    graph.node.extend(nodes)


def _drop_last_dim(vi: onnx.ValueInfoProto) -> None:
    tensor = vi.type.tensor_type
    if tensor.HasField("shape") and len(tensor.shape.dim):
        del tensor.shape.dim[-1]


def _reads(nodes, node_idx, live) -> list[str]:
    """Tensors the nodes ``node_idx`` read from outside, in order, and the adjoints
    ``live`` they do not compute (an adjoint may be an input or a forward tensor
    as it is, once Identity nodes are folded away)."""
    reads, defines = [], set()
    for i in sorted(node_idx):
        for name in node_reads(nodes[i]):
            if name not in defines and name not in reads:
                reads.append(name)
        defines.update(nodes[i].output)
    reads.extend(n for n in live if n not in defines and n not in reads)
    return reads


# Ops whose output is a cheap, memory-bound copy or rearrangement of their
# inputs: recomputing one costs about what saving and reading it back does.
_COPY_OPS = frozenset(
    {
        "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity", "Flatten",
        "Pad", "Slice", "Gather", "Concat", "Constant",
    }
)  # fmt: skip


def _copies_of_inputs(nodes, forward_idx, graph, seeds, inits) -> set[int]:
    """Forward nodes computing copies of graph inputs through copy ops alone,
    and what depends on constants only (onnxruntime folds it when it loads
    the backward), and a ``MatMul`` of such a copy by a constant (a weight
    spread over a constant matrix: weight-sized work, where saving it keeps
    a tensor per step)."""
    sources = {i.name for i in graph.input if i.name not in seeds} | inits
    constants = set(inits)
    found = set()
    for idx in sorted(forward_idx):  # topological order
        node = nodes[idx]
        if node.domain not in ("", "ai.onnx"):
            continue
        reads = node_reads(node)
        if not all(r in sources for r in reads):
            continue
        if node.op_type == "Constant" or (
            reads and node.op_type not in _RANDOM and all(r in constants for r in reads)
        ):
            constants.update(o for o in node.output if o)
        elif not (
            node.op_type in _COPY_OPS
            or (node.op_type == "MatMul" and any(r in constants for r in reads))
        ):
            continue
        found.add(idx)
        sources.update(o for o in node.output if o)
    return found


def _forward_identities(graph: onnx.GraphProto, keep: set[str]) -> None:
    """Make readers of an ``Identity``'s output read its source instead.

    Otherwise both names may be saved for the backward, two copies of one
    tensor. Graph outputs keep their names; unused Identity nodes are left
    for the split to drop.
    """
    source = {}
    for node in graph.node:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            if node.output[0] not in keep:
                source[node.output[0]] = source.get(node.input[0], node.input[0])
    if not source:
        return
    for node in graph.node:
        for pos, name in enumerate(node.input):
            if name in source:
                node.input[pos] = source[name]


def _is_zeros(name, producer, nodes) -> bool:
    """Whether ``name`` is a ``ConstantOfShape`` of zeros, through Identity nodes.

    onnx-ad writes an unreached adjoint so, sized like its seed.
    """
    while name in producer:
        node = nodes[producer[name]]
        if node.op_type == "Identity":
            name = node.input[0]
            continue
        if node.op_type != "ConstantOfShape":
            return False
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return value is None or not onnx.numpy_helper.to_array(value).any()
    return False


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Type and shape of every tensor onnx's inference can type."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # untyped tensors are typed by onnxruntime later
        inferred = model
    g = inferred.graph
    found = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type:
            found[vi.name] = vi
    for init in g.initializer:
        found.setdefault(
            init.name, helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        )
    return found
