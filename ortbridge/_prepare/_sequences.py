"""ONNX sequences rewritten as tensors, so that gradients can flow through them.

onnx-ad 0.3.0 has no reverse rule for any sequence operator, and
onnxruntime-training 1.19's gradient builder does not follow a weight into a
sequence. torch's exporters write sequences in two shapes that have plain
tensor equivalents; :func:`sequences_as_tensors` rewrites both, keeping the
forward values exactly:

- A sequence of known length whose elements are only read back by constant
  position: ``SplitToSequence`` with a constant ``split`` (dynamo's
  ``torch.split`` and ``tensor_split``, e.g. ``nn.TransformerDecoderLayer``'s
  cross-attention weights) or ``SequenceConstruct``, read by ``SequenceAt``
  with a constant index, ``ConcatFromSequence`` or ``SequenceLength``. It
  becomes a ``Split`` (or the tensors themselves), ``Identity``, ``Concat``
  (with ``Unsqueeze`` for ``new_axis=1``) and a constant.
- A ``Loop`` that appends one float tensor per iteration to a sequence
  starting from ``SequenceEmpty``, concatenated after the loop by
  ``ConcatFromSequence`` (dynamo's ``nn.EmbeddingBag``). The tensor becomes a
  scan output of the Loop (the iterations stacked on a new first axis),
  moved and merged into the concatenation by ``Transpose`` and ``Squeeze``
  or ``Reshape``.
  A scan output needs one shape in every iteration: onnxruntime raises
  "Inconsistent shape in loop output" where a loop appends tensors of
  different sizes (ragged bags never come out wrong, they fail loudly).
  Only loops whose appended tensor depends on a float graph input are
  rewritten: nothing else can need a gradient.

Anything else (a sequence read in a subgraph, a non-constant position, a
graph output that is a sequence) is left as it is; onnx-ad then refuses it by
name where it lies on a gradient path.

Both rewrites are methods of one ``_Rewriter``, sharing its state (the names
taken, the constants, the inferred types): they stay in one module for that.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._onnx_utils import attr, node_reads, subgraph_reads, subgraphs

_LIST_READERS = frozenset({"SequenceAt", "ConcatFromSequence", "SequenceLength"})
_INTEGERS = frozenset(
    {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL}
    | {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
)


def sequences_as_tensors(model: onnx.ModelProto, loops: bool = True) -> onnx.ModelProto:
    """``model`` with its sequences of known length, and the loops that build one, as tensors.

    Returns ``model`` itself when nothing changes, else a rewritten copy. Only
    the main graph's sequences are rewritten (and the bodies of the loops that
    build them). ``loops=False`` leaves loops as they are: for a graph that
    runs without gradients too, where a ragged sequence must keep working.
    Graphs below ai.onnx opset 13 are left as they are.

    Examples
    --------
    >>> import numpy as np
    >>> from onnx import helper, numpy_helper
    >>> sizes = numpy_helper.from_array(np.array([2, 1]), "sizes")
    >>> second = numpy_helper.from_array(np.array(1), "second")
    >>> graph = helper.make_graph(
    ...     [helper.make_node("SplitToSequence", ["w", "sizes"], ["parts"]),
    ...      helper.make_node("SequenceAt", ["parts", "second"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("w", 1, [3, 4])],
    ...     [helper.make_tensor_value_info("y", 1, [1, 4])], [sizes, second])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    >>> [n.op_type for n in sequences_as_tensors(model).graph.node]
    ['Constant', 'Split', 'Identity']
    """
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)
    if opset < 13 or not any("Sequence" in n.op_type for n in _all_nodes(model.graph)):
        return model  # (Split, Squeeze and Unsqueeze read their sizes from inputs from 13)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    rewriter = _Rewriter(copy)
    if not ((loops and rewriter.loops()) | rewriter.lists()):
        return model
    return copy


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


def _size(proto: onnx.TensorProto) -> int:
    return int(np.prod(proto.dims, dtype=np.int64))


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.taken = {v.name for v in self.graph.input} | {t.name for t in self.graph.initializer}
        self.taken |= {v.name for v in self.graph.output}
        for node in _all_nodes(self.graph):
            self.taken.update(node.output)
            self.taken.add(node.name)
        for node in _all_nodes(self.graph):
            for sub in subgraphs(node):
                self.taken.update(v.name for v in sub.input)
        # Constant values, read on demand (the initializers may be large weights).
        self._protos = {t.name: t for t in self.graph.initializer}
        for node in self.graph.node:
            if node.op_type == "Constant" and node.attribute:
                kind = node.attribute[0]
                if kind.name == "value":
                    self._protos[node.output[0]] = kind.t
                elif kind.name in ("value_int", "value_ints"):
                    array = np.asarray(helper.get_attribute_value(kind), np.int64)
                    self._protos[node.output[0]] = numpy_helper.from_array(array)
        self._shapes = None

    def value(self, name: str, small: bool = False) -> np.ndarray | None:
        """The value of a main-graph constant, else None; ``small``: integers, 64 at most."""
        proto = self._protos.get(name)
        if proto is None or (small and (proto.data_type not in _INTEGERS or _size(proto) > 64)):
            return None
        return numpy_helper.to_array(proto)

    # -- shared ---------------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def ints(self, values, out_nodes) -> str:
        name = self.fresh("seq_ints")
        array = numpy_helper.from_array(np.asarray(values, np.int64))
        out_nodes.append(helper.make_node("Constant", [], [name], name, value=array))
        return name

    def shapes(self) -> dict[str, onnx.TypeProto]:
        """Inferred types of the main graph and the loop bodies, by name (computed once)."""
        if self._shapes is None:
            # onnx's inference does not see an outer constant inside a subgraph: the
            # probe gives each body a copy of the small integer constants it reads.
            probe = onnx.ModelProto()
            probe.CopyFrom(self.model)
            for node in _all_nodes(probe.graph):
                for sub in subgraphs(node):
                    for name in sorted(subgraph_reads(sub)):
                        value = self.value(name, small=True)
                        if value is not None:
                            sub.initializer.append(numpy_helper.from_array(value, name))
            try:
                inferred = onnx.shape_inference.infer_shapes(probe)
            except Exception:
                inferred = self.model
            found = {}

            def collect(graph):
                for v in list(graph.input) + list(graph.output) + list(graph.value_info):
                    found.setdefault(v.name, v.type)
                for node in graph.node:
                    for sub in subgraphs(node):
                        collect(sub)

            collect(inferred.graph)
            self._shapes = found
        return self._shapes

    def rank(self, name: str) -> int | None:
        kind = self.shapes().get(name)
        if kind is None or not kind.HasField("tensor_type"):
            return None
        tensor = kind.tensor_type
        return len(tensor.shape.dim) if tensor.HasField("shape") else None

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        """Main-graph nodes by the names they read (a subgraph's reads count for its node)."""
        found: dict[str, list] = {}
        for node in self.graph.node:
            for name in set(node_reads(node)):
                found.setdefault(name, []).append(node)
        return found

    def replace(self, replacements: dict[int, list[onnx.NodeProto]]) -> None:
        """Swap main-graph nodes (by id) for their replacements, in place."""
        nodes = []
        for node in self.graph.node:
            nodes.extend(replacements.get(id(node), [node]))
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self._shapes = None

    # -- sequences of known length --------------------------------------------------------------

    def lists(self) -> bool:
        outputs = {v.name for v in self.graph.output}
        consumers = self.consumers()
        replacements = {}
        for node in self.graph.node:
            if node.op_type not in ("SplitToSequence", "SequenceConstruct") or node.domain:
                continue
            seq = node.output[0]
            readers = consumers.get(seq, [])
            if seq in outputs or not all(r.op_type in _LIST_READERS for r in readers):
                continue
            if any(seq in r.input[1:] for r in readers):  # an index or a position, not data
                continue
            built = []
            parts = self._parts(node, built)
            if parts is None:
                continue
            reads = {}
            for reader in readers:
                new = self._read(reader, parts)
                if new is None:
                    break
                reads[id(reader)] = new
            else:
                replacements[id(node)] = built
                replacements.update(reads)
        if replacements:
            self.replace(replacements)
        return bool(replacements)

    def _parts(self, node, built) -> list[str] | None:
        """The element tensors of a known-length sequence, their nodes appended to ``built``."""
        if node.op_type == "SequenceConstruct":
            return list(node.input)
        x = node.input[0]
        axis = attr(node, "axis", 0)
        split = self.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if len(node.input) > 1 and node.input[1] and split is None:
            return None
        if split is not None and split.ndim == 1:
            sizes = [int(s) for s in split]
            squeeze = False
        else:
            rank = self.rank(x)
            dims = self.shapes().get(x)
            if rank is None or dims is None:
                return None
            dim = dims.tensor_type.shape.dim[axis % rank]
            if not dim.HasField("dim_value"):
                return None
            length = dim.dim_value
            if split is None:  # one element per index along the axis
                sizes, squeeze = [1] * length, not attr(node, "keepdims", 1)
            else:  # chunks of one size, the last one shorter
                step = int(split)
                sizes = [min(step, length - k) for k in range(0, length, step)]
                squeeze = False
        if not sizes:
            return None
        outs = [self.fresh(f"{node.output[0]}_{k}") for k in range(len(sizes))]
        split_name = self.ints(sizes, built)
        built.append(
            helper.make_node("Split", [x, split_name], outs, node.name or outs[0], axis=axis)
        )
        if squeeze:
            axes = self.ints([axis], built)
            squeezed = [self.fresh(f"{o}_squeezed") for o in outs]
            built.extend(
                helper.make_node("Squeeze", [o, axes], [s], s) for o, s in zip(outs, squeezed)
            )
            outs = squeezed
        return outs

    def _read(self, reader, parts) -> list[onnx.NodeProto] | None:
        out, name = reader.output[0], reader.name or reader.output[0]
        if reader.op_type == "SequenceLength":
            value = numpy_helper.from_array(np.array(len(parts), np.int64))
            return [helper.make_node("Constant", [], [out], name, value=value)]
        if reader.op_type == "SequenceAt":
            index = self.value(reader.input[1])
            if index is None or index.size != 1:
                return None
            k = int(index.reshape(-1)[0])
            if not -len(parts) <= k < len(parts):
                return None
            return [helper.make_node("Identity", [parts[k]], [out], name)]
        axis = attr(reader, "axis")
        if attr(reader, "new_axis", 0):
            nodes, axes = [], None
            stacked = []
            for part in parts:
                axes = axes or self.ints([axis], nodes)
                unsqueezed = self.fresh(f"{part}_unsqueezed")
                nodes.append(helper.make_node("Unsqueeze", [part, axes], [unsqueezed], unsqueezed))
                stacked.append(unsqueezed)
            nodes.append(helper.make_node("Concat", stacked, [out], name, axis=axis))
            return nodes
        return [helper.make_node("Concat", parts, [out], name, axis=axis)]

    # -- loops appending to a sequence ----------------------------------------------------------

    def loops(self) -> bool:
        changed = False
        while self._one_loop():  # each rewrite replaces a Loop node: look again
            changed = True
        return changed

    def _one_loop(self) -> bool:
        consumers = self.consumers()
        producers = {o: n for n in self.graph.node for o in n.output}
        outputs = {v.name for v in self.graph.output}
        for loop in self.graph.node:
            if loop.op_type != "Loop" or loop.domain:
                continue
            body = attr(loop, "body")
            for j in range(len(loop.input) - 2):
                plan = self._appending(loop, body, j, consumers, producers, outputs)
                if plan is not None and self._rewrite_loop(loop, body, j, *plan):
                    return True
        return False

    def _appending(self, loop, body, j, consumers, producers, outputs):
        """(SequenceEmpty node, SequenceInsert node, ConcatFromSequence readers), or None."""
        initial, final = loop.input[2 + j], loop.output[j]
        empty = producers.get(initial)
        if empty is None or empty.op_type != "SequenceEmpty" or len(consumers[initial]) != 1:
            return None
        if final in outputs or not all(
            r.op_type == "ConcatFromSequence" and r.input[0] == final
            for r in consumers.get(final, [])
        ):
            return None
        state_in, state_out = body.input[2 + j].name, body.output[1 + j].name
        inserts = [n for n in body.node if state_in in node_reads(n)]
        if len(inserts) != 1:
            return None
        insert = inserts[0]
        if insert.op_type != "SequenceInsert" or len(insert.input) != 2:
            return None
        if insert.input[0] != state_in or insert.output[0] != state_out:
            return None
        if any(insert.output[0] in node_reads(n) for n in body.node):
            return None
        element = insert.input[1]
        if not self._float_dependent(element, body):
            return None
        return empty, insert, consumers.get(final, [])

    def _float_dependent(self, element, body) -> bool:
        """Whether ``element`` (in ``body``) depends on a float graph input."""
        floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
        reached = {v.name for v in self.graph.input if v.type.tensor_type.elem_type in floats}
        for node in self.graph.node:
            if any(n in reached for n in node_reads(node)):
                reached.update(node.output)
        for node in body.node:
            if any(n in reached for n in node_reads(node)):
                reached.update(node.output)
        return element in reached

    def _rewrite_loop(self, loop, body, j, empty, insert, readers) -> bool:
        element = insert.input[1]
        seq_type = body.output[1 + j].type
        elem_type = seq_type.sequence_type.elem_type.tensor_type.elem_type or TensorProto.FLOAT
        dims = self.dims(element)
        # The body: the sequence state goes, the element becomes the last scan output.
        scan = self.fresh(f"{element}_scan")
        new_body = onnx.GraphProto()
        new_body.CopyFrom(body)
        del new_body.node[:]
        new_body.node.extend(n for n in body.node if n is not insert)
        new_body.node.append(helper.make_node("Identity", [element], [scan], scan))
        inputs = [v for k, v in enumerate(body.input) if k != 2 + j]
        del new_body.input[:]
        new_body.input.extend(inputs)
        outs = [v for k, v in enumerate(body.output) if k != 1 + j]
        outs.append(helper.make_tensor_value_info(scan, elem_type, dims))
        del new_body.output[:]
        new_body.output.extend(outs)
        del new_body.value_info[:]  # the sequence state's among them
        stacked = self.fresh(f"{loop.output[j]}_stacked")
        new_loop = helper.make_node(
            "Loop",
            [k for i, k in enumerate(loop.input) if i != 2 + j],
            [o for i, o in enumerate(loop.output) if i != j] + [stacked],
            loop.name,
            body=new_body,
        )
        replacements = {id(loop): [new_loop], id(empty): []}
        for reader in readers:
            nodes = self._concat_stacked(reader, stacked, dims)
            if nodes is None:
                return False
            replacements[id(reader)] = nodes
        self.replace(replacements)
        return True

    def dims(self, name: str) -> list | None:
        """The inferred shape of ``name``: sizes, None where unknown; None if the rank is."""
        kind = self.shapes().get(name)
        if kind is None or not kind.tensor_type.HasField("shape"):
            return None
        return [
            d.dim_value if d.HasField("dim_value") else None for d in kind.tensor_type.shape.dim
        ]

    def _concat_stacked(self, reader, stacked, dims):
        """``ConcatFromSequence`` of the loop's elements (``dims``), from their stack.

        The stack has the iterations on a new first axis. Sizes are kept
        visible to shape inference where the element's are known (onnx-ad
        sizes its seeds from them).
        """
        out, name = reader.output[0], reader.name or reader.output[0]
        axis, new_axis = attr(reader, "axis"), attr(reader, "new_axis", 0)
        rank = len(dims) if dims is not None else None
        if rank is None:
            out_rank = self.rank(out)
            rank = None if out_rank is None else out_rank - int(bool(new_axis))
        if rank is None:
            return None
        dims = dims if dims is not None else [None] * rank
        nodes = []
        axis = axis % (rank + 1) if new_axis else axis % rank
        perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank + 1))
        moved = stacked
        if axis:
            moved = self.fresh(f"{stacked}_moved")
            nodes.append(helper.make_node("Transpose", [stacked], [moved], moved, perm=perm))
        if new_axis:
            nodes.append(helper.make_node("Identity", [moved], [out], name))
            return nodes
        # Merge the stack axis (now at ``axis``) with the element's axis after it.
        if dims[axis] == 1:
            squeeze = self.ints([axis + 1], nodes)
            nodes.append(helper.make_node("Squeeze", [moved, squeeze], [out], name))
            return nodes
        if all(d is not None for d in dims[axis + 1 :]):  # Reshape's 0 keeps a leading size
            target = self.ints([0] * axis + [-1] + dims[axis + 1 :], nodes)
            nodes.append(helper.make_node("Reshape", [moved, target], [out], name))
            return nodes
        shape = self.fresh(f"{stacked}_shape")
        nodes.append(helper.make_node("Shape", [moved], [shape], shape))
        pieces = []
        if axis:
            head = self.fresh(f"{stacked}_head")
            starts, ends = self.ints([0], nodes), self.ints([axis], nodes)
            nodes.append(helper.make_node("Slice", [shape, starts, ends], [head], head))
            pieces.append(head)
        pieces.append(self.ints([-1], nodes))
        if axis + 2 <= rank:
            tail = self.fresh(f"{stacked}_tail")
            starts, ends = self.ints([axis + 2], nodes), self.ints([rank + 1], nodes)
            nodes.append(helper.make_node("Slice", [shape, starts, ends], [tail], tail))
            pieces.append(tail)
        target = self.fresh(f"{stacked}_target")
        nodes.append(helper.make_node("Concat", pieces, [target], target, axis=0))
        nodes.append(helper.make_node("Reshape", [moved, target], [out], name))
        return nodes
